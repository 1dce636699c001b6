"""The routing-trace format and the simulator's accounting, and bench/residency_sim.py's output."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest

from freetoken_py.residency.adaptive import AdaptivePolicy
from freetoken_py.residency.planner import CostModel
from freetoken_py.residency.policy import LruPolicy, PinPolicy, StaticPolicy
from freetoken_py.residency.profiles import FRONTIER_MODELS, PROFILES, ModelSpec
from freetoken_py.residency.simulate import (belady_misses, online_ceiling_flat_tok_s, simulate, synthetic_trace,
                                             upper_bound_tok_s)
from freetoken_py.residency.stats import RoutingStats, RoutingTrace, iter_layer_steps, routing_counts

ROOT = Path(__file__).resolve().parents[1]
SMALL = ModelSpec("small", num_layers=6, num_experts=16, top_k=4, hidden=2048, moe_intermediate=768,
                  dense_params=1e9)


def test_trace_round_trip(tmp_path):
    trace = synthetic_trace("locality", SMALL, steps=20, seed=3)
    trace.add_step({0: np.array([[1, 2, 3, 4], [5, 6, 7, 8]]), 2: np.array([[0, 1, 2, 3], [4, 5, 6, 7]])})
    trace.save(tmp_path / "t.jsonl")
    back = RoutingTrace.load(tmp_path / "t.jsonl")
    assert (back.num_layers, back.num_experts, back.top_k, back.source) == (6, 16, 4, trace.source)
    assert len(back.steps) == 21
    for a, b in zip(trace.steps, back.steps):
        assert a.keys() == b.keys() and all(np.array_equal(a[l], b[l]) for l in a)
    (tmp_path / "bad.jsonl").write_text('{"format": "other"}\n')
    with pytest.raises(ValueError, match="not a freetoken-routing-trace"):
        RoutingTrace.load(tmp_path / "bad.jsonl")


def test_routing_counts_add_up_every_routed_pair():
    trace = synthetic_trace("flat_skew", SMALL, steps=40, seed=3)
    trace.add_step({1: np.array([[0, 1, 2, 3], [0, 5, 6, 7]])})          # a two-token step
    expected = np.zeros((6, 16), np.int64)
    for step in trace.steps:
        for l, ids in step.items():
            np.add.at(expected[l], ids.ravel(), 1)
    assert np.array_equal(routing_counts(trace), expected) and expected[1, 0] >= 2


@pytest.mark.parametrize("regime", ["locality", "flat_skew", "flat"])
def test_synthetic_traces_route_k_distinct_experts(regime):
    trace = synthetic_trace(regime, SMALL, steps=50)
    for step in trace.steps:
        for ids in step.values():
            assert ids.shape == (1, 4) and len(set(ids[0].tolist())) == 4 and ids.max() < 16


def test_regimes_have_the_published_character():
    """locality: an LRU cache hits far more than chance; flat_skew: frequency beats LRU."""
    spec = ModelSpec("m", 4, 64, 4, 1024, 512, 1e8)
    cost = CostModel(PROFILES["rtx5090"], spec.expert_bytes, spec.expert_flops_per_token)
    cap = 4 * 16                                                   # a quarter of the experts
    loc = simulate(synthetic_trace("locality", spec, 400), LruPolicy(cap, 1.0), cost, spec.dense_bytes)
    assert loc.hit_rate > 0.5
    skew, calib = synthetic_trace("flat_skew", spec, 400), synthetic_trace("flat_skew", spec, 400, seed=9)
    counts = routing_counts(calib)
    lru = simulate(skew, LruPolicy(cap, 1.0), cost, spec.dense_bytes).hit_rate
    pin = simulate(skew, PinPolicy(list(range(4)), counts, cap), cost, spec.dense_bytes).hit_rate
    assert pin > lru + 0.1


@pytest.mark.parametrize("make", [
    lambda cap: StaticPolicy(list(range(6)), 16, cap),
    lambda cap: LruPolicy(cap, 0.4),
    lambda cap: AdaptivePolicy(list(range(6)), 16, cap),
])
def test_accounting_is_consistent(make):
    trace = synthetic_trace("flat_skew", SMALL, steps=60, seed=1)
    cost = CostModel(PROFILES["rtx4090"], SMALL.expert_bytes, SMALL.expert_flops_per_token)
    policy = make(40)
    r = simulate(trace, policy, cost, SMALL.dense_bytes)
    assert r.routed_pairs == 60 * 6 * 4 == trace.num_pairs()
    assert r.hit_pairs + r.stream_pairs + r.cpu_pairs + r.split_pairs == r.routed_pairs
    assert r.stream_pairs == r.streamed_experts          # decode: one token per streamed expert
    # a cut expert (ours only) sends part of its bytes over PCIe
    assert r.streamed_experts * SMALL.expert_bytes <= r.pcie_bytes
    assert r.pcie_bytes <= (r.streamed_experts + r.split_pairs) * SMALL.expert_bytes
    assert r.split_cpu_share <= r.split_pairs
    assert r.tokens == r.decode_tokens == 60 and r.decode_seconds == pytest.approx(r.seconds)
    assert len(policy.keys) <= 40


def test_static_hit_rate_is_the_resident_layer_share():
    trace = synthetic_trace("flat", SMALL, steps=30)
    cost = CostModel(PROFILES["rtx4090"], SMALL.expert_bytes, SMALL.expert_flops_per_token)
    r = simulate(trace, StaticPolicy(list(range(6)), 16, 16 * 2 + 5), cost, SMALL.dense_bytes)
    assert r.hit_rate == pytest.approx(2 / 6) and r.cpu_share == pytest.approx(4 / 6)
    # its time, by hand: 4 CPU layers of 4 experts, 2 resident layers, dense spread over 6 layers
    p = cost.profile
    cpu_layer = 4 * SMALL.expert_bytes / (p.cpu_expert_gbps * 1e9) + p.cpu_call_s
    gpu_layer = 4 * SMALL.expert_bytes / (p.vram_gbps * 1e9)
    per_token = SMALL.dense_bytes / (p.vram_gbps * 1e9) + 4 * cpu_layer + 2 * gpu_layer
    assert r.decode_tok_s == pytest.approx(1 / per_token)


def test_routing_stats_counts_and_recency():
    s = RoutingStats(num_layers=2, num_experts=4, half_life_steps=1.0)
    s.observe(1, 0, np.array([[0, 1], [1, 2]]))
    n = s.observe(1, 1, np.array([[1, 3]]))
    assert n.tolist() == [0, 1, 0, 1]
    assert s.counts[1].tolist() == [1, 3, 1, 1]
    assert s.recent[1].tolist() == pytest.approx([0.5, 2.0, 0.5, 1.0])
    assert s.last_step[1].tolist() == [0, 1, 0, 1] and s.last_step[0].tolist() == [-1] * 4


def test_bench_prints_one_line_per_profile_trace_policy(tmp_path):
    trace = synthetic_trace("locality", SMALL, steps=12)
    trace.save(tmp_path / "rec.jsonl")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "residency_sim.py"), "--steps", "8",
                           "--models", "qwen3-30b-a3b", "--regimes", "flat", "--trace", str(tmp_path / "rec.jsonl")],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == 2 * 4 * 4                  # (1 synthetic + 1 recorded) x 4 profiles x 4 policies
    fields = {"profile", "trace", "policy", "hit_rate", "pcie_bytes_per_token", "cpu_share",
              "predicted_decode_tok_s", "fits_in_vram", "fits_in_host_ram"}
    assert all(fields <= set(r) for r in rows)
    assert {r["policy"] for r in rows} == {"static", "pin", "lru", "ours"}
    assert {r["trace"] for r in rows} == {"flat@qwen3-30b-a3b", "rec@qwen3-235b-a22b-bytes"}
    assert all(0 <= r["hit_rate"] <= 1 and 0 <= r["cpu_share"] <= 1 for r in rows)
    assert "static" in proc.stderr and ("PASS" in proc.stderr or "FAIL" in proc.stderr or "n/a" in proc.stderr)


def test_host_ram_fit_counts_every_experts_host_copy():
    """`fits_in_host_ram`: every routed expert's host copy (4.5 bits a weight) and 8 GiB for the
    rest, against each profile's assumed host memory; unknown memory says None."""
    spec = FRONTIER_MODELS["qwen3-235b-a22b"]
    need = 94 * 128 * int(3 * 4096 * 1536 * 4.5 / 8) + 8 * 2**30
    assert spec.expert_host_bytes + 8 * 2**30 == need
    for prof in PROFILES.values():
        assert prof.host_ram_bytes > 0 and spec.fits_in_host_ram(prof) == (need <= prof.host_ram_bytes)
    assert [spec.fits_in_host_ram(PROFILES[p]) for p in ("rtx4060-laptop-8g", "rtx-pro-6000")] == [False, True]
    assert spec.fits_in_host_ram(replace(PROFILES["rtx4090"], host_ram_bytes=0)) is None
    assert FRONTIER_MODELS["qwen3-30b-a3b"].fits_in_host_ram(PROFILES["rtx4060-laptop-8g"])


