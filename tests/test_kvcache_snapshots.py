"""Recurrent-state snapshots in the prefix cache, no model: the real StatePool (fp32 tensors of a
Gated DeltaNet layer's shapes), SnapshotStore and RadixCache. The reference is the source slot's
own bytes: a restore must reproduce them exactly, and every check (slot reassigned, another
namespace, changed bytes) must refuse to restore."""
from __future__ import annotations

import pytest
import torch

from freetoken_py.kvcache import PageAllocator
from freetoken_py.kvcache.radix import RadixCache
from freetoken_py.kvcache.snapshots import SnapshotStore, snapshot_every_pages
from freetoken_py.kvcache.spec import PagedKV, Recurrent
from freetoken_py.kvcache.state import StatePool

P = 4
SPECS = [Recurrent(24, 3, 4, 8, 8), Recurrent(24, 3, 4, 8, 8), PagedKV(2, 8)]  # 2 GDN layers + 1 attention


def _pool(slots=8):
    return StatePool(SPECS, slots)


def _fill(pool, slot, seed):
    g = torch.Generator().manual_seed(seed)
    for t in pool.conv + pool.rec:
        if t is not None:
            t[slot] = torch.randn(t[slot].shape, generator=g)


def _state(pool, slot):
    return [t[slot].clone() for t in pool.conv + pool.rec if t is not None]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_take_restore_round_trip_and_release():
    pool = _pool()
    req = pool.allocate()
    _fill(pool, req, 1)
    store = SnapshotStore(pool, capacity=2)
    ref = store.take(req, "ns", 8)
    before = _state(pool, req)
    _fill(pool, req, 2)                                   # the request moves on
    dst = pool.allocate()
    assert store.restore(ref, "ns", dst) and _same(_state(pool, dst), before)
    free = pool.num_free
    store.release(ref)
    assert pool.num_free == free + 1 and store.num_free == 2
    assert not store.restore(ref, "ns", dst)              # a given-back snapshot is never read again
    assert store.num_mismatches == 1


def test_capacity_is_the_store_budget_not_the_pool():
    pool = _pool(8)
    src = pool.allocate()
    store = SnapshotStore(pool, capacity=2)
    refs = [store.take(src, "ns", P) for _ in range(3)]
    assert refs[2] is None and pool.num_free == 8 - 1 - 2  # the rest stays for requests
    assert store.bytes_held == 2 * pool.bytes_per_slot == 2 * sum(s.bytes_per_request for s in SPECS[:2])


def test_restore_refuses_other_owner_reassigned_slot_and_changed_bytes():
    pool = _pool()
    src, dst = pool.allocate(), pool.allocate()
    _fill(pool, src, 3)
    store = SnapshotStore(pool, capacity=3)
    a, b, c = (store.take(src, "alice", P) for _ in range(3))
    _fill(pool, dst, 9)
    untouched = _state(pool, dst)
    assert not store.restore(a, "bob", dst)               # another namespace
    store.tags[b.slot] += 1                               # the slot changed hands under the ref
    assert not store.restore(b, "alice", dst)
    pool.rec[0][c.slot, 1, 2, 3] += 1e-3                  # one value of one layer's state tampered
    assert not store.restore(c, "alice", dst)
    assert _same(_state(pool, dst), untouched) and store.num_mismatches == 3
    assert store.restore(a, "alice", dst)


def test_match_stops_at_the_deepest_snapshot_on_the_shared_path():
    pool = _pool()
    alloc = PageAllocator(16)
    store = SnapshotStore(pool, capacity=4)
    cache = RadixCache(alloc, P, snapshots=store)
    src = pool.allocate()
    tokens = list(range(100, 100 + 5 * P))
    pages = alloc.allocate(5)
    cache.insert("ns", tokens, pages)
    snaps = {}
    for n in (1, 3):                                      # snapshots after pages 1 and 3
        _fill(pool, src, n)
        snaps[n] = (store.take(src, "ns", n * P), _state(pool, src))
        assert cache.attach("ns", tokens[:n * P], snaps[n][0])
    m = cache.match("ns", tokens, with_state=True)
    assert m.num_tokens == 3 * P and m.pages == pages[:3] and m.snapshot == snaps[3][0]
    diverged = tokens[:2 * P + 1] + [7] * (3 * P)        # diverges mid page 3: back to the snapshot after page 1
    m = cache.match("ns", diverged, with_state=True)
    assert m.num_tokens == P and m.snapshot == snaps[1][0]
    dst = pool.allocate()
    assert store.restore(m.snapshot, "ns", dst) and _same(_state(pool, dst), snaps[1][1])
    assert cache.match("other", tokens, with_state=True).num_tokens == 0
    assert cache.match("ns", tokens).num_tokens == 5 * P  # without with_state: pages as before
    assert not cache.attach("ns", [9] * P, store.take(src, "ns", P))  # no such path: the caller keeps it


