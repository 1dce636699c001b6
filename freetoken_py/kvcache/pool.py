"""Fixed-size KV pages and who owns them.

Layout of one layer's cache (K and V alike)::

    k[layer] : [num_pages, page_size, num_kv_heads, head_dim]
    slot      = page_id * page_size + offset          (flat index into the view [P*S, H, D])
    token pos -> page_table[pos // page_size], offset pos % page_size

A request's page table is a plain list of page ids owned by the request; the allocator only hands
out and takes back ids (with reference counts, so a prefix cache can share pages later).
"""
from __future__ import annotations

import torch


class OutOfPagesError(RuntimeError):
    """Not enough free pages; the scheduler preempts or waits."""


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refcount = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refcount[p] > 0, f"page {p} is free"
            self._refcount[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refcount[p] > 0, f"double free of page {p}"
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refcount[page]


class KVCache:
    """The K and V tensors of every layer, addressed by flat slot index."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype):
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.page_size = page_size
        self.num_pages = num_pages

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        elem = torch.empty(0, dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem

    def slots(self, page_table: list[int], start: int, end: int) -> torch.Tensor:
        """Flat slot indices of token positions [start, end) of a request."""
        pos = torch.arange(start, end)
        pages = torch.tensor(page_table, dtype=torch.long)[pos // self.page_size]
        return pages * self.page_size + pos % self.page_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v.dtype))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer].index_select(0, slots), self.v[layer].index_select(0, slots)