def _fewest_misses_exhaustive(trace: RoutingTrace, capacity: int) -> int:
    """Independent reference for MIN: a search over every cache state (tiny traces only). Any
    starting set is free; on a miss the new expert is dropped or replaces any one resident."""
    accesses = [l * trace.num_experts + int(e) for _, l, ids in iter_layer_steps(trace) for e in np.unique(ids)]
    universe = sorted(set(accesses))
    states = {frozenset(c): 0 for c in combinations(universe, min(capacity, len(universe)))}
    for key in accesses:
        nxt: dict[frozenset, int] = {}
        for st, cost in states.items():
            if key in st:
                cands = [(st, cost)]
            else:
                cands = [(st, cost + 1)] + [((st - {v}) | {key}, cost + 1) for v in st]
            for s2, c2 in cands:
                if c2 < nxt.get(s2, 1 << 30):
                    nxt[s2] = c2
        states = nxt
    return min(states.values())


@pytest.mark.parametrize("seed", range(6))
def test_belady_matches_an_exhaustive_search(seed):
    spec = ModelSpec("tiny", num_layers=2, num_experts=5, top_k=2, hidden=64, moe_intermediate=32, dense_params=1e3)
    trace = synthetic_trace(["locality", "flat_skew", "flat"][seed % 3], spec, steps=7, seed=seed)
    for cap in (1, 3, 4):
        assert int(belady_misses(trace, cap).sum()) == _fewest_misses_exhaustive(trace, cap), (seed, cap)
    assert belady_misses(trace, 10).sum() == 0          # everything fits: the free preload covers it


