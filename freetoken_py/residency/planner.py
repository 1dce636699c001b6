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
   resident and hit next time; a CPU-evaluated one never will.
4. Streaming needs a free or evictable slot (`budgets.stream_slots`); beyond that, misses go to
   the CPU. With `budgets.cpu_enabled` False (no host copy), every miss streams.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

from freetoken_py.residency.profiles import GB, TierProfile


@dataclass(frozen=True)
class CostModel:
    """Seconds per action: the profile's numbers, updated by live measurements (EMA)."""
    profile: TierProfile
    expert_bytes: int
    expert_flops_per_token: float
    pcie_gbps: float = 0.0          # 0: take the profile's prior
    cpu_expert_gbps: float = 0.0

    def __post_init__(self) -> None:
        if self.pcie_gbps <= 0:
            object.__setattr__(self, "pcie_gbps", self.profile.pcie_gbps)
        if self.cpu_expert_gbps <= 0:
            object.__setattr__(self, "cpu_expert_gbps", self.profile.cpu_expert_gbps)

    def gpu_compute_s(self, tokens: int) -> float:
        p = self.profile
        return max(self.expert_bytes / (p.vram_gbps * GB), tokens * self.expert_flops_per_token / (p.gpu_tflops * 1e12))

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
    reasons: dict[int, str] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return max(self.gpu_s, self.cpu_s)


def _gpu_finish(hit_s: float, copy_s: float, computes: list[float]) -> float:
    """Copies run on the copy engine while hits compute; each streamed expert computes after its copy."""
    return max(hit_s + sum(computes), copy_s + computes[-1]) if computes else hit_s


def plan(stats: LayerStats, cost: CostModel, budgets: Budgets) -> Plan:
    hits = tuple(sorted(e for e in stats.tokens if e in stats.resident))
    misses = sorted((e for e in stats.tokens if e not in stats.resident),
                    key=lambda e: (-stats.tokens[e], e))
    hit_s = sum(cost.gpu_compute_s(stats.tokens[e]) for e in hits)
    call = cost.profile.cpu_call_s
    copy_q, computes, cpu_q = 0.0, [], 0.0
    stream, cpu, reasons = [], [], {}
    for e in misses:
        n = stats.tokens[e]
        gpu_now = _gpu_finish(hit_s, copy_q, computes)
        gpu_after = _gpu_finish(hit_s, copy_q + cost.copy_s(), computes + [cost.gpu_compute_s(n)])
        cpu_now = cpu_q + call if cpu else 0.0
        cpu_after = cpu_q + cost.cpu_s(n) + call
        can_stream = len(stream) < budgets.stream_slots or not budgets.cpu_enabled
        value = budgets.stream_values.get(e, budgets.stream_value_s)
        if can_stream and (not budgets.cpu_enabled or max(gpu_after, cpu_now) - value <= max(gpu_now, cpu_after)):
            copy_q += cost.copy_s()
            computes.append(cost.gpu_compute_s(n))
            stream.append(e)
            reasons[e] = "stream: the layer finishes no later than with it on the CPU"
        else:
            cpu_q += cost.cpu_s(n)
            cpu.append(e)
            reasons[e] = "cpu: finishes sooner than a copy" if can_stream else "cpu: no slot to stream into"
    return Plan(hits, tuple(stream), tuple(cpu), _gpu_finish(hit_s, copy_q, computes),
                cpu_q + call if cpu else 0.0, reasons)


def evaluate(stats: LayerStats, stream: tuple[int, ...] | list[int], cost: CostModel) -> Plan:
    """The predicted times of a given split (hits = resident, `stream` copied in, the rest on CPU):
    how the baselines' fixed rules are costed with the same model `plan` optimises."""
    order = sorted(stats.tokens, key=lambda e: (-stats.tokens[e], e))
    hits = tuple(sorted(e for e in stats.tokens if e in stats.resident))
    chosen = set(stream)
    streamed = tuple(e for e in order if e in chosen and e not in stats.resident)
    cpu = tuple(e for e in order if e not in stats.resident and e not in chosen)
    hit_s = sum(cost.gpu_compute_s(stats.tokens[e]) for e in hits)
    computes = [cost.gpu_compute_s(stats.tokens[e]) for e in streamed]
    cpu_s = sum(cost.cpu_s(stats.tokens[e]) for e in cpu) + cost.profile.cpu_call_s if cpu else 0.0
    return Plan(hits, streamed, cpu, _gpu_finish(hit_s, cost.copy_s() * len(streamed), computes), cpu_s)
