"""Every compiled (numba) function of the residency package, in one file.

numba's disk cache (`cache=True`) checks a cached function only against its own source file: a
compiled function calling one from another file would keep stale machine code after that file
changed. Kept together here, a change to any of them recompiles all of them. No module-level
constant from elsewhere is baked in either: the planner gets its bandwidths in bytes per second
(`planner.core_costs`), the policy its value window as an argument.

The planner's decisions (`_plan_core`) are documented in `planner.py`, the policy's bookkeeping
(`_split_core`, `_touch_core`, `_admit_core`, `_victim_scan`) in `adaptive.py`.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _plan_core(ids, ntok, res, vals, by_value, stream_slots, cpu_enabled, split_experts, costs):  # pragma: no cover - jitted
    """Decisions 1-5 (module docstring) on arrays. Returns, as indices into `ids`: the streamed
    misses and the CPU ones in their final order, each CPU one's reason (1 = finishes sooner,
    2 = no slot), the hits by expert id; then the accelerator and CPU finish times, the cut
    miss (-1: none) and the share of its columns on the accelerator. Every sum runs in the order
    the decisions are described in, so the times are reproducible to the last bit."""
    expert_bytes, flops, vram_bps, gpu_tflops, pcie_bps = costs[0], costs[1], costs[2], costs[3], costs[4]
    copy_call_s, cpu_bps, cpu_tflops, cpu_call_s = costs[5], costs[6], costs[7], costs[8]
    m = ids.shape[0]
    gc, cc = np.empty(m), np.empty(m)            # accelerator / CPU seconds of each expert
    for i in range(m):
        gc[i] = max(expert_bytes / vram_bps, ntok[i] * flops / (gpu_tflops * 1e12))
        cc[i] = max(expert_bytes / cpu_bps, ntok[i] * flops / (cpu_tflops * 1e12))
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
    call, copy = cpu_call_s, expert_bytes / pcie_bps + copy_call_s
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
    copy_bytes_s = expert_bytes / pcie_bps
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


@njit(cache=True)
def _victim_scan(flat, layer, last, freq, layer_last, count, lru, now, exclude, busy_layer, fair,
                 fmax=-1.0):  # pragma: no cover - jitted
    """Flat index (layer * E + expert) of the lowest-scoring resident, skipping `exclude` and
    busy_layer's experts routed at step `now`; a candidate in a layer above its floor
    (count > fair) wins over any in a protected layer; among equal scores the lower flat index.
    -1 when there is none. The residents come as parallel arrays: flat index, layer, last step
    routed, decayed count. Scores: LRU = steps since last routed, counted on the resident's own
    layer's clock (last - the layer's latest step: within a step, a layer not reached yet is not
    older than one already past), among equals the rarer; LFU = decayed count, among equals the
    older. `fmax`: the largest count among the residents, if the caller knows it."""
    if lru and fmax < 0:     # (the largest count among the residents, when the caller has not kept it)
        fmax = _fmax(freq)
    best, best_i, guarded, guarded_i = np.inf, -1, np.inf, -1
    for i in range(flat.shape[0]):
        r, l = flat[i], layer[i]
        if r == exclude or (l == busy_layer and last[i] == now):
            continue
        if lru:
            score = last[i] - layer_last[l] + 0.5 * freq[i] / (1.0 + fmax)
        else:
            score = freq[i] + 1e-9 * (last[i] + 1) / (now + 2)
        if score < best or (score == best and r < best_i):
            best, best_i = score, r
        if count[l] > fair and (score < guarded or (score == guarded and r < guarded_i)):
            guarded, guarded_i = score, r
    return guarded_i if guarded_i >= 0 else best_i


@njit(cache=True)
def _rate(freq, fast, fast_step, slow_scale, slow_norm, fd, fast_norm, now):  # pragma: no cover - jitted
    """Routes per step lately (1.0: routed every step): the larger of the slow decayed count
    (stored inflated; `slow_scale` deflates it) and the fast one (decayed from its last update),
    each normalised to a rate."""
    return max(freq * slow_scale * slow_norm, fast * fd ** float(now - fast_step) * fast_norm)


@njit(cache=True)
def _min_rate(flat, freq, fast, fast_step, slow_scale, slow_norm, fd, fast_norm, now):  # pragma: no cover - jitted
    """The lowest `_rate` among the residents `flat` (indices into the flattened [L, E] arrays)."""
    low = np.inf
    for i in flat:
        low = min(low, _rate(freq[i], fast[i], fast_step[i], slow_scale, slow_norm, fd, fast_norm, now))
    return low


@njit(cache=True)
def _miss_values(ids, res, freq, fast, fast_step, slow_scale, slow_norm, fd, fast_norm, now, victim,
                 per_miss, window):  # pragma: no cover - jitted
    """`stream_values` for the experts `ids` of one layer (0 for the resident ones): the rate above
    the victim's, over `window` steps, times the cheaper way to serve a miss."""
    vals = np.zeros(ids.shape[0])
    for i in range(ids.shape[0]):
        if not res[i]:
            e = ids[i]
            r = _rate(freq[e], fast[e], fast_step[e], slow_scale, slow_norm, fd, fast_norm, now)
            vals[i] = max(0.0, r - victim) * window * per_miss
    return vals