@pytest.mark.parametrize("host_s", [0.0, 3e-4])   # 3e-4: a measured profile's fixed host work per layer-step
@pytest.mark.parametrize("regime", ["locality", "flat_skew", "flat"])
@pytest.mark.parametrize("profile", ["rtx4060-laptop-8g", "rtx-pro-6000"])
def test_no_policy_beats_the_upper_bound(regime, profile, host_s):
    trace = synthetic_trace(regime, SMALL, steps=60, seed=2)
    calib = synthetic_trace(regime, SMALL, steps=60, seed=5)
    counts = routing_counts(calib)
    cost = CostModel(replace(PROFILES[profile], host_layer_s=host_s), SMALL.expert_bytes, SMALL.expert_flops_per_token)
    cap = 30
    bound = upper_bound_tok_s(trace, cost, SMALL.dense_bytes, cap)
    fewest = int(belady_misses(trace, cap).sum())
    for make in (lambda: StaticPolicy(list(range(6)), 16, cap), lambda: PinPolicy(list(range(6)), counts, cap),
                 lambda: LruPolicy(cap, 0.4), lambda: AdaptivePolicy(list(range(6)), 16, cap)):
        policy = make()
        if hasattr(policy, "warm_start"):
            policy.warm_start(counts)
        r = simulate(trace, policy, cost, SMALL.dense_bytes)
        assert r.routed_pairs - r.hit_pairs >= fewest, policy.name
        assert r.decode_tok_s <= bound, policy.name


@pytest.mark.parametrize("host_s", [0.0, 3e-4])
@pytest.mark.parametrize("profile", ["rtx4060-laptop-8g", "rtx-pro-6000"])
def test_online_policies_stay_under_the_flat_ceiling(profile, host_s):
    """On uniform, step-independent routing no online policy beats the expected-hit ceiling (up
    to sampling noise), the static set's hit rate is capacity / experts, and clairvoyant MIN
    does better than any of them."""
    trace = synthetic_trace("flat", SMALL, steps=300, seed=7)
    calib = synthetic_trace("flat", SMALL, steps=300, seed=8)
    counts = routing_counts(calib)
    cost = CostModel(replace(PROFILES[profile], host_layer_s=host_s), SMALL.expert_bytes, SMALL.expert_flops_per_token)
    cap = 40
    ceiling = online_ceiling_flat_tok_s(trace, cost, SMALL.dense_bytes, cap)
    pin = simulate(trace, PinPolicy(list(range(6)), counts, cap), cost, SMALL.dense_bytes)
    assert pin.hit_rate == pytest.approx(cap / (6 * 16), abs=0.03)
    speeds = [pin.decode_tok_s] + [simulate(trace, p, cost, SMALL.dense_bytes).decode_tok_s
                                    for p in (LruPolicy(cap, 0.4), AdaptivePolicy(list(range(6)), 16, cap))]
    assert max(speeds) <= 1.03 * ceiling
    assert speeds[-1] >= 0.75 * ceiling          # ours gets close: the ceiling is not a loose one
    assert upper_bound_tok_s(trace, cost, SMALL.dense_bytes, cap) > ceiling


