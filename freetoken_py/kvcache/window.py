"""The windowed layers' pages (`spec.PagedWindowKV`): their own pool, their own page table per request.

A model mixing sliding-window and full layers (gpt-oss) keeps the two kinds in separate page
pools: the full layers' pages are the request's `page_table` (pool.PageAllocator, the prefix
cache, page tags, as every model), the windowed layers' pages are here. A windowed table is
positional like a page table (entry j holds tokens [j * page_size, (j + 1) * page_size)), with -1
for the pages behind the window, which were given back::

    full layers      page_table    [ 7,  2,  9,  4,  5]        every page of the context
    windowed layers  tables[rid]   [-1, -1, -1, 11, 12]        the pages the next token reads

A token at position p reads the keys (p - window, p], i.e. pages first_page(p) .. p // page_size.
`ensure` allocates the pages a chunk writes and reads (those behind its window start at -1);
`trim` gives back the pages behind the next token's window (the scheduler calls it after a
step, once the step's pages are published to the prefix cache); so between steps a request holds
at most `spec.window_pages_per_seq` pages here (window + one page of rows when the page size
divides the window), and during a step the chunk it computes on top.

Prefix cache (radix.py): a cached node holds its full-layer page and, where the request that
published it still held it, its windowed page. A hit resuming at token N is exact only with the
windowed rows (N - window, N) too, so a match stops at the deepest page boundary whose window
pages are all cached (RadixCache.match(window=...)); the pages before that window are not needed.

Every windowed page has a generation tag in this pool's allocator; the integrity tracker keeps a
kind for it (tags.IntegrityTracker.add_kind), checked in the same step as the full pages.
Requests that never pass through the scheduler (start-up calibration and warm-up passes, tests
driving the runner) get their pages from `ensure` too, and back when the request object dies.
"""
from __future__ import annotations

import weakref

from freetoken_py.kvcache.pool import PageAllocator


class WindowPages:
    def __init__(self, window: int, page_size: int, num_pages: int):
        if window < 1:
            raise ValueError("window must be positive")
        self.window, self.page_size = window, page_size
        self.allocator = PageAllocator(num_pages)
        self.tables: dict[int, list[int]] = {}   # request id -> page per sequence page, -1 = not held
        self._finalizers: dict[int, weakref.finalize] = {}
        # reclaim(n): give back up to n pages held elsewhere (the prefix cache's, set by the scheduler)
        self.reclaim = None

    def first_page(self, pos: int) -> int:
        """The first sequence page a token at position `pos` reads (keys (pos - window, pos])."""
        return max(0, pos - self.window + 1) // self.page_size

    def table(self, request_id: int) -> list[int]:
        return self.tables.get(request_id, [])

    def held(self, request_id: int) -> list[int]:
        """The pages the request holds in this pool."""
        return [p for p in self.tables.get(request_id, []) if p >= 0]

    def pages_needed(self, req, end: int) -> int:
        """Pages `ensure(req, end)` would allocate."""
        t, first = self.tables.get(req.request_id, []), self.first_page(req.num_computed)
        return max(0, -(-end // self.page_size) - max(len(t), first))

    def _open(self, req) -> list[int]:
        rid = req.request_id
        if rid not in self.tables:
            self.tables[rid] = []
            self._finalizers[rid] = weakref.finalize(req, self._drop, rid)
        return self.tables[rid]

    def ensure(self, req, end: int) -> list[int]:
        """Pages for the chunk [req.num_computed, end): the new ones it writes and the earlier
        ones its window reads (which must be held). Returns the pages allocated (OutOfPagesError
        when the pool has too few free; nothing changes then)."""
        if req.request_id not in self.tables and self.first_page(req.num_computed) * self.page_size < req.num_computed:
            raise RuntimeError(f"request {req.request_id} resumes at token {req.num_computed} without its windowed "
                               "pages (a prefix hit through a scheduler built without `windows`)")
        t, first, last = self._open(req), self.first_page(req.num_computed), -(-end // self.page_size)
        lost = [j for j in range(first, min(last, len(t))) if t[j] < 0]
        if lost:
            raise RuntimeError(f"request {req.request_id}: windowed pages {lost} were given back but are read")
        need = max(0, last - max(len(t), first))
        if need > self.allocator.num_free and self.reclaim is not None:
            self.reclaim(need - self.allocator.num_free)
        pages = self.allocator.allocate(need)
        it = iter(pages)
        t.extend(next(it) if j >= first else -1 for j in range(len(t), last))
        return pages

    def adopt(self, req, pages: list[int]) -> None:
        """A prefix-cache hit: the request starts with these windowed pages (a positional table,
        -1 behind its window), shared with the cache."""
        assert not self.tables.get(req.request_id), "adopt before any page is held"
        t = self._open(req)
        t[:] = pages
        self.allocator.share([p for p in pages if p >= 0])

    def trim(self, req) -> list[int]:
        """Give back the pages behind the window of the request's next token. Returns them."""
        t = self.tables.get(req.request_id)
        if not t:
            return []
        first = min(self.first_page(req.num_computed), len(t))
        freed = [p for p in t[:first] if p >= 0]
        t[:first] = [-1] * first
        self.allocator.release(freed)
        return freed

    def release(self, request_id: int, valid: list[int] | None = None) -> None:
        """Give back every page of the request (only `valid` ones, when the integrity check says
        some changed hands under it)."""
        t = self.tables.pop(request_id, None)
        fin = self._finalizers.pop(request_id, None)
        if fin is not None:
            fin.detach()
        if t is not None:
            self.allocator.release([p for p in t if p >= 0] if valid is None else valid)

    def _drop(self, request_id: int) -> None:
        t = self.tables.pop(request_id, None)
        self._finalizers.pop(request_id, None)
        if t:
            self.allocator.release([p for p in t if p >= 0])

    def grow(self, num_pages: int) -> None:
        self.allocator.grow(num_pages)
