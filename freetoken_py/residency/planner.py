"""The per-layer, per-step placement decision: a pure function of (stats, profile, budgets).

    plan(stats, cost, budgets) -> Plan

Decisions (each one is tested with hand-built numbers in tests/test_residency_planner.py):

1. A resident expert (a hit) runs on the accelerator; nothing else is considered for it.
2. Misses are taken largest first (most tokens routed to them), and each goes to the tier whose
   finish time *after* adding it is smaller, so the copy queue and the CPU finish together
   (greedy longest-processing-time; exact for equal-sized experts):
       stream: copy queue += bytes / PCIe + per-copy latency; the layer also waits for the
               accelerator to compute it after the last copy;
       CPU:    CPU queue += max(bytes / CPU kernel bandwidth, tokens * FLOPs / CPU FLOP/s),
               plus one activation round trip per layer.
   Decode (one token per expert) compares bandwidths; prefill (many tokens per expert) makes the
   CPU compute-bound, so weights travel to the accelerator instead of activations to the CPU.
3. A tie goes to streaming, and streaming is credited `budgets.stream_value_s`, the seconds a
   kept expert is expected to save later (0 = judge this step alone): a streamed expert may stay
   resident and hit next time; a CPU-evaluated one never will. Misses with equal token counts
   cost the same on either side, so once the counts are placed, the streamed ones among them
   are those most worth keeping (`stream_values`).
4. Streaming needs a free or evictable slot (`budgets.stream_slots`); beyond that, misses go to
   the CPU. With `budgets.cpu_enabled` False (no host copy), every miss streams.
5. With `budgets.split_experts`, whole experts leave the two sides unequal (two decode misses
   with the CPU twice as fast as PCIe: one each, and the copy finishes last). One miss is then cut
   along its intermediate dimension (columns of gate/up, rows of down: the two parts' outputs add
   up to the whole expert's, exactly): the first `fraction` of its columns is copied (into
   staging, not kept) and computed on the accelerator, the rest on the CPU, with the fraction
   chosen so both sides finish together. The cut expert is the last placed miss on the side that
   finishes last (the smallest, and among equals the least worth keeping); a streamed one is only cut when the time saved exceeds what keeping it was
   worth (`stream_values`), as a cut expert is not kept.

The decisions run as one compiled call (`_plan_core`, numba; the policies call it for every
layer-step). tests/plan_reference.py keeps them as the plain Python they were first written in,
and the compiled planner must match it exactly on random cases.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Optional

import numpy as np

from freetoken_py.residency._jit import _plan_core
from freetoken_py.residency.profiles import GB, TierProfile


@dataclass(frozen=True)
class CostModel:
    """Seconds per action: the profile's numbers, updated by live measurements (EMA)."""
    profile: TierProfile
    expert_bytes: int
    expert_flops_per_token: float
    pcie_gbps: float = 0.0          # 0: take the profile's prior
    cpu_expert_gbps: float = 0.0
    # fixed costs no bandwidth contains (None: the profile's, `TierProfile.gpu_step_s` /
    # `host_step_s`; a measured GPU profile's are seeded from the H200 run, profiles.H200_SEEDS):
    # the accelerator's fixed time in a layer-step it has work in (its launches and their
    # latency), and the host's time per MoE layer outside the executor (the launches of the
    # dense part between two MoE layers, which the GPU waits for at batch 1)
    gpu_step_s: Optional[float] = None
    host_step_s: Optional[float] = None

    def __post_init__(self) -> None:
        if self.pcie_gbps <= 0:
            object.__setattr__(self, "pcie_gbps", self.profile.pcie_gbps)
        if self.cpu_expert_gbps <= 0:
            object.__setattr__(self, "cpu_expert_gbps", self.profile.cpu_expert_gbps)
        for f in ("gpu_step_s", "host_step_s"):
            if getattr(self, f) is None:
                object.__setattr__(self, f, getattr(self.profile, f))
            elif getattr(self, f) < 0:
                raise ValueError(f"cost model: {f} must not be negative")

    def moe_s(self, p: "Plan") -> float:
        """A layer-step's expert time: the plan's, with the accelerator's fixed step cost on its
        side when it has work (the plan's own decisions leave it out: hits pay it wherever the
        misses go)."""
        if not self.gpu_step_s or not (p.hits or p.stream or p.split):
            return p.seconds
        return max(p.gpu_s + self.gpu_step_s, p.cpu_s)

    def layer_step_s(self, p: "Plan") -> float:
        """A whole MoE layer-step's time besides the dense weights' read: the executor's host work
        (`host_layer_s`), the host's launches outside it (`host_step_s`) and the experts (`moe_s`)."""
        return self.profile.host_layer_s + self.host_step_s + self.moe_s(p)

    def gpu_compute_s(self, tokens: int) -> float:
        p = self.profile
        return max(self.expert_bytes / (p.expert_gbps * GB), tokens * self.expert_flops_per_token / (p.gpu_tflops * 1e12))

    def copy_s(self) -> float:
        return self.expert_bytes / (self.pcie_gbps * GB) + self.profile.copy_call_s

    def cpu_s(self, tokens: int) -> float:
        return max(self.expert_bytes / (self.cpu_expert_gbps * GB),
                   tokens * self.expert_flops_per_token / (self.profile.cpu_tflops * 1e12))

    def observe(self, copy_gbps: float | None = None, cpu_gbps: float | None = None,
                alpha: float = 0.2) -> "CostModel":
        """A new model nudged toward measured bandwidths (called once per step with what was seen)."""
        pcie = self.pcie_gbps if copy_gbps is None else (1 - alpha) * self.pcie_gbps + alpha * copy_gbps
        cpu = self.cpu_expert_gbps if cpu_gbps is None else (1 - alpha) * self.cpu_expert_gbps + alpha * cpu_gbps
        return replace(self, pcie_gbps=pcie, cpu_expert_gbps=cpu)