def test_fixed_host_work_adds_to_every_layer_step_and_changes_no_decision():
    """A profile's `host_layer_s` (measured by residency.calibrate; 0 in the hand-built profiles)
    is paid once per layer-step by every policy: the same decisions, and the predicted time
    longer by exactly that times the layer-steps."""
    trace = synthetic_trace("locality", SMALL, steps=50, seed=3)
    base = CostModel(PROFILES["rtx4090"], SMALL.expert_bytes, SMALL.expert_flops_per_token)
    host = CostModel(replace(PROFILES["rtx4090"], host_layer_s=2.5e-4), SMALL.expert_bytes, SMALL.expert_flops_per_token)
    for make in (lambda: AdaptivePolicy(list(range(6)), 16, 30), lambda: LruPolicy(30, 0.4)):
        a, b = simulate(trace, make(), base, SMALL.dense_bytes), simulate(trace, make(), host, SMALL.dense_bytes)
        assert (a.hit_pairs, a.stream_pairs, a.cpu_pairs, a.split_pairs, a.pcie_bytes) == \
            (b.hit_pairs, b.stream_pairs, b.cpu_pairs, b.split_pairs, b.pcie_bytes)
        assert b.decode_seconds - a.decode_seconds == pytest.approx(2.5e-4 * 6 * a.decode_tokens, rel=1e-9)
    with pytest.raises(ValueError, match="host_layer_s must not be negative"):
        replace(PROFILES["rtx4090"], host_layer_s=-1e-6)


def test_the_upper_bound_counts_decode_only_after_a_prefill():
    """A prefill may cost a policy misses that are not counted; MIN is then run on the decode
    steps with its own free preload, so a policy warmed on exactly the decode set stays under it."""
    spec = ModelSpec("tiny", num_layers=2, num_experts=16, top_k=4, hidden=2048, moe_intermediate=768,
                     dense_params=1e6)
    trace = RoutingTrace(2, 16, 4)
    trace.add_step({l: np.array([[0, 1, 2, 3], [4, 5, 6, 7]]) for l in range(2)})     # prefill
    for _ in range(6):
        trace.add_step({l: np.array([[8, 9, 10, 11]]) for l in range(2)})
    counts = np.zeros((2, 16))
    counts[:, 8:12] = 1
    cost = CostModel(PROFILES["rtx4090"], spec.expert_bytes, spec.expert_flops_per_token)
    r = simulate(trace, PinPolicy([0, 1], counts, 8), cost, spec.dense_bytes)
    assert r.hit_rate > 0.5 and r.decode_tok_s <= upper_bound_tok_s(trace, cost, spec.dense_bytes, 8)
    # the prefill's two tokens are counted apart from the six decode steps; the time adds up
    assert (r.prefill_tokens, r.decode_tokens, r.tokens) == (2, 6, 8)
    assert r.seconds == pytest.approx(r.prefill_seconds + r.decode_seconds) and r.prefill_seconds > 0


@pytest.mark.parametrize("profile", ["rtx4060-laptop-8g", "rtx4090", "rtx-pro-6000"])
def test_layer_floor_is_under_every_plan_and_is_the_exact_minimum(profile):
    """layer_floor_s never exceeds what the planner achieves for the same hits and misses (with or
    without the cut), and is the minimum of its own formula over the copied amount (a grid search
    of that formula comes out no lower)."""
    from freetoken_py.residency.planner import Budgets, LayerStats, plan
    from freetoken_py.residency.simulate import layer_floor_s

    spec = FRONTIER_MODELS["qwen3-235b-a22b"]
    cost = CostModel(PROFILES[profile], spec.expert_bytes, spec.expert_flops_per_token)
    p = cost.profile
    g, b_pcie, b_cpu = cost.gpu_compute_s(1), spec.expert_bytes / (cost.pcie_gbps * 1e9), \
        spec.expert_bytes / (cost.cpu_expert_gbps * 1e9)
    for hits in range(9):
        for misses in range(9 - hits):
            floor = layer_floor_s(hits, misses, cost)
            stats = LayerStats({e: 1 for e in range(hits + misses)}, frozenset(range(hits)))
            for split in (False, True):
                assert floor <= plan(stats, cost, Budgets(stream_slots=64, split_experts=split)).seconds * (1 + 1e-9)
            if misses == 0:
                assert floor == pytest.approx(hits * g)
                continue
            grid = np.linspace(0.0, misses, 4001)
            f = np.maximum(hits * g + grid * g, np.where(grid > 0, p.copy_call_s + grid * b_pcie, 0.0))
            f = np.maximum(f, np.where(grid < misses, p.cpu_call_s + (misses - grid) * b_cpu, 0.0))
            assert floor <= f.min() * (1 + 1e-9)
            assert floor >= f.min() - 1e-3 * b_pcie           # the grid's step, at most


