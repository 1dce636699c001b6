"""numba kernels of the routed-expert MLP (see cpu_moe for the API and docs/kernels.md).

Pairs: routing gives P = T * k (token, expert) pairs; pair p = t * k + j. ``group_pairs``
counting-sorts them by expert::

    order [P]      pair ids, grouped by expert
    eids  [U]      the distinct experts hit, ascending
    off   [U + 1]  pairs of eids[u] are order[off[u]:off[u + 1]]

Both stages stream each routed expert's rows from memory once per call; the pairs of that expert
are served 4 at a time per pass over a block of its rows (held in L1/L2), a lone pair by the
single-token dot — T = 1 decode and grouped prefill are the same loops:

    stage 1  prange over (expert, block of RB1 rows of I):  h[p, i] = act(gate_i . x_t, up_i . x_t)
    stage 2  prange over blocks of RB2 rows of D (all experts): out[t, d] += w_p * (down_d . h_p)

Stage 2 owns whole output rows, so the top-k sum needs no atomics and no extra pass. Where every
expert is hit by at most 4 pairs (decode), stage 2 runs expert-major instead, as stage 1 does:

    stage 2' prange over (expert, block of RB_DOWN_FEW rows of D):  y[q, d] = down_d . h_order[q]
             (the dense GEMV block, cpu_linear.gemv_block, over the expert's pairs' rows)
    combine  prange over blocks of D:  out[t, d] += w_p * y[q, d], experts ascending, pairs in order

so each task streams one expert's contiguous rows (the row-block form reads every expert's rows
in short pieces per task); the combine adds the same products in the same order as the
row-block form (fast-math may contract a multiply-add differently: equal to ~1e-7, not bit for
bit). On a Zen 4 VM (2 threads, Qwen3-30B-A3B widths, one decode token, interleaved) the whole
call read 2-12 % faster for int4 / nvfp4 / fp8 / int8 (docs/kernels.md, "Expert-major down stage").
Where the decode call's experts also deal evenly over the workers (``whole_experts``), the three
become one parallel region:

    whole    prange over workers j: experts j, j + W, ... each whole (stage 1 over all I rows,
             its pairs' h prepared, stage 2' over all D rows into y); then the combine, sequential

no barrier between the stages, each expert's rows streamed start to end by one core (Zen 4,
paired against the staged form: int4 1.04-1.13x, nvfp4 1.18-1.27x, int8 / fp8 1.00-1.03x, bf16
0.97-1.02x, i.e. within noise there; docs/kernels.md "fp8 and int8 in 16-row slabs; whole experts").

Stage 1 puts a block's gates in h and its up projections in a buffer, then the activation runs
once per pair over the block (``_act_rows``: the vector SwiGLU); every stage tests the vector dot's
shape once per block and runs its row loop on a path tag (_dots "Path tags").

Prefill tiles: where an expert is hit by >= TILE_MIN_PAIRS pairs and its rows are fp8 or bf16
with fp32 activations (CPUs without AVX512-BF16), a stage widens its block's rows once into an
fp32 tile and multiplies 4 rows x 4 pairs per register block (``_gate_up_tiled`` /
``_down_tiled``, _simd "Prefill tiles"); rows past the last whole 4 and experts with fewer pairs
take the row dots. Same products (the weight times its scale rounded once to fp32, as fp8f_row_dot
does), summed in another order.

Row blocks (``row_blocks``): RB1 / RB2 rows per task where the experts are hit by several pairs
(prefill: a block's activations are reused over its rows); RB_FEW where every expert is hit by
at most 4 pairs (decode: one row pass serves them all, so a task is a plain stream of weight rows,
and longer streams read memory faster), as long as each stage keeps >= 4 tasks per thread.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.extending import overload

from freetoken_py.kernels._dots import (ACT_SILU, ANY, VEC, act, by_layout, pdot, pdot4, prepare, r16_cols, tile_form,
                                       tile_rows, vec_rows, widen_row)
from freetoken_py.kernels._simd import r16_dot, r16_dot4, swiglu, tile_dot44
from freetoken_py.kernels.cpu_linear import gemv_block

RB1 = 16   # gate/up rows per stage-1 task: 16 x (2 rows) x D bytes, small enough to balance 2 threads
RB2 = 16   # down rows per stage-2 task
RB_FEW = 64   # rows per task in both stages where no expert has more than 4 pairs (decode)
RB_DOWN_FEW = 256   # down rows per expert-major stage-2 task (decode); 1024 measured the same
RB_COMBINE = 256    # output columns per combine task
TILE_MIN_PAIRS = 8  # an expert's pairs from which its fp8 / bf16 rows take the prefill tiles (module doc)


@njit(fastmath=True, cache=True)
def group_pairs(ids, num_experts):
    """Counting sort of the flat expert ids [P] -> (order, eids, off); raises on an id outside [0, E)."""
    counts = np.zeros(num_experts + 1, np.int64)
    for p in range(ids.shape[0]):
        if ids[p] < 0 or ids[p] >= num_experts:
            raise ValueError("expert id out of range")
        counts[ids[p] + 1] += 1
    for e in range(num_experts):
        counts[e + 1] += counts[e]
    start = counts.copy()
    order = np.empty(ids.shape[0], np.int64)
    for p in range(ids.shape[0]):
        e = ids[p]
        order[start[e]] = p
        start[e] += 1
    num_u = 0
    for e in range(num_experts):
        if counts[e + 1] > counts[e]:
            num_u += 1
    eids = np.empty(num_u, np.int64)
    off = np.empty(num_u + 1, np.int64)
    u = 0
    for e in range(num_experts):
        if counts[e + 1] > counts[e]:
            eids[u] = e
            off[u] = counts[e]
            u += 1
    off[num_u] = ids.shape[0]
    return order, eids, off


@njit(cache=True)
def few_pairs(off):
    """True where no expert is hit by more than 4 pairs (pairs grouped as by group_pairs)."""
    for u in range(off.shape[0] - 1):
        if off[u + 1] - off[u] > 4:
            return False
    return True


@njit(cache=True)
def most_pairs(off):
    """The most pairs any expert is hit by (pairs grouped as by group_pairs)."""
    most = 0
    for u in range(off.shape[0] - 1):
        most = max(most, off[u + 1] - off[u])
    return most


@njit(cache=True)
def row_blocks(off, inter, hidden, threads):
    """(stage-1 rows, stage-2 rows) per task for pairs grouped as by group_pairs (see the module doc).
    Decode at Qwen3-30B-A3B's widths, one thread, RB_FEW 16 -> 64: int4 0.74 -> 0.78 of the DRAM
    read, fp8 unchanged (docs/kernels.md, "Row blocks A/B")."""
    num_u = off.shape[0] - 1
    few = few_pairs(off)
    rb1 = RB_FEW if few and num_u * ((inter + RB_FEW - 1) // RB_FEW) >= 4 * threads else RB1
    rb2 = RB_FEW if few and (hidden + RB_FEW - 1) // RB_FEW >= 4 * threads else RB2
    return rb1, rb2


@njit(cache=True)
def down_expert_major(off, hidden, threads):
    """True where stage 2 runs expert-major (decode: no expert hit by more than 4 pairs, and
    >= 4 tasks per thread of RB_DOWN_FEW rows; see the module doc)."""
    return few_pairs(off) and (off.shape[0] - 1) * ((hidden + RB_DOWN_FEW - 1) // RB_DOWN_FEW) >= 4 * threads


@njit(fastmath=True, cache=True)
def _chunk(pairs, q, k):
    """Pairs q..q+3 (the last ones repeated past the end) and their tokens; a 2-3 pair tail is
    padded so one row pass still serves it (the duplicate results are rewritten, not summed)."""
    n = pairs.shape[0]
    p0, p1, p2, p3 = pairs[q], pairs[min(q + 1, n - 1)], pairs[min(q + 2, n - 1)], pairs[min(q + 3, n - 1)]
    return p0, p1, p2, p3, p0 // k, p1 // k, p2 // k, p3 // k


@njit(fastmath=True, cache=True)
def _act_rows(kind, g, u):
    """g[i] = act(g[i], u[i]) in place: SwiGLU by the vector exp (_simd.swiglu), GPT-OSS's clamped
    variant per element. Measured on a Zen 4 core, an expert's gate / up rows in cache: the
    scalar act inside the row loop cost 4-12 % of stage 1 (docs/kernels.md, "Path tags and vector SwiGLU")."""
    if kind == ACT_SILU:
        swiglu(g, u, g)
    else:
        for i in range(g.shape[0]):
            g[i] = act(kind, g[i], u[i])


@njit(fastmath=True, cache=True)
def _gate_up_rows(path, w13, s13, xv, xg, pairs, k, i0, i1, kind, hb, h, ub, b13):
    inter = w13.shape[0] // 2
    n = pairs.shape[0]
    if b13.shape[0]:  # biased experts (gpt-oss): one pair at a time, the bias in the epilogue
        for q in range(n):
            p = pairs[q]
            t = p // k
            for i in range(i0, i1):
                g = pdot(path, w13[i], s13[i], xv[t], xg[t], hb) + b13[i]
                u = pdot(path, w13[inter + i], s13[inter + i], xv[t], xg[t], hb) + b13[inter + i]
                h[p, i] = act(kind, g, u)
        return
    for q in range(0, n, 4):
        if n - q == 1:
            p = pairs[q]
            t = p // k
            for i in range(i0, i1):
                h[p, i] = pdot(path, w13[i], s13[i], xv[t], xg[t], hb)
                ub[0, i - i0] = pdot(path, w13[inter + i], s13[inter + i], xv[t], xg[t], hb)
            _act_rows(kind, h[p, i0:i1], ub[0])
            continue
        p0, p1, p2, p3, t0, t1, t2, t3 = _chunk(pairs, q, k)
        for i in range(i0, i1):
            h[p0, i], h[p1, i], h[p2, i], h[p3, i] = pdot4(path, w13[i], s13[i], xv[t0], xv[t1], xv[t2], xv[t3],
                                                           xg[t0], xg[t1], xg[t2], xg[t3], hb)
            ub[0, i - i0], ub[1, i - i0], ub[2, i - i0], ub[3, i - i0] = pdot4(
                path, w13[inter + i], s13[inter + i], xv[t0], xv[t1], xv[t2], xv[t3], xg[t0], xg[t1], xg[t2], xg[t3], hb)
        c = min(n - q, 4)          # a padded tail's repeats hold the last pair's values: act once per pair
        _act_rows(kind, h[p0, i0:i1], ub[0])
        _act_rows(kind, h[p1, i0:i1], ub[1])
        if c > 2:
            _act_rows(kind, h[p2, i0:i1], ub[2])
        if c > 3:
            _act_rows(kind, h[p3, i0:i1], ub[3])


@njit(fastmath=True, cache=True)
def _gate_up_block(w13, s13, xv, xg, pairs, k, i0, i1, kind, hb, h, ub, b13):
    """h[p, i] for rows i0..i1 of one expert (w13 [2I, K]) and its pairs, 4 pairs per row pass;
    ub [4, >= i1 - i0]: the task's scratch for up projections (gates go to h, then the activation).
    b13 [2I]: the expert's gate / up biases, added before the activation (0 entries: none). The
    vector dot's shape test once per block (_dots "Path tags")."""
    if not b13.shape[0]:
        i0 = gate_up_tiles(w13, s13, xv, pairs, k, i0, i1, kind, hb, h)
        if i0 == i1:
            return
    if vec_rows(w13, s13, xv, hb):
        _gate_up_rows(VEC, w13, s13, xv, xg, pairs, k, i0, i1, kind, hb, h, ub, b13)
    else:
        _gate_up_rows(ANY, w13, s13, xv, xg, pairs, k, i0, i1, kind, hb, h, ub, b13)


