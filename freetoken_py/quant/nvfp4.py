"""NVFP4 weights (e2m1 values, e4m3 scales per group of 16, a per-tensor fp32 factor), torch references.

Execution form (what the CPU kernels read), one row of K columns, group size g (16)::

    codes  uint8 [N, K/2]        byte j: element 2j in the low nibble, 2j + 1 in the high one;
                                 nibble = sign (bit 3) | e2m1 magnitude index (bits 0-2):
                                 0, 0.5, 1, 1.5, 2, 3, 4, 6
    scales uint8 [N, K/g + 4]    K/g e4m3fn bytes, then the row's fp32 factor f (4 bytes, little-endian)
    W[n, k] = e2m1(code) * eff[n, k // g],   eff = e4m3(s) * f   if f > 0
                                             eff = e4m3(s) / -f  if f < 0

The factor folds the checkpoint's per-tensor scale in exactly: compressed-tensors stores a
reciprocal global scale gs (``eff = s / gs``: f = -gs), ModelOpt a multiplier weight_scale_2
(``eff = s * ws2``: f = ws2). The group scale is formed first and then multiplied by the e2m1
value, as compressed-tensors' decompressor computes it (one rounding each, in fp32), so the
values equal the decompressor's bit for bit. 4 + 8/16 bits per weight plus 4 bytes per row.

MXFP4 (e2m1 with ue8m0 group-32 scales, F3) is the same nibble decode (`E2M1`) with a different
group-scale decode; it plugs in at `group_scales`.
"""
from __future__ import annotations

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
GROUP = 16
FACTOR_BYTES = 4
FP4_MAX, E4M3_MAX = 6.0, 448.0


def unpack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N, K/2] -> float32 [..., N, K] (low nibble first)."""
    c, lut = codes.to(torch.int64), E2M1.to(codes.device)
    v = torch.stack((lut[c & 15], lut[c >> 4]), dim=-1)
    return v.reshape(*codes.shape[:-1], codes.shape[-1] * 2)


def row_factor_bytes(f: torch.Tensor) -> torch.Tensor:
    """float32 [N] -> uint8 [N, 4] (the factor's bits, little-endian)."""
    return f.to(torch.float32).contiguous().view(torch.uint8).view(-1, FACTOR_BYTES)


def split_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [..., N, G + 4] -> (e4m3 bytes [..., N, G], factor float32 [..., N, 1])."""
    g = scales.shape[-1] - FACTOR_BYTES
    f = scales[..., g:].contiguous().view(torch.float32)
    return scales[..., :g], f


def group_scales(scales: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N, G + 4] -> the effective float32 group scales [..., N, G]."""
    s8, f = split_scales(scales)
    s = s8.contiguous().view(torch.float8_e4m3fn).float()
    return torch.where(f > 0, s * f, s / -f)


def dequantize_nvfp4(codes: torch.Tensor, scales: torch.Tensor, group_size: int = GROUP) -> torch.Tensor:
    """codes uint8 [..., N, K/2], scales uint8 [..., N, K/g + 4] -> float32 [..., N, K]."""
    return unpack_e2m1(codes) * group_scales(scales).repeat_interleave(group_size, dim=-1)


def exec_scales(scale_e4m3: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """A checkpoint's e4m3 group scales [N, G] (float8_e4m3fn or its bytes) and the row factor
    (a scalar or [N], sign as above) -> the execution form's uint8 [N, G + 4]."""
    n = scale_e4m3.shape[0]
    f = torch.as_tensor(factor, dtype=torch.float32).reshape(-1).expand(n)
    return torch.cat([scale_e4m3.contiguous().view(torch.uint8), row_factor_bytes(f)], dim=1)


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 magnitude index (a tie to the even index, as compressed-tensors rounds) | sign << 3."""
    mid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    a = x.abs().clamp(max=FP4_MAX).contiguous()
    idx = torch.searchsorted(mid, a)                   # the mids below a (a tie counts the lower side)
    tie = (idx < 7) & (mid[idx.clamp(max=6)] == a) & (idx % 2 == 1)
    return (idx + tie.to(idx.dtype)) | (torch.signbit(x).to(torch.int64) << 3)


def quantize_nvfp4(w: torch.Tensor, group_size: int = GROUP, per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (codes uint8 [N, K/2], scales uint8 [N, K/g + 4]) by NVFP4's rule (as
    compressed-tensors' min-max observer): gs = 448 * 6 / amax (per row, or of the whole tensor
    with `per_tensor`: the checkpoint form, `freetoken quantize --to nvfp4`), s = e4m3(amax(group)
    / 6 * gs), and each value rounded to the nearest e2m1 of w / (s / gs), a tie to the even one.
    Checkpoints keep their own values; this is for float sources."""
    n, k = w.shape
    if k % group_size or group_size % 2:
        raise ValueError(f"nvfp4 needs K divisible by an even group size: K={k}, group_size={group_size}")
    wf = w.float()
    amax = wf.abs().amax().expand(n) if per_tensor else wf.abs().amax(dim=1)
    gs = torch.where(amax > 0, FP4_MAX * E4M3_MAX / amax, torch.ones_like(amax))
    g = wf.view(n, k // group_size, group_size)
    s = (g.abs().amax(-1) / FP4_MAX * gs[:, None]).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    scales = exec_scales(s, -gs)
    eff = group_scales(scales)
    q = torch.where(eff[..., None] > 0, g / torch.where(eff > 0, eff, 1.0)[..., None], torch.zeros_like(g))
    idx = _round_e2m1(q.view(n, k))
    codes = (idx[:, 0::2] | (idx[:, 1::2] << 4)).to(torch.uint8)
    return codes.contiguous(), scales.contiguous()
