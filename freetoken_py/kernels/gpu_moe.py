"""The accelerator tier's experts for decode-sized batches in two Triton launches per layer-step.

The torch path (`residency.executor._swiglu` per expert) issues about nine operations per expert
(gather, two GEMVs, chunk, SiLU, multiply, scale, scatter): at decode, with one token and up to
top-k experts on the accelerator, that is ~70 kernel launches and their Python per MoE layer.
Here every (token, expert) pair of a layer-step is one row of two kernels:

    _gate_up   grid (pairs, I / BLOCK_I):  h[p, i] = silu(gate_i . x_t) * (up_i . x_t)      (fp32)
    _down      grid (pairs, D / BLOCK_D):  y[p, d] = w_p * (down_d . h[p])                   (fp32)

then `out.index_add_(0, token_of_pair, y)`. Each pair's weights are addressed by pointer (an int64
address per pair, cast in the kernel), so experts in any slot chunk or staging buffer are read in
place: no gather copy of weights. A pair reads its expert's weights once, so an expert routed by
many tokens is read once per token: the executor sends a layer-step here only when every expert
on the accelerator has at most `MAX_TOKENS_PER_EXPERT` tokens (decode), and keeps torch's GEMMs
for prefill.

Triton is optional: CUDA builds of torch ship it; without it (or on a CPU-only torch) `available()`
is False and the executor keeps the torch path. Under `TRITON_INTERPRET=1` the same kernels run
on CPU tensors through Triton's interpreter: that is how CI checks them against the torch
reference (tests/test_gpu_moe.py); their speed is only measured on a GPU.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch

MAX_TOKENS_PER_EXPERT = 4
BLOCK_I, BLOCK_D = 16, 64          # gate/up: rows of I per program, columns of D per step
BLOCK_OUT, BLOCK_K = 16, 64        # down: rows of D per program, columns of I per step

_kernels = None


def available(device: torch.device | str) -> bool:
    """Whether the kernels can run for tensors on `device`: Triton importable, and the device a
    CUDA GPU (or any device under TRITON_INTERPRET=1, Triton's CPU interpreter)."""
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        _load()
    except ImportError:
        return False
    return True


def _load():
    global _kernels
    if _kernels is not None:
        return _kernels
    import triton
    import triton.language as tl

    @triton.jit
    def _gate_up(x_ptr, rows_ptr, w13_ptrs, h_ptr, D, I, stride_x,
                 DTYPE: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr):
        p = tl.program_id(0)
        i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        im = i < I
        row = tl.load(rows_ptr + p)
        w = tl.load(w13_ptrs + p).to(tl.pointer_type(DTYPE), bitcast=True)   # [2I, D]: gate rows, then up
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
    def _down(h_ptr, wts_ptr, w2_ptrs, y_ptr, D, I,
              DTYPE: tl.constexpr, BLOCK_OUT: tl.constexpr, BLOCK_K: tl.constexpr):
        p = tl.program_id(0)
        d = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        dm = d < D
        w = tl.load(w2_ptrs + p).to(tl.pointer_type(DTYPE), bitcast=True)    # [D, I]
        acc = tl.zeros([BLOCK_OUT], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < I
            hv = tl.load(h_ptr + p * I + k, mask=km, other=0.0)
            wd = tl.load(w + d[:, None] * I + k[None, :], mask=dm[:, None] & km[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(wd * hv[None, :], axis=1)
        scale = tl.load(wts_ptr + p)
        tl.store(y_ptr + p * D + d, acc * scale, mask=dm)

    _kernels = (_gate_up, _down, {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                                  torch.float32: tl.float32})
    return _kernels


def moe_pairs(out: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
              w13: Sequence[torch.Tensor], w2: Sequence[torch.Tensor]) -> None:
    """out[rows[p]] += weights[p] * expert_p(x[rows[p]]) for every pair p, with expert_p the SwiGLU
    of w13[p] [2I, D] (gate rows, then up rows) and w2[p] [D, I] (contiguous, one dtype, on x's
    device; the same expert may appear in several pairs). x [T, D] with unit column stride; rows
    [P] int64 and weights [P] on x's device. Sums in fp32, adds into out in out's dtype."""
    pairs = len(w13)
    if pairs == 0:
        return
    gate_up, down, tl_dtypes = _load()
    dtype = w13[0].dtype
    two_i, hidden = w13[0].shape
    inter = two_i // 2
    if x.stride(1) != 1 or x.shape[1] != hidden or rows.numel() != pairs or weights.numel() != pairs:
        raise ValueError(f"moe_pairs: x {tuple(x.shape)} (column stride {x.stride(1)}), {rows.numel()} rows, "
                         f"{weights.numel()} weights for {pairs} pairs of [{two_i}, {hidden}] experts")
    for a, b in zip(w13, w2):
        if a.shape != (two_i, hidden) or b.shape != (hidden, inter) or a.dtype != dtype or b.dtype != dtype \
                or not (a.is_contiguous() and b.is_contiguous()):
            raise ValueError(f"moe_pairs: every expert must be contiguous {dtype} [{two_i}, {hidden}] / "
                             f"[{hidden}, {inter}], got {tuple(a.shape)} {a.dtype} / {tuple(b.shape)} {b.dtype}")
    dev = x.device
    ptrs = torch.tensor([[a.data_ptr() for a in w13], [b.data_ptr() for b in w2]], dtype=torch.int64)
    ptrs = ptrs.to(dev, non_blocking=True) if dev.type == "cuda" else ptrs
    rows = rows.to(dev, torch.int64).contiguous()
    scale = weights.to(dev, torch.float32).contiguous()
    h = torch.empty((pairs, inter), dtype=torch.float32, device=dev)
    y = torch.empty((pairs, hidden), dtype=torch.float32, device=dev)
    tdt = tl_dtypes[dtype]
    gate_up[(pairs, -(-inter // BLOCK_I))](x, rows, ptrs[0], h, hidden, inter, x.stride(0),
                                           DTYPE=tdt, BLOCK_I=BLOCK_I, BLOCK_D=BLOCK_D)
    down[(pairs, -(-hidden // BLOCK_OUT))](h, scale, ptrs[1], y, hidden, inter,
                                           DTYPE=tdt, BLOCK_OUT=BLOCK_OUT, BLOCK_K=BLOCK_K)
    out.index_add_(0, rows, y.to(out.dtype))


def self_check(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Run the kernels once on a small random case against a plain torch SwiGLU on `device`:
    None when they agree (fp32 accumulation: 1e-4 relative in fp32, 2e-2 in 16-bit types), else
    what went wrong. The executor runs it before using the kernels on a GPU (a Triton or driver
    problem then costs the torch path, not wrong outputs)."""
    try:
        g = torch.Generator().manual_seed(0)
        hidden, inter = 96, 80                       # off the block grid on both axes
        w13 = [(torch.randn(2 * inter, hidden, generator=g) / 10).to(device, dtype) for _ in range(3)]
        w2 = [(torch.randn(hidden, inter, generator=g) / 9).to(device, dtype) for _ in range(3)]
        x = torch.randn(2, hidden, generator=g).to(device, dtype)
        pairs = [(0, 0), (0, 2), (1, 1), (1, 2)]
        rows = torch.tensor([t for t, _ in pairs], device=device)
        wts = torch.tensor([0.5, 0.25, 0.75, 0.125], device=device)
        out = torch.zeros(2, hidden, device=device, dtype=dtype)
        moe_pairs(out, x, rows, wts, [w13[e] for _, e in pairs], [w2[e] for _, e in pairs])
        ref = torch.zeros(2, hidden, device=device)
        for (t, e), w in zip(pairs, wts.tolist()):
            gate, up = (x[t].float() @ w13[e].float().T).chunk(2)
            ref[t] += w * (w2[e].float() @ (torch.nn.functional.silu(gate) * up))
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        return None if err <= tol else f"Triton experts differ from torch by {err:.2e} (relative) on {device}"
    except Exception as exc:           # a compile or launch failure: report it, the caller falls back
        return f"Triton experts failed on {device}: {type(exc).__name__}: {exc}"