def test_lower_hull_is_the_best_mix_of_two_points():
    from freetoken_py.residency.simulate import _lower_hull_at

    rng = np.random.default_rng(3)
    for _ in range(20):
        g = list(rng.random(9) * 10)
        for x in np.linspace(0, 8, 33):
            best = min(g[a] + (g[b] - g[a]) * (x - a) / (b - a) if b > a else g[a]
                       for a in range(9) for b in range(a, 9) if a <= x <= b)
            assert _lower_hull_at(g, float(x)) == pytest.approx(best)


def test_policy_cost_bench_prints_one_line_per_case():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "residency_policy_cost.py"), "--steps", "10",
                           "--model", "qwen3-30b-a3b", "--profiles", "rtx4060-laptop-8g", "--regimes", "locality,flat"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["regime"] for r in rows] == ["locality", "flat"]
    for r in rows:
        parts = r["split_ms_per_token"] + r["touch_ms_per_token"] + r["admit_ms_per_token"]
        assert r["total_ms_per_token"] == pytest.approx(parts, abs=0.02) and r["total_ms_per_token"] > 0
        assert r["layers"] == 48 and r["expert_slots"] == 2109
        assert r["predict_ms_per_token"] > 0 and r["predict_counting_ms_per_token"] > 0


def test_locality_oracle_bound_script():
    """bench/residency_locality_bound.py: the generator's per-position chances fall with age and
    add up to at most k; the oracle's hits per layer-step are at most its slots per layer."""
    sys.path.insert(0, str(ROOT / "bench"))
    from residency_locality_bound import position_chances

    inside, outside = position_chances(48, 128, 8, samples=3000)
    assert inside[0] > inside[8] > inside[40] > outside > 0
    assert inside.sum() + outside * (128 - 48) == pytest.approx(8)     # k distinct experts every step
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "residency_locality_bound.py"), "--samples", "500",
                           "--steps", "16"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout)
    assert 0 < row["oracle_hits_per_layer_step"] <= row["slots_per_layer"] and row["oracle_decode_tok_s"] > 0
    # knowing only the last step's set (not its draw order) cannot predict better
    assert 0 < row["sets_oracle_hits_per_layer_step"] <= row["oracle_hits_per_layer_step"] * 1.02


def test_locality_order_posterior_matches_the_generator():
    """order_posterior (the sets-only oracle's chance that each member of a drawn set was drawn
    j-th) against the generator itself: draw many steps from a fixed small pool and, for the most
    common set, count the orders it came out in."""
    import itertools
    from collections import Counter

    sys.path.insert(0, str(ROOT / "bench"))
    from residency_locality_bound import draw_chances, order_posterior

    from freetoken_py.residency.simulate import _locality_step

    rng = np.random.default_rng(3)
    pool, E, k = [4, 1, 3], 6, 2
    draws = [tuple(_locality_step(rng, pool, E, k)) for _ in range(60000)]
    sets = Counter(frozenset(d) for d in draws)
    # the most common set of the pool's front and an expert outside the pool: unequal chances
    common = max((s for s in sets if 4 in s and not s & {1, 3}), key=sets.get)
    members = sorted(common)
    orders = Counter(d for d in draws if frozenset(d) == common)
    seen = np.zeros((k, k))
    for order, n in orders.items():
        for j, e in enumerate(order):
            seen[members.index(e), j] += n
    seen /= seen.sum(axis=0, keepdims=True)
    q = draw_chances(pool, E, k)
    post = order_posterior(np.array([q.get(e, 0.2 / E) for e in members]),
                           np.array(list(itertools.permutations(range(k)))))
    assert post.sum(axis=0) == pytest.approx(np.ones(k)) and post.sum(axis=1) == pytest.approx(np.ones(k))
    assert post == pytest.approx(seen, abs=0.02)
    assert abs(post[0, 0] - 0.5) > 0.05          # the order is informative: not uniform


