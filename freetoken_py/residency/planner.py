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
from typing import Mapping

import numpy as np
from numba import njit

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
    reasons: Mapping[int, str] = field(default_factory=dict)
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
    per call), made once per model."""
    got = cost.__dict__.get("_core_costs")
    if got is None:
        p = cost.profile
        got = np.array([cost.expert_bytes, cost.expert_flops_per_token, p.vram_gbps, p.gpu_tflops, cost.pcie_gbps,
                        p.copy_call_s, cost.cpu_expert_gbps, p.cpu_tflops, p.cpu_call_s], np.float64)
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


@njit(cache=True)
def _plan_core(ids, ntok, res, vals, by_value, stream_slots, cpu_enabled, split_experts, costs):  # pragma: no cover - jitted
    """Decisions 1-5 (module docstring) on arrays. Returns, as indices into `ids`: the streamed
    misses and the CPU ones in their final order, each CPU one's reason (1 = finishes sooner,
    2 = no slot), the hits by expert id; then the accelerator and CPU finish times, the cut
    miss (-1: none) and the share of its columns on the accelerator. Every sum runs in the order
    the decisions are described in, so the times are reproducible to the last bit."""
    expert_bytes, flops, vram_gbps, gpu_tflops, pcie_gbps = costs[0], costs[1], costs[2], costs[3], costs[4]
    copy_call_s, cpu_gbps, cpu_tflops, cpu_call_s = costs[5], costs[6], costs[7], costs[8]
    m = ids.shape[0]
    gc, cc = np.empty(m), np.empty(m)            # accelerator / CPU seconds of each expert
    for i in range(m):
        gc[i] = max(expert_bytes / (vram_gbps * GB), ntok[i] * flops / (gpu_tflops * 1e12))
        cc[i] = max(expert_bytes / (cpu_gbps * GB), ntok[i] * flops / (cpu_tflops * 1e12))
    # 1. hits, by expert id
    nh = 0
    for i in range(m):
        nh += res[i]
    hits = np.empty(nh, np.int64)
    j = 0
    for i in range(m):
        if res[i]:
            hits[j] = i
            j += 1
    hits = hits[np.argsort(ids[hits], kind="mergesort")]
    hit_s = 0.0
    for i in hits:
        hit_s += gc[i]
    # 2-4. misses, most tokens first (then by id), each to the side that finishes sooner with it
    misses = np.empty(m - nh, np.int64)
    j = 0
    for i in range(m):
        if not res[i]:
            misses[j] = i
            j += 1
    big = 1
    for i in range(m):
        big = max(big, ids[i] + 1)
    key = np.empty(misses.shape[0], np.int64)
    for a in range(misses.shape[0]):
        key[a] = -ntok[misses[a]] * big + ids[misses[a]]
    misses = misses[np.argsort(key, kind="mergesort")]
    call, copy = cpu_call_s, expert_bytes / (pcie_gbps * GB) + copy_call_s
    copy_q, sum_c, last_c, cpu_q = 0.0, 0.0, 0.0, 0.0
    stream = np.empty(misses.shape[0], np.int64)
    cpu = np.empty(misses.shape[0], np.int64)
    why = np.empty(misses.shape[0], np.int64)
    ns, nc = 0, 0
    for i in misses:
        gpu_now = max(hit_s + sum_c, copy_q + last_c)
        gpu_after = max(hit_s + (sum_c + gc[i]), (copy_q + copy) + gc[i])
        cpu_now = cpu_q + call if nc else 0.0
        cpu_after = cpu_q + cc[i] + call
        can_stream = ns < stream_slots or not cpu_enabled
        if can_stream and (not cpu_enabled or max(gpu_after, cpu_now) - vals[i] <= max(gpu_now, cpu_after)):
            copy_q += copy
            sum_c += gc[i]
            last_c = gc[i]
            stream[ns] = i
            ns += 1
        else:
            cpu_q += cc[i]
            cpu[nc] = i
            why[nc] = 1 if can_stream else 2
            nc += 1
    stream, cpu, why = stream[:ns], cpu[:nc], why[:nc]
    if by_value and ns + nc:
        # 3. among misses of equal counts, the ones most worth keeping stream (the greedy streamed
        # as many of each count as it did); each side ordered by count, then worth, then id
        order = np.concatenate((stream, cpu))
        for a in range(1, order.shape[0]):       # insertion sort: (-tokens, -worth, id)
            x = order[a]
            b = a - 1
            while b >= 0:
                y = order[b]
                if ntok[y] > ntok[x] or (ntok[y] == ntok[x] and (vals[y] > vals[x] or (vals[y] == vals[x] and ids[y] < ids[x]))):
                    break
                order[b + 1] = y
                b -= 1
            order[b + 1] = x
        new_stream, new_cpu, new_why = np.empty(ns, np.int64), np.empty(nc, np.int64), np.empty(nc, np.int64)
        a, s2, c2 = 0, 0, 0
        while a < order.shape[0]:
            n = ntok[order[a]]
            k = 0                                 # how many of this count streamed
            for i in stream:
                k += ntok[i] == n
            reason_at = 0                         # the CPU reasons of this count, in their order
            while a < order.shape[0] and ntok[order[a]] == n:
                if k > 0:
                    new_stream[s2] = order[a]
                    s2 += 1
                    k -= 1
                else:
                    while ntok[cpu[reason_at]] != n:
                        reason_at += 1
                    new_cpu[c2], new_why[c2] = order[a], why[reason_at]
                    reason_at += 1
                    c2 += 1
                a += 1
        stream, cpu, why = new_stream, new_cpu, new_why
    gpu_s = max(hit_s + sum_c, copy_q + last_c)
    cpu_s = cpu_q + call if nc else 0.0
    if not (split_experts and cpu_enabled and ns + nc):
        return stream, cpu, why, hits, gpu_s, cpu_s, -1, 0.0
    # 5. cut the smallest miss on the side that finishes last
    if cpu_s > gpu_s and nc:
        x, value = cpu[nc - 1], 0.0
        nc -= 1
    elif gpu_s > cpu_s and ns:
        x = stream[ns - 1]
        value = vals[x]
        ns -= 1
    else:
        return stream, cpu, why, hits, gpu_s, cpu_s, -1, 0.0
    copy_q2 = copy * ns
    sum_c2, cpu_q2 = 0.0, 0.0
    for i in stream[:ns]:
        sum_c2 += gc[i]
    for i in cpu[:nc]:
        cpu_q2 += cc[i]
    cx, cs = gc[x], cc[x]
    copy_bytes_s = expert_bytes / (pcie_gbps * GB)
    # with the first fraction f of x's columns on the accelerator (x's part last):
    #   accelerator = max(hit_s + sum_c + f cx,  copy_q + copy_call + f (copy_bytes_s + cx))
    #   CPU         = cpu_q + call + (1 - f) cs
    # the accelerator side rises with f and the CPU side falls: they cross where the CPU line
    # meets the first of the two accelerator lines
    cpu0 = cpu_q2 + call + cs
    a0, a1 = hit_s + sum_c2, cx
    b0, b1 = copy_q2 + copy_call_s, copy_bytes_s + cx
    f = min((cpu0 - a0) / (a1 + cs), (cpu0 - b0) / (b1 + cs))
    if not 0.0 < f < 1.0:
        return stream, cpu, why, hits, gpu_s, cpu_s, -1, 0.0
    cut_gpu = max(a0 + a1 * f, b0 + b1 * f)
    cut_cpu = cpu0 - f * cs
    if max(cut_gpu, cut_cpu) + value >= max(gpu_s, cpu_s) * (1 - 1e-3):
        return stream, cpu, why, hits, gpu_s, cpu_s, -1, 0.0
    return stream[:ns], cpu[:nc], why[:nc], hits, cut_gpu, cut_cpu, x, f


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