@dataclass(frozen=True)
class Budgets:
    stream_slots: int          # misses that may be streamed this layer-step (free + evictable slots)
    cpu_enabled: bool = True
    stream_value_s: float = 0.0   # expected future seconds saved per streamed (kept) expert
    stream_values: Mapping[int, float] = field(default_factory=dict)   # per expert, overrides the above
    split_experts: bool = False   # decision 5: cut one miss between the two sides


@dataclass(frozen=True)
class LayerStats:
    """What one layer-step routed: tokens per expert, and which of those experts are resident."""
    tokens: dict[int, int]     # expert -> tokens routed to it this step (only experts with > 0)
    resident: frozenset[int]


@dataclass(frozen=True)
class Plan:
    hits: tuple[int, ...]
    stream: tuple[int, ...]
    cpu: tuple[int, ...]
    gpu_s: float               # predicted accelerator finish (hits + streamed, copies included)
    cpu_s: float               # predicted CPU finish (0 when nothing runs there)
    reasons: Mapping[int, str] = field(default_factory=dict)
    split: tuple[tuple[int, float], ...] = ()   # (expert, fraction of its columns on the accelerator)

    @property
    def seconds(self) -> float:
        return max(self.gpu_s, self.cpu_s)


def _add(values) -> float:
    """Left to right, one rounding per addition, as the compiled planner adds (Python 3.12's `sum`
    compensates float rounding: the baselines' times would depend on the Python version)."""
    total = 0.0
    for v in values:
        total += v
    return total


def _gpu_finish(hit_s: float, copy_q: float, sum_c: float, last_c: float) -> float:
    """Copies run on the copy engine while hits compute; each streamed expert computes after its
    copy: the accelerator ends after all its compute (hits + streamed, `sum_c`) or after the last
    copy (`copy_q`) and that expert's compute (`last_c`). With nothing streamed it is `hit_s`."""
    return max(hit_s + sum_c, copy_q + last_c)


def plan(stats: LayerStats, cost: CostModel, budgets: Budgets) -> Plan:
    tokens = stats.tokens
    m = len(tokens)
    ids = np.fromiter(tokens, np.int64, m)
    ntok = np.fromiter(tokens.values(), np.int64, m)
    res = np.fromiter((e in stats.resident for e in tokens), np.bool_, m)
    values, default = budgets.stream_values, budgets.stream_value_s
    vals = np.fromiter((values.get(e, default) for e in tokens), np.float64, m)
    return plan_from_core(ids, _plan_core(ids, ntok, res, vals, bool(values), budgets.stream_slots,
                                          budgets.cpu_enabled, budgets.split_experts, core_costs(cost)))


