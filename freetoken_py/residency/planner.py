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
    reasons: dict[int, str] = field(default_factory=dict)
    split: tuple[tuple[int, float], ...] = ()   # (expert, fraction of its columns on the accelerator)

    @property
    def seconds(self) -> float:
        return max(self.gpu_s, self.cpu_s)


def _gpu_finish(hit_s: float, copy_q: float, sum_c: float, last_c: float) -> float:
    """Copies run on the copy engine while hits compute; each streamed expert computes after its
    copy: the accelerator ends after all its compute (hits + streamed, `sum_c`) or after the last
    copy (`copy_q`) and that expert's compute (`last_c`). With nothing streamed it is `hit_s`."""
    return max(hit_s + sum_c, copy_q + last_c)


def plan(stats: LayerStats, cost: CostModel, budgets: Budgets) -> Plan:
    tokens = stats.tokens
    hits = tuple(sorted(e for e in tokens if e in stats.resident))
    misses = sorted((e for e in tokens if e not in stats.resident), key=lambda e: (-tokens[e], e))
    gpu_c, cpu_c = {}, {}                      # per token count: accelerator / CPU seconds
    for n in set(tokens.values()):
        gpu_c[n], cpu_c[n] = cost.gpu_compute_s(n), cost.cpu_s(n)
    hit_s = sum(gpu_c[tokens[e]] for e in hits)
    call, copy = cost.profile.cpu_call_s, cost.copy_s()
    copy_q, sum_c, last_c, cpu_q = 0.0, 0.0, 0.0, 0.0   # the accelerator side, as _gpu_finish takes it
    stream, cpu, reasons = [], [], {}
    for e in misses:
        n = tokens[e]
        gpu_now = _gpu_finish(hit_s, copy_q, sum_c, last_c)
        gpu_after = _gpu_finish(hit_s, copy_q + copy, sum_c + gpu_c[n], gpu_c[n])
        cpu_now = cpu_q + call if cpu else 0.0
        cpu_after = cpu_q + cpu_c[n] + call
        can_stream = len(stream) < budgets.stream_slots or not budgets.cpu_enabled
        value = budgets.stream_values.get(e, budgets.stream_value_s)
        if can_stream and (not budgets.cpu_enabled or max(gpu_after, cpu_now) - value <= max(gpu_now, cpu_after)):
            copy_q += copy
            sum_c += gpu_c[n]
            last_c = gpu_c[n]
            stream.append(e)
            reasons[e] = "stream: the layer finishes no later than with it on the CPU"
        else:
            cpu_q += cpu_c[n]
            cpu.append(e)
            reasons[e] = "cpu: finishes sooner than a copy" if can_stream else "cpu: no slot to stream into"
    if budgets.stream_values:
        stream, cpu = _worth_keeping_streams(stream, cpu, tokens, reasons, budgets)
    whole = Plan(hits, tuple(stream), tuple(cpu), _gpu_finish(hit_s, copy_q, sum_c, last_c),
                 cpu_q + call if cpu else 0.0, reasons)
    if budgets.split_experts and budgets.cpu_enabled and (stream or cpu):
        return _cut_one(whole, stats, cost, budgets, hit_s, gpu_c, cpu_c) or whole
    return whole


def _worth_keeping_streams(stream: list[int], cpu: list[int], tokens: Mapping[int, int], reasons: dict,
                           budgets: Budgets) -> tuple[list[int], list[int]]:
    """Misses with the same token count cost the same on either side, so which of them stream is
    free to choose: the ones most worth keeping (`stream_values`), each side then ordered by
    tokens and, among equals, by that worth (so a cut takes the streamed miss least worth keeping)."""
    def worth(e: int) -> float:
        return budgets.stream_values.get(e, budgets.stream_value_s)

    streamed_per_count: dict[int, int] = {}
    for e in stream:
        streamed_per_count[tokens[e]] = streamed_per_count.get(tokens[e], 0) + 1
    cpu_reasons: dict[int, list[str]] = {}
    for e in cpu:
        cpu_reasons.setdefault(tokens[e], []).append(reasons[e])
    stream_reason = reasons[stream[0]] if stream else ""
    groups: dict[int, list[int]] = {}
    for e in stream + cpu:
        groups.setdefault(tokens[e], []).append(e)
    new_stream, new_cpu = [], []
    for n in sorted(groups, reverse=True):
        group = sorted(groups[n], key=lambda e: (-worth(e), e))
        k = streamed_per_count.get(n, 0)
        new_stream += group[:k]
        new_cpu += group[k:]
        for e in group[:k]:
            reasons[e] = stream_reason
        for e, why in zip(group[k:], cpu_reasons.get(n, [])):
            reasons[e] = why
    return new_stream, new_cpu


def _cut_one(whole: Plan, stats: LayerStats, cost: CostModel, budgets: Budgets, hit_s: float,
             gpu_c: Mapping[int, float], cpu_c: Mapping[int, float]) -> Plan | None:
    """Decision 5: move part of one miss from the side that finishes last to the other side, so
    both finish together. None when no cut gains time (or gains less than keeping was worth).
    `gpu_c` / `cpu_c`: `plan`'s accelerator / CPU seconds per token count."""
    copy_bytes_s = cost.expert_bytes / (cost.pcie_gbps * GB)
    call, copy_call = cost.profile.cpu_call_s, cost.profile.copy_call_s
    stream, cpu = list(whole.stream), list(whole.cpu)
    if whole.cpu_s > whole.gpu_s and cpu:
        x, value = cpu.pop(), 0.0              # the smallest CPU miss (placed last)
    elif whole.gpu_s > whole.cpu_s and stream:
        x = stream.pop()                       # the smallest streamed miss; a cut one is not kept
        value = budgets.stream_values.get(x, budgets.stream_value_s)
    else:
        return None
    n = stats.tokens[x]
    copy_q = cost.copy_s() * len(stream)
    sum_c = sum(gpu_c[stats.tokens[e]] for e in stream)
    cpu_q = sum(cpu_c[stats.tokens[e]] for e in cpu)
    cx, cs = gpu_c[n], cpu_c[n]
    # with the first fraction f of x's columns on the accelerator (as _gpu_finish, x's part last):
    #   accelerator = max(hit_s + sum_c + f cx,  copy_q + copy_call + f (copy_bytes_s + cx))
    #   CPU         = cpu_q + call + (1 - f) cs
    # the accelerator side rises with f and the CPU side falls: they cross where the CPU line
    # meets the first of the two accelerator lines
    cpu0 = cpu_q + call + cs
    lines = ((hit_s + sum_c, cx), (copy_q + copy_call, copy_bytes_s + cx))
    f = min((cpu0 - a0) / (a1 + cs) for a0, a1 in lines)
    if not 0.0 < f < 1.0:
        return None
    gpu_s = max(a0 + a1 * f for a0, a1 in lines)
    cpu_s = cpu0 - f * cs
    if max(gpu_s, cpu_s) + value >= whole.seconds * (1 - 1e-3):
        return None
    reasons = dict(whole.reasons)
    reasons[x] = f"split: {f:.0%} of its columns copied and computed on the accelerator, the rest on the CPU"
    return Plan(whole.hits, tuple(stream), tuple(cpu), gpu_s, cpu_s, reasons, ((x, f),))


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
    gpu_s = _gpu_finish(hit_s, cost.copy_s() * len(streamed), sum(computes), computes[-1] if computes else 0.0)
    return Plan(hits, streamed, cpu, gpu_s, cpu_s)