def test_check_targets_verdicts_and_the_sets_only_ceiling():
    """check_targets: PASS / FAIL / CEILING from hand-built rows; on a locality trace that would
    fail, the sets-only oracle's figure is asked for (and only then), and decides."""
    sys.path.insert(0, str(ROOT / "bench"))
    from residency_sim import check_targets

    def rows(trace, ours, static=10.0, lru=9.0, pin=8.0, bound=100.0, online=None):
        base = {"profile": "p", "trace": trace, "fits_in_vram": False, "expert_slots": 5,
                "upper_bound_tok_s": bound, "online_ceiling_tok_s": online}
        return [dict(base, policy=n, predicted_decode_tok_s=v)
                for n, v in (("static", static), ("pin", pin), ("lru", lru), ("ours", ours))]

    asked = []

    def sets_ceiling(value):
        def f(profile, model):
            asked.append((profile, model))
            return value
        return f

    assert check_targets(rows("locality@m", 16.0), sets_ceiling(1.0))[0].startswith("PASS")
    assert check_targets(rows("locality@m", 8.0), sets_ceiling(1.0))[0].startswith("FAIL")   # < 0.97 x lru
    assert asked == []
    line = check_targets(rows("locality@m", 14.0), sets_ceiling(14.5))[0]
    assert line.startswith("CEILING") and "[sets-only oracle]" in line and asked == [("p", "m")]
    assert check_targets(rows("locality@m", 14.0), sets_ceiling(15.5))[0].startswith("FAIL")
    assert check_targets(rows("locality@m", 14.0))[0].startswith("FAIL")       # no oracle given
    assert check_targets(rows("flat@m", 14.0, online=14.2))[0].startswith("CEILING")
    assert check_targets(rows("flat_skew@m", 14.0), sets_ceiling(1.0))[0].startswith("FAIL")  # locality only


# ---- look-ahead prefetch in the replay -------------------------------------------------------
def _with_predictions(trace: RoutingTrace, guess) -> RoutingTrace:
    """`trace` with a prediction for every MoE layer but the first of each step: guess(step, layer)."""
    out = RoutingTrace(trace.num_layers, trace.num_experts, trace.top_k, trace.source)
    for s, step in enumerate(trace.steps):
        out.add_step(step, {l: guess(s, l) for l in sorted(step)[1:]})
    return out


def test_trace_predictions_round_trip_and_old_files_still_load(tmp_path):
    trace = synthetic_trace("flat", SMALL, steps=5, seed=2)
    with_p = _with_predictions(trace, lambda s, l: [s, l, 15])
    with_p.save(tmp_path / "p.jsonl")
    back = RoutingTrace.load(tmp_path / "p.jsonl")
    assert back.has_predictions and back.prediction(3, 2) == [3, 2, 15] and back.prediction(3, 0) is None
    assert back.predicted == with_p.predicted
    trace.save(tmp_path / "plain.jsonl")            # no "predicted" key in any line
    assert '"predicted"' not in (tmp_path / "plain.jsonl").read_text()
    plain = RoutingTrace.load(tmp_path / "plain.jsonl")
    assert not plain.has_predictions and plain.prediction(3, 2) is None


def test_step_kinds_round_trip_and_steer_the_replay(tmp_path):
    """A trace's step kinds: a file says so only where T == 1 would not (a batch of requests
    decoding together, a one-token pass of a prompt), loads back the same, and a file without
    them reads T == 1 as decode. The replay counts a decode batch's tokens as decode tokens, its
    time as decode time, and the upper bound counts them too."""
    from freetoken_py.residency.simulate import upper_bound_tok_s

    trace = RoutingTrace(2, 16, 2)
    rows = {1: [[0, 1]], 2: [[0, 1], [2, 3]], 4: [[0, 1], [2, 3], [4, 5], [6, 7]]}
    for n, decode in ((4, False), (1, None), (2, True), (2, True), (1, False), (1, None)):
        trace.add_step({0: rows[n], 1: rows[n]}, decode=decode)
    trace.save(tmp_path / "k.jsonl")
    lines = (tmp_path / "k.jsonl").read_text().splitlines()[1:]
    assert ['"decode"' in ln for ln in lines] == [False, False, True, True, True, False]
    back = RoutingTrace.load(tmp_path / "k.jsonl")
    kinds = [back.is_decode(s) for s in range(6)]
    assert kinds == [False, True, True, True, False, True] == [trace.is_decode(s) for s in range(6)]
    old = RoutingTrace(2, 16, 2)
    old.steps = back.steps                          # no kinds: T == 1 is decode
    assert [old.is_decode(s) for s in range(6)] == [False, True, False, False, True, True]
    cost = CostModel(PROFILES["rtx4090"], 10**6, 1.0)
    r, r_old = (simulate(t, LruPolicy(4, 0.5), cost, 0) for t in (back, old))
    assert (r.decode_tokens, r.prefill_tokens) == (1 + 2 + 2 + 1, 4 + 1)
    assert (r_old.decode_tokens, r_old.prefill_tokens) == (1 + 1 + 1, 4 + 2 + 2)
    assert r.decode_seconds + r.prefill_seconds == pytest.approx(r.seconds)
    # every expert fits: the bound is the dense read per step, 6 tokens in 4 decode steps against 3 in 3
    assert upper_bound_tok_s(back, cost, 10**6, 32) == pytest.approx(1.5 * upper_bound_tok_s(old, cost, 10**6, 32))


