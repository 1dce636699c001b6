"""Cache policies and elastic VRAM as pure mechanisms: exact resident sets and eviction order."""
from __future__ import annotations

import numpy as np
import pytest

from freetoken_py.residency.adaptive import AdaptivePolicy
from freetoken_py.residency.elastic import ElasticVram
from freetoken_py.residency.planner import CostModel, LayerStats
from freetoken_py.residency.policy import LruPolicy, PinPolicy, StaticPolicy
from freetoken_py.residency.profiles import FRONTIER_MODELS, PROFILES

SPEC = FRONTIER_MODELS["qwen3-30b-a3b"]
COST = CostModel(PROFILES["rtx4090"], SPEC.expert_bytes, SPEC.expert_flops_per_token)


def test_static_keeps_whole_layers_from_the_top():
    p = StaticPolicy([0, 1, 2, 3], num_experts=4, capacity=9)   # room for two full layers
    assert p.keys == {(l, e) for l in (2, 3) for e in range(4)}
    plan = p.split(0, LayerStats({0: 1, 1: 1}, p.resident(0)), COST)
    assert plan.stream == () and plan.cpu == (0, 1)


def test_pin_keeps_the_most_frequent_pairs():
    counts = np.array([[5, 0, 1], [0, 9, 2]])
    p = PinPolicy([0, 1], counts, capacity=3)
    assert p.keys == {(1, 1), (0, 0), (1, 2)}
    assert p.resize(2) == [(1, 2)] and p.keys == {(0, 0), (1, 1)}


def test_lru_fixed_split_and_eviction_order():
    p = LruPolicy(capacity=2, stream_share=0.5)
    plan = p.split(0, LayerStats({1: 1, 2: 1, 3: 1, 4: 1}, frozenset()), COST)
    assert plan.stream == (2, 4) and plan.cpu == (1, 3)          # every second miss streams
    assert p.admit(0, 2, 0) == [] and p.admit(0, 4, 0) == []
    p.touch(0, 1, {2: 1})                                       # 2 is now the most recent
    assert p.admit(1, 7, 1) == [(0, 4)]
    assert p.keys == {(0, 2), (1, 7)}


def drive(policy, routing: list[list[int]], layer: int = 0) -> int:
    """Route each step's experts through `policy`, streaming (admitting) every miss; returns hits."""
    hits = 0
    for step, experts in enumerate(routing):
        tokens = {e: 1 for e in experts}
        hits += sum(policy.is_resident(layer, e) for e in experts)
        policy.touch(layer, step, tokens)
        for e in experts:
            if not policy.is_resident(layer, e):
                policy.admit(layer, e, step)
    return hits


def test_adaptive_learns_frequency_when_recency_keeps_failing():
    # experts 0-3 are routed every step, a one-off expert rides along each step: LRU keeps
    # evicting a hot expert for the one-off; LFU keeps the hot four
    rng = np.random.default_rng(0)
    routing = [[0, 1, 2, 3][: 2 + s % 3] + [10 + int(rng.integers(50))] for s in range(400)]
    p = AdaptivePolicy([0], num_experts=64, capacity=4, seed=1)
    drive(p, routing[:200])
    assert p.keys == {(0, 0), (0, 1), (0, 2), (0, 3)}
    drive(p, routing[200:])
    assert p._leader() == 1           # the LFU shadow scores more hits, so LFU decides evictions
    assert p.keys == {(0, 0), (0, 1), (0, 2), (0, 3)}


