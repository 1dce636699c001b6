"""Replay a routing trace through a cache policy and the cost model: hit rate, PCIe bytes, CPU
share and predicted decode tokens/s. Pure Python + numpy; no model, no accelerator.

Time model per layer-step (the planner's own, see planner.py): dense weights are read from VRAM;
hits compute on the accelerator while copies run on the copy engine; a streamed expert computes
after its copy; CPU experts run concurrently; the layer ends when both sides do. Look-ahead
prefetch is not modelled here (a conservative omission: it only hides copy time).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from freetoken_py.residency.planner import CostModel, LayerStats
from freetoken_py.residency.profiles import GB, ModelSpec
from freetoken_py.residency.stats import RoutingTrace, iter_layer_steps, tokens_per_expert


@dataclass
class SimResult:
    routed_pairs: int = 0
    hit_pairs: int = 0
    stream_pairs: int = 0
    cpu_pairs: int = 0
    streamed_experts: int = 0        # copies over PCIe (one per streamed expert per layer-step)
    tokens: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    seconds: float = 0.0
    pcie_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_pairs / self.routed_pairs if self.routed_pairs else 0.0

    @property
    def cpu_share(self) -> float:
        return self.cpu_pairs / self.routed_pairs if self.routed_pairs else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def to_dict(self) -> dict:
        return dict(asdict(self), hit_rate=self.hit_rate, cpu_share=self.cpu_share,
                    decode_tok_s=self.decode_tok_s)


def simulate(trace: RoutingTrace, policy, cost: CostModel, dense_bytes: int) -> SimResult:
    """`dense_bytes`: non-expert weights read per token (spread over the MoE layers)."""
    profile = cost.profile
    layers = trace.moe_layers
    dense_layer_s = dense_bytes / max(1, len(layers)) / (profile.vram_gbps * GB)
    r = SimResult()
    step_s, step_tokens, cur = 0.0, 0, -1
    for step, layer, ids in iter_layer_steps(trace):
        if step != cur:
            r.seconds += step_s
            if step_tokens == 1:
                r.decode_tokens, r.decode_seconds = r.decode_tokens + 1, r.decode_seconds + step_s
            step_s, step_tokens, cur = 0.0, ids.shape[0], step
            r.tokens += step_tokens
        counts = tokens_per_expert(ids, trace.num_experts)
        tokens = {int(e): int(counts[e]) for e in np.flatnonzero(counts)}
        stats = LayerStats(tokens, policy.resident(layer))
        p = policy.split(layer, stats, cost)
        policy.touch(layer, step, tokens)
        for e in p.stream:
            policy.admit(layer, e, step)
        r.routed_pairs += int(counts.sum())
        r.hit_pairs += sum(tokens[e] for e in p.hits)
        r.stream_pairs += sum(tokens[e] for e in p.stream)
        r.cpu_pairs += sum(tokens[e] for e in p.cpu)
        r.streamed_experts += len(p.stream)
        r.pcie_bytes += len(p.stream) * cost.expert_bytes
        step_s += dense_layer_s + p.seconds
    r.seconds += step_s
    if step_tokens == 1:
        r.decode_tokens, r.decode_seconds = r.decode_tokens + 1, r.decode_seconds + step_s
    return r


# ---- synthetic traces ---------------------------------------------------------------------------
def _distinct(rng, num_experts: int, k: int, p: np.ndarray | None = None) -> np.ndarray:
    return rng.choice(num_experts, size=k, replace=False, p=p)


def synthetic_trace(regime: str, spec: ModelSpec, steps: int, seed: int = 0, model_seed: int = 0) -> RoutingTrace:
    """Decode traces (one token per step) for three published routing regimes:

    locality   strong temporal locality: each token reuses, per slot, an expert the layer routed
               in the last few steps with probability 0.8 (a recent-use cache of half the
               experts then hits ~65-70%, as the llama.cpp measurement reports)
    flat_skew  no temporal correlation, stationary Zipf(1.0) popularity per layer (a frequency
               oracle beats LRU, as FreeToken issue #174 measured on DeepSeek-V4-Flash)
    flat       no correlation and no skew: every expert equally likely

    `model_seed` fixes the per-layer popularity (a property of the model, shared by a calibration
    trace and an evaluation trace); `seed` the tokens.
    """
    pop_rng, rng = np.random.default_rng(model_seed), np.random.default_rng(seed + 1)
    L, E, k = spec.num_layers, spec.num_experts, spec.top_k
    trace = RoutingTrace(L, E, k, source=f"synthetic:{regime}:{spec.name}")
    zipf = 1.0 / np.arange(1, E + 1)
    pops = [pop_rng.permutation(zipf / zipf.sum()) for _ in range(L)]
    recent = [list(_distinct(rng, E, k)) for _ in range(L)]
    for _ in range(steps):
        step = {}
        for l in range(L):
            if regime == "flat":
                ids = _distinct(rng, E, k)
            elif regime == "flat_skew":
                ids = _distinct(rng, E, k, pops[l])
            elif regime == "locality":
                ids = _locality_step(rng, recent[l], E, k)
                recent[l] = (list(ids) + recent[l])[:6 * k]
            else:
                raise ValueError(f"unknown regime {regime!r}")
            step[l] = np.asarray(ids, np.int64).reshape(1, k)
        trace.add_step(step)
    return trace


def _locality_step(rng, recent: list[int], num_experts: int, k: int) -> list[int]:
    chosen: list[int] = []
    pool = list(dict.fromkeys(recent))
    while len(chosen) < k:
        if pool and rng.random() < 0.8:
            e = pool[min(int(rng.exponential(k)), len(pool) - 1)]
        else:
            e = int(rng.integers(num_experts))
        if e not in chosen:
            chosen.append(e)
    return chosen
