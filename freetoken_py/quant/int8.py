"""Symmetric per-output-channel int8: ``w[..., n, k] ~= q[..., n, k] * scale[..., n]``."""
from __future__ import annotations

import torch

from freetoken_py.quant._common import as_float32, as_tensor, out, safe_scale

QMAX = 127


def quantize_int8(w):
    """w [..., N, K] (any float dtype, torch or numpy) -> (q int8 [..., N, K], scale float32 [..., N]).

    ``scale = max|w[n, :]| / 127``; ``q = round(w / scale)`` in [-127, 127], so each element's
    round-trip error is at most ``scale / 2``. An all-zero row gets scale 0 and q 0.
    """
    wf, numpy = as_float32(w)
    if wf.dim() < 2:
        raise ValueError(f"quantize_int8 expects [..., N, K], got shape {tuple(wf.shape)}")
    scale, div = safe_scale(wf.abs().amax(dim=-1), QMAX)          # [..., N]
    q = torch.round(wf / div.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return out(q, numpy), out(scale.contiguous(), numpy)


def dequantize_int8(q, scale):
    """(q int8 [..., N, K], scale [..., N]) -> float32 [..., N, K]."""
    qt, st = as_tensor(q), as_tensor(scale)
    w = qt.to(torch.float32) * st.to(torch.float32).unsqueeze(-1)
    return out(w, not isinstance(q, torch.Tensor))
