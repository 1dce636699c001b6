"""The planner's decisions as the plain Python they were first written in: the reference the
compiled `freetoken_py.residency.planner.plan` is checked against (tests/test_residency_planner.py,
random stats, profiles and budgets; the decisions must be identical and the times equal). Its
sums are plain left-to-right additions (planner's `_add`), as the compiled loops are, on every
Python."""
from __future__ import annotations

from typing import Mapping

# the two plain helpers are shared with planner.evaluate: left-to-right sums, the accelerator's finish
from freetoken_py.residency.planner import GB, Budgets, CostModel, LayerStats, Plan, _add, _gpu_finish


def plan(stats: LayerStats, cost: CostModel, budgets: Budgets) -> Plan:
    tokens = stats.tokens
    hits = tuple(sorted(e for e in tokens if e in stats.resident))
    misses = sorted((e for e in tokens if e not in stats.resident), key=lambda e: (-tokens[e], e))
    gpu_c, cpu_c = {}, {}                      # per token count: accelerator / CPU seconds
    for n in set(tokens.values()):
        gpu_c[n], cpu_c[n] = cost.gpu_compute_s(n), cost.cpu_s(n)
    hit_s = _add(gpu_c[tokens[e]] for e in hits)
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
    sum_c = _add(gpu_c[stats.tokens[e]] for e in stream)
    cpu_q = _add(cpu_c[stats.tokens[e]] for e in cpu)
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
