"""The accelerator tier's experts for decode-sized batches in two Triton launches per layer-step.

The torch path (`residency.formats.swiglu` per expert) issues about nine operations per expert
(gather, two GEMVs, chunk, SiLU, multiply, scale, scatter): at decode, with one token and up to
top-k experts on the accelerator, that is ~70 kernel launches and their Python per MoE layer.
Here every (token, expert) pair of a layer-step is one row of two kernels:

    gate_up_kernel   grid (pairs, I / BLOCK_I):    h[p, i] = silu(gate_i . x_t) * (up_i . x_t)   (fp32)
    down_kernel      grid (pairs, D / BLOCK_OUT):  y[p, d] = w_p * (down_d . h[p])                (fp32)

then the pairs' sum per token, in fp32, added into the output once. `moe_pairs_quant` does the
same for int8 / int4 experts (the expert store's layouts: packed weights and scales, read in
place), with x and h rounded as the CPU kernels see them. Each pair's weights are
found at an element offset from a typed base tensor (one of the batch's experts), so experts in
any slot chunk are read in place: no gather copy of weights. When every offset and row length is
a multiple of 16 elements (slots in a chunk, chunks from the allocator) the kernels are told so
and read the rows as 16-byte vectors. A pair reads its expert's weights once, so an expert routed by
many tokens is read once per token: the executor sends a layer-step here only when every expert
on the accelerator has at most `MAX_TOKENS_PER_EXPERT` tokens (decode), and keeps torch's GEMMs
for prefill.

Triton is optional: CUDA builds of torch ship it; without it (or on a CPU-only torch) `available()`
is False and the executor keeps the torch path. Under `TRITON_INTERPRET=1` the same kernels run
on CPU tensors through Triton's interpreter: that is how CI checks them against the torch
reference (tests/test_gpu_moe.py), which also compiles them for sm_80 and sm_90 through Triton's
whole pipeline (no GPU needed) and checks the vector loads; their speed is only measured on a GPU.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch

MAX_TOKENS_PER_EXPERT = 4
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK_I, BLOCK_D = 16, 64          # gate/up: rows of I per program, columns of D per step
BLOCK_OUT, BLOCK_K = 16, 64        # down: rows of D per program, columns of I per step

_kernels = None


def available(device: torch.device | str) -> bool:
    """Whether the kernels can run for tensors on `device`: Triton importable (any failure to
    import it counts as absent), and the device a CUDA GPU (or any device under
    TRITON_INTERPRET=1, Triton's CPU interpreter)."""
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        _load()
    except Exception:                  # not installed, or a build that does not match this torch
        return False
    return True


def _load():
    global _kernels
    if _kernels is None:
        from freetoken_py.kernels import _triton_moe

        _kernels = (_triton_moe.gate_up_kernel, _triton_moe.down_kernel, _triton_moe.gate_up_q_kernel,
                    _triton_moe.down_q_kernel)
    return _kernels


def seen_by_cpu_kernels(v: torch.Tensor) -> torch.Tensor:
    """An activation [n, K] fp32, on any device, as the CPU kernels multiply it with int8 / int4 /
    nvfp4 weights (`_dots.INT_ACT`): on the int8 path every 32-element block rounded to int8 against
    max|block| / 127 and back (a partial last block as if zero-padded; the arithmetic of
    `quant.roundtrip_act_q8`, which works on the host), else as is."""
    from freetoken_py.kernels._dots import INT_ACT

    if INT_ACT != "int8":
        return v
    k = v.shape[-1]
    blocks = torch.nn.functional.pad(v, (0, -k % 32)).view(*v.shape[:-1], -1, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.round(blocks / torch.where(scale > 0, scale, 1.0)).clamp_(-127, 127)
    return (q * scale).view(*v.shape[:-1], -1)[..., :k]


def _offsets(tensors: Sequence[torch.Tensor], base: torch.Tensor) -> list[int]:
    """Each tensor's start as an element offset from `base`'s (same dtype, one address space)."""
    size, start = base.element_size(), base.data_ptr()
    return [(t.data_ptr() - start) // size for t in tensors]


def _staged(offsets: list[list[int]], dev: torch.device) -> torch.Tensor:
    """The pairs' offsets, one row per part, as int64 on `dev`; rows padded to an even width so
    every row starts 16-byte aligned (one compiled variant)."""
    pairs = len(offsets[0])
    offs = torch.zeros((len(offsets), pairs + pairs % 2), dtype=torch.int64)
    offs[:, :pairs] = torch.tensor(offsets, dtype=torch.int64)
    return offs.to(dev, non_blocking=True) if dev.type == "cuda" else offs


def _add_pairs(out: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> None:
    """out[rows[p]] += y[p] (fp32 [P, D]): a lone token's pairs summed in order, else fp32 sums
    per token; one rounding into out's dtype."""
    if out.shape[0] == 1:
        out += y.sum(0, keepdim=True).to(out.dtype)
    else:
        summed = torch.zeros((out.shape[0], y.shape[1]), dtype=torch.float32, device=y.device)
        summed.index_add_(0, rows, y)
        out += summed.to(out.dtype)


def moe_pairs(out: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
              w13: Sequence[torch.Tensor], w2: Sequence[torch.Tensor]) -> None:
    """out[rows[p]] += weights[p] * expert_p(x[rows[p]]) for every pair p, with expert_p the SwiGLU
    of w13[p] [2I, D] (gate rows, then up rows) and w2[p] [D, I] (contiguous, one dtype, on x's
    device; the same expert may appear in several pairs). x [T, D] (made contiguous if its
columns are strided); rows
    [P] int64 and weights [P] on x's device. Sums in fp32 (a lone token's pairs in a fixed order)
    and adds into out once, in out's dtype."""
    pairs = len(w13)
    if pairs == 0:
        return
    gate_up, down, *_ = _load()
    dtype = w13[0].dtype
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"moe_pairs: expert weights must be one of {', '.join(map(str, FLOAT_DTYPES))}, got {dtype}")
    two_i, hidden = w13[0].shape
    inter = two_i // 2
    if x.dim() == 2 and x.stride(1) != 1:     # the kernels read a token's row as one run
        x = x.contiguous()
    if x.dim() != 2 or x.shape[1] != hidden or rows.numel() != pairs or weights.numel() != pairs:
        raise ValueError(f"moe_pairs: x {tuple(x.shape)}, {rows.numel()} rows, "
                         f"{weights.numel()} weights for {pairs} pairs of [{two_i}, {hidden}] experts")
    for a, b in zip(w13, w2):
        if a.shape != (two_i, hidden) or b.shape != (hidden, inter) or a.dtype != dtype or b.dtype != dtype \
                or not (a.is_contiguous() and b.is_contiguous()):
            raise ValueError(f"moe_pairs: every expert must be contiguous {dtype} [{two_i}, {hidden}] / "
                             f"[{hidden}, {inter}], got {tuple(a.shape)} {a.dtype} / {tuple(b.shape)} {b.dtype}")
    dev = x.device
    offs13, offs2 = _offsets(w13, w13[0]), _offsets(w2, w2[0])
    # 16-element-aligned starts (slots in a chunk, chunks from the allocator) and row lengths:
    # the kernels may then load rows as aligned vectors
    aligned = hidden % 16 == 0 and inter % 16 == 0 and all(o % 16 == 0 for o in offs13 + offs2)
    offs = _staged([offs13, offs2], dev)
    rows = rows.to(dev, torch.int64).contiguous()
    scale = weights.to(dev, torch.float32).contiguous()
    h = torch.empty((pairs, inter), dtype=torch.float32, device=dev)
    y = torch.empty((pairs, hidden), dtype=torch.float32, device=dev)
    gate_up[(pairs, -(-inter // BLOCK_I))](x, rows, w13[0], offs[0], h, hidden, inter, x.stride(0),
                                           BLOCK_I=BLOCK_I, BLOCK_D=BLOCK_D, ALIGNED=aligned)
    down[(pairs, -(-hidden // BLOCK_OUT))](h, scale, w2[0], offs[1], y, hidden, inter,
                                           BLOCK_OUT=BLOCK_OUT, BLOCK_K=BLOCK_K, ALIGNED=aligned)
    _add_pairs(out, y, rows)


QUANT_FORMATS = ("int8", "int4")


def moe_pairs_quant(out: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
                    experts: Sequence[tuple], fmt: str, group_size: int = 32) -> None:
    """`moe_pairs` for quantised experts: `experts[p]` = (q13, s13, q2, s2) of pair p's expert in
    the expert store's layouts (`residency.formats`; int4 scales as int16 bits), each part
    contiguous and of one dtype across pairs. x and h are rounded as the CPU kernels see them
    (`seen_by_cpu_kernels`), so a pair gives the CPU tier's result up to fp32 rounding."""
    pairs = len(experts)
    if pairs == 0:
        return
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"moe_pairs_quant: format must be one of {QUANT_FORMATS}, got {fmt!r}")
    *_, gate_up, down = _load()
    int4 = fmt == "int4"
    q13, s13, q2, s2 = experts[0]
    two_i, hidden = q13.shape[0], q2.shape[0]
    inter = two_i // 2
    per_byte = 2 if int4 else 1
    shapes = [(two_i, hidden // per_byte), (two_i, hidden // group_size if int4 else 1),
              (hidden, inter // per_byte), (hidden, inter // group_size if int4 else 1)]
    if x.dim() != 2 or x.shape[1] != hidden or rows.numel() != pairs or weights.numel() != pairs \
            or (int4 and (hidden % group_size or inter % group_size
                          or not (group_size == 32 or group_size % max(BLOCK_D, BLOCK_K) == 0))):
        raise ValueError(f"moe_pairs_quant: x {tuple(x.shape)}, {rows.numel()} rows, {weights.numel()} weights "
                         f"for {pairs} pairs of {fmt} experts [{two_i}, {hidden}] (group {group_size})")
    for parts in experts:
        for t, shape, first in zip(parts, shapes, experts[0]):
            if tuple(t.shape) != shape or t.dtype != first.dtype or not t.is_contiguous():
                raise ValueError(f"moe_pairs_quant: every expert's parts must be contiguous {shapes} of one "
                                 f"dtype each, got {tuple(t.shape)} {t.dtype}")
    dev = x.device
    parts_offs = [_offsets([e[k] for e in experts], experts[0][k]) for k in range(4)]
    # weight rows of 16-byte multiples starting at 16-byte-aligned offsets: vector loads
    aligned = all(shape[1] * experts[0][k].element_size() % 16 == 0 for k, shape in ((0, shapes[0]), (2, shapes[2]))) \
        and all(o * experts[0][k].element_size() % 16 == 0 for k in (0, 2) for o in parts_offs[k])
    offs = _staged(parts_offs, dev)
    rows = rows.to(dev, torch.int64).contiguous()
    scale = weights.to(dev, torch.float32).contiguous()
    xs = seen_by_cpu_kernels(x.float()).contiguous()
    h = torch.empty((pairs, inter), dtype=torch.float32, device=dev)
    y = torch.empty((pairs, hidden), dtype=torch.float32, device=dev)
    ng_d, ng_k = max(1, BLOCK_D // group_size), max(1, BLOCK_K // group_size)   # scale groups per step
    gate_up[(pairs, -(-inter // BLOCK_I))](xs, rows, q13, offs[0], s13, offs[1], h, hidden, inter, xs.stride(0),
                                           INT4=int4, G=group_size, NG=ng_d, BLOCK_I=BLOCK_I, BLOCK_D=BLOCK_D,
                                           ALIGNED=aligned)
    h = seen_by_cpu_kernels(h).contiguous()
    down[(pairs, -(-hidden // BLOCK_OUT))](h, scale, q2, offs[2], s2, offs[3], y, hidden, inter,
                                           INT4=int4, G=group_size, NG=ng_k, BLOCK_OUT=BLOCK_OUT, BLOCK_K=BLOCK_K,
                                           ALIGNED=aligned)
    _add_pairs(out, y, rows)


def self_check_quant(device: torch.device | str, fmt: str, group_size: int = 32) -> str | None:
    """`self_check` for `moe_pairs_quant`: a small random int8 / int4 case against the torch path
    (`quant_swiglu`: the same experts dequantised, the activations rounded alike; 2e-3 relative)."""
    try:
        from freetoken_py.quant import quantize_int4, quantize_int8

        g = torch.Generator().manual_seed(0)
        hidden, inter = 2 * max(32, group_size), max(64, 2 * group_size)
        parts = []
        for _ in range(3):
            w13 = torch.randn(2 * inter, hidden, generator=g) / 10
            w2 = torch.randn(hidden, inter, generator=g) / 9
            if fmt == "int4":
                (a, sa), (b, sb) = (quantize_int4(w, group_size, torch.float16) for w in (w13, w2))
                sa, sb = sa.view(torch.int16), sb.view(torch.int16)
            else:
                (a, sa), (b, sb) = (quantize_int8(w) for w in (w13, w2))
                sa, sb = sa[:, None].contiguous(), sb[:, None].contiguous()
            parts.append(tuple(t.to(device) for t in (a, sa, b, sb)))
        x = torch.randn(2, hidden, generator=g).to(device)
        pairs = [(0, 0), (0, 2), (1, 1), (1, 2)]
        rows = torch.tensor([t for t, _ in pairs], device=device)
        wts = torch.tensor([0.5, 0.25, 0.75, 0.125], device=device)
        out = torch.zeros(2, hidden, device=device)
        moe_pairs_quant(out, x, rows, wts, [parts[e] for _, e in pairs], fmt, group_size)
        ref = torch.zeros(2, hidden, device=device)
        for (t, e), w in zip(pairs, wts.tolist()):
            ref[t] += w * quant_swiglu(x[t:t + 1], parts[e], fmt, group_size)[0]
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        # (2e-3: room for one element of h rounded a step apart near an int8 tie, ~1e-3 at this
        # size; a wrong nibble, scale or group is off by far more)
        return None if err <= 2e-3 else f"Triton {fmt} experts differ from torch by {err:.2e} (relative) on {device}"
    except Exception as exc:
        return f"Triton {fmt} experts failed on {device}: {type(exc).__name__}: {exc}"


def dequant_int4(packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """int4 rows (uint8 [N, K/2], low nibble the even column, value + 8; fp16 scale bits
    [N, K/g] as int16) -> fp32 [N, K], on their device: what the accelerator's torch path
    computes from."""
    p = packed.to(torch.int16)
    w = torch.stack([p & 15, p >> 4], dim=-1).reshape(p.shape[0], -1).float() - 8.0
    scale = scales.view(torch.float16).float()
    return (w.view(w.shape[0], scale.shape[1], group_size) * scale[..., None]).reshape(w.shape)


def quant_swiglu(x: torch.Tensor, parts: tuple, fmt: str, group_size: int = 32) -> torch.Tensor:
    """One int8 / int4 / nvfp4 / fp8 expert (q13, s13, q2, s2, as `moe_pairs_quant` takes them) in torch, on
    their device: x [n, D] -> [n, D] in x's dtype, from the dequantised weights in fp32 with x
    and h seen as the CPU kernels see them. The accelerator's path without the Triton kernels."""
    q13, s13, q2, s2 = parts
    if fmt == "fp8":     # the numba fp8 kernel multiplies exact fp32 activations: no rounding of x or h
        from freetoken_py.quant.fp8 import dequantize_fp8

        w13, w2 = dequantize_fp8(q13, s13, group_size), dequantize_fp8(q2, s2, group_size)
        gate, up = torch.nn.functional.linear(x.float(), w13).chunk(2, dim=-1)
        return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2).to(x.dtype)
    if fmt == "nvfp4":   # the numba nvfp4 kernel rounds x and h as the int4 one does (INT_ACT)
        from freetoken_py.quant.nvfp4 import dequantize_nvfp4

        w13, w2 = dequantize_nvfp4(q13, s13, group_size), dequantize_nvfp4(q2, s2, group_size)
    elif fmt == "int4":
        w13, w2 = dequant_int4(q13, s13, group_size), dequant_int4(q2, s2, group_size)
    else:
        w13, w2 = q13.float() * s13.float(), q2.float() * s2.float()      # [N, K] * [N, 1]
    gate, up = torch.nn.functional.linear(seen_by_cpu_kernels(x.float()), w13).chunk(2, dim=-1)
    return torch.nn.functional.linear(seen_by_cpu_kernels(torch.nn.functional.silu(gate) * up), w2).to(x.dtype)


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
