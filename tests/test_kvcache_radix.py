"""Prefix cache + scheduler + page tags, no model: exact page ids, pinned prefix lengths at the
page boundaries, LRU eviction order, namespaces, and a hypothesis state machine that drives the
real Scheduler/RadixCache/PageAllocator/IntegrityTracker against a simulated KV store.

The simulated store is the independent reference: computing position `pos` of a request writes
(namespace, tokens[:pos+1]) into that slot, so a request that reads a slot holding anything else
(another request's prefix, a stale page) is caught, whatever the bookkeeping says."""
from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from freetoken_py.core import Request, SamplingParams
from freetoken_py.kvcache import PageAllocator
from freetoken_py.kvcache.radix import RadixCache
from freetoken_py.kvcache.tags import IntegrityTracker
from freetoken_py.scheduler.scheduler import Scheduler

P = 4


def _engine(num_pages=32, budget=64, seqs=4):
    alloc = PageAllocator(num_pages)
    cache = RadixCache(alloc, P)
    tracker = IntegrityTracker(alloc)
    return alloc, cache, tracker, Scheduler(alloc, P, seqs, budget, cache, None, tracker)


def _run_prefill(s: Scheduler) -> list:
    chunks = s.schedule()
    for ch in chunks:
        ch.req.num_computed += ch.num_new
    s.publish_prompts(chunks)
    return chunks


@pytest.mark.parametrize("shared", [0, 1, P - 1, P, P + 1, 2 * P])
def test_pinned_prefix_lengths_share_only_full_pages(shared):
    alloc, cache, _, s = _engine()
    base = list(range(100, 100 + 3 * P))
    a = Request(base, SamplingParams(max_tokens=4))
    s.add(a)
    _run_prefill(s)
    s.finish(a)
    b = Request(base[:shared] + [7] * (3 * P - shared), SamplingParams(max_tokens=4))
    s.add(b)
    (ch,) = s.schedule()
    full = shared // P
    assert b.num_cached_tokens == b.num_computed == full * P
    assert b.page_table[:full] == a_pages(cache, base)[:full]  # the very pages a computed
    assert ch.num_new == 3 * P - full * P
    assert all(alloc.refcount(p) == 2 for p in b.page_table[:full])  # cache + b


def a_pages(cache: RadixCache, tokens: list[int]) -> list[int]:
    return cache.match(("default", None), tokens).pages


@pytest.mark.parametrize("length", [1, P - 1, P, P + 1, 2 * P])
def test_identical_prompt_still_computes_its_last_token(length):
    """SGLang #22819's shape: prompt length = a multiple of the page size, fully cached."""
    _, _, _, s = _engine()
    prompt = list(range(length))
    first = Request(prompt, SamplingParams())
    s.add(first)
    _run_prefill(s)
    s.finish(first)
    again = Request(prompt, SamplingParams())
    s.add(again)
    (ch,) = s.schedule()
    assert again.num_cached_tokens == (length - 1) // P * P
    assert ch.num_new >= 1 and ch.samples


def test_lru_eviction_order_and_locked_pages_stay():
    alloc, cache, _, s = _engine(num_pages=8)
    reqs = [Request([i] * (2 * P), SamplingParams()) for i in range(3)]  # 2 full pages each + 1 for the tail
    for r in reqs:
        s.add(r)
        _run_prefill(s)
        s.finish(r)
    assert cache.num_pages == 6 and [r.page_table for r in reqs] == [[], [], []]  # pages 0-1, 2-3, 4-5 cached
    locked = Request([1] * (2 * P) + [5], SamplingParams())  # re-uses request 1's pages
    s.add(locked)
    s.schedule()
    order = [n.page for n in sorted(cache.evictable_leaves(), key=lambda n: n.last_access)]
    assert order == [1, 5]  # leaves of requests 0 and 2; request 1's pages 2-3 are locked
    assert cache.evict(1) == 1 and alloc.refcount(1) == 0  # least recently used first
    assert cache.evict(10) == 3  # then 0 (now a leaf, older than 5), 5 and 4
    assert sorted(cache.cached_pages()) == sorted(locked.page_table[:2])