def gate_up_tiles(w13, s13, xv, pairs, k, i0, i1, kind, hb, h):
    """_gate_up_tiled where the expert has >= TILE_MIN_PAIRS pairs and its rows take the tiles
    (`_dots.tile_rows`); returns the first row not done (i0 where the tiles do not apply; for
    other formats no tile code is compiled). Jitted only."""
    raise NotImplementedError("gate_up_tiles is only callable from numba-compiled code")


@overload(gate_up_tiles, jit_options={"fastmath": True}, inline="always")
def _gate_up_tiles_impl(w13, s13, xv, pairs, k, i0, i1, kind, hb, h):
    if tile_form(w13, s13, xv) is None:
        return lambda w13, s13, xv, pairs, k, i0, i1, kind, hb, h: i0

    def impl(w13, s13, xv, pairs, k, i0, i1, kind, hb, h):
        if pairs.shape[0] >= TILE_MIN_PAIRS and tile_rows(w13, s13, xv, hb):
            return _gate_up_tiled(w13, s13, xv, pairs, k, i0, i1, kind, hb, h)
        return i0
    return impl


@njit(fastmath=True, cache=True)
def _gate_up_tiled(w13, s13, xv, pairs, k, i0, i1, kind, hb, h):
    """_gate_up_block's rows i0.. in whole 4s by the prefill tiles: the block's gate and up rows
    widened once into an fp32 tile [2 m, K] (m rows), then per 4 pairs (their activations stay in
    L1) 4 x 4 blocks of tile rows by tile_dot44; returns the first row not done (the rest: the
    row dots)."""
    inter = w13.shape[0] // 2
    n = pairs.shape[0]
    m = (i1 - i0) // 4 * 4
    tile = np.empty((2 * m, xv.shape[1]), np.float32)
    for r in range(m):
        widen_row(w13[i0 + r], s13[i0 + r], hb, tile[r])
        widen_row(w13[inter + i0 + r], s13[inter + i0 + r], hb, tile[m + r])
    ub = np.empty((n, m), np.float32)
    for q in range(0, n, 4):
        p0, p1, p2, p3, t0, t1, t2, t3 = _chunk(pairs, q, k)
        c = min(n - q, 4)
        for a in range(0, m, 4):
            g = tile_dot44(tile[a], tile[a + 1], tile[a + 2], tile[a + 3], xv[t0], xv[t1], xv[t2], xv[t3])
            u = tile_dot44(tile[m + a], tile[m + a + 1], tile[m + a + 2], tile[m + a + 3], xv[t0], xv[t1], xv[t2], xv[t3])
            for r in range(4):     # a padded tail's repeats rewrite the last pair's values
                i = i0 + a + r
                h[p0, i], h[p1, i], h[p2, i], h[p3, i] = g[4 * r], g[4 * r + 1], g[4 * r + 2], g[4 * r + 3]
                for j in range(c):
                    ub[q + j, a + r] = u[4 * r + j]
    for q in range(n):
        _act_rows(kind, h[pairs[q], i0:i0 + m], ub[q])
    return i0 + m