def test_snapshots_are_freed_with_their_nodes_and_lru_alone():
    pool = _pool()
    alloc = PageAllocator(16)
    store = SnapshotStore(pool, capacity=3)
    cache = RadixCache(alloc, P, snapshots=store)
    src = pool.allocate()
    convs = [[i] * (2 * P) for i in range(3)]            # three unrelated 2-page prompts
    for toks in convs:
        pages = alloc.allocate(2)
        cache.insert("ns", toks, pages)
        alloc.release(pages)
        cache.attach("ns", toks, store.take(src, "ns", 2 * P))
    cache.match("ns", convs[0], with_state=True)         # conversation 0 used again: most recent
    assert store.num_free == 0
    assert cache.evict_snapshots(1) == 1                  # the least recently used: conversation 1
    assert cache.match("ns", convs[1], with_state=True).num_tokens == 0
    assert cache.match("ns", convs[0], with_state=True).num_tokens == 2 * P
    free = pool.num_free
    cache.evict(16)                                       # every page goes, and the snapshots with them
    assert cache.num_snapshots == 0 and store.num_free == 3 and pool.num_free == free + 2
    assert alloc.num_free == 16


def test_a_snapshot_whose_slot_changed_hands_is_dropped_at_match():
    pool = _pool()
    alloc = PageAllocator(8)
    store = SnapshotStore(pool, capacity=2)
    cache = RadixCache(alloc, P, snapshots=store)
    src = pool.allocate()
    toks = list(range(2 * P))
    cache.insert("ns", toks, alloc.allocate(2))
    cache.attach("ns", toks[:P], store.take(src, "ns", P))
    ref = store.take(src, "ns", 2 * P)
    cache.attach("ns", toks, ref)
    store.tags[ref.slot] += 1                             # reassigned under the cache
    m = cache.match("ns", toks, with_state=True)
    assert m.num_tokens == P and cache.num_snapshots == 1


def test_spacing_rule():
    # a Qwen3.6-35B-A3B-shaped model: 30 GDN layers (8192-channel conv x 3, 32 heads x 128 x 128) and
    # 10 attention layers of 2 KV heads x 256 in bf16
    state = 30 * 4 * (8192 * 3 + 32 * 128 * 128)
    kv_per_token = 10 * 2 * 2 * 256 * 2
    every = snapshot_every_pages(state, kv_per_token, 16)
    assert (every - 1) * 16 * kv_per_token < state <= every * 16 * kv_per_token
    assert snapshot_every_pages(10, 1000, 16) == 1


# ---- the scheduler's side (prefix_state.PrefixStateReuse) against a simulated recurrent model ----
MOD = 65521  # the simulated state: a polynomial hash of the prefix, exact in fp32


def _hash(tokens) -> float:
    h = 0
    for t in tokens:
        h = (h * 31 + t + 1) % MOD
    return float(h)


