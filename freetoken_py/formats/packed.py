"""A weight kept in its checkpoint's quantised form, in the layout the CPU kernels execute.

    fp8   codes uint8 [N, K] (e4m3 bytes), scales float32 [N, ceil(K/g)]  (one per row and g columns)
    int4  codes uint8 [N, K/2] (low nibble = even column, q + 8), scales float16 [N, K/g]
    nvfp4 codes uint8 [N, K/2] (e2m1 nibbles, low = even column), scales uint8 [N, K/16 + 4]
          (e4m3 group scales, then the row's fp32 factor: quant/nvfp4.py)

`dequantize()` is the float32 value of every element, computed the way the checkpoint's own
definition (and transformers' dequantisation) computes it: one product per element.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken_py.quant import dequantize_int4
from freetoken_py.quant.fp8 import dequantize_fp8
from freetoken_py.quant.nvfp4 import dequantize_nvfp4

EXEC_FORMATS = ("fp8", "int4", "nvfp4")
DEQUANTISED_BYTES = 0   # float32 bytes `dequantize()` made in this process (tests, bench/startup_rss.py)


@dataclass(frozen=True, eq=False)
class Packed:
    fmt: str
    group_size: int
    codes: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int]   # the logical [N, K]

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        global DEQUANTISED_BYTES
        DEQUANTISED_BYTES += 4 * self.shape[0] * self.shape[1]
        if self.fmt == "fp8":
            return dequantize_fp8(self.codes, self.scales, self.group_size)
        if self.fmt == "nvfp4":
            return dequantize_nvfp4(self.codes, self.scales, self.group_size)
        return dequantize_int4(self.codes, self.scales, self.group_size)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    def arrays(self):
        """(codes, scales) as the kernels' numpy arrays (int4 scales: fp16 bits as uint16)."""
        s = self.scales.numpy() if self.fmt != "int4" else self.scales.view(torch.int16).numpy().view("uint16")
        return self.codes.numpy(), s


def cat_rows(parts: list[Packed]) -> Packed:
    """Stack weights of one format and input width along the output rows (q, k, v into qkv)."""
    first = parts[0]
    if any((p.fmt, p.group_size, p.shape[1]) != (first.fmt, first.group_size, first.shape[1]) for p in parts):
        raise ValueError("cat_rows needs one format, group size and input width")
    return Packed(first.fmt, first.group_size, torch.cat([p.codes for p in parts]),
                  torch.cat([p.scales for p in parts]), (sum(p.shape[0] for p in parts), first.shape[1]))
