"""Symmetric group-wise int4, two values per byte.

Layout of one row of K columns (group_size g)::

    packed[n, j] = (q[n, 2j] + 8) | (q[n, 2j + 1] + 8) << 4      j in [0, K/2)
    scales[n, c] = max|w[n, c*g : (c+1)*g]| / 7                   c in [0, K/g)
    w[n, k] ~= q[n, k] * scales[n, k // g],   q in [-8, 7]
"""
from __future__ import annotations

import torch

from freetoken_py.quant._common import as_float32, as_tensor, out, safe_scale

QMAX = 7
GROUP_SIZES = (32, 64, 128)


def check_group(k: int, group_size: int) -> None:
    if group_size <= 0 or group_size % 2:
        raise ValueError(f"int4 group_size must be a positive even number, got {group_size}")
    if k % group_size:
        raise ValueError(f"int4 needs K divisible by group_size: K={k}, group_size={group_size}")


def quantize_int4(w, group_size: int = 32, scale_dtype: torch.dtype = torch.float32):
    """w [..., N, K] -> (packed uint8 [..., N, K//2], scales [..., N, K//group_size] in scale_dtype).

    ``scale = max|w_group| / 7`` and ``q = round(w / scale)`` (so q is in [-7, 7] and every
    element's round-trip error is at most ``scale / 2``); stored as ``q + 8``. With
    ``scale_dtype=torch.float16`` (what the kernels store, as llama.cpp's Q4_0 does) the scale is
    rounded to fp16 (up, when rounding to nearest went below max|w| / 7; capped at fp16's max) and
    q computed against that scale, so the stored pair keeps the half-step bound (except groups past
    the cap, max|w| > 458,000, whose q is clamped). Raises ValueError
    when K is not divisible by group_size.
    """
    wf, numpy = as_float32(w)
    if wf.dim() < 2:
        raise ValueError(f"quantize_int4 expects [..., N, K], got shape {tuple(wf.shape)}")
    k = wf.shape[-1]
    check_group(k, group_size)
    groups = wf.reshape(*wf.shape[:-1], k // group_size, group_size)      # [..., N, G, g]
    amax = groups.abs().amax(dim=-1)                                      # [..., N, G]
    if scale_dtype == torch.float16:
        scale = (amax / QMAX).clamp_(max=torch.finfo(torch.float16).max).to(torch.float16)
        # rounded down (at most one fp16 step; subnormal scales, max|w| < ~4e-4, lose most), the
        # largest element would need |q| > 7: take the next fp16 value up instead (bits + 1)
        low = (scale.float() * QMAX < amax) & (scale < torch.finfo(torch.float16).max)
        scale = torch.where(low, (scale.view(torch.int16) + 1).view(torch.float16), scale)
        div = torch.where(scale > 0, scale.float(), 1.0)                   # the stored scale
    elif scale_dtype == torch.float32:
        scale, div = safe_scale(amax, QMAX)
    else:
        raise ValueError(f"int4 scales are float32 or float16, got {scale_dtype}")
    q = torch.round(groups / div.unsqueeze(-1)).clamp_(-8, QMAX).to(torch.int16) + 8
    q = q.reshape(wf.shape)                                               # [..., N, K] in [0, 15]
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)         # [..., N, K/2]
    return out(packed, numpy), out(scale.contiguous(), numpy)


def unpack_int4(packed) -> torch.Tensor:
    """packed uint8 [..., K//2] -> signed q int8 [..., K] in [-8, 7] (low nibble = even column)."""
    p = as_tensor(packed).to(torch.int16)
    q = torch.stack([p & 15, p >> 4], dim=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])
    return (q - 8).to(torch.int8)


def dequantize_int4(packed, scales, group_size: int = 32):
    """(packed uint8 [..., N, K//2], scales [..., N, K//group_size]) -> float32 [..., N, K]."""
    q = unpack_int4(packed)
    st = as_tensor(scales).to(torch.float32)
    k = q.shape[-1]
    check_group(k, group_size)
    if st.shape[-1] != k // group_size:
        raise ValueError(f"scales have {st.shape[-1]} groups per row, expected K/group_size = {k // group_size}")
    w = q.to(torch.float32).reshape(*q.shape[:-1], k // group_size, group_size) * st.unsqueeze(-1)
    return out(w.reshape(q.shape), not isinstance(packed, torch.Tensor))
