"""An estimate of the best decode speed any online policy could reach on the synthetic `locality`
traces, by knowing the generator's law (for the one simulator case the target misses).

    python bench/residency_locality_bound.py [--profile rtx4060-laptop-8g] [--model qwen3-235b-a22b] [--samples 20000]

The `locality` generator (residency/simulate.py) draws each routed expert from the layer's
recent-use pool (48 most recent, most recent first) with probability 0.8, at an exponentially
distributed position, else uniformly. Given the pool, the chance that the expert at position j is
routed next step is a property of the generator alone; a policy that knew it would hold, in each
layer, the experts with the highest chances. This samples the generator from a full pool to
estimate those chances, sums the best `slots / layers` of them (expected hits per layer-step,
with the slots spread evenly; the layers are alike), and turns that into decode tokens/s with
`simulate.layer_floor_s` (the least time a layer-step with that many hits can take, its hull
over integer hit counts) plus the dense read: a ceiling for an oracle policy, not a
measurement. It ignores that a kept expert must first be copied, so it is optimistic.
One JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from freetoken_py.residency.planner import CostModel  # noqa: E402
from freetoken_py.residency.profiles import FRONTIER_MODELS, GB, PROFILES  # noqa: E402
from freetoken_py.residency.simulate import _locality_step, _lower_hull_at, layer_floor_s  # noqa: E402


def position_chances(num_experts: int, top_k: int, samples: int, seed: int = 0) -> np.ndarray:
    """[6k] chance that the expert at each position of a full recent-use pool is routed next step."""
    rng = np.random.default_rng(seed)
    pool = list(range(6 * top_k))        # distinct ids 0..6k-1 stand for pool positions
    counts = np.zeros(len(pool))
    for _ in range(samples):
        for e in _locality_step(rng, pool, num_experts, top_k):
            if e < len(pool):
                counts[e] += 1
    return counts / samples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="rtx4060-laptop-8g", choices=list(PROFILES))
    ap.add_argument("--model", default="qwen3-235b-a22b", choices=list(FRONTIER_MODELS))
    ap.add_argument("--samples", type=int, default=20000)
    args = ap.parse_args(argv)
    spec, prof = FRONTIER_MODELS[args.model], PROFILES[args.profile]
    cost = CostModel(prof, spec.expert_bytes, spec.expert_flops_per_token)
    slots = spec.expert_slots(prof)
    per_layer = slots / spec.num_layers
    chances = np.sort(position_chances(spec.num_experts, spec.top_k, args.samples))[::-1]
    whole = int(per_layer)
    hits = chances[:whole].sum() + (per_layer - whole) * chances[whole] if whole < len(chances) else chances.sum()
    hits = min(hits, spec.top_k)
    floor = [layer_floor_s(h, spec.top_k - h, cost) for h in range(spec.top_k + 1)]
    for h in range(1, spec.top_k + 1):           # a bound: h hits cost at least what fewer could
        floor[h] = min(floor[h], floor[h - 1])
    dense_s = spec.dense_bytes / (prof.vram_gbps * GB)
    tok_s = 1.0 / (dense_s + spec.num_layers * _lower_hull_at(floor, float(hits)))
    print(json.dumps({"bench": "residency_locality_bound", "profile": args.profile, "model": args.model,
                      "expert_slots": slots, "slots_per_layer": round(per_layer, 3),
                      "oracle_hits_per_layer_step": round(float(hits), 3),
                      "oracle_hit_rate": round(float(hits) / spec.top_k, 4),
                      "oracle_decode_tok_s": round(tok_s, 3), "samples": args.samples}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
