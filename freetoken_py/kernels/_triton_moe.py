"""The Triton kernels of `gpu_moe` (imported only when they are used: Triton is optional).

Each pair's expert is found at an element offset from a typed base tensor (`w13_base`,
`w2_base`: one of the batch's experts), so the weights are read in place wherever they sit in
device memory. With `ALIGNED` (every offset a multiple of 16 elements, checked by the caller)
the compiler knows the rows start 16-byte aligned and issues vector loads.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # fused multiply-adds (Triton 3.9 warns when unset)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _expert_at(base, offs, p, ALIGNED: tl.constexpr):
    """Pair p's expert part: `base` plus its element offset; with ALIGNED the offset is known to
    be a multiple of 16, so its rows can be read as aligned vectors."""
    off = tl.load(offs + p)
    if ALIGNED:
        off = tl.multiple_of(off, 16)
    return base + off


@triton.jit
def gate_up_kernel(x_ptr, rows_ptr, w13_base, w13_offs, h_ptr, D, I, stride_x,
                   BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr):
    """h[p, i] = silu(gate_i . x_t) * (up_i . x_t) for pair p (token row t = rows[p]), fp32."""
    p = tl.program_id(0)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    im = i < I
    row = tl.load(rows_ptr + p)
    w = _expert_at(w13_base, w13_offs, p, ALIGNED)        # [2I, D]: gate rows, then up rows
    acc_g = tl.zeros([BLOCK_I], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < D
        xv = tl.load(x_ptr + row * stride_x + d, mask=dm, other=0.0).to(tl.float32)
        m = im[:, None] & dm[None, :]
        wg = tl.load(w + i[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
        wu = tl.load(w + (i[:, None] + I) * D + d[None, :], mask=m, other=0.0).to(tl.float32)
        acc_g += tl.sum(wg * xv[None, :], axis=1)
        acc_u += tl.sum(wu * xv[None, :], axis=1)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(h_ptr + p * I + i, h, mask=im)


@triton.jit
def down_kernel(h_ptr, wts_ptr, w2_base, w2_offs, y_ptr, D, I,
                BLOCK_OUT: tl.constexpr, BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr):
    """y[p, d] = wts[p] * (down_d . h[p]) for pair p, fp32."""
    p = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    dm = d < D
    w = _expert_at(w2_base, w2_offs, p, ALIGNED)          # [D, I]
    acc = tl.zeros([BLOCK_OUT], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < I
        hv = tl.load(h_ptr + p * I + k, mask=km, other=0.0)
        wd = tl.load(w + d[:, None] * I + k[None, :], mask=dm[:, None] & km[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wd * hv[None, :], axis=1)
    scale = tl.load(wts_ptr + p)
    tl.store(y_ptr + p * D + d, acc * scale, mask=dm)


@triton.jit
def _int4_rows(q, s, r, half, groups, j, gi, rm, xe, xo, NG: tl.constexpr, ROWS: tl.constexpr,
               BYTES: tl.constexpr):
    """One step of int4 rows `r` (mask `rm`) against activations: bytes j of each row (columns
    2j, 2j + 1: low nibble times `xe`, high times `xo`), each of its NG scale groups `gi` summed,
    then scaled once. Returns [ROWS] fp32."""
    m = rm[:, None] & (j < half)[None, :]
    b = tl.load(q + r[:, None] * half + j[None, :], mask=m, other=136).to(tl.int32)   # 136: two zeros
    prod = ((b & 15) - 8).to(tl.float32) * xe[None, :] + ((b >> 4) - 8).to(tl.float32) * xo[None, :]
    sc = tl.load(s + r[:, None] * groups + gi[None, :], mask=rm[:, None] & (gi < groups)[None, :],
                 other=0).to(tl.float16, bitcast=True)
    return tl.sum(tl.sum(tl.reshape(prod, [ROWS, NG, BYTES // NG]), axis=2) * sc.to(tl.float32), axis=1)


@triton.jit
def _int8_rows(q, r, K, k, rm, km, v):
    """One step of int8 rows `r` against activations `v` at columns `k`: [rows] fp32, unscaled."""
    w = tl.load(q + r[:, None] * K + k[None, :], mask=rm[:, None] & km[None, :], other=0).to(tl.float32)
    return tl.sum(w * v[None, :], axis=1)


@triton.jit
def gate_up_q_kernel(x_ptr, rows_ptr, q_base, q_offs, s_base, s_offs, h_ptr, D, I, stride_x,
                     INT4: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, BLOCK_I: tl.constexpr,
                     BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr):
    """`gate_up_kernel` for quantised weights: int8 (q [2I, D] int8, s [2I, 1] fp32 per row) or
    int4 (q [2I, D/2] uint8, two columns a byte, low nibble even, value + 8; s [2I, D/G] fp16
    bits held as int16). x is taken as given (the caller rounds it as the CPU kernels see it).
    int4: a step of BLOCK_D columns spans NG scale groups (NG = BLOCK_D / G, or 1 when a group is
    wider; G is then a multiple of BLOCK_D): each group's products are summed, then scaled once."""
    p = tl.program_id(0)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    im = i < I
    row = tl.load(rows_ptr + p)
    q = _expert_at(q_base, q_offs, p, ALIGNED)
    s = _expert_at(s_base, s_offs, p, False)
    acc_g = tl.zeros([BLOCK_I], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < D
        xv = tl.load(x_ptr + row * stride_x + d, mask=dm, other=0.0).to(tl.float32)
        if INT4:
            xe, xo = tl.split(tl.reshape(xv, [BLOCK_D // 2, 2]))     # even and odd columns
            j = d0 // 2 + tl.arange(0, BLOCK_D // 2)
            gi = d0 // G + tl.arange(0, NG)
            acc_g += _int4_rows(q, s, i, D // 2, D // G, j, gi, im, xe, xo, NG, BLOCK_I, BLOCK_D // 2)
            acc_u += _int4_rows(q, s, i + I, D // 2, D // G, j, gi, im, xe, xo, NG, BLOCK_I, BLOCK_D // 2)
        else:
            acc_g += _int8_rows(q, i, D, d, im, dm, xv)
            acc_u += _int8_rows(q, i + I, D, d, im, dm, xv)
    if not INT4:                                               # one fp32 scale a row
        acc_g *= tl.load(s + i, mask=im, other=0.0)
        acc_u *= tl.load(s + I + i, mask=im, other=0.0)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(h_ptr + p * I + i, h, mask=im)


@triton.jit
def down_q_kernel(h_ptr, wts_ptr, q_base, q_offs, s_base, s_offs, y_ptr, D, I,
                  INT4: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, BLOCK_OUT: tl.constexpr,
                  BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr):
    """`down_kernel` for quantised weights (q [D, I] int8 with s [D, 1], or [D, I/2] int4 with
    s [D, I/G] fp16 bits; NG as in `gate_up_q_kernel`); h as given (rounded by the caller)."""
    p = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    dm = d < D
    q = _expert_at(q_base, q_offs, p, ALIGNED)
    s = _expert_at(s_base, s_offs, p, False)
    acc = tl.zeros([BLOCK_OUT], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < I
        hv = tl.load(h_ptr + p * I + k, mask=km, other=0.0)
        if INT4:
            he, ho = tl.split(tl.reshape(hv, [BLOCK_K // 2, 2]))
            j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            gi = k0 // G + tl.arange(0, NG)
            acc += _int4_rows(q, s, d, I // 2, I // G, j, gi, dm, he, ho, NG, BLOCK_OUT, BLOCK_K // 2)
        else:
            acc += _int8_rows(q, d, I, k, dm, km, hv)
    if not INT4:
        acc *= tl.load(s + d, mask=dm, other=0.0)
    scale = tl.load(wts_ptr + p)
    tl.store(y_ptr + p * D + d, acc * scale, mask=dm)
