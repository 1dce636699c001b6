"""bench/common's paired ratios and per-round DRAM samples (issue 45: decode against llama.cpp on a
VM whose bandwidth moves between rounds). Reference: the engines' true speed ratio, which a
bandwidth drift scales alike within a round."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import common  # noqa: E402


def test_paired_ratio_recovers_the_true_ratio_under_drift_where_the_ratio_of_medians_does_not():
    true = 1.25
    bandwidth = [1.0, 1.6, 0.7, 1.5, 0.8]             # the machine's speed per round
    peer = [50.0 * b for b in bandwidth]
    ours = [50.0 * true * b for b in bandwidth]
    ours[1] = 50.0 * true * 0.7                        # ours' round-1 run fell in a slow spell
    ours[3] = 50.0 * true * 0.75                       # and round 3's
    assert common.paired_ratio(ours, peer) == round(common.median([o / p for o, p in zip(ours, peer)]), 3)
    assert abs(common.median(ours) / common.median(peer) - true) > 0.2   # medians pair unlike rounds
    # every round but the two perturbed ones holds the true ratio: their median is it
    assert common.paired_ratio(ours, peer) == true
    assert common.paired_ratio([], []) is None and common.paired_ratio([1.0], [0.0]) is None


def test_time_rounds_takes_a_dram_sample_after_each_round():
    calls = []
    engines = {"a": (lambda p: calls.append("pa") or 100.0, lambda p, n: calls.append("da") or 10.0),
               "b": (lambda p: calls.append("pb") or 200.0, lambda p, n: calls.append("db") or 20.0)}
    dram: list[float] = []
    samples = common.time_rounds(engines, list(range(64)), 4, 3, dram=dram)
    assert len(dram) == 3 and all(d > 0 for d in dram)
    assert samples["a"]["decode"] == [10.0] * 3 and samples["b"]["prefill"] == [200.0] * 3
    assert calls[:4] == ["pa", "da", "pb", "db"]                 # the warm-up, then the rounds
    fields = common.peer_fields(samples["a"], samples["b"], "q8_0", 1000)
    assert fields["paired_ratio_decode"] == 0.5 and fields["paired_ratio_prefill"] == 0.5