class SimEngine:
    """Real Scheduler / RadixCache / PageAllocator / StatePool / SnapshotStore; the 'model' keeps
    hash(prefix) in its recurrent slot and (namespace, prefix) in each K/V slot, so any resumed
    state or page that is not exactly the prefix's is caught."""

    def __init__(self, num_pages=32, capacity=4, every_pages=2, budget=64, seqs=3, in_layer=False):
        from freetoken_py.kvcache.tags import IntegrityTracker
        from freetoken_py.scheduler.prefix_state import PrefixStateReuse
        from freetoken_py.scheduler.scheduler import Scheduler

        self.alloc = PageAllocator(num_pages)
        self.pool = _pool(seqs + capacity)
        self.store = SnapshotStore(self.pool, capacity)
        self.cache = RadixCache(self.alloc, P, snapshots=self.store)
        self.states = PrefixStateReuse(self.cache, self.store, P, every_pages, in_layer=in_layer)
        self.s = Scheduler(self.alloc, P, seqs, budget, self.cache, None, IntegrityTracker(self.alloc),
                           state_pool=self.pool, states=self.states)
        self.kv: dict[int, tuple] = {}
        self.chunk_ends: dict[int, list[int]] = {}

    def add(self, tokens, max_tokens=1):
        from freetoken_py.core import Request, SamplingParams

        req = Request(list(tokens), SamplingParams(max_tokens=max_tokens))
        self.s.add(req)
        return req

    def run(self):
        done = []
        while self.s.has_work:
            chunks = self.s.schedule()
            for ch in chunks:
                req, ns = ch.req, self.s.namespace(ch.req)
                toks = req.all_token_ids
                assert self.pool.rec[0][req.state_slot, 0, 0, 0].item() == _hash(toks[:req.num_computed])
                for pos in range(req.num_computed):
                    slot = req.page_table[pos // P] * P + pos % P
                    assert self.kv.get(slot) == (ns, tuple(toks[:pos + 1])), pos
                for pos in range(req.num_computed, req.num_computed + ch.num_new):
                    self.kv[req.page_table[pos // P] * P + pos % P] = (ns, tuple(toks[:pos + 1]))
                for rows, dst in ch.captures:   # the mixer's capture: the state after those rows
                    self.pool.rec[0][dst, 0, 0, 0] = _hash(toks[:req.num_computed + rows])
                req.num_computed += ch.num_new
                self.pool.rec[0][req.state_slot, 0, 0, 0] = _hash(toks[:req.num_computed])
                self.chunk_ends.setdefault(req.request_id, []).append(req.num_computed)
            self.s.publish_prompts(chunks)
            for ch in chunks:
                req = ch.req
                if ch.samples:
                    req.output_token_ids.append((sum(req.all_token_ids) * 7) % 50)
                    if len(req.output_token_ids) >= req.params.max_tokens:
                        self.s.finish(req)
                        done.append(req)
        return done


@pytest.mark.parametrize("in_layer", [False, True])
def test_turn_two_resumes_at_the_end_of_turn_one(in_layer):
    e = SimEngine(every_pages=2, capacity=6, in_layer=in_layer)
    prompt = list(range(5 * P + 2))
    (a,) = e.run() if e.add(prompt, max_tokens=P + 1) else ()
    # the snapshot points 2P, 4P and the prompt's last page: chunks cut there, or captured inside one
    ends = [5 * P + 2] if in_layer else [2 * P, 4 * P, 5 * P, 5 * P + 2]
    assert e.chunk_ends[a.request_id][:len(ends)] == ends
    assert a.num_cached_tokens == 0
    b = e.add(a.all_token_ids + [3, 4, 5])              # the next turn: the whole history + a new message
    e.run()
    assert b.num_cached_tokens == 6 * P                   # the rolling snapshot of a's decode (6P <= its 6P+2 tokens)
    c = e.add(prompt[:4 * P + 1] + [9] * 6)               # diverges in page 5: back to the snapshot at 4P
    e.run()
    assert c.num_cached_tokens == 4 * P
    d = e.add(prompt)                                     # the same prompt again: the last snapshot before its last token
    e.run()
    assert d.num_cached_tokens == 5 * P


@pytest.mark.parametrize("in_layer", [False, True])
def test_tiny_snapshot_budget_evicts_and_stays_exact(in_layer):
    e = SimEngine(num_pages=12, capacity=2, every_pages=1, in_layer=in_layer)
    convs = [[i * 10 + j for j in range(3 * P + 1)] for i in range(4)]
    for rounds in range(2):
        for toks in convs:
            e.add(toks, max_tokens=2)
            e.run()                                   # the simulation asserts every resumed state and page
    assert e.cache.num_snapshots_evicted > 0 and e.store.num_free >= 0
    assert e.store.num_mismatches == 0


def test_a_corrupted_snapshot_is_refused_and_the_request_recomputes():
    e = SimEngine(every_pages=1)
    prompt = list(range(3 * P + 1))
    e.add(prompt)
    e.run()
    ref = e.cache.snapshot_at(("default", None), prompt[:3 * P])
    e.pool.rec[1][ref.slot, 0, 0, 0] += 1.0            # tamper with the deepest snapshot
    r = e.add(prompt + [1, 2])
    e.run()                                           # resumed from the snapshot at 2P, state checked
    assert r.num_cached_tokens == 2 * P and e.store.num_mismatches == 1


@pytest.mark.parametrize("shape", [(24, 3), (4, 8, 8), (5, 3)])
def test_checksum_same_on_host_and_device_paths_and_sees_one_flipped_bit(shape):
    """The host (numpy) and device (torch) reductions of word_sum agree on the same bytes (the
    device path runs on a CPU tensor here), including the odd-size 32-bit fallback, and one
    flipped bit anywhere changes the sum."""
    from freetoken_py.kvcache.snapshots import word_sum

    x = torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 1e30   # big words: the sum wraps
    assert word_sum(x, on_host=True) == word_sum(x, on_host=False)
    for idx in (0, x.numel() // 2, x.numel() - 1):
        y = x.clone().reshape(-1)
        y.view(torch.int32)[idx] ^= 1 << 17
        assert word_sum(y, on_host=True) != word_sum(x, on_host=True)
        assert word_sum(y, on_host=False) == word_sum(y, on_host=True)