@njit(fastmath=True, cache=True)
def _down_rows(path, w2, s2, hv, hg, order, eids, off, wts, k, d0, d1, hb, out):
    for u in range(eids.shape[0]):
        e = eids[u]
        pairs = order[off[u]:off[u + 1]]
        n = pairs.shape[0]
        for q in range(0, n, 4):
            if n - q == 1:
                p = pairs[q]
                for d in range(d0, d1):
                    out[p // k, d] += wts[p] * pdot(path, w2[e, d], s2[e, d], hv[p], hg[p], hb)
                continue
            p0, p1, p2, p3, t0, t1, t2, t3 = _chunk(pairs, q, k)
            c = min(n - q, 4)
            for d in range(d0, d1):
                y0, y1, y2, y3 = pdot4(path, w2[e, d], s2[e, d], hv[p0], hv[p1], hv[p2], hv[p3],
                                       hg[p0], hg[p1], hg[p2], hg[p3], hb)
                out[t0, d] += wts[p0] * y0
                out[t1, d] += wts[p1] * y1
                if c > 2:
                    out[t2, d] += wts[p2] * y2
                if c > 3:
                    out[t3, d] += wts[p3] * y3


@njit(fastmath=True, cache=True)
def _down_block(w2, s2, hv, hg, order, eids, off, wts, k, d0, d1, hb, out):
    """out[t, d0:d1] += sum over pairs of w_p * down_e[d] . h_p, for every routed expert (the
    vector dot's shape test once per block)."""
    if tile_rows(w2, s2, hv, hb) and d1 - d0 >= 4 and most_pairs(off) >= TILE_MIN_PAIRS:
        tile = np.empty((d1 - d0, hv.shape[1]), np.float32)
        vec = vec_rows(w2, s2, hv, hb)
        for u in range(eids.shape[0]):     # experts ascending, as _down_rows adds them
            dd = down_tiles(w2[eids[u]], s2[eids[u]], hv, order[off[u]:off[u + 1]], wts, k, d0, d1, hb, tile, out)
            if dd < d1 and vec:
                _down_rows(VEC, w2, s2, hv, hg, order, eids[u:u + 1], off[u:u + 2], wts, k, dd, d1, hb, out)
            elif dd < d1:
                _down_rows(ANY, w2, s2, hv, hg, order, eids[u:u + 1], off[u:u + 2], wts, k, dd, d1, hb, out)
        return
    if vec_rows(w2, s2, hv, hb):
        _down_rows(VEC, w2, s2, hv, hg, order, eids, off, wts, k, d0, d1, hb, out)
    else:
        _down_rows(ANY, w2, s2, hv, hg, order, eids, off, wts, k, d0, d1, hb, out)


def down_tiles(w2, s2, hv, pairs, wts, k, d0, d1, hb, tile, out):
    """_down_tiled where the expert has >= TILE_MIN_PAIRS pairs (the caller tested tile_rows);
    returns the first row not done (d0 otherwise; no tile code compiled for other formats)."""
    raise NotImplementedError("down_tiles is only callable from numba-compiled code")


@overload(down_tiles, jit_options={"fastmath": True}, inline="always")
def _down_tiles_impl(w2, s2, hv, pairs, wts, k, d0, d1, hb, tile, out):
    if tile_form(w2, s2, hv) is None:
        return lambda w2, s2, hv, pairs, wts, k, d0, d1, hb, tile, out: d0

    def impl(w2, s2, hv, pairs, wts, k, d0, d1, hb, tile, out):
        if pairs.shape[0] >= TILE_MIN_PAIRS:
            return _down_tiled(w2, s2, hv, pairs, wts, k, d0, d1, hb, tile, out)
        return d0
    return impl


@njit(fastmath=True, cache=True)
def _down_tiled(w2, s2, hv, pairs, wts, k, d0, d1, hb, tile, out):
    """out[t, d] += w_p * down_d . h_p for one expert (w2 [D, I]) and its pairs, rows d0.. in whole
    4s by the prefill tiles (tile [>= d1 - d0, I] scratch: the rows widened once, then per 4
    pairs 4 x 4 blocks); returns the first row not done."""
    n = pairs.shape[0]
    m = (d1 - d0) // 4 * 4
    for r in range(m):
        widen_row(w2[d0 + r], s2[d0 + r], hb, tile[r])
    for q in range(0, n, 4):
        p0, p1, p2, p3, t0, t1, t2, t3 = _chunk(pairs, q, k)
        c = min(n - q, 4)
        for a in range(0, m, 4):
            y = tile_dot44(tile[a], tile[a + 1], tile[a + 2], tile[a + 3], hv[p0], hv[p1], hv[p2], hv[p3])
            for r in range(4):
                d = d0 + a + r
                out[t0, d] += wts[p0] * y[4 * r]
                if c > 1:
                    out[t1, d] += wts[p1] * y[4 * r + 1]
                if c > 2:
                    out[t2, d] += wts[p2] * y[4 * r + 2]
                if c > 3:
                    out[t3, d] += wts[p3] * y[4 * r + 3]
    return d0 + m


@njit(fastmath=True, cache=True)
def _combine(y, order, wts, k, d0, d1, out):
    """out[t, d0:d1] += w_p * y[q, d0:d1] for the grouped pairs p = order[q] in order (experts
    ascending, pairs in order): _down_block's order of additions."""
    for q in range(order.shape[0]):
        p = order[q]
        t = p // k
        for d in range(d0, d1):
            out[t, d] += wts[p] * y[q, d]


# int4 / nvfp4 / fp8 / int8 banks in 16-row slabs (layout "r16": int16 / int8 / int32 scales; _simd "int4 / nvfp4 weights
# in 16-row interleaved slabs"): the same stages with whole slabs of 16 rows per dot call, picked at
# compile time from the scales' dtype (`gate_up_block`, `down_block`; the expert-major down stage's cpu_linear.gemv_block picks
# the same way). Every row block (RB1, RB2, RB_FEW, RB_DOWN_FEW) is a multiple of 16 and such a
# bank's I and D are (cpu_moe.r16_layout_fits), so a task's rows are whole slabs.
@njit(fastmath=True, cache=True)
def _gate_up_r16(w13, s13, xv, xg, pairs, k, i0, i1, kind, hb, h, ub, b13):
    inter = w13.shape[0] // 2
    bpg = hb // 16
    if xv.shape[1] != r16_cols(w13, s13) or (i1 - i0) % 16 or i0 % 16 or inter % 16:
        raise ValueError("r16 experts: activations of the rows' K, rows on 16-row slabs")
    n = pairs.shape[0]
    m = i1 - i0
    gw, gs_, uw, us = w13[i0:i1], s13[i0:i1], w13[inter + i0:inter + i1], s13[inter + i0:inter + i1]
    step = 1 if b13.shape[0] else 4      # biased experts: a pair at a time, the bias before the act
    for q in range(0, n, step):
        if n - q == 1 or step == 1:
            p = pairs[q]
            t = p // k
            r16_dot(gw, gs_, xv[t], xg[t], bpg, h[p, i0:i1])
            r16_dot(uw, us, xv[t], xg[t], bpg, ub[0, :m])
            if b13.shape[0]:
                for i in range(i0, i1):
                    h[p, i] = act(kind, h[p, i] + b13[i], ub[0, i - i0] + b13[inter + i])
            else:
                _act_rows(kind, h[p, i0:i1], ub[0, :m])
            continue
        p0, p1, p2, p3, t0, t1, t2, t3 = _chunk(pairs, q, k)
        r16_dot4(gw, gs_, xv[t0], xv[t1], xv[t2], xv[t3], xg[t0], xg[t1], xg[t2], xg[t3], bpg,
                   h[p0, i0:i1], h[p1, i0:i1], h[p2, i0:i1], h[p3, i0:i1])
        r16_dot4(uw, us, xv[t0], xv[t1], xv[t2], xv[t3], xg[t0], xg[t1], xg[t2], xg[t3], bpg,
                   ub[0, :m], ub[1, :m], ub[2, :m], ub[3, :m])
        c = min(n - q, 4)            # a padded tail's repeats hold the last pair's values: act once per pair
        _act_rows(kind, h[p0, i0:i1], ub[0, :m])
        _act_rows(kind, h[p1, i0:i1], ub[1, :m])
        if c > 2:
            _act_rows(kind, h[p2, i0:i1], ub[2, :m])
        if c > 3:
            _act_rows(kind, h[p3, i0:i1], ub[3, :m])


@njit(fastmath=True, cache=True)
def _down_r16(w2, s2, hv, hg, order, eids, off, wts, k, d0, d1, hb, out):
    bpg = hb // 16
    if hv.shape[1] != r16_cols(w2, s2) or (d1 - d0) % 16 or d0 % 16:
        raise ValueError("r16 experts: activations of the rows' K, rows on 16-row slabs")
    y = np.empty((4, d1 - d0), np.float32)
    for u in range(eids.shape[0]):          # experts ascending, pairs in order: _down_rows's order
        e = eids[u]
        pairs = order[off[u]:off[u + 1]]
        n = pairs.shape[0]
        for q in range(0, n, 4):
            p0, p1, p2, p3, t0, t1, t2, t3 = _chunk(pairs, q, k)
            c = min(n - q, 4)
            r16_dot4(w2[e, d0:d1], s2[e, d0:d1], hv[p0], hv[p1], hv[p2], hv[p3], hg[p0], hg[p1], hg[p2], hg[p3],
                       bpg, y[0], y[1], y[2], y[3])
            for r in range(d1 - d0):
                out[t0, d0 + r] += wts[p0] * y[0, r]
                if c > 1:
                    out[t1, d0 + r] += wts[p1] * y[1, r]
                if c > 2:
                    out[t2, d0 + r] += wts[p2] * y[2, r]
                if c > 3:
                    out[t3, d0 + r] += wts[p3] * y[3, r]


def gate_up_block(w13, s13, xv, xg, pairs, k, i0, i1, kind, hb, h, ub, b13):
    """Stage 1 for one expert's rows i0..i1: _gate_up_block, or the slab form for "r16" (jitted only)."""
    raise NotImplementedError("gate_up_block is only callable from numba-compiled code")


def down_block(w2, s2, hv, hg, order, eids, off, wts, k, d0, d1, hb, out):
    """Stage 2's row-block form over output rows d0..d1: _down_block, or the slab form (jitted only)."""
    raise NotImplementedError("down_block is only callable from numba-compiled code")


by_layout(gate_up_block, _gate_up_r16, _gate_up_block)
by_layout(down_block, _down_r16, _down_block)


@njit(cache=True)
def whole_experts(off, hidden, threads):
    """True where a decode call runs each routed expert whole on one worker (`_experts_whole`):
    the expert-major case (`down_expert_major`) with the experts dealt evenly (their count a
    multiple of the workers) or >= 4 per worker, so no worker waits long for another."""
    num_u = off.shape[0] - 1
    return (down_expert_major(off, hidden, threads) and num_u >= threads
            and (num_u % threads == 0 or num_u >= 4 * threads))


@njit(parallel=True, fastmath=True, cache=True)
def _experts_whole(w13, s13, w2, s2, xv, xg, order, eids, off, k, kind, gs, workers, b13, h, y):
    """Decode, one parallel region: worker j runs experts j, j + workers, ... whole — gate / up
    over all I rows and the activation (stage 1's block over [0, I)), its pairs' h prepared, then
    the down GEMV over all D rows into y[q] (stage 2' for the expert) — so no barrier separates
    the stages and each worker streams every expert's rows start to end. The same dots on the same
    rows as the staged form (per-row results do not depend on the blocks)."""
    inter = w13.shape[1] // 2
    hidden = w2.shape[1]
    num_u = eids.shape[0]
    no_bias = np.zeros(0, np.float32)
    for j in prange(workers):
        ub = np.empty((4, inter), np.float32)
        for u in range(j, num_u, workers):
            e = eids[u]
            a, b = off[u], off[u + 1]
            pairs = order[a:b]
            gate_up_block(w13[e], s13[e], xv, xg, pairs, k, 0, inter, kind, gs // 2, h, ub,
                          b13[e] if b13.shape[0] else no_bias)
            hv, hg = prepare(w2, s2, h[pairs], gs)
            gemv_block(w2[e], s2[e], hv, hg, gs // 2, 0, hidden, y[a:b])


@njit(fastmath=True, cache=True)
def _add_down_biases(b2, ids, wts, k, out):
    """out[t] += w_p * b2[e_p] per pair (gpt-oss's down biases; b2 with 0 rows: none)."""
    if b2.shape[0]:
        for p in range(ids.shape[0]):
            t = p // k
            for d in range(out.shape[1]):
                out[t, d] += wts[p] * b2[ids[p], d]


@njit(parallel=True, fastmath=True, cache=True)
def moe_rows(w13, s13, w2, s2, x, topk_ids, topk_weights, kind, gs, threads, out, b13, b2):
    """Routed-expert MLP for all tokens x [T, D]; topk ids/weights [T, k]; out [T, D] zeroed;
    threads = numba's thread count for the row blocks (an argument: numba.get_num_threads inside
    the kernel would stop it from being cached). b13 [E, 2I] / b2 [E, D]: expert biases (gpt-oss;
    0 rows: none), b2 added as w_p * b2[e] per pair. Banks in 16-row slabs ("r16": int4 / nvfp4 /
    fp8 / int8, int16 / int8 / int32 scales) take the slab stages (above)."""
    k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1)          # pair p = t * k + j
    wts = topk_weights.reshape(-1)
    xv, xg = prepare(w13, s13, x, gs)
    inter = w13.shape[1] // 2
    hidden = w2.shape[1]
    order, eids, off = group_pairs(ids, w13.shape[0])
    num_pairs = ids.shape[0]
    h = np.empty((num_pairs, inter), np.float32)
    if whole_experts(off, hidden, threads):        # decode: one region, whole experts per worker
        y = np.empty((num_pairs, hidden), np.float32)    # y[q]: pair order[q]'s down projection
        _experts_whole(w13, s13, w2, s2, xv, xg, order, eids, off, k, kind, gs, threads, b13, h, y)
        _combine(y, order, wts, k, 0, hidden, out)
        _add_down_biases(b2, ids, wts, k, out)
        return
    rb1, rb2 = row_blocks(off, inter, hidden, threads)
    no_bias = np.zeros(0, np.float32)
    nb1 = (inter + rb1 - 1) // rb1
    ub = np.empty((eids.shape[0] * nb1, 4, rb1), np.float32)   # each stage-1 task's up projections
    for task in prange(eids.shape[0] * nb1):
        u = task // nb1
        i0 = (task - u * nb1) * rb1
        e = eids[u]
        gate_up_block(w13[e], s13[e], xv, xg, order[off[u]:off[u + 1]], k, i0,
                      min(inter, i0 + rb1), kind, gs // 2, h, ub[task], b13[e] if b13.shape[0] else no_bias)
    hv, hg = prepare(w2, s2, h, gs)
    if down_expert_major(off, hidden, threads):    # decode (module doc)
        nbd = (hidden + RB_DOWN_FEW - 1) // RB_DOWN_FEW
        hvg, hgg = hv[order], hg[order]               # the pairs' activations in grouped order
        y = np.empty((num_pairs, hidden), np.float32)    # y[q]: pair order[q]'s down projection
        for task in prange(eids.shape[0] * nbd):
            u = task // nbd
            d0 = (task - u * nbd) * RB_DOWN_FEW
            a, b = off[u], off[u + 1]
            gemv_block(w2[eids[u]], s2[eids[u]], hvg[a:b], hgg[a:b], gs // 2, d0, min(hidden, d0 + RB_DOWN_FEW), y[a:b])
        for task in prange((hidden + RB_COMBINE - 1) // RB_COMBINE):
            d0 = task * RB_COMBINE
            _combine(y, order, wts, k, d0, min(hidden, d0 + RB_COMBINE), out)
    else:
        nb2 = (hidden + rb2 - 1) // rb2
        for task in prange(nb2):
            d0 = task * rb2
            down_block(w2, s2, hv, hg, order, eids, off, wts, k, d0, min(hidden, d0 + rb2), gs // 2, out)
    _add_down_biases(b2, ids, wts, k, out)
