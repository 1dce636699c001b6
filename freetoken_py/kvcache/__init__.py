"""Paged KV storage and page bookkeeping. Imports nothing from engine, scheduler or server."""
from freetoken_py.kvcache.pool import KVCache, PageAllocator, OutOfPagesError
from freetoken_py.kvcache.spec import PagedKV, PagedLatent, StateSpec, page_bytes, values_per_token

__all__ = ["KVCache", "PageAllocator", "OutOfPagesError", "PagedKV", "PagedLatent", "StateSpec", "page_bytes",
           "values_per_token"]
