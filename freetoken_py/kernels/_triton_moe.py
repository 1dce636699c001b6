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
def gate_up_kernel(x_ptr, rows_ptr, w13_base, w13_offs, h_ptr, D, I, stride_x,
                   BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr):
    """h[p, i] = silu(gate_i . x_t) * (up_i . x_t) for pair p (token row t = rows[p]), fp32."""
    p = tl.program_id(0)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    im = i < I
    row = tl.load(rows_ptr + p)
    off = tl.load(w13_offs + p)
    if ALIGNED:
        off = tl.multiple_of(off, 16)
    w = w13_base + off                                    # [2I, D]: gate rows, then up rows
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
    off = tl.load(w2_offs + p)
    if ALIGNED:
        off = tl.multiple_of(off, 16)
    w = w2_base + off                                     # [D, I]
    acc = tl.zeros([BLOCK_OUT], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < I
        hv = tl.load(h_ptr + p * I + k, mask=km, other=0.0)
        wd = tl.load(w + d[:, None] * I + k[None, :], mask=dm[:, None] & km[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wd * hv[None, :], axis=1)
    scale = tl.load(wts_ptr + p)
    tl.store(y_ptr + p * D + d, acc * scale, mask=dm)
