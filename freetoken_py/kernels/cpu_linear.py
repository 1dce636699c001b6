"""Dense weights for the non-expert part of decode (attention projections, router, lm_head).

    dw = DenseWeight.from_tensor(w, fmt="bf16")     # w [N, K], once at load
    y = dense_linear(dw, x)                          # x [T, K] float32 -> y [T, N] float32

A numba kernel, parallel over blocks of output rows: each weight row is read once per call and
multiplied with 4 tokens per pass (row_dot4), so T = 1 streams at memory speed and larger T is
compute-bound at 45-65 GFLOP/s per core. fp32 weights at T >= 256 go to torch (a zero-copy
view, MKL GEMM), where it measured 10-25% faster; bf16 weights with bf16 activations
(_dots.BF16_ACT, AVX512-BF16 CPUs) at T >= 32 go to torch's bf16 GEMM (a zero-copy bf16 view,
oneDNN's vdpbf16ps kernels; ~2x our row-dot kernel at prefill sizes), whose outputs are rounded
to bf16 (measurements in docs/kernels.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit, prange

from freetoken_py.kernels._buffers import (R16_SCALES, decode_rows, empty_rows, encode_rows, host_array, is_r16_scales,
                                           r16_fits, r16_pack, r16_unpack)
from freetoken_py.kernels._dots import ANY, BF16_ACT, FORMATS, VEC, by_layout, pdot, pdot4, prepare, r16_cols, r16_ok, vec_rows
from freetoken_py.kernels._simd import r16_dot, r16_dot4

ROWS_PER_TASK = 32         # output rows per prange task
TORCH_MIN_TOKENS = 256     # from this many tokens, fp32 weights use torch's GEMM (docs/kernels.md)
TORCH_BF16_MIN_TOKENS = 32  # from this many, bf16 weights use torch's bf16 GEMM when activations are bf16


def torch_bf16(w: np.ndarray) -> torch.Tensor:
    """uint16 bf16 bits (any shape) -> the same memory as a torch bfloat16 tensor (no copy)."""
    return torch.from_numpy(w.view(np.int16)).view(torch.bfloat16)


def use_torch_bf16(fmt: str, num_tokens: int) -> bool:
    """True where a bf16 weight's product with num_tokens rows goes to torch's bf16 GEMM."""
    return fmt == "bf16" and BF16_ACT == "bf16" and num_tokens >= TORCH_BF16_MIN_TOKENS


@dataclass(frozen=True, eq=False)
class DenseWeight:
    """A [N, K] weight in execution format: w [N, K] float32 | uint16 (bf16 bits) | int8, or
    uint8 [N, K/2] (int4, nvfp4); s [N, G] scales: float32 (G = 0, 1 for int8), int4 fp16 bits as
    uint16 (G = K/group_size), nvfp4 uint8 (e4m3 per 16, then the row factor), fp8 uint8 [N, K]
    with float32 block scales. int4 / nvfp4 / int8 on AVX-512 VNNI CPUs, fp8 on AVX512-BF16 + VBMI
    ones, where N % 16 == 0 and K % 32 == 0: in 16-row slabs, the scales' bytes as int16 / int8 /
    int32 (`layout` "r16", ExpertBank's; the default "auto" picks it: `dense_layout`)."""

    def __post_init__(self):
        if is_r16_scales(self.s):
            _check_r16(self.fmt, self.w.shape[0], self.in_features, self.group_size)

    fmt: str
    group_size: int
    w: np.ndarray
    s: np.ndarray
    in_features: int

    @property
    def out_features(self) -> int:
        return self.w.shape[0]

    @property
    def layout(self) -> str:
        return "r16" if is_r16_scales(self.s) else "rows"

    @property
    def nbytes(self) -> int:
        return self.w.nbytes + self.s.nbytes

    @classmethod
    def from_tensor(cls, w, fmt: str = "bf16", group_size: int = 32, layout: str = "auto") -> "DenseWeight":
        """w [N, K] (torch, any float dtype) -> page-aligned weight in `fmt` (int4 needs K % group_size == 0);
        layout "auto" (int4 / nvfp4 / int8 / fp8 in 16-row slabs where this CPU runs them: dense_layout) or "rows"."""
        if fmt not in FORMATS:
            raise ValueError(f"unknown dense format {fmt!r}; expected one of {FORMATS}")
        w = w.detach().to("cpu") if isinstance(w, torch.Tensor) else torch.as_tensor(w)
        if w.dim() != 2:
            raise ValueError(f"DenseWeight expects a 2-D [N, K] weight, got shape {tuple(w.shape)}")
        n, k = w.shape
        wq, s = empty_rows(fmt, (n,), k, group_size)
        chunk = 4096                                  # rows per conversion step: bounded temporaries
        for r in range(0, n, chunk):
            encode_rows(w[r:r + chunk], fmt, group_size, wq[r:r + chunk], s[r:r + chunk])
        return cls(fmt, group_size, *_in_layout(wq, s, fmt, k, group_size, layout), k)

    @classmethod
    def from_arrays(cls, fmt: str, group_size: int, w: np.ndarray, s: np.ndarray, in_features: int,
                    layout: str = "auto") -> "DenseWeight":
        """A weight already in execution format (a checkpoint's fp8 / int4 codes and scales in the
        row layout, see formats.Packed.arrays), copied into page-aligned storage as it is (int4:
        then into `layout`, as from_tensor)."""
        wq, sq = empty_rows(fmt, (w.shape[0],), in_features, group_size)
        if wq.shape != w.shape or sq.shape != s.shape or wq.dtype != w.dtype or sq.dtype != s.dtype:
            raise ValueError(f"{fmt} g{group_size} [{w.shape[0]}, {in_features}] needs arrays {wq.shape} {wq.dtype} / "
                             f"{sq.shape} {sq.dtype}, got {w.shape} {w.dtype} / {s.shape} {s.dtype}")
        wq[...], sq[...] = w, s
        return cls(fmt, group_size, *_in_layout(wq, sq, fmt, in_features, group_size, layout), in_features)

    def dequantized(self) -> torch.Tensor:
        """float32 [N, K] as the kernel sees it, for references."""
        w, s = r16_unpack(self.w, self.s) if self.layout == "r16" else (self.w, self.s)
        return decode_rows(w, s, self.fmt, self.group_size)


def dense_layout(fmt: str, n: int, k: int, group_size: int) -> str:
    """"r16" where this process's kernels run int4 / nvfp4 / int8 / fp8 [n, k] rows in 16-row slabs, else "rows"."""
    return "r16" if r16_ok(fmt) and r16_fits(fmt, n, k, group_size) else "rows"


def _check_r16(fmt: str, n: int, k: int, group_size: int) -> None:
    if dense_layout(fmt, n, k, group_size) != "r16":
        raise ValueError(f"the r16 layout takes int4 / nvfp4 (AVX2 or AVX-512 VNNI, int8 activations), int8 (AVX-512 VNNI) or fp8 (AVX512-BF16 + "
                         f"VBMI, bf16 activations) [N % 16 == 0, K % 32 == 0]; this process cannot hold {fmt} "
                         f"[{n}, {k}] g{group_size} in it")


def _in_layout(w: np.ndarray, s: np.ndarray, fmt: str, k: int, group_size: int, layout: str):
    """(w, s) of [N, k] rows, in place, in `layout` ("auto": dense_layout)."""
    if layout == "auto":
        layout = dense_layout(fmt, w.shape[0], k, group_size)
    if layout not in ("rows", "r16"):
        raise ValueError(f"unknown dense layout {layout!r}; expected 'auto', 'rows' or 'r16'")
    if layout == "rows":
        return w, s
    _check_r16(fmt, w.shape[0], k, group_size)
    w[...], s16 = r16_pack(w, s)
    s = s.view(R16_SCALES[fmt])
    s[...] = s16
    return w, s


@njit(fastmath=True, cache=True)
def _gemv_rows(path, w, s, xv, xg, hb, n0, n1, out):
    num_t = xv.shape[0]
    for t in range(0, num_t, 4):
        if num_t - t == 1:
            for n in range(n0, n1):
                out[t, n] = pdot(path, w[n], s[n], xv[t], xg[t], hb)
            continue
        t1, t2, t3 = min(t + 1, num_t - 1), min(t + 2, num_t - 1), min(t + 3, num_t - 1)
        for n in range(n0, n1):
            y0, y1, y2, y3 = pdot4(path, w[n], s[n], xv[t], xv[t1], xv[t2], xv[t3], xg[t], xg[t1], xg[t2], xg[t3], hb)
            out[t, n] = y0
            out[t1, n] = y1
            out[t2, n] = y2
            out[t3, n] = y3


@njit(fastmath=True, cache=True)
def _gemv_block_rows(w, s, xv, xg, hb, n0, n1, out):
    if vec_rows(w, s, xv, hb):
        _gemv_rows(VEC, w, s, xv, xg, hb, n0, n1, out)
    else:
        _gemv_rows(ANY, w, s, xv, xg, hb, n0, n1, out)


@njit(fastmath=True, cache=True)
def _gemv_block_r16(w, s, xv, xg, hb, n0, n1, out):
    """gemv_block over int4 / nvfp4 / int8 / fp8 rows in 16-row slabs (n0, n1 on slab bounds): one slab-dot call
    for the block's rows per token (or per 4 tokens)."""
    bpg = hb // 16                     # group size / 32
    if xv.shape[1] != r16_cols(w, s) or (n1 - n0) % 16 or n0 % 16:
        raise ValueError("r16 rows: activations of the rows' K, row ranges on 16-row slabs")
    num_t = xv.shape[0]
    for t in range(0, num_t, 4):
        if num_t - t == 1:
            r16_dot(w[n0:n1], s[n0:n1], xv[t], xg[t], bpg, out[t, n0:n1])
            continue
        t1, t2, t3 = min(t + 1, num_t - 1), min(t + 2, num_t - 1), min(t + 3, num_t - 1)
        r16_dot4(w[n0:n1], s[n0:n1], xv[t], xv[t1], xv[t2], xv[t3], xg[t], xg[t1], xg[t2], xg[t3], bpg,
                   out[t, n0:n1], out[t1, n0:n1], out[t2, n0:n1], out[t3, n0:n1])


def gemv_block(w, s, xv, xg, hb, n0, n1, out):
    """out[:, n0:n1]: 4 tokens per pass over the rows (a 2-3 token tail padded with repeats); the
    vector dot's shape test made once here, not per row (_dots "Path tags"). int4 / nvfp4 / int8 / fp8 rows in
    16-row slabs (layout "r16") take the slab dot, the block's rows in one call (jitted only)."""
    raise NotImplementedError("gemv_block is only callable from numba-compiled code")


by_layout(gemv_block, _gemv_block_r16, _gemv_block_rows)


@njit(parallel=True, fastmath=True, cache=True)
def dense_rows(w, s, x, gs, out):
    """out [T, N] = x [T, K] @ dequant(w).T, every weight row read once for all tokens."""
    xv, xg = prepare(w, s, x, gs)
    n = w.shape[0]
    num_tasks = (n + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(num_tasks):
        n0 = task * ROWS_PER_TASK
        gemv_block(w, s, xv, xg, gs // 2, n0, min(n, n0 + ROWS_PER_TASK), out)


@njit(parallel=True, fastmath=True, cache=True)
def dense_rows_prepared(w, s, xv, xg, gs, out):
    """dense_rows for activations already prepared (xv, xg from _dots.prepare, or any form
    row_dot takes for these weights: bf16 weights with fp32 x, or with prep_bf16_rows(x))."""
    n = w.shape[0]
    num_tasks = (n + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(num_tasks):
        n0 = task * ROWS_PER_TASK
        gemv_block(w, s, xv, xg, gs // 2, n0, min(n, n0 + ROWS_PER_TASK), out)


def dense_linear(dw: DenseWeight, x):
    """x [T, K] float32 (torch or numpy) -> [T, N] float32 of the same kind."""
    xs = host_array(x, np.float32)
    if xs.ndim != 2 or xs.shape[1] != dw.in_features:
        raise ValueError(f"x must be [T, {dw.in_features}], got shape {xs.shape}")
    if xs.shape[0] >= TORCH_MIN_TOKENS and dw.fmt == "fp32":
        out = (torch.from_numpy(xs) @ torch.from_numpy(dw.w).T).numpy()
    elif use_torch_bf16(dw.fmt, xs.shape[0]):
        out = (torch.from_numpy(xs).bfloat16() @ torch_bf16(dw.w).T).float().numpy()
    else:
        out = np.empty((xs.shape[0], dw.out_features), np.float32)
        if xs.shape[0]:
            dense_rows(dw.w, dw.s, xs, dw.group_size, out)
    return torch.from_numpy(out) if isinstance(x, torch.Tensor) else out
