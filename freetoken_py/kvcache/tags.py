"""KV-page integrity tags (the Cloudflare design): prove a request still owns the pages it reads.

Every physical page has a generation tag in `PageAllocator.tags` (bumped when the page is handed
out and when it returns to the free list). Whenever a request gains pages (allocation or a prefix
cache hit) the tracker records the (page, tag) pairs it expects; `check()` compares all of them
for all live requests with one gather and one comparison::

    flat_pages : [N] page ids of every tracked request, concatenated
    flat_tags  : [N] the tag each request saw when it got the page
    owner      : [N] index of the request each entry belongs to
    bad        = allocator.tags[flat_pages] != flat_tags        # one vectorised op per step

A page freed, re-allocated or re-tagged under a live request shows up as a mismatch, and only the
requests holding that page are reported. `NullTracker` is the no-op used when checking is off.
The arrays are numpy (the tags' own storage): on the CPU path a numpy op costs ~1 us where the
same torch op costs ~10 us, and this check runs every step.
"""
from __future__ import annotations

import numpy as np

from freetoken_py.kvcache.pool import PageAllocator


class IntegrityTracker:
    enabled = True

    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self._expected: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # request id -> (pages, tags)
        self._flat: tuple[np.ndarray, np.ndarray, np.ndarray, list[int]] | None = None
        self._slot: dict[int, int] = {}  # request id -> its index in _flat's ids
        self.num_checks = 0
        self.num_mismatches = 0  # requests aborted because a page tag changed under them
        self.kinds: dict[str, IntegrityTracker] = {}  # other page pools (kvcache/window.py), checked with this one

    def add_kind(self, name: str, allocator: PageAllocator) -> "IntegrityTracker":
        """A tracker for another page pool (a windowed layers' pool, kvcache/window.py): the caller
        records into it; `check` reports its mismatches with this pool's."""
        self.kinds[name] = IntegrityTracker(allocator)
        return self.kinds[name]

    def drop(self, request_id: int, pages: list[int]) -> None:
        """The request gave `pages` back while it goes on (a window moving past them)."""
        old = self._expected.get(request_id)
        if old is None or not pages:
            return
        keep = ~np.isin(old[0], np.asarray(pages, dtype=np.int64))
        self._expected[request_id] = (old[0][keep], old[1][keep])
        self._flat = None

    def record(self, request_id: int, pages: list[int]) -> None:
        """The request now holds `pages` as they are (call right after allocate/share)."""
        if not pages:
            return
        new_pages = np.asarray(pages, dtype=np.int64)
        new_tags = self.allocator.tags_np[new_pages]  # [k] a copy: the tags as of now
        old = self._expected.get(request_id)
        self._expected[request_id] = (new_pages, new_tags) if old is None else (
            np.concatenate((old[0], new_pages)), np.concatenate((old[1], new_tags)))
        if self._flat is not None:  # a decode step gains one page: append, do not rebuild
            flat_pages, flat_tags, owner, ids = self._flat
            if request_id not in self._slot:
                self._slot[request_id] = len(ids)
                ids.append(request_id)
            own = np.full(len(new_pages), self._slot[request_id], dtype=np.int64)
            self._flat = (np.concatenate((flat_pages, new_pages)), np.concatenate((flat_tags, new_tags)),
                          np.concatenate((owner, own)), ids)

    def forget(self, request_id: int) -> None:
        if self._expected.pop(request_id, None) is not None:
            self._flat = None
        for sub in self.kinds.values():
            sub.forget(request_id)

    def valid_pages(self, request_id: int) -> list[int]:
        """The recorded pages whose tag still matches: the ones the request may safely release."""
        if request_id not in self._expected:
            return []
        held, tags = self._expected[request_id]
        return held[self.allocator.tags_np[held] == tags].tolist()

    def _flatten(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
        if self._flat is None:  # rebuilt when a request leaves; growth appends (see record)
            ids = list(self._expected)
            self._slot = {rid: i for i, rid in enumerate(ids)}
            parts = [self._expected[rid] for rid in ids]
            empty = np.empty(0, dtype=np.int64)
            owner = np.repeat(np.arange(len(ids), dtype=np.int64), [len(pg) for pg, _ in parts])  # [N]
            self._flat = (np.concatenate([pg for pg, _ in parts]) if parts else empty,
                          np.concatenate([t for _, t in parts]) if parts else empty, owner, ids)
        return self._flat

    def check(self) -> dict[int, list[int]]:
        """Request id -> its pages whose tag changed (in this pool or one of `kinds`); empty when
        every request is intact."""
        out = self._check()
        for sub in self.kinds.values():
            for rid, pages in sub._check().items():
                if rid not in out:
                    self.num_mismatches += 1
                out.setdefault(rid, []).extend(pages)
        return out

    def _check(self) -> dict[int, list[int]]:
        self.num_checks += 1
        pages, tags, owner, ids = self._flatten()
        if pages.size == 0:
            return {}
        bad = self.allocator.tags_np[pages] != tags  # [N]
        if not bad.any():
            return {}
        out: dict[int, list[int]] = {}
        for i, p in zip(owner[bad].tolist(), pages[bad].tolist()):
            out.setdefault(ids[i], []).append(p)
        self.num_mismatches += len(out)
        return out


class NullTracker:
    """Integrity checking off: same interface, does nothing."""
    enabled = False
    num_checks = 0
    num_mismatches = 0

    def __init__(self, allocator: PageAllocator | None = None):
        self.allocator = allocator

    def record(self, request_id: int, pages: list[int]) -> None:
        pass

    def forget(self, request_id: int) -> None:
        pass

    def add_kind(self, name: str, allocator: PageAllocator) -> "NullTracker":
        return NullTracker(allocator)

    def drop(self, request_id: int, pages: list[int]) -> None:
        pass

    def valid_pages(self, request_id: int) -> list[int] | None:
        return None  # unknown: trust the page table

    def check(self) -> dict[int, list[int]]:
        return {}
