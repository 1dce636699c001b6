"""What our cache policy's bookkeeping costs per decoded token on the host, at frontier geometry.

    python bench/residency_policy_cost.py [--steps 40] [--model qwen3-235b-a22b] [--profiles ...] [--regimes ...]

`AdaptivePolicy.split` (stream values + `plan`), `touch` (counts, shadows, ghosts) and
`admit_many` (victim scans, evictions) are each one compiled call plus some Python, and run on the
critical path of every MoE layer: on a GPU machine this time adds to each token. The script
replays a synthetic decode trace of the model's geometry (94 MoE layers x 128 experts, top-8 for
Qwen3-235B-A22B) through the policy with the profile's slot count, exactly as the simulator and
the executor call it, and times the three calls after 8 warm-up steps. One JSON line per
(profile, regime): ms per token for each call and in all, and per layer. This machine's CPU time;
no accelerator is involved.

Each line also times the look-ahead's prediction for one decode token from a router's logits
[1, E] (`stats.predict_experts`, run at every MoE layer-step with slots): `predict_ms_per_token`
(its one-token path, top-k by logit), next to `predict_counting_ms_per_token`, the general
counting rule on the same token (two identical rows: the same ranking, the prefill path's work).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from freetoken_py.residency.adaptive import AdaptivePolicy  # noqa: E402
from freetoken_py.residency.planner import CostModel, LayerStats  # noqa: E402
from freetoken_py.residency.profiles import FRONTIER_MODELS, PROFILES  # noqa: E402
from freetoken_py.residency.simulate import synthetic_trace  # noqa: E402
from freetoken_py.residency.stats import (iter_layer_steps, predict_experts, routing_counts,  # noqa: E402
                                          tokens_per_expert)

WARM_STEPS = 8


def measure(profile: str, regime: str, model: str, steps: int) -> dict:
    spec, prof = FRONTIER_MODELS[model], PROFILES[profile]
    trace = synthetic_trace(regime, spec, steps, seed=0)
    calib = synthetic_trace(regime, spec, steps, seed=1)
    cost = CostModel(prof, spec.expert_bytes, spec.expert_flops_per_token)
    policy = AdaptivePolicy(trace.moe_layers, trace.num_experts, spec.expert_slots(prof))
    policy.warm_start(routing_counts(calib))
    calls = []
    for step, layer, ids in iter_layer_steps(trace):
        counts = tokens_per_expert(ids, trace.num_experts)
        calls.append((step, layer, {int(e): int(counts[e]) for e in np.flatnonzero(counts)}))
    spent = np.zeros(3)
    for step, layer, tokens in calls:
        t0 = time.perf_counter()
        p = policy.split(layer, LayerStats(tokens, policy.resident(layer)), cost)
        t1 = time.perf_counter()
        policy.touch(layer, step, tokens)
        t2 = time.perf_counter()
        policy.admit_many(layer, p.stream, step)
        t3 = time.perf_counter()
        if step >= WARM_STEPS:
            spent += (t1 - t0, t2 - t1, t3 - t2)
    per_token = spent / (steps - WARM_STEPS) * 1e3
    layers = len(trace.moe_layers)
    one = torch.randn(1, trace.num_experts, generator=torch.Generator().manual_seed(0))
    predict, counting = (_per_call_s(lambda x=x: predict_experts(x, trace.top_k)) * layers * 1e3
                         for x in (one, torch.cat([one, one])))
    return {"bench": "residency_policy_cost", "profile": profile, "regime": regime, "model": model,
            "expert_slots": policy.capacity, "layers": len(trace.moe_layers),
            "split_ms_per_token": round(per_token[0], 2), "touch_ms_per_token": round(per_token[1], 2),
            "admit_ms_per_token": round(per_token[2], 2), "total_ms_per_token": round(per_token.sum(), 2),
            "ms_per_layer": round(per_token.sum() / layers, 3),
            "predict_ms_per_token": round(predict, 3), "predict_counting_ms_per_token": round(counting, 3)}


def _per_call_s(fn, calls: int = 2000) -> float:
    """Median seconds per call of `fn` over 5 rounds (after a warm-up round)."""
    rounds = []
    for r in range(6):
        t0 = time.perf_counter()
        for _ in range(calls // 5):
            fn()
        if r:
            rounds.append((time.perf_counter() - t0) / (calls // 5))
    return float(np.median(rounds))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="decode steps per trace (the first 8 are not timed)")
    ap.add_argument("--model", default="qwen3-235b-a22b", choices=list(FRONTIER_MODELS))
    ap.add_argument("--profiles", default="rtx4060-laptop-8g,rtx4090,rtx-pro-6000")
    ap.add_argument("--regimes", default="locality,flat")
    args = ap.parse_args(argv)
    if args.steps <= WARM_STEPS:
        ap.error(f"--steps must be above {WARM_STEPS} (the warm-up steps)")
    for profile in args.profiles.split(","):
        for regime in args.regimes.split(","):
            print(json.dumps(measure(profile, regime, args.model, args.steps)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