def test_prefetch_allowance_counts_the_copies_that_fit_the_copy_engines_idle_time():
    from freetoken_py.residency.planner import Plan, copies_s, prefetch_allowance
    from freetoken_py.residency.profiles import TierProfile

    prof = TierProfile("t", 10**12, 1000.0, 10.0, 5.0, 1.0, 100.0, cpu_call_s=0.0, copy_call_s=0.01)
    cost = CostModel(prof, 10**9, 1.0)                      # a copy: 0.1 s + 0.01 s call
    p = Plan(hits=(0,), stream=(1, 2), cpu=(3,), gpu_s=0.3, cpu_s=0.62)
    assert copies_s(p, cost) == pytest.approx(0.22)
    # ahead copies wait for the accelerator side (0.3 s); the CPU runs 0.32 s past it, + lead 0.06
    # = 0.38 s -> 3 copies of 0.11 s; without the lead 2
    assert prefetch_allowance(p, cost, 0.06) == 3
    assert prefetch_allowance(p, cost, 0.0) == 2
    busy = Plan(hits=(), stream=(1, 2, 3, 4, 5), cpu=(), gpu_s=0.56, cpu_s=0.0)   # no CPU part: the lead only
    assert prefetch_allowance(busy, cost, 0.0) == 0 and prefetch_allowance(busy, cost, 0.12) == 1


def test_a_backlog_delays_the_copies_and_only_the_hits_that_wait_for_it():
    """simulate's timing of a layer-step whose copy engine is still busy with look-ahead copies:
    by hand, and equal to the planner's own time when the backlog is nil."""
    from freetoken_py.residency.planner import Budgets, LayerStats, Plan, plan
    from freetoken_py.residency.profiles import TierProfile
    from freetoken_py.residency.simulate import _with_backlog

    prof = TierProfile("t", 10**12, 1000.0, 10.0, 5.0, 1.0, 100.0, cpu_call_s=0.0, copy_call_s=0.0)
    cost = CostModel(prof, 10**9, 1.0)           # copy 0.1 s, accelerator compute 1 ms, CPU 0.2 s
    tokens = {0: 1, 1: 1, 2: 1}
    p = Plan(hits=(0,), stream=(1,), cpu=(2,), gpu_s=0.102, cpu_s=0.2)
    assert _with_backlog(p, tokens, cost, 0.0, set()) == (p.seconds, p.gpu_s, pytest.approx(0.1))
    # backlog 0.15: the copy starts at 0.15, ends 0.25, computes 1 ms; the hit runs at once
    assert _with_backlog(p, tokens, cost, 0.15, set())[:2] == (pytest.approx(0.251), pytest.approx(0.251))
    # the hit is a prefetched expert still in the queue: it starts at 0.15 as well
    assert _with_backlog(p, tokens, cost, 0.15, {0})[0] == pytest.approx(0.251)
    slow_cpu = Plan(hits=(0,), stream=(1,), cpu=(2,), gpu_s=0.102, cpu_s=0.4)
    assert _with_backlog(slow_cpu, tokens, cost, 0.15, set())[:2] == (pytest.approx(0.4), pytest.approx(0.251))
    only_hits = Plan(hits=(0,), stream=(), cpu=(2,), gpu_s=0.001, cpu_s=0.2)
    assert _with_backlog(only_hits, tokens, cost, 0.5, set())[0] == pytest.approx(0.2)     # no wait
    assert _with_backlog(only_hits, tokens, cost, 0.5, {0})[0] == pytest.approx(0.501)    # waits
    # consistency with the planner: with a vanishing backlog the replay's formula gives the plan's time
    rng = np.random.default_rng(0)
    for _ in range(200):
        m = int(rng.integers(1, 8))
        toks = {int(e): int(rng.integers(1, 6)) for e in rng.choice(16, m, replace=False)}
        res = frozenset(e for e in toks if rng.random() < 0.4)
        pl = plan(LayerStats(toks, res), CostModel(PROFILES["rtx4090"], SMALL.expert_bytes, SMALL.expert_flops_per_token),
                  Budgets(stream_slots=int(rng.integers(0, 5))))
        c = CostModel(PROFILES["rtx4090"], SMALL.expert_bytes, SMALL.expert_flops_per_token)
        assert _with_backlog(pl, toks, c, 1e-15, set())[0] == pytest.approx(pl.seconds, rel=1e-9, abs=1e-12)