@njit(cache=True)
def _split_core(ids, ntok, res, freq, fast, fast_step, slow_scale, slow_norm, fd, fast_norm, now, victim, per_miss,
                window, capacity, costs):  # pragma: no cover - jitted
    """`AdaptivePolicy.split` in one call: the misses' values, then the planner with every slot
    open to streaming and cuts allowed (no slots: nothing is worth keeping, nothing streams)."""
    has_miss = False
    for r in res:
        has_miss |= not r
    if capacity > 0:
        vals = _miss_values(ids, res, freq, fast, fast_step, slow_scale, slow_norm, fd, fast_norm, now, victim, per_miss,
                            window)
    else:
        vals = np.zeros(ids.shape[0])
    return _plan_core(ids, ntok, res, vals, has_miss and capacity > 0, capacity, True, capacity > 0, costs)


@njit(cache=True)
def _touch_core(ids, ntok, freq, fast, fast_step, last, rpos, base, rfreq, rlast, scale, fd, step):  # pragma: no cover - jitted
    """One layer-step's routing into the counts of its layer's rows: the slow count (inflated by
    `scale`), the fast one (decayed to this step first), the last step routed; a resident's
    contiguous copies (`rfreq`, `rlast`, at `rpos[base + e]`) follow."""
    for a in range(ids.shape[0]):
        e = ids[a]
        freq[e] += ntok[a] * scale
        fast[e] = fast[e] * fd ** float(step - fast_step[e]) + ntok[a]
        fast_step[e] = step
        last[e] = step
        i = rpos[base + e]
        if i >= 0:
            rfreq[i], rlast[i] = freq[e], step


@njit(cache=True)
def _admit_core(flats, layer, num_experts, capacity, nres, leader, w_lru, rbuf, rbuf_at, now, fair, res, count, last,
                freq, layer_last, rlist, rpos, rlayer, rlast, rfreq, out):  # pragma: no cover - jitted
    """`AdaptivePolicy.admit` for each of `flats` (layer * E + expert) in turn, on the arrays: with
    the cache full, the rule is the duel's `leader` (-1: a LeCaR draw from `rbuf`, LRU when below
    `w_lru`) and the victim `_victim_scan`'s (never the expert itself nor one its layer routed at
    `now`); under LFU an expert rarer than its victim is refused. Per expert, `out` gets (added,
    victim's flat index or -1, rule). Returns the residents after and the next unused draw.
    The residents' largest count (the LRU scan's tie-break scale) is kept across the batch."""
    fmax = -1.0                                            # -1: not known
    for a in range(flats.shape[0]):
        flat = flats[a]
        out[a, 0], out[a, 1], out[a, 2] = 0, -1, 0
        if res[flat]:
            continue
        victim = -1
        if nres >= capacity:
            which = leader
            if which < 0:
                which = 0 if rbuf[rbuf_at] < w_lru else 1
                rbuf_at += 1
            out[a, 2] = which
            if which == 0 and fmax < 0:
                fmax = _fmax(rfreq[:nres])
            victim = _victim_scan(rlist[:nres], rlayer[:nres], rlast[:nres], rfreq[:nres], layer_last, count,
                                  which == 0, now, flat, layer, fair, fmax)
            if victim < 0:
                continue
            out[a, 1] = victim
            if which == 1 and freq[flat] < freq[victim]:
                continue                                   # refused
            # swap-remove the victim: the last entry moves into its place
            i, j = rpos[victim], nres - 1
            if rfreq[i] >= fmax:
                fmax = -1.0                                # the largest count may have left: rescan
            moved = rlist[j]
            rlist[i], rpos[moved], rpos[victim] = moved, i, -1
            rlayer[i], rlast[i], rfreq[i] = rlayer[j], rlast[j], rfreq[j]
            res[victim] = False
            count[victim // num_experts] -= 1
            nres -= 1
        res[flat] = True
        count[layer] += 1
        rlist[nres], rpos[flat], rlayer[nres] = flat, nres, layer
        rlast[nres], rfreq[nres] = last[flat], freq[flat]
        if fmax >= 0:
            fmax = max(fmax, freq[flat])
        nres += 1
        out[a, 0] = 1
    return nres, rbuf_at


@njit(cache=True)
def _fmax(freq):  # pragma: no cover - jitted
    """The largest of the counts `freq` (0 when empty)."""
    fmax = 0.0
    for i in range(freq.shape[0]):
        fmax = max(fmax, freq[i])
    return fmax
