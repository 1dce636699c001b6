"""FP8 e4m3 weights with block scales (DeepSeek-V3's `weight_scale_inv` layout), torch references.

The checkpoint form: codes float8_e4m3fn [N, K] and a block grid s [ceil(N/bn), ceil(K/bk)]
(float32), ``W[r, c] = code[r, c] * s[r // bn, c // bk]`` (edge blocks are partial). The
execution form the CPU kernels read keeps the codes as bytes (uint8) and expands the grid to one
scale per row and column block, ``rs[r, b] = s[r // bn, b]`` [N, ceil(K/bk)]: the dequantised
values are the same products, at 8 bits + 32/bk bits per weight.
"""
from __future__ import annotations

import numpy as np
import torch

E4M3_MAX = 448.0


def e4m3_table() -> np.ndarray:
    """float32 [256]: the value of every e4m3fn byte (0x7f / 0xff are NaN)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


def expand_block_scales(grid: torch.Tensor, rows: int, block_rows: int) -> torch.Tensor:
    """grid [ceil(N/bn), G] -> per-row scales [N, G] float32 (row r takes grid row r // bn)."""
    return grid.float().repeat_interleave(block_rows, dim=0)[:rows].contiguous()


def dequantize_fp8(codes: torch.Tensor, row_scales: torch.Tensor, block_cols: int) -> torch.Tensor:
    """codes [..., N, K] (float8_e4m3fn or its uint8 bits), row_scales [..., N, ceil(K/bk)] -> float32."""
    c = codes.view(torch.float8_e4m3fn) if codes.dtype == torch.uint8 else codes
    k = c.shape[-1]
    s = row_scales.float().repeat_interleave(block_cols, dim=-1)[..., :k]
    return c.float() * s


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes float8_e4m3fn [N, K], grid float32 [ceil(N/bn), ceil(K/bk)]): the documented
    rule (per tile s = amax / 448, codes = (w / s) clamped to +-448), what DeepSeek's and
    compressed-tensors' fp8-block writers do. An all-zero tile gets s = 1."""
    bn, bk = block
    n, k = w.shape
    gn, gk = -(-n // bn), -(-k // bk)
    wf = torch.zeros(gn * bn, gk * bk, dtype=torch.float32)
    wf[:n, :k] = w.float()
    tiles = wf.view(gn, bn, gk, bk)
    amax = tiles.abs().amax(dim=(1, 3))                               # [gn, gk]
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (tiles / s[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).view(gn * bn, gk * bk)[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), s.contiguous()
