"""Continuous batching: requests join and leave between steps.

Every request computes tokens [num_computed, num_tokens) and samples when it reaches the end, so
prefill, chunked prefill, decode and recompute-after-preemption are the same operation. A step
takes running requests first (decodes cost one token of the budget), then admits waiting ones
while the token budget, the sequence limit and the free pages allow.

With a prefix cache, a request being admitted first takes the longest cached prefix of its
tokens (whole pages, locked by `share`), starting at `num_computed = num_cached_tokens = N`; N
stops short of the last token, whose logits must be computed. When pages run out, unlocked
cached pages are evicted before any running request is preempted. Finished, aborted and
preempted requests, and every request whose prompt has just been computed, publish their full
pages to the cache. Every page a request gains is recorded with the integrity tracker.

Hybrid models (a recurrent layer kind, kvcache/state.py) pass `state_pool`: every admitted
request holds one state slot, allocated (zeroed) at admission and freed when it finishes, aborts
or is preempted (recompute then starts from a fresh slot); chunked prefill continues from it.
Without prefix-state snapshots (`states`), such a model takes no prefix-cache hits (a page hit
without the recurrent state would be wrong) and reports 0 cached tokens.

Hybrid models (recurrent layers) pass `states` (prefix_state.PrefixStateReuse): a cached prefix
is then resumed only up to the deepest page boundary holding a snapshot of the recurrent state,
prefill chunks end at the snapshot points, and snapshots are taken after each forward.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Hashable

from freetoken_py.core import Request
from freetoken_py.engine.runner import ScheduledChunk
from freetoken_py.kvcache import PageAllocator, StatePool
from freetoken_py.kvcache.radix import RadixCache
from freetoken_py.kvcache.tags import IntegrityTracker, NullTracker
from freetoken_py.kvcache.window import WindowPages
from freetoken_py.scheduler.prefix_state import PrefixStateReuse


class Scheduler:
    def __init__(self, allocator: PageAllocator, page_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_cache: RadixCache | None = None,
                 namespace: Callable[[Request], Hashable | None] | None = None,
                 tracker: IntegrityTracker | NullTracker | None = None,
                 more_pages: Callable[[int], int] | None = None, state_pool: StatePool | None = None,
                 states: PrefixStateReuse | None = None, windows: WindowPages | None = None):
        self.allocator = allocator
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache = prefix_cache
        # namespace(req) -> the cache key's namespace; None = do not cache this request
        self.namespace = namespace or (lambda req: ("default", req.cache_salt))
        self.tracker = tracker or NullTracker(allocator)
        # more_pages(n) -> pages added to the allocator (the engine may grow the KV cache, taking
        # the memory from elsewhere), asked after the prefix cache and before preempting anyone
        self.more_pages = more_pages
        self.state_pool = state_pool  # hybrids: the per-request recurrent-state slots
        self.states = states  # hybrid models: snapshots of the recurrent state in the prefix cache
        # models with windowed layers: their own pages and tables (kvcache/window.py), tags and cached pages
        self.windows = windows
        self.wtracker = self.tracker.add_kind("window", windows.allocator) if windows is not None else None
        if windows is not None and prefix_cache is not None:
            assert states is None, "windowed layers in a hybrid: not supported"
            prefix_cache.windows = windows
            windows.reclaim = prefix_cache.evict_windows   # (passes run outside the scheduler)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages_needed(self, req: Request, upto: int) -> int:
        return max(0, -(-upto // self.page_size) - len(req.page_table))

    def _grow(self, req: Request, upto: int, running: bool = False) -> bool:
        """Pages for `req` up to token `upto`. `running`: it would be preempted otherwise, so the
        engine is asked for more pages (a waiting request just waits)."""
        need = self._pages_needed(req, upto)
        if need > self.allocator.num_free and self.prefix_cache is not None:
            self.prefix_cache.evict(need - self.allocator.num_free)  # cached pages go before requests
        if need > self.allocator.num_free and running and self.more_pages is not None:
            self.more_pages(need - self.allocator.num_free)
        if need > self.allocator.num_free or not self._grow_window(req, upto):
            return False
        pages = self.allocator.allocate(need)
        req.page_table.extend(pages)
        self.tracker.record(req.request_id, pages)
        return True

    def _grow_window(self, req: Request, upto: int) -> bool:
        """Models with windowed layers: their pages for `req` up to token `upto` (the pages behind
        its window were given back after its last step, `_trim`)."""
        w = self.windows
        if w is None:
            return True
        self._trim(req)   # (publish_prompts did after the last step; a loop driving schedule alone gets it here)
        need = w.pages_needed(req, upto)
        if need > w.allocator.num_free and self.prefix_cache is not None:   # the cache's windows go first
            self.prefix_cache.evict_windows(need - w.allocator.num_free)
        while need > w.allocator.num_free and self.prefix_cache is not None:
            if not self.prefix_cache.evict(need - w.allocator.num_free):
                break
        if need > w.allocator.num_free:
            return False
        self.wtracker.record(req.request_id, w.ensure(req, upto))
        return True

    def _trim(self, req: Request) -> None:
        """Give back the windowed layers' pages behind the request's next token's window."""
        if self.windows is not None:
            self.wtracker.drop(req.request_id, self.windows.trim(req))

    def _match_prefix(self, req: Request) -> bool:
        """Start a request with no pages from the longest cached prefix of its tokens. True when
        a recurrent-state snapshot was restored into its slot (hybrids)."""
        ns = self.namespace(req) if self.prefix_cache is not None else None
        if ns is None or req.page_table:
            return False
        if self.state_pool is not None and getattr(self, "states", None) is None:
            return False  # a hybrid without state snapshots: a page hit without its recurrent state would be wrong
        limit = (req.num_tokens - 1) // self.page_size * self.page_size  # keep >= 1 token to compute
        if self.states is not None:  # hybrid: only where the recurrent state is known too
            m = self.states.match(req, ns, req.all_token_ids[:limit])
        else:  # windowed layers: only where their window's pages are cached too
            m = self.prefix_cache.match(ns, req.all_token_ids[:limit])
        if m.pages:
            self.allocator.share(m.pages)
            req.page_table = list(m.pages)
            self.tracker.record(req.request_id, m.pages)
            if self.windows is not None:
                self.windows.adopt(req, m.window_pages)
                self.wtracker.record(req.request_id, self.windows.held(req.request_id))
        req.num_computed = m.num_tokens
        if not req.output_token_ids:
            req.num_cached_tokens = m.num_tokens
        return m.snapshot is not None

    def _release(self, req: Request, publish: bool) -> None:
        """Give back the request's pages (publishing its computed full pages to the cache first)."""
        valid = self.tracker.valid_pages(req.request_id)
        if valid is not None and valid != req.page_table:
            publish = False  # a page changed hands under it: its K/V must not enter the cache
        w, wvalid = self.windows, None
        if w is not None:
            wvalid = self.wtracker.valid_pages(req.request_id)
            if wvalid is not None and wvalid != w.held(req.request_id):
                publish = False
        ns = self.namespace(req) if (publish and self.prefix_cache is not None) else None
        if self.states is not None:  # hybrid: pages up to its last snapshot, which goes with them
            self.states.release(req, ns)
        elif ns is not None:
            self.prefix_cache.insert(ns, req.all_token_ids[:req.num_computed], req.page_table,
                                     w.table(req.request_id) if w is not None else None)
        self.allocator.release(req.page_table if valid is None else valid)  # never free a page we lost
        self.tracker.forget(req.request_id)
        if w is not None:
            w.release(req.request_id, wvalid)
            self.wtracker.forget(req.request_id)
        req.page_table = []
        if req.state_slot is not None:
            self.state_pool.free(req.state_slot)
            req.state_slot = None

    def move_pages_below(self, limit: int, copy_pages: Callable[[list[int], list[int]], None]) -> bool:
        """Before the KV cache shrinks to `limit` pages: every held page at or above it moves
        into a free page below it (`copy_pages(src, dst)` copies the K/V), and its holders follow:
        running requests' page tables, the prefix cache's nodes (`RadixCache.move_pages`) and the
        integrity tracker's records. When the free pages below are too few, the prefix cache gives
        back its least recently used pages first. False when they still are (the cache may have
        given back pages by then) or when a request has lost a page (the integrity check acts on
        it first); nothing moved then. An exception from `copy_pages` leaves everything as it was.
        Called between steps: a waiting request holds no pages then (`schedule` gives a matched
        prefix back when the rest does not fit)."""
        a, cache = self.allocator, self.prefix_cache
        for req in self.running:
            valid = self.tracker.valid_pages(req.request_id)
            if valid is not None and valid != req.page_table:
                return False

        def held_above() -> list[int]:
            return [p for p in range(limit, a.num_pages) if a.refcount(p)]

        high = held_above()
        while len(high) > a.num_free_below(limit):
            if cache is None or not cache.evict(len(high) - a.num_free_below(limit)):
                return False
            high = held_above()
        if not high:
            return True
        low = a.allocate_below(len(high), limit)
        try:
            copy_pages(high, low)
        except Exception:
            a.release(low)                          # nothing moved: the new pages go back
            raise
        for p, q in zip(high, low):
            a.share([q] * (a.refcount(p) - 1))      # as many holders as the page it replaces
        moves = dict(zip(high, low))
        if cache is not None:
            cache.move_pages(moves)
        for req in self.running:
            if any(p in moves for p in req.page_table):
                req.page_table = [moves.get(p, p) for p in req.page_table]
                self.tracker.forget(req.request_id)
                self.tracker.record(req.request_id, req.page_table)
        for p in high:
            a.release([p] * a.refcount(p))
        return True

    def _preempt(self, req: Request) -> None:
        """Free the request's pages; it recomputes its tokens (or re-matches them) when readmitted."""
        self.running.remove(req)
        self._release(req, publish=True)
        req.num_computed = 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preemptions_before = self.num_preemptions
        for req in list(self.running):
            if req not in self.running or budget == 0:
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            if self.states is not None:
                n = self.states.cut(req, n)
            while not self._grow(req, req.num_computed + n, running=True):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            else:
                chunks.append(ScheduledChunk(req, n))
                budget -= n
        chunks = [c for c in chunks if c.req in self.running]
        if self.num_preemptions != preemptions_before:
            return self._plan(chunks)  # pages are short: readmitting the victim now would only preempt it again
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            fresh = False
            if self.state_pool is not None and req.state_slot is None:
                if self.state_pool.num_free == 0:
                    break
                # with snapshots, zeroed only when none is restored into it (a restore writes every byte)
                req.state_slot = self.state_pool.allocate(zeroed=self.states is None)
                fresh = self.states is not None
            if not self._match_prefix(req) and fresh:
                self.state_pool.reset(req.state_slot)  # computes from token 0
            n = min(req.num_tokens - req.num_computed, budget)
            if self.states is not None:
                n = self.states.cut(req, n)
            if not self._grow(req, req.num_computed + n):
                self._release(req, publish=False)  # give the matched pages (and the slot) back; retry next step
                req.num_computed = 0
                break
            self.waiting.popleft()
            self.running.append(req)
            chunks.append(ScheduledChunk(req, n))
            budget -= n
        return self._plan(chunks)

    def _plan(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """Hybrids: the snapshot captures inside each chunk (prefix_state.PrefixStateReuse.plan)."""
        if self.states is not None:
            for ch in chunks:
                self.states.plan(ch, self.namespace(ch.req))
        return chunks

    def publish_prompts(self, chunks: list[ScheduledChunk]) -> None:
        """After a forward: cache the prompt pages of requests whose prefill just completed, so
        requests arriving while they decode can share them. Then (windowed layers) each request
        gives back its windowed pages behind its next token's window."""
        try:
            self._publish_prompts(chunks)
        finally:
            for ch in chunks:
                self._trim(ch.req)

    def _publish_prompts(self, chunks: list[ScheduledChunk]) -> None:
        if self.prefix_cache is None:
            return
        if self.states is not None:  # hybrid: snapshots (with their pages) instead
            for ch in chunks:
                self.states.after_forward(ch.req, self.namespace(ch.req))
            return
        for ch in chunks:
            req, n = ch.req, len(ch.req.prompt_token_ids)
            if not req.num_computed - ch.num_new < n <= req.num_computed:
                continue  # decode steps and unfinished prefill chunks: nothing to publish
            ns = self.namespace(req)
            if ns is not None:
                self.prefix_cache.insert(ns, req.prompt_token_ids, req.page_table,
                                         self.windows.table(req.request_id) if self.windows is not None else None)

    def finish(self, req: Request, publish: bool = True) -> None:
        """Remove a finished or aborted request. publish=False for a request whose pages failed
        the integrity check: nothing it computed is trusted, and only pages still its own are freed."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req, publish)
