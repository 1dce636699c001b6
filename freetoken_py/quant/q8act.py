"""Per-block int8 activations: the form the int4 and int8 kernels use on AVX2 (llama.cpp's Q8_0 idea).

Each block of ``BLOCK = 32`` consecutive elements of a row gets its own scale::

    scale[..., b] = max|x[..., 32b : 32b+32]| / 127
    q[..., k]     = round(x[..., k] / scale[..., k // 32])   in [-127, 127]   (round half to even)

This is ``quantize_int8`` applied to every 32-element block, so each element is within
``scale / 2`` of the input and an all-zero block gets scale 0. Block size 32, whatever the weight
group size: an activation outlier only coarsens its own 32 neighbours, and the kernel's cost per
32 weights is one convert + one FMA either way. The kernels' quantisers
(``kernels._dots.prep_q8_row`` / ``prep_q8n_row``) must produce exactly these values; tests compare bytes.
"""
from __future__ import annotations

import torch

from freetoken_py.quant._common import as_float32, out
from freetoken_py.quant.int8 import dequantize_int8, quantize_int8

BLOCK = 32


def quantize_act_q8(x):
    """x [..., K] (torch or numpy, K % 32 == 0) -> (q int8 [..., K], scale float32 [..., K/32])."""
    xf, numpy = as_float32(x)
    k = xf.shape[-1]
    if xf.dim() < 1 or k % BLOCK:
        raise ValueError(f"quantize_act_q8 needs the last dim a multiple of {BLOCK}, got shape {tuple(xf.shape)}")
    q, s = quantize_int8(xf.reshape(*xf.shape[:-1], k // BLOCK, BLOCK))   # [..., K/32, 32], [..., K/32]
    return out(q.reshape(xf.shape), numpy), out(s, numpy)


def dequantize_act_q8(q, scale):
    """(q int8 [..., K], scale [..., K/32]) -> float32 [..., K]."""
    qt = torch.as_tensor(q)
    k = qt.shape[-1]
    w = dequantize_int8(qt.reshape(*qt.shape[:-1], k // BLOCK, BLOCK), torch.as_tensor(scale))
    return out(w.reshape(qt.shape), not isinstance(q, torch.Tensor))


def roundtrip_act_q8(x):
    """x [..., K] (any K) -> float32 dequantize(quantize(x)): the activation as the int8 kernels see
    it. A partial last block (K % 32 != 0, int8 weights only) is quantised as if zero-padded: zeros
    change neither its max nor its q values (kernels._dots.prep_q8n_row does the same)."""
    xf, numpy = as_float32(x)
    k = xf.shape[-1]
    padded = torch.nn.functional.pad(xf, (0, -k % BLOCK))                 # [..., ceil(K/32) * 32]
    return out(dequantize_act_q8(*quantize_act_q8(padded))[..., :k], numpy)
