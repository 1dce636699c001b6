"""An estimate of the best decode speed any online policy could reach on the synthetic `locality`
traces, by knowing the generator's law (for the one simulator case the target misses).

    python bench/residency_locality_bound.py [--profile rtx4060-laptop-8g] [--model qwen3-235b-a22b] [--steps 128]

The `locality` generator (residency/simulate.py) draws each routed expert, with probability 0.8,
from the layer's recent-use pool (the distinct experts among the last 6k routed, most recent
first) at an exponentially distributed position, else uniformly. Given the pool, the chance that
the expert at position j (or any expert outside the pool) is routed next step depends only on the
pool's length; it is estimated once per length by sampling the generator. A policy that knew the
law would hold, each step, the `slots` (layer, expert) pairs with the highest chances, over all
layers at once; this runs the generator for --steps steps, sums those chances each step
(expected hits), and turns the mean hits per layer-step into decode tokens/s with
`simulate.layer_floor_s` (the least time a layer-step with that many hits can take: a running
minimum over fewer hits, then its convex hull, so the mean is a valid argument) plus the dense
read. It also ignores that a kept expert must first be copied. So it is a ceiling for an oracle
policy, not a measurement.

That oracle knows each pool's *order*, and the order of the newest experts is the order the
generator drew them in. A policy sees less: which experts a layer routed in a step (a set; the
planner's `LayerStats`, the executor's routing), not the generator's draw order. The second
figure (`sets_*`) is the same ceiling for an oracle that knows the law, the exact pool before the
last step (more than a policy can know) and only the *set* of experts the last step drew: for
each of those it takes the posterior chance of each position (`order_posterior`: every order of
the set, weighted by how likely the generator was to draw it in that order), so its expected hits
are at least those of any policy that sees sets. One JSON line with both.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from freetoken_py.residency.planner import CostModel  # noqa: E402
from freetoken_py.residency.profiles import FRONTIER_MODELS, GB, PROFILES  # noqa: E402
from freetoken_py.residency.simulate import _locality_step, _lower_hull_at, layer_floor_s  # noqa: E402


def position_chances(pool_len: int, num_experts: int, top_k: int, samples: int, seed: int = 0):
    """(chance of each position of a pool of `pool_len` distinct experts, chance of each expert
    outside the pool) of being routed in the next step."""
    rng = np.random.default_rng(seed)
    pool = list(range(pool_len))          # distinct ids 0..n-1 stand for pool positions
    counts, outside = np.zeros(pool_len), 0
    for _ in range(samples):
        for e in _locality_step(rng, pool, num_experts, top_k):
            if e < pool_len:
                counts[e] += 1
            else:
                outside += 1
    return counts / samples, outside / samples / max(1, num_experts - pool_len)


def draw_chances(pool: list[int], num_experts: int, k: int) -> dict[int, float]:
    """The chance one draw of `_locality_step` picks each expert, before duplicates are redrawn:
    0.8 x P(int(Exp(mean k)) = position, the last position taking the tail) + 0.2 / E."""
    j = np.arange(len(pool))
    p = np.exp(-j / k) - np.exp(-(j + 1) / k)
    p[-1] = np.exp(-(len(pool) - 1) / k)
    return {e: 0.8 * float(pj) + 0.2 / num_experts for e, pj in zip(pool, p)}


def order_posterior(q: np.ndarray, perms: np.ndarray) -> np.ndarray:
    """[i, j]: the chance that member i of a drawn set was drawn j-th, given the set and each
    member's per-draw chance q[i]. The generator draws until k distinct experts are chosen, so an
    order has probability prod_i q[o_i] / (1 - sum of the chances already drawn): the numerators
    are the same for every order, the denominators favour drawing likely experts first."""
    qo = q[perms]                                         # [orders, k]
    before = np.cumsum(qo, axis=1) - qo
    w = np.prod(1.0 / (1.0 - before), axis=1)
    w /= w.sum()
    k = q.shape[0]
    return np.stack([np.bincount(perms[:, j], weights=w, minlength=k) for j in range(k)], axis=1)


def oracle_hits(spec, slots: int, steps: int, samples: int, seed: int = 0) -> tuple[float, float]:
    """Mean over the generator's steps of the best `slots` chances summed over all layers, per
    layer: the expected hits per layer-step of a policy that knew the law and every pool's order,
    and of one that knew the law, the pool before the last step and only the last step's set."""
    rng = np.random.default_rng(seed + 1)
    L, E, k = spec.num_layers, spec.num_experts, spec.top_k
    perms = np.array(list(itertools.permutations(range(k))))
    recent = [list(rng.choice(E, size=k, replace=False)) for _ in range(L)]
    cache: dict[int, tuple] = {}
    total = total_sets = 0.0
    for _ in range(steps):
        chances, chances_sets = [], []
        for l in range(L):
            q = draw_chances(list(dict.fromkeys(recent[l])), E, k)
            ids = _locality_step(rng, recent[l], E, k)
            recent[l] = (list(ids) + recent[l])[:6 * k]
            # the chances for the next step, from the new pool: this step's k experts first (in
            # draw order), then what is left of the old pool
            n = len(dict.fromkeys(recent[l]))
            if n not in cache:
                cache[n] = position_chances(n, E, k, samples, seed=n)
            inside, outside = cache[n]
            rest = np.full(min(E - n, slots), outside)
            chances += [inside, rest]
            post = order_posterior(np.array([q.get(e, 0.2 / E) for e in ids]), perms)
            chances_sets += [post @ inside[:k], inside[k:], rest]
        total += np.sort(np.concatenate(chances))[::-1][:slots].sum()
        total_sets += np.sort(np.concatenate(chances_sets))[::-1][:slots].sum()
    return min(total / steps / L, k), min(total_sets / steps / L, k)


