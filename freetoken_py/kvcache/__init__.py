"""Paged KV storage and page bookkeeping. Imports nothing from engine, scheduler or server."""
from freetoken_py.kvcache.pool import KVCache, PageAllocator, OutOfPagesError
from freetoken_py.kvcache.spec import (PagedIndexedLatent, PagedKV, PagedLatent, PagedWindowKV, Recurrent, StateSpec, is_paged, page_bytes,
                                      paged_bytes, values_per_token)
from freetoken_py.kvcache.state import OutOfStateSlotsError, StatePool

__all__ = ["KVCache", "PageAllocator", "OutOfPagesError", "PagedKV", "PagedWindowKV", "PagedLatent", "PagedIndexedLatent", "Recurrent", "StateSpec", "is_paged", "StatePool", "OutOfStateSlotsError", "page_bytes", "paged_bytes",
           "values_per_token"]