def core_costs(cost: CostModel) -> np.ndarray:
    """The cost model's numbers as `_plan_core` takes them (one array: fewer arguments to check
    per call; bandwidths in bytes per second), made once per model."""
    got = cost.__dict__.get("_core_costs")
    if got is None:
        p = cost.profile
        got = np.array([cost.expert_bytes, cost.expert_flops_per_token, p.expert_gbps * GB, p.gpu_tflops,
                        cost.pcie_gbps * GB, p.copy_call_s, cost.cpu_expert_gbps * GB, p.cpu_tflops, p.cpu_call_s],
                       np.float64)
        cost.__dict__["_core_costs"] = got        # (frozen: set beside the fields, as a cache)
    return got


def plan_from_core(ids: np.ndarray, core: tuple) -> Plan:
    """The Plan for `_plan_core`'s result on the experts `ids`."""
    stream, cpu, why, hits, gpu_s, cpu_s, cut, f = core
    idl = ids.tolist()
    stream_ids, cpu_ids = [idl[i] for i in stream.tolist()], [idl[i] for i in cpu.tolist()]
    split = ((idl[cut], f),) if cut >= 0 else ()
    return Plan(tuple([idl[i] for i in hits.tolist()]), tuple(stream_ids), tuple(cpu_ids), gpu_s, cpu_s,
                _Reasons(stream_ids, cpu_ids, why, split), split)


class _Reasons(Mapping):
    """`Plan.reasons` for a compiled plan: the words are put together only when read."""

    def __init__(self, stream: list[int], cpu: list[int], why: np.ndarray, split: tuple):
        self._args, self._dict = (stream, cpu, why, split), None

    def _words(self) -> dict[int, str]:
        if self._dict is None:
            stream, cpu, why, split = self._args
            d = {e: _WHY[0] for e in stream}
            d.update((e, _WHY[w]) for e, w in zip(cpu, why.tolist()))
            for e, f in split:
                d[e] = f"split: {f:.0%} of its columns copied and computed on the accelerator, the rest on the CPU"
            self._dict = d
        return self._dict

    def __getitem__(self, e: int) -> str:
        return self._words()[e]

    def __iter__(self):
        return iter(self._words())

    def __len__(self) -> int:
        return len(self._words())

    def __repr__(self) -> str:
        return repr(self._words())


_WHY = ("stream: the layer finishes no later than with it on the CPU", "cpu: finishes sooner than a copy",
        "cpu: no slot to stream into")


def copies_s(p: Plan, cost: CostModel) -> float:
    """Seconds the plan's own copies hold the copy engine (streamed experts, a cut expert's part)."""
    return len(p.stream) * cost.copy_s() + _add(f * cost.expert_bytes / (cost.pcie_gbps * GB) + cost.profile.copy_call_s
                                               for _, f in p.split)


def prefetch_allowance(p: Plan, cost: CostModel, lead_s: float) -> int:
    """Look-ahead copies worth issuing after this layer-step (the executor's prefetch): as many as
    fit where the copy engine would otherwise idle. An ahead copy waits for the layer's
    accelerator work (the slot it overwrites may still be read; on a GPU the copy stream waits
    for the compute stream), so it can use the time the CPU side runs past the accelerator
    side, plus `lead_s`, the time before the next layer's experts start (its attention and dense
    part, host work). A copy beyond that delays the next layer's own copies (and a prefetched
    hit waits for it) by about what a right guess saves, and a wrong one saves nothing."""
    idle = max(0.0, p.cpu_s - p.gpu_s) + max(0.0, lead_s)
    return int(idle / cost.copy_s())


def evaluate(stats: LayerStats, stream: tuple[int, ...] | list[int], cost: CostModel) -> Plan:
    """The predicted times of a given split (hits = resident, `stream` copied in, the rest on CPU):
    how the baselines' fixed rules are costed with the same model `plan` optimises."""
    order = sorted(stats.tokens, key=lambda e: (-stats.tokens[e], e))
    hits = tuple(sorted(e for e in stats.tokens if e in stats.resident))
    chosen = set(stream)
    streamed = tuple(e for e in order if e in chosen and e not in stats.resident)
    cpu = tuple(e for e in order if e not in stats.resident and e not in chosen)
    hit_s = _add(cost.gpu_compute_s(stats.tokens[e]) for e in hits)
    computes = [cost.gpu_compute_s(stats.tokens[e]) for e in streamed]
    cpu_s = _add(cost.cpu_s(stats.tokens[e]) for e in cpu) + cost.profile.cpu_call_s if cpu else 0.0
    gpu_s = _gpu_finish(hit_s, cost.copy_s() * len(streamed), _add(computes), computes[-1] if computes else 0.0)
    return Plan(hits, streamed, cpu, gpu_s, cpu_s)