def test_namespaces_do_not_share():
    _, cache, _, s = _engine()
    a = Request(list(range(3 * P)), SamplingParams(), cache_salt="alice")
    s.add(a)
    _run_prefill(s)
    s.finish(a)
    for salt, hit in (("bob", 0), (None, 0), ("alice", 2 * P)):
        r = Request(list(range(3 * P)), SamplingParams(), cache_salt=salt)
        s.add(r)
        s.schedule()
        assert r.num_cached_tokens == hit, salt
        s.finish(r)


class CacheMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.alloc, self.cache, self.tracker, self.s = _engine(num_pages=10, budget=12, seqs=3)
        self.kv: dict[int, tuple] = {}  # slot -> (namespace, tokens up to and including it)
        self.live: list[Request] = []
        self.prev_tags = self.alloc.tags.clone()

    @rule(prefix=st.sampled_from([0, 1, P - 1, P, P + 1, 2 * P]), tail=st.lists(st.integers(0, 2), max_size=2 * P),
          salt=st.sampled_from([None, None, "x"]), max_tokens=st.integers(1, 3))
    def add(self, prefix, tail, salt, max_tokens):
        tokens = [9, 8, 7, 6, 5, 4, 3, 2, 1][:prefix] + tail
        if tokens and len(self.live) < 6:
            req = Request(tokens, SamplingParams(max_tokens=max_tokens), cache_salt=salt)
            self.s.add(req)
            self.live.append(req)

    @rule()
    def step(self):
        for ch in self.s.schedule():
            req, ns = ch.req, self.s.namespace(ch.req)
            toks = req.all_token_ids
            for pos in range(req.num_computed):  # the context it attends to must be its own prefix
                assert self.kv.get(self._slot(req, pos)) == (ns, tuple(toks[:pos + 1])), (req.request_id, pos)
            for pos in range(req.num_computed, req.num_computed + ch.num_new):
                self.kv[self._slot(req, pos)] = (ns, tuple(toks[:pos + 1]))
            req.num_computed += ch.num_new
            self.s.publish_prompts([ch])
            if ch.samples:
                req.output_token_ids.append(sum(toks) % 3)
                if len(req.output_token_ids) >= req.params.max_tokens:
                    self._finish(req, publish=True)

    @rule(i=st.integers(0, 5), publish=st.booleans())
    def abort(self, i, publish):
        if i < len(self.live):
            self._finish(self.live[i], publish)

    @rule(n=st.integers(1, 4))
    def evict(self, n):
        before = {p for r in self.live for p in r.page_table}
        self.cache.evict(n)
        assert all(self.alloc.refcount(p) > 0 for p in before)  # locked pages never evicted

    @rule(n=st.integers(1, 4))
    def grow(self, n):
        self.alloc.grow(min(14, self.alloc.num_pages + n))

    @rule(limit=st.integers(4, 13))
    def shrink(self, limit):
        """The KV cache shrinks to `limit` pages: held pages above move below it (the simulated
        store's entries are copied), then the pages above are gone from the store."""
        if limit >= self.alloc.num_pages:
            return

        def copy(src, dst):
            for a, b in zip(src, dst):
                for off in range(P):
                    self.kv[b * P + off] = self.kv.get(a * P + off)

        if self.s.move_pages_below(limit, copy):
            self.alloc.shrink(limit)
            for slot in [k for k in self.kv if k >= limit * P]:
                del self.kv[slot]

    def _finish(self, req, publish):
        self.s.finish(req, publish)
        self.live.remove(req)

    def _slot(self, req, pos):
        return req.page_table[pos // P] * P + pos % P

    @invariant()
    def bookkeeping(self):
        if not hasattr(self, "s"):
            return
        holders = [0] * self.alloc.num_pages
        for r in self.live:
            assert len(set(r.page_table)) == len(r.page_table)  # no duplicate pages
            for p in r.page_table:
                holders[p] += 1
        cached = self.cache.cached_pages()
        assert len(set(cached)) == len(cached)
        for p in cached:
            holders[p] += 1
        free = set(self.alloc._free)
        assert len(free) == len(self.alloc._free)
        for p in range(self.alloc.num_pages):
            assert self.alloc.refcount(p) == holders[p]  # refcounts equal holders
            assert (p in free) != (holders[p] > 0)  # each page free xor owned
        for leaf in self.cache.evictable_leaves():
            assert holders[leaf.page] == 1  # only unlocked pages are evictable
        n = min(len(self.alloc.tags), len(self.prev_tags))
        assert bool((self.alloc.tags[:n] >= self.prev_tags[:n]).all())  # tags monotonic
        self.prev_tags = self.alloc.tags.clone()
        assert self.tracker.check() == {}  # no false alarms

    @invariant()
    def cached_pages_hold_their_tokens(self):
        if not hasattr(self, "s"):
            return
        for ns, root in self.cache._roots.items():
            stack = [(root, ())]
            while stack:
                node, path = stack.pop()
                for child in node.children.values():
                    toks = path + child.key
                    for off in range(P):
                        assert self.kv[child.page * P + off] == (ns, toks[:len(path) + off + 1])
                    stack.append((child, toks))


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_cache_state_machine = CacheMachine.TestCase


def test_moved_pages_still_match_with_their_new_tags():
    """RadixCache.move_pages: after the caller copied a cached page elsewhere, the node points at
    the new page and takes its tag, so a match returns the new page; the old page can be freed
    and reused without the cache noticing anything but its own nodes."""
    alloc = PageAllocator(8)
    cache = RadixCache(alloc, P)
    tokens = list(range(3 * P))
    pages = alloc.allocate(3)                      # 0, 1, 2
    cache.insert("ns", tokens, pages)
    alloc.release(pages)                           # the request is done: only the cache holds them
    new = alloc.allocate(1)                        # 3
    assert cache.move_pages({1: new[0]}) == 1
    alloc.release([1])
    assert cache.match("ns", tokens).pages == [0, 3, 2]
    reused = alloc.allocate(1)                     # 1 again, retagged: no node refers to it
    assert reused == [1] and cache.match("ns", tokens).pages == [0, 3, 2]
    assert sorted(cache.cached_pages()) == [0, 2, 3]


def test_a_stale_node_stays_stale_when_its_page_moves():
    """A node whose page's tag changed under it (it no longer matches) must not start matching
    when the page moves: the new page holds other K/V."""
    alloc = PageAllocator(8)
    cache = RadixCache(alloc, P)
    tokens = list(range(2 * P))
    pages = alloc.allocate(2)
    cache.insert("ns", tokens, pages)
    alloc.release(pages)
    alloc.tags_np[pages[1]] += 1                   # page 1 changed hands under the cache
    assert cache.match("ns", tokens).pages == [pages[0]]
    new = alloc.allocate(1)
    cache.move_pages({pages[1]: new[0]})
    assert cache.match("ns", tokens).pages == [pages[0]]


def test_moving_pages_down_leaves_everything_as_it_was_when_the_copy_fails():
    """Scheduler.move_pages_below with a copy that raises: the exception comes out, and page
    tables, refcounts, free pages and the cache are untouched."""
    alloc, cache, tracker, s = _engine(num_pages=8, budget=64, seqs=4)
    alloc.allocate(5)                              # 0..4 taken by someone else
    r = Request(list(range(2 * P)), SamplingParams(max_tokens=4))
    s.add(r)
    _run_prefill(s)
    assert r.page_table == [5, 6]
    alloc.release([0, 1])
    before = (list(r.page_table), [alloc.refcount(p) for p in range(8)], alloc.num_free, sorted(cache.cached_pages()))

    def fail(src, dst):
        raise MemoryError("copy failed")

    with pytest.raises(MemoryError):
        s.move_pages_below(5, fail)
    assert (list(r.page_table), [alloc.refcount(p) for p in range(8)], alloc.num_free,
            sorted(cache.cached_pages())) == before
    assert s.move_pages_below(5, lambda src, dst: None) and all(p < 5 for p in r.page_table)
    assert tracker.check() == {}
