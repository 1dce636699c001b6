"""The Triton kernels of `gpu_moe` (imported only when they are used: Triton is optional).

One family for every expert format (`FMT`): 0 float (bf16 / fp16 / fp32 weights), 1 int8 (one
fp32 scale a row), 2 int4 (g-column groups, fp16 scales held as int16), 3 fp8 (e4m3 bytes, one
fp32 scale a row and block of G columns), 4 nvfp4 (e2m1 nibbles, e4m3 group-16 scale bytes and
the row's fp32 factor at the end of its scale row). Quantised weights are read as int32 words
(4 bytes, or 8 nibbles: our nibble order, low nibble the even column, is exactly a word's bit
order), decoded arithmetically (no table gathers), and each word's products are summed before
its scale is applied once (int4: the +8 zero point folded per word, s * (sum q x - 8 sum x)).

A layer-step is a set of *groups*: one expert (a slot of the on-device slot table) and up to NT
of its (token, weight) pairs, so an expert routed by several tokens is read once. A program
computes BLOCK_N rows of one group's expert for its NT tokens; its K loop is pipelined
(`tl.range(num_stages=STAGES)`) and accumulates a [NT, BLOCK_N, BLOCK_K / UNIT / RED] tile,
reduced across lanes once, in the epilogue (RED = 1 defers the whole reduction). The int8
rounding of x that the CPU kernels apply (ROUND) happens as x is loaded; SiLU * up with h's
rounding, and the routing weight, are epilogues; the per-token sum, in the pairs' order and
without atomics on values, is done by the last program of each row block of the down kernel
(or by `combine_kernel` for more than 16 tokens): two launches a layer-step.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # fused multiply-adds (Triton 3.9 warns when unset)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _rint(v):
    """Round to nearest, ties to even (torch.round), exact for |v| < 2**22, in any backend."""
    r = tl.floor(v)
    d = v - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)


@triton.jit
def _round32(v, R: tl.constexpr, C: tl.constexpr):
    """v fp32 [R, C] (C a multiple of 32) as the CPU kernels see it: each 32-column block rounded
    to int8 against max|block| / 127 and back (`gpu_moe.seen_by_cpu_kernels`, bit for bit)."""
    b = tl.reshape(v, [R, C // 32, 32])
    scale = tl.math.div_rn(tl.max(tl.abs(b), axis=2), tl.full([R, C // 32], 127.0, tl.float32))
    div = tl.where(scale > 0, scale, 1.0)
    q = _rint(tl.math.div_rn(b, tl.broadcast_to(div[:, :, None], [R, C // 32, 32])))
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    return tl.reshape(q * scale[:, :, None], [R, C])


@triton.jit
def _e4m3(b, NATIVE: tl.constexpr):
    """int32 bytes (0..255) of e4m3fn -> fp32, exactly (0x7f / 0xff, NaN there, decode as +-480).
    NATIVE: the hardware's conversion (sm89+); else the bits placed into an fp32 (normals) or
    m * 2**-9 (subnormals)."""
    if NATIVE:
        return b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    mag = b & 127
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    v = tl.where(mag < 8, (mag & 7).to(tl.float32) * 0.001953125, normal)
    return tl.where(b >= 128, -v, v)


@triton.jit
def _e2m1(n):
    """int32 nibbles (sign bit 3, magnitude index 0..7) -> fp32 (0, .5, 1, 1.5, 2, 3, 4, 6): the
    index's bits are the exponent and mantissa, placed into an fp32; 0 and 0.5 by hand."""
    i = n & 7
    v = tl.where(i < 2, i.to(tl.float32) * 0.5, ((i + 252) << 22).to(tl.float32, bitcast=True))
    return tl.where(n >= 8, -v, v)