def test_adaptive_learns_recency_on_a_sliding_working_set():
    # a working set of 3 that moves by one expert every 6 steps: what is recent is what is used
    routing = [[(s // 6 + j) % 40 for j in range(3)] for s in range(600)]
    p = AdaptivePolicy([0], num_experts=40, capacity=4, seed=1)
    hits = drive(p, routing)
    assert p._leader() == 0           # the LRU shadow scores more hits, so LRU decides evictions
    lru = LruPolicy(capacity=4, stream_share=1.0)
    assert hits >= 0.97 * drive(lru, routing)


def test_per_layer_floor_protects_a_quiet_layer():
    # capacity 8 over 2 layers: fair share 4, floor 2. Layer 1 holds 2 experts; a burst of new
    # layer-0 experts may evict layer 0's own entries but never layer 1's last two.
    p = AdaptivePolicy([0, 1], num_experts=32, capacity=8, seed=0)
    p.touch(1, 0, {0: 1, 1: 1})
    p.admit(1, 0, 0), p.admit(1, 1, 0)
    for step in range(1, 40):
        p.touch(0, step, {step % 30: 1})
        p.admit(0, step % 30, step)
    assert p.resident(1) == frozenset({0, 1})
    assert len(p.resident(0)) == 6


def not_kept(plan) -> list[int]:
    """Misses served without taking a slot: on the CPU, or cut between the CPU and a staging copy
    (planner decision 5)."""
    return sorted(list(plan.cpu) + [e for e, _ in plan.split])


def test_cpu_absorbed_misses_evict_nothing():
    # on the laptop a decode miss of an expert with no history runs on the CPU: no slot asked for
    laptop = CostModel(PROFILES["rtx4060-laptop-8g"], SPEC.expert_bytes, SPEC.expert_flops_per_token)
    p = AdaptivePolicy([0], num_experts=16, capacity=2)
    p.touch(0, 0, {0: 1, 1: 1})
    p.admit(0, 0, 0), p.admit(0, 1, 0)
    assert p.stream_values(0, [5], laptop) == {5: 0.0}
    plan = p.split(0, LayerStats({0: 1, 5: 1}, p.resident(0)), laptop)
    assert plan.stream == () and not_kept(plan) == [5]
    assert p.keys == {(0, 0), (0, 1)}


def test_a_hot_missed_expert_is_worth_streaming_even_where_the_cpu_is_faster():
    # PRO 6000 box: CPU 110 GB/s beats PCIe 52 GB/s for one decode miss, so a cold miss goes to
    # the CPU; an expert routed every recent step (while the resident ones idle) is worth keeping
    pro = CostModel(PROFILES["rtx-pro-6000"], SPEC.expert_bytes, SPEC.expert_flops_per_token)
    p = AdaptivePolicy([0], num_experts=16, capacity=2)
    p.touch(0, 0, {0: 1, 1: 1})
    p.admit(0, 0, 0), p.admit(0, 1, 0)
    cold = p.split(0, LayerStats({7: 1}, p.resident(0)), pro)
    assert cold.stream == () and not_kept(cold) == [7]
    for step in range(1, 30):
        p.touch(0, step, {7: 1})                      # served on the CPU each time: 7 stays a miss
    values = p.stream_values(0, [7, 9], pro)
    assert values[7] > pro.copy_s() - pro.cpu_s(1) and values[9] == 0.0
    plan = p.split(0, LayerStats({7: 1, 9: 1}, p.resident(0)), pro)
    assert plan.stream == (7,) and not_kept(plan) == [9]


def test_adaptive_resize_evicts_down_and_regrows():
    p = AdaptivePolicy([0, 1], num_experts=8, capacity=6)
    for step, (l, e) in enumerate([(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]):
        p.touch(l, step, {e: 1})
        p.admit(l, e, step)
    evicted = p.resize(2)
    assert len(evicted) == 4 and len(p.keys) == 2 and not set(evicted) & p.keys
    assert p.resize(6) == [] and p.capacity == 6
    p.touch(0, 10, {5: 1})
    assert p.admit(0, 5, 10) == [] and p.is_resident(0, 5)


def test_warm_start_fills_from_counts():
    counts = np.zeros((2, 4))
    counts[0, 3], counts[1, 1], counts[1, 2] = 9, 5, 1
    p = AdaptivePolicy([0, 1], num_experts=4, capacity=2)
    p.warm_start(counts)
    assert p.keys == {(0, 3), (1, 1)}


def test_elastic_shrinks_at_once_and_grows_with_hysteresis():
    mb = 2**20
    ev = ElasticVram(slot_bytes=10 * mb, max_slots=100, reserve_bytes=50 * mb, grow_margin_bytes=40 * mb)
    assert ev.target(free_bytes=550 * mb, current_slots=0) == 50          # (550-50)/10
    assert ev.target(free_bytes=10 * mb, current_slots=50) == 46          # 500+10-50 = 460 MB
    assert ev.target(free_bytes=80 * mb, current_slots=46) == 46          # 30 MB spare < margin
    assert ev.target(free_bytes=100 * mb, current_slots=46) == 51
    assert ev.target(free_bytes=10**12, current_slots=51) == 100          # capped by the budget
    assert ev.target(free_bytes=0, current_slots=3) == 0


@pytest.mark.parametrize("capacity", [0, 1])
def test_zero_or_one_slot_never_breaks(capacity):
    p = AdaptivePolicy([0], num_experts=4, capacity=capacity)
    drive(p, [[0, 1], [2, 3], [0, 2]])
    assert len(p.keys) <= capacity


def test_without_shadows_the_ghost_weights_still_learn():
    """The LeCaR part on its own (shadow margin never reached): the ghost-list regrets move the
    weights toward the expert whose evictions were not regretted."""
    rng = np.random.default_rng(0)
    freq_routing = [[0, 1, 2, 3][: 2 + s % 3] + [10 + int(rng.integers(50))] for s in range(400)]
    recency_routing = [[(s // 6 + j) % 40 for j in range(3)] for s in range(600)]
    # margin 1: |a - b| <= a + b always, the duel never decides
    p = AdaptivePolicy([0], num_experts=64, capacity=4, seed=1, shadow_margin=1.0)
    drive(p, freq_routing)
    assert p.weights[1] > 0.9 and p._leader() is None              # w_lfu
    q = AdaptivePolicy([0], num_experts=40, capacity=4, seed=1, shadow_margin=1.0)
    drive(q, recency_routing)
    assert q.weights[0] > 0.9                                       # w_lru


def test_victim_scan_over_the_resident_list_matches_a_full_scan():
    """The numba victim scan walks a list of residents (with copies of their layer, last step and
    count) kept beside the [L, E] arrays; after random admits, evictions, resizes and a re-base of
    the counts, the list holds exactly the residents with current copies, and the victim it picks
    is the one a plain scan of every (layer, expert) by the documented rule picks (LRU: age on the
    resident's own layer's clock)."""
    rng = np.random.default_rng(5)
    p = AdaptivePolicy(list(range(4)), num_experts=16, capacity=20, seed=1)
    for step in range(60):
        for layer in range(4):
            tokens = {int(e): 1 for e in rng.choice(16, 4, replace=False)}
            p.touch(layer, step, tokens)
            for e in tokens:
                if rng.random() < 0.5:
                    p.admit(layer, e, step)
        if step in (20, 40):
            p.resize(12 if step == 20 else 24)
        if step == 30:
            p._base = step - 40_000                     # force the overflow re-base in the next touch
        if step == 31:
            assert p._base == 31
        flat = sorted(int(x) for x in p._rlist[:p._nres])
        assert flat == sorted(l * 16 + e for l, e in p.keys)
        n = p._nres
        assert (p._rlayer[:n] == p._rlist[:n] // 16).all()
        assert (p._rlast[:n] == p.last.ravel()[p._rlist[:n]]).all()
        assert (p._rfreq[:n] == p.freq.ravel()[p._rlist[:n]]).all()
        assert all(p.resident(l) == set(np.flatnonzero(p.res[l]).tolist()) for l in range(4))
        fair = int(p.floor_share * p.capacity / 4)
        for which in (0, 1):
            for busy in (-1, 2):
                def score(l, e):
                    if which == 0:
                        return p.last[l, e] - p.layer_last[l] + 0.5 * p.freq[l, e] / (1.0 + p.freq[p.res].max())
                    return p.freq[l, e] + 1e-9 * (p.last[l, e] + 1) / (p.now + 2)
                cands = [(l, e) for l, e in sorted(p.keys) if not (l == busy and p.last[l, e] == p.now)]
                unguarded = [k for k in cands if p.count[k[0]] > fair]
                pool = unguarded or cands
                want = min(pool, key=lambda k: (score(*k), k)) if pool else None
                got = p._victim(which, busy_layer=None if busy < 0 else busy)
                assert (None if got is None else (int(got[0]), int(got[1]))) == want


def test_slot_cache_shrinks_without_allocating_and_keeps_what_a_failed_grow_got():
    """Chunked slots: a shrink moves the experts out of the chunks it drops and allocates nothing
    (so it works with every allocation failing); a grow appends chunks and stops at the first
    failure, keeping the chunks it got. Every resident expert keeps its weights throughout."""
    import torch

    from freetoken_py.residency.slots import SlotCache

    fail = {"on": False}

    def alloc(shape, **kw):
        if fail["on"]:
            raise torch.OutOfMemoryError("emulated: CUDA out of memory")
        return torch.empty(shape, **kw)

    cache = SlotCache(12, [((4, 3), torch.float32), ((3, 2), torch.float32)], alloc=alloc, chunk_slots=4)
    assert cache.num_slots == 12 and len(cache._chunks) == 3
    weights = {}
    for key in [(0, 1), (0, 2), (1, 0), (1, 5), (2, 3)]:
        w13, w2 = cache.views(cache.reserve(key))
        w13.copy_(torch.randn(4, 3))
        w2.copy_(torch.randn(3, 2))
        weights[key] = (w13.clone(), w2.clone())
    cache.evict((0, 1))
    del weights[(0, 1)]
    for key in [(3, 3), (3, 4), (4, 0), (4, 1), (4, 2)]:      # fill into the last chunk too
        w13, w2 = cache.views(cache.reserve(key))
        w13.fill_(float(key[1])), w2.fill_(-float(key[1]))
        weights[key] = (w13.clone(), w2.clone())
    for key in [(3, 3), (3, 4), (4, 0)]:
        cache.evict(key)
        del weights[key]
    assert max(cache.slot_of.values()) >= 8                  # something sits in the last chunk

    def same():
        return all(torch.equal(cache.get(k)[0], a) and torch.equal(cache.get(k)[1], b) for k, (a, b) in weights.items())

    fail["on"] = True
    assert cache.resize(7) == 8                              # whole chunks: 8 slots hold the 6 experts
    assert len(cache._chunks) == 2 and max(cache.slot_of.values()) < 8 and same()
    assert sorted(cache.free + list(cache.slot_of.values())) == list(range(8))
    assert cache.resize(16) == 8                             # every allocation fails: nothing gained, nothing lost
    fail["on"] = False
    assert cache.resize(14) == 14 and [c[0].shape[0] for c in cache._chunks] == [4, 4, 4, 2] and same()
    calls = {"n": 0}

    def third_fails(shape, **kw):
        calls["n"] += 1
        if calls["n"] == 3:                                  # the second chunk's first tensor
            raise torch.OutOfMemoryError("emulated: CUDA out of memory")
        return torch.empty(shape, **kw)

    cache._alloc = third_fails
    assert cache.resize(30) == 18 and same()                 # one more chunk of 4, then the failure
    key = (9, 9)
    assert cache.reserve(key) not in {s for k, s in cache.slot_of.items() if k != key}
    with pytest.raises(RuntimeError):
        cache.resize(len(cache.slot_of) - 1)                 # the policy must evict first


def test_shadows_admit_what_the_accelerator_handled_within_the_copies_made():
    """A shadow admits, in order, the misses the plan streamed and then the real cache's hits it
    lacks, at most as many as the plan copied: a pure LRU offered every miss of a step larger
    than the cache would loop and never hit."""
    from freetoken_py.residency.adaptive import _LfuShadow, _LruShadow

    freq = np.ones((2, 8))
    for shadow in (_LruShadow(), _LfuShadow()):
        shadow.fill([(0, 0), (0, 1)], freq)
        routed = [(1, 2), (1, 3), (1, 4)]
        # streamed (1, 3), real hit (1, 4), one copy made: only (1, 3) gets in
        assert shadow.access(routed, 4, freq, offered=[(1, 3), (1, 4)], budget=1) == 0
        held = shadow.keys if isinstance(shadow, _LruShadow) else shadow.resident
        assert set(held) == {(0, 0), (0, 1), (1, 3)}
        # next step (1, 3) is already held, so the one copy picks up the real cache's hit (1, 4)
        assert shadow.access(routed, 4, freq, offered=[(1, 3), (1, 4)], budget=1) == 1
        held = shadow.keys if isinstance(shadow, _LruShadow) else shadow.resident
        assert set(held) == {(0, 0), (0, 1), (1, 3), (1, 4)}
        assert shadow.access(routed, 4, freq, offered=[], budget=0) == 2     # nothing offered: nothing admitted


def test_lru_age_is_counted_on_each_layers_own_clock():
    """Within a step, layer 0 has routed and layer 1 not yet: layer 0's expert from last step is a
    step stale, layer 1's (routed in layer 1's latest step, the same step number) is not. The LRU
    victim is layer 0's, even though it was routed more (the old raw-step rule evicted the rarer
    one, layer 1's, just before layer 1 could use it)."""
    p = AdaptivePolicy([0, 1], num_experts=8, capacity=2, floor_share=0.0, seed=0)
    p.touch(0, 0, {1: 3})
    p.admit(0, 1, 0)
    p.touch(1, 0, {2: 1})
    p.admit(1, 2, 0)
    p.touch(0, 1, {3: 1})                       # step 1: layer 0 routes 3, not 1; layer 1 not yet
    assert p.freq[0, 1] > p.freq[1, 2] and p.last[0, 1] == p.last[1, 2] == 0
    assert p._victim(0, exclude=(0, 3), busy_layer=0) == (0, 1)
    p.touch(1, 1, {5: 1})                       # now layer 1 has routed too: both a step stale,
    assert p._victim(0, exclude=(1, 5), busy_layer=1) == (1, 2)    # and among equals the rarer


def test_slot_chunks_grown_inside_a_forward_can_shrink_and_fill_outside_one():
    """The forward runs in inference mode, so a chunk the elastic sizing grows there is an
    inference tensor; a shrink outside a forward (an out-of-memory retry, the KV/slot split) moves
    experts into such chunks, and the streamer may copy into them: neither may raise."""
    import torch

    from freetoken_py.residency.formats import ExpertFormat
    from freetoken_py.residency.slots import SlotCache
    from freetoken_py.residency.streamer import Streamer

    host13, host2 = torch.randn(6, 4, 3), torch.randn(6, 3, 2)
    fmt = ExpertFormat.of_float(host13, host2)
    cache = SlotCache(2, fmt.specs, chunk_slots=2)
    streamer = Streamer(cache, [(host13, host2)], fmt)
    with torch.inference_mode():
        cache.resize(6)                                    # two chunks grown "inside a forward"
    for e in range(5):
        streamer.to_slot(0, e)                            # outside: copies into the grown chunks too
    assert cache.slot_of == {(0, e): e for e in range(5)}
    cache.evict((0, 2))
    cache.evict((0, 3))
    assert cache.resize(4) == 4                            # outside: (0, 4) moves into a grown chunk
    assert cache.slot_of[(0, 4)] in (2, 3)
    for e in (0, 1, 4):
        assert torch.equal(cache.get((0, e))[0], host13[e]) and torch.equal(cache.get((0, e))[1], host2[e])


def test_shadow_caches_sample_every_fourth_layer_with_that_share_of_the_capacity():
    """Set sampling: with 8 MoE layers the shadows replay layers 0 and 4 only and hold at most a
    quarter of the capacity; with fewer than 8 layers they replay every layer at full capacity."""
    from freetoken_py.residency.adaptive import SHADOW_EVERY

    assert SHADOW_EVERY == 4
    rng = np.random.default_rng(2)
    p = AdaptivePolicy(list(range(8)), num_experts=16, capacity=40, seed=1)
    p.warm_start(rng.integers(0, 5, (8, 16)))
    assert p._sampled == {0, 4} and p._shadow_capacity() == 10
    for step in range(30):
        for layer in range(8):
            tokens = {int(e): 1 for e in rng.choice(16, 4, replace=False)}
            p.touch(layer, step, tokens)
            for e in tokens:
                p.admit(layer, e, step)
    lru, lfu = p.shadows
    for keys in (set(lru.keys), lfu.resident):
        assert keys and {l for l, _ in keys} <= {0, 4} and len(keys) <= 10
    assert p.shadow_hits.sum() > 0
    q = AdaptivePolicy(list(range(7)), num_experts=16, capacity=40, seed=1)
    assert q._sampled == set(range(7)) and q._shadow_capacity() == 40


def test_lru_shadow_keeps_turning_over_when_a_step_routes_more_experts_than_it_holds():
    """A prefill or batch routes more experts in one layer-step than the (sampled) LRU shadow
    holds: it must still replace last step's keys with this step's, and never evict this step's
    own (it stopped admitting anything once full, and so froze and 'won' the duel)."""
    from freetoken_py.residency.adaptive import _LruShadow

    freq = np.zeros((1, 32))
    shadow = _LruShadow()
    shadow.fill([], freq)
    first = [(0, e) for e in range(6)]
    shadow.access(first, 4, freq, first, 6)
    assert list(shadow.keys) == first[:4]                  # full of this step's: the rest not kept
    second = [(0, e) for e in range(10, 16)]
    assert shadow.access(second, 4, freq, second, 6) == 0
    assert set(shadow.keys) == set(second[:4])             # last step's keys all replaced
    third = second[:2] + [(0, 20), (0, 21)]
    assert shadow.access(third, 4, freq, third, 4) == 2
    assert set(shadow.keys) == set(third)


def test_admitting_a_layers_streams_at_once_equals_admitting_them_one_by_one():
    """`admit_many` (one compiled call per layer-step, the LeCaR draws from a buffer) leaves the
    policy exactly as `admit` called for each expert in turn: residents, counts, the residents'
    copies, ghosts, evictions returned, and the generator's next draw. Small capacity and both
    rules in play (a near tie in the duel, so draws happen), with refusals under LFU."""
    rng = np.random.default_rng(11)
    one, many = (AdaptivePolicy(list(range(3)), num_experts=12, capacity=7, seed=3, shadow_margin=0.9)
                 for _ in range(2))
    for step in range(80):
        for layer in range(3):
            tokens = {int(e): int(rng.integers(1, 3)) for e in rng.choice(12, 4, replace=False)}
            streamed = [e for e in tokens if rng.random() < 0.7]
            for p in (one, many):
                p.touch(layer, step, tokens)
            got = many.admit_many(layer, streamed, step)
            want = [one.admit(layer, e, step) for e in streamed]
            assert [[(int(l), int(e)) for l, e in ev] for ev in got] == \
                   [[(int(l), int(e)) for l, e in ev] for ev in want]
            assert (one.res == many.res).all() and (one.count == many.count).all()
            assert (one.count == one.res.sum(axis=1)).all()
            assert one._nres == many._nres == one.res.sum()
            assert list(one.ghosts.items()) == list(many.ghosts.items())
            assert [one.resident(l) for l in range(3)] == [many.resident(l) for l in range(3)]
            n = one._nres
            assert sorted(one._rlist[:n].tolist()) == sorted(many._rlist[:n].tolist())
    assert one.draws == many.draws > 5
    # the same draws were consumed: the next one matches
    nxt_one = one._rbuf[one._rbuf_at] if one._rbuf_at < len(one._rbuf) else one._rng.random()
    nxt_many = many._rbuf[many._rbuf_at] if many._rbuf_at < len(many._rbuf) else many._rng.random()
    assert nxt_one == nxt_many
