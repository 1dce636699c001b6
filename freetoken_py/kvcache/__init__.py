"""Paged KV storage and page bookkeeping. Imports nothing from engine, scheduler or server."""
from freetoken_py.kvcache.pool import KVCache, PageAllocator, OutOfPagesError

__all__ = ["KVCache", "PageAllocator", "OutOfPagesError"]