@triton.jit
def _nvfp4_factor(s, r, rm, SROW, G_COLS):
    """The fp32 row factor at the end of each row's scale bytes (little-endian, any alignment)."""
    p = s + r * SROW + G_COLS
    bits = tl.load(p, mask=rm, other=0).to(tl.int32) | (tl.load(p + 1, mask=rm, other=0).to(tl.int32) << 8) \
        | (tl.load(p + 2, mask=rm, other=0).to(tl.int32) << 16) | (tl.load(p + 3, mask=rm, other=0).to(tl.int32) << 24)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _step(q, s, r, rm, f, k0, KW, SROW, xp, xm, FMT: tl.constexpr, G: tl.constexpr, NT: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNIT: tl.constexpr, GW: tl.constexpr,
          RED: tl.constexpr, NATIVE: tl.constexpr, ROUND: tl.constexpr):
    """Rows r (mask rm) of one expert against NT activation rows (pointers xp [NT], mask xm) over
    columns [k0, k0 + BLOCK_K): [NT, BLOCK_N, BLOCK_K / UNIT / GW / RED] fp32 partial sums (int4 and
    nvfp4: each scale group's GW words summed, then scaled once; else GW = 1). KW: a row's
    length in loaded elements (words, or float elements); SROW: a scale row's length; f: nvfp4's
    row factors [BLOCK_N]. ROUND: the activations rounded per 32 columns as they are loaded (word
    formats; BLOCK_K a multiple of 32)."""
    W: tl.constexpr = BLOCK_K // UNIT
    kw = k0 // UNIT + tl.arange(0, W)                           # [W] word (element) index in the row
    km = kw < KW
    m = rm[:, None] & km[None, :]
    if FMT == 0:
        w = tl.load(q + r[:, None] * KW + kw[None, :], mask=m, other=0.0).to(tl.float32)
        xv = tl.load(xp[:, None] + kw[None, :], mask=xm[:, None] & km[None, :], other=0.0)
        c = w[None, :, :] * xv[:, None, :]                       # [NT, BLOCK_N, W]
    else:
        w = tl.load(q + r[:, None] * KW + kw[None, :], mask=m, other=0)      # int32 words
        xm2 = xm[:, None] & km[None, :]
        c = tl.zeros([NT, BLOCK_N, W], dtype=tl.float32)
        xs = tl.zeros([NT, W], dtype=tl.float32)
        if ROUND:                                                # x's 32-column blocks: a word's block is kw // BW
            BW: tl.constexpr = 32 // UNIT
            mx = tl.zeros([NT, W], dtype=tl.float32)
            for j in tl.static_range(UNIT):
                mx = tl.maximum(mx, tl.abs(tl.load(xp[:, None] + kw[None, :] * UNIT + j, mask=xm2, other=0.0)))
            bs = tl.math.div_rn(tl.max(tl.reshape(mx, [NT, W // BW, BW]), axis=2),
                                tl.full([NT, W // BW], 127.0, tl.float32))
            scw = tl.reshape(tl.broadcast_to(bs[:, :, None], [NT, W // BW, BW]), [NT, W])
            divw = tl.where(scw > 0, scw, 1.0)
        for j in tl.static_range(UNIT):
            xj = tl.load(xp[:, None] + kw[None, :] * UNIT + j, mask=xm2, other=0.0)   # [NT, W] column UNIT*kw + j
            if ROUND:                                            # as the CPU kernels see x (`_round32`)
                xj = tl.minimum(tl.maximum(_rint(tl.math.div_rn(xj, divw)), -127.0), 127.0) * scw
            if FMT == 1:                                         # int8: byte j, sign-extended
                v = ((w << (24 - 8 * j)) >> 24).to(tl.float32)
            elif FMT == 2:                                       # int4: nibble j as q in 0..15 (2**23 + q - 2**23)
                v = (((w >> (4 * j)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                xs += xj
            elif FMT == 3:
                v = _e4m3((w >> (8 * j)) & 255, NATIVE)
            else:
                v = _e2m1((w >> (4 * j)) & 15)
            c += v[None, :, :] * xj[:, None, :]
        if FMT == 2 or FMT == 4:                                 # per scale group of GW words (in a thread's 16 bytes)
            c = tl.sum(tl.reshape(c, [NT, BLOCK_N, W // GW, GW]), axis=3)
            gi = (k0 // UNIT) // GW + tl.arange(0, W // GW)
            gm = rm[:, None] & (gi < KW // GW)[None, :]
            if FMT == 2:                                         # s * (sum q x - 8 sum x)
                xs = tl.sum(tl.reshape(xs, [NT, W // GW, GW]), axis=2)
                sc = tl.load(s + r[:, None] * SROW + gi[None, :], mask=gm, other=0)
                c = (c - 8.0 * xs[:, None, :]) * sc.to(tl.float16, bitcast=True).to(tl.float32)[None, :, :]
            else:                                                # e4m3 group scale times (or over) the factor
                sv = _e4m3(tl.load(s + r[:, None] * SROW + gi[None, :], mask=gm, other=0).to(tl.int32), NATIVE)
                fb = tl.broadcast_to(f[:, None], [BLOCK_N, W // GW])
                eff = tl.where(fb > 0, sv * fb, tl.math.div_rn(sv, tl.where(fb < 0, -fb, 1.0)))
                c = c * eff[None, :, :]
        elif FMT == 3:                                           # one scale a row and block of G columns:
            SB: tl.constexpr = (G if G < BLOCK_K else BLOCK_K) // UNIT      # words of a step under one scale
            bi = (k0 + tl.arange(0, W // SB) * (SB * UNIT)) // G
            sc = tl.load(s + r[:, None] * SROW + bi[None, :], mask=rm[:, None] & (bi * G < KW * UNIT)[None, :],
                         other=0.0)                              # [BLOCK_N, W / SB]: loaded once, broadcast
            c = tl.reshape(tl.reshape(c, [NT, BLOCK_N, W // SB, SB]) * sc[None, :, :, None], [NT, BLOCK_N, W])
    if RED == 1:
        return c
    return tl.sum(tl.reshape(c, [NT, BLOCK_N, W // GW // RED, RED]), axis=3)


@triton.jit
def _slot(table, n_slots, part, slot, ALIGN: tl.constexpr):
    """A slot's part: its offset in loaded elements from the part's base; ALIGN (checked when the
    table was built) tells the compiler every offset is a multiple of 16 bytes: vector loads."""
    off = tl.load(table + part * n_slots + slot)
    if ALIGN > 1:
        off = tl.multiple_of(off, ALIGN)
    return off


@triton.jit
def _pairs(plan, g, NT: tl.constexpr):
    """Group g's pair indices [NT] (-1: none) from the plan ([groups] slot ids, then [groups, NT])."""
    return tl.load(plan + g * NT + tl.arange(0, NT))


@triton.jit
def _gate_up_epilogue(a_g, a_u, s, n, nm, p, pm, h_ptr, N_OUT, FMT: tl.constexpr, NT: tl.constexpr,
                      BLOCK_N: tl.constexpr, ROUND: tl.constexpr):
    """h = silu(gate) * up from the finished dot products [NT, BLOCK_N] (int8: its row scales
    first), rounded per 32 rows with ROUND, stored for the pairs p."""
    if FMT == 1:                                                 # int8: one fp32 scale a row
        a_g *= tl.load(s + n, mask=nm, other=0.0)[None, :]
        a_u *= tl.load(s + N_OUT + n, mask=nm, other=0.0)[None, :]
    h = a_g / (1.0 + tl.exp(-a_g)) * a_u
    if ROUND:                                                    # (BLOCK_N a multiple of 32; rows past I are 0)
        h = _round32(h, NT, BLOCK_N)
    tl.store(h_ptr + p[:, None] * N_OUT + n[None, :], h, mask=pm[:, None] & nm[None, :])


@triton.jit
def gate_up_kernel(x_ptr, stride_x, rows_ptr, plan_ptr, slots_ptr, table_ptr, n_slots, q_base, s_base, h_ptr,
                   KW, SROW, N_OUT, G_COLS, part_ptr, cnt_ptr, FMT: tl.constexpr, G: tl.constexpr, NT: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNIT: tl.constexpr, GW: tl.constexpr,
                   RED: tl.constexpr, STAGES: tl.constexpr, ROUND: tl.constexpr, NATIVE: tl.constexpr, ALIGN: tl.constexpr,
                   SPLIT: tl.constexpr = 1):
    """h[p, i] = silu(gate_i . x[rows[p]]) * (up_i . x[rows[p]]) for the pairs p of group
    program_id(0) (fp32; rounded per 32 columns with ROUND), rows [BLOCK_N * program_id(1), +BLOCK_N)
    of I = N_OUT. The expert's parts: table[0 | 1, slots[g]] elements from q_base / s_base.
    SPLIT > 1 (split-K, for grids shorter than a wave): program_id(2) takes the z-th of SPLIT
    column ranges (whole BLOCK_K steps) and stores its partial dot products in part_ptr
    ([groups, SPLIT, 2, NT, N_OUT] fp32); the last of a row block's SPLIT programs to finish (a
    counter per group and row block in cnt_ptr: an atomic on the count only) sums them in z
    order, a fixed order whichever program it is, and runs the epilogue."""
    g = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N_OUT
    slot = tl.load(slots_ptr + g)
    q = q_base + _slot(table_ptr, n_slots, 0, slot, ALIGN)
    s = s_base + _slot(table_ptr, n_slots, 1, slot, 1)
    p = _pairs(plan_ptr, g, NT)
    pm = p >= 0
    xp = x_ptr + tl.load(rows_ptr + p, mask=pm, other=0) * stride_x
    f_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    f_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    if FMT == 4:
        f_g = _nvfp4_factor(s, n, nm, SROW, G_COLS)
        f_u = _nvfp4_factor(s, n + N_OUT, nm, SROW, G_COLS)
    AW: tl.constexpr = BLOCK_K // UNIT // GW // RED
    acc_g = tl.zeros([NT, BLOCK_N, AW], dtype=tl.float32)
    acc_u = tl.zeros([NT, BLOCK_N, AW], dtype=tl.float32)
    if SPLIT == 1:
        lo, hi = 0, KW * UNIT
    else:                                                        # this program's whole steps of the columns
        chunk = tl.cdiv(tl.cdiv(KW * UNIT, BLOCK_K), SPLIT) * BLOCK_K
        lo = tl.program_id(2) * chunk
        hi = tl.minimum(lo + chunk, KW * UNIT)
    for k0 in tl.range(lo, hi, BLOCK_K, num_stages=STAGES):
        acc_g += _step(q, s, n, nm, f_g, k0, KW, SROW, xp, pm, FMT, G, NT, BLOCK_N, BLOCK_K, UNIT, GW, RED, NATIVE,
                       ROUND)
        acc_u += _step(q, s, n + N_OUT, nm, f_u, k0, KW, SROW, xp, pm, FMT, G, NT, BLOCK_N, BLOCK_K, UNIT, GW,
                       RED, NATIVE, ROUND)
    a_g = tl.sum(acc_g, axis=2)                                  # [NT, BLOCK_N]: the one cross-lane reduction
    a_u = tl.sum(acc_u, axis=2)
    if SPLIT == 1:
        _gate_up_epilogue(a_g, a_u, s, n, nm, p, pm, h_ptr, N_OUT, FMT, NT, BLOCK_N, ROUND)
    else:
        t = tl.arange(0, NT)
        cell = t[:, None] * N_OUT + n[None, :]                   # [NT, BLOCK_N] within one (group, z, gate|up)
        cm = nm[None, :] & (t < NT)[:, None]
        base = part_ptr + g.to(tl.int64) * (SPLIT * 2 * NT) * N_OUT
        mine = base + tl.program_id(2) * (2 * NT) * N_OUT
        tl.store(mine + cell, a_g, mask=cm)
        tl.store(mine + NT * N_OUT + cell, a_u, mask=cm)
        counter = cnt_ptr + g * tl.num_programs(1) + tl.program_id(1)
        done = tl.atomic_add(counter, 1, sem="acq_rel")          # (after this program's partials)
        if done == SPLIT - 1:
            a_g = tl.zeros([NT, BLOCK_N], dtype=tl.float32)
            a_u = tl.zeros([NT, BLOCK_N], dtype=tl.float32)
            for z in tl.static_range(SPLIT):                     # z order: the same sum whoever is last
                src = base + z * (2 * NT) * N_OUT
                a_g += tl.load(src + cell, mask=cm, other=0.0, cache_modifier=".cg")
                a_u += tl.load(src + NT * N_OUT + cell, mask=cm, other=0.0, cache_modifier=".cg")
            _gate_up_epilogue(a_g, a_u, s, n, nm, p, pm, h_ptr, N_OUT, FMT, NT, BLOCK_N, ROUND)
            tl.atomic_xchg(counter, 0)                           # ready for the next launch


@triton.jit
def down_kernel(h_ptr, wts_ptr, plan_ptr, slots_ptr, table_ptr, n_slots, q_base, s_base, y_ptr,
                KW, SROW, N_OUT, G_COLS, out_ptr, stride_out, rows_ptr, T, P, counter_ptr,
                FMT: tl.constexpr, G: tl.constexpr, NT: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNIT: tl.constexpr, GW: tl.constexpr,
                RED: tl.constexpr, STAGES: tl.constexpr, NATIVE: tl.constexpr, ALIGN: tl.constexpr,
                TB: tl.constexpr):
    """y[p, d] = wts[p] * (down_d . h[p]) for the pairs of group program_id(0), rows of D = N_OUT
    (fp32). The expert's parts: table[2 | 3, slots[g]]. With TB > 0 (T <= TB tokens) the last
    program to finish a block of rows (a counter per block: an atomic on the count only) adds
    the pairs' y into out itself (`_combine_block`), so no combine launch follows."""
    g = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N_OUT
    slot = tl.load(slots_ptr + g)
    q = q_base + _slot(table_ptr, n_slots, 2, slot, ALIGN)
    s = s_base + _slot(table_ptr, n_slots, 3, slot, 1)
    p = _pairs(plan_ptr, g, NT)
    pm = p >= 0
    xp = h_ptr + tl.where(pm, p, 0).to(tl.int64) * (KW * UNIT)
    f = tl.zeros([BLOCK_N], dtype=tl.float32)
    if FMT == 4:
        f = _nvfp4_factor(s, n, nm, SROW, G_COLS)
    AW: tl.constexpr = BLOCK_K // UNIT // GW // RED
    acc = tl.zeros([NT, BLOCK_N, AW], dtype=tl.float32)
    for k0 in tl.range(0, KW * UNIT, BLOCK_K, num_stages=STAGES):
        acc += _step(q, s, n, nm, f, k0, KW, SROW, xp, pm, FMT, G, NT, BLOCK_N, BLOCK_K, UNIT, GW, RED, NATIVE, False)
    a = tl.sum(acc, axis=2)
    if FMT == 1:
        a *= tl.load(s + n, mask=nm, other=0.0)[None, :]
    wt = tl.load(wts_ptr + p, mask=pm, other=0.0)
    tl.store(y_ptr + p[:, None] * N_OUT + n[None, :], a * wt[:, None], mask=pm[:, None] & nm[None, :])
    if TB > 0:
        done = tl.atomic_add(counter_ptr + tl.program_id(1), 1, sem="acq_rel")   # (after this program's y)
        if done == tl.num_programs(0) - 1:
            _combine_block(out_ptr, stride_out, y_ptr, rows_ptr, T, P, N_OUT, n, nm, TB, BLOCK_N)
            tl.atomic_xchg(counter_ptr + tl.program_id(1), 0)                    # ready for the next launch


@triton.jit
def _combine_block(out_ptr, stride_out, y_ptr, rows_ptr, T, P, D, n, nm, TB: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[t, n] += sum of y[p, n] over the pairs p of token t, in pair order (fp32; one rounding
    into out's dtype): a fixed order whichever program runs it, and no atomics on values."""
    tb = tl.arange(0, TB)
    acc = tl.zeros([TB, BLOCK_N], dtype=tl.float32)
    for q in range(P):
        yv = tl.load(y_ptr + q * D + n, mask=nm, other=0.0, cache_modifier=".cg")   # (written by other SMs)
        acc += tl.where((tb == tl.load(rows_ptr + q))[:, None], yv[None, :], 0.0)
    o = out_ptr + tb[:, None] * stride_out + n[None, :]
    om = (tb < T)[:, None] & nm[None, :]
    prev = tl.load(o, mask=om, other=0.0)
    tl.store(o, (prev.to(tl.float32) + acc).to(prev.dtype), mask=om)


@triton.jit
def combine_kernel(out_ptr, stride_out, y_ptr, rows_ptr, P, D, BLOCK: tl.constexpr):
    """out[t] += sum of y[p] over the pairs p of token t, in pair order (fp32; one rounding into
    out's dtype): a fixed order whatever the placement, and no atomics."""
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dm = d < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in range(P):
        mine = (tl.zeros([BLOCK], dtype=tl.int64) + tl.load(rows_ptr + p)) == t    # (a vector mask)
        acc += tl.load(y_ptr + p * D + d, mask=dm & mine, other=0.0)
    o = out_ptr + t * stride_out + d
    prev = tl.load(o, mask=dm, other=0.0)
    tl.store(o, (prev.to(tl.float32) + acc).to(prev.dtype), mask=dm)


@triton.jit
def read_kernel(src, out, n_words, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """The read roofline: each program xors BLOCK int32 words at a time (16-byte loads) over a
    grid-strided share of `src`, and writes one word, so every byte is read once and nothing else
    moves (a device-to-device copy would also write)."""
    pid, grid = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in tl.range(pid * BLOCK, n_words, grid * BLOCK, num_stages=STAGES):
        i = start + tl.arange(0, BLOCK)
        acc ^= tl.load(src + i, mask=i < n_words, other=0)
    tl.store(out + pid, tl.xor_sum(acc, axis=0))