def test_prefetch_replay_follows_the_quality_of_the_predictions_and_the_allowance():
    """Right predictions with room to copy
    them turn misses into hits and save time; predictions of experts never routed only cost
    slots; a given lead bounds the copies; with no room nothing is copied and the time is the
    same, while copying every prediction regardless (ungated) backs the copy engine up into
    the next layers and costs time."""
    trace = synthetic_trace("flat", SMALL, steps=60, seed=5)
    cost = CostModel(PROFILES["rtx4090"], SMALL.expert_bytes, SMALL.expert_flops_per_token)
    layers = list(range(SMALL.num_layers))

    def run(tr, prefetch, dense=SMALL.dense_bytes, **kw):
        return simulate(tr, AdaptivePolicy(layers, 16, 24), cost, dense, prefetch=prefetch, **kw)

    right = _with_predictions(trace, lambda s, l: trace.steps[s][l][0].tolist())
    routed = lambda s, l: set(trace.steps[s][l][0].tolist())                      # noqa: E731
    wrong = _with_predictions(trace, lambda s, l: [e for e in range(16) if e not in routed(s, l)][:4])
    big_lead = SMALL.dense_bytes * 50          # a long dense part per layer (long context): room to copy
    off, good, bad = run(trace, False, big_lead), run(right, True, big_lead), run(wrong, True, big_lead)
    assert good.prefetch_accuracy == 1.0 and bad.prefetch_accuracy == 0.0
    assert good.prefetch_copies > 0 and bad.prefetch_copies > 0
    dense_s = off.decode_tokens * big_lead / (cost.profile.vram_gbps * 1e9)

    def expert_s(r):                           # the decode time less the dense part every policy pays
        return r.decode_seconds - dense_s
    assert good.hit_rate > off.hit_rate + 0.15 and expert_s(good) < 0.9 * expert_s(off)
    assert bad.hit_rate <= off.hit_rate and expert_s(bad) >= 0.999 * expert_s(off)
    assert good.pcie_bytes >= good.prefetch_copies * cost.expert_bytes
    # the lead given: at most floor(lead / copy) copies per layer-step where the CPU side is idle
    no_cpu = CostModel(replace(PROFILES["rtx4090"], cpu_expert_gbps=1e-3), SMALL.expert_bytes,
                       SMALL.expert_flops_per_token)              # the CPU never takes an expert
    for n in (0, 1, 2):
        r = simulate(right, AdaptivePolicy(layers, 16, 24), no_cpu, 0, prefetch=True,
                     lead_s=(n + 0.5) * no_cpu.copy_s())
        assert r.cpu_pairs == 0 and r.prefetch_copies <= n * 60 * (SMALL.num_layers - 1)
        assert (r.prefetch_copies > 0) == (n > 0)
    # ungated, wrong guesses and no lead: the copies run into the next layers' own copies
    gated, ungated, none = run(wrong, True, 0), run(wrong, True, 0, prefetch_limit=False), run(trace, False, 0)
    assert ungated.prefetch_copies > gated.prefetch_copies
    assert gated.prefetch_copies == 0 and gated.decode_seconds == none.decode_seconds
    assert ungated.decode_seconds > 1.05 * none.decode_seconds


def test_a_look_ahead_stops_when_it_would_evict_a_better_guess():
    """Predicted [0, 5, 6] for layer 1 with a two-slot LRU holding layer 1's expert 0 (the
    oldest): admitting 5 evicts 0, a better-ranked guess, so 6 is not tried (the executor's rule)."""
    trace = RoutingTrace(2, 8, 1)
    trace.add_step({0: np.array([[1]]), 1: np.array([[0]])})            # both streamed and kept
    trace.add_step({0: np.array([[1]]), 1: np.array([[5]])}, {1: [0, 5, 6]})
    cost = CostModel(PROFILES["rtx4090"], SMALL.expert_bytes, SMALL.expert_flops_per_token)
    policy = LruPolicy(2, 1.0)                                          # every miss streams
    r = simulate(trace, policy, cost, 0, prefetch=True, lead_s=1.0)     # room for every guess
    assert r.prefetch_copies == 1 and policy.is_resident(1, 5) and not policy.is_resident(1, 6)
    ungated = LruPolicy(2, 1.0)
    simulate(trace, ungated, cost, 0, prefetch=True, lead_s=1.0, prefetch_limit=False)
    assert ungated.is_resident(1, 5) and not ungated.is_resident(1, 6)   # the same stop, ungated too


def test_a_lone_tokens_prediction_is_the_general_rule():
    """predict_experts' one-token shortcut (top-k by logit) ranks as the counting rule does: the
    same token twice (every count and probability doubled) gives the same experts in order."""
    import torch

    from freetoken_py.residency.stats import predict_experts

    g = torch.Generator().manual_seed(0)
    for E, k in ((8, 2), (64, 8), (128, 8)):
        for _ in range(50):
            x = torch.randn(1, E, generator=g)
            one = predict_experts(x, k)
            assert one == predict_experts(torch.cat([x, x]), k) and len(one) == k