def oracle_tok_s(profile: str, model: str, steps: int, samples: int = 4000) -> dict:
    """Both oracles' hits per layer-step and decode tokens/s on (profile, model): the JSON row."""
    spec, prof = FRONTIER_MODELS[model], PROFILES[profile]
    cost = CostModel(prof, spec.expert_bytes, spec.expert_flops_per_token)
    slots = spec.expert_slots(prof)
    hits, hits_sets = oracle_hits(spec, slots, steps, samples)
    floor = [layer_floor_s(h, spec.top_k - h, cost) for h in range(spec.top_k + 1)]
    for h in range(1, spec.top_k + 1):           # a bound: h hits cost at least what fewer could
        floor[h] = min(floor[h], floor[h - 1])
    dense_s = spec.dense_bytes / (prof.vram_gbps * GB)

    def tok_s(h: float) -> float:
        return 1.0 / (dense_s + spec.num_layers * _lower_hull_at(floor, float(h)))

    return {"bench": "residency_locality_bound", "profile": profile, "model": model,
            "expert_slots": slots, "slots_per_layer": round(slots / spec.num_layers, 3),
            "oracle_hits_per_layer_step": round(float(hits), 3),
            "oracle_hit_rate": round(float(hits) / spec.top_k, 4),
            "oracle_decode_tok_s": round(tok_s(hits), 3),
            "sets_oracle_hits_per_layer_step": round(float(hits_sets), 3),
            "sets_oracle_hit_rate": round(float(hits_sets) / spec.top_k, 4),
            "sets_oracle_decode_tok_s": round(tok_s(hits_sets), 3),
            "steps": steps, "samples": samples}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="rtx4060-laptop-8g", choices=list(PROFILES))
    ap.add_argument("--model", default="qwen3-235b-a22b", choices=list(FRONTIER_MODELS))
    ap.add_argument("--samples", type=int, default=4000, help="generator samples per pool length")
    ap.add_argument("--steps", type=int, default=128)
    args = ap.parse_args(argv)
    print(json.dumps(oracle_tok_s(args.profile, args.model, args.steps, args.samples)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
