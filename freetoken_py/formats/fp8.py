"""FP8 block-scaled e4m3 (`quant_method: fp8`; DeepSeek-V3/R1, Kimi K2, GLM-4.5+, Qwen3 / MiniMax FP8).

Stored per linear X: `X.weight` float8_e4m3fn [out, in] and `X.weight_scale_inv` float32
[ceil(out/bn), ceil(in/bk)] (`weight_block_size` [bn, bk], edge blocks partial; `scale_fmt:
ue8m0` only says the scales are powers of two, which needs nothing special; an F8_E8M0 grid is
decoded as 2^(byte-127)). `W[r, c] = w8[r, c] * s[r // bn, c // bk]`. Norms, embeddings, the
router and whatever the ignore list names are stored bf16 and stay so.
"""
from __future__ import annotations

import math

import torch

from freetoken_py.errors import ModelLoadError
from freetoken_py.formats.base import QuantDecoder, logical
from freetoken_py.formats.packed import Packed
from freetoken_py.quant.fp8 import expand_block_scales

TAG = "FP8_BLOCK"
_DROPPED = ("activation_scale", "input_scale")   # static activation scales: the CPU path quantises nothing


class Fp8BlockDecoder(QuantDecoder):
    name = "fp8-block"
    exec_format = "fp8"
    tag = TAG

    def __init__(self, qcfg: dict, stored: dict, field: str):
        fmt = qcfg.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ModelLoadError(f"{field}.fmt: '{fmt}' is not supported (fp8 loads e4m3 weights)")
        block = qcfg.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 and b % 2 == 0
                                                                      for b in block)):
            raise ModelLoadError(f"{field}.weight_block_size: {block!r} is not supported (fp8 loads block-scaled "
                                 "weights, e.g. [128, 128]; per-tensor fp8 is not supported)")
        self.block = (block[0], block[1])
        self.group_size = block[1]
        super().__init__(stored, field)

    def describe(self) -> str:
        return f"fp8 block {list(self.block)}"

    def scan(self) -> tuple[dict, set]:
        out, quantised = {}, set()
        for name, info in self.stored.items():
            if name.endswith("weight_scale_inv") or name.endswith(_DROPPED):
                continue
            if info.dtype == "F8_E4M3":
                grid = self.need(name + "_scale_inv")
                want = tuple(math.ceil(d / b) for d, b in zip(info.shape, self.block))
                if len(info.shape) != 2 or tuple(grid.shape) != want:
                    raise ModelLoadError(f"{grid.file}: scale tensor '{grid.name}' has shape {list(grid.shape)}, "
                                         f"but weight {list(info.shape)} in blocks {list(self.block)} needs "
                                         f"{list(want)}")
                if grid.dtype not in ("F32", "BF16", "F8_E8M0"):
                    raise ModelLoadError(f"{grid.file}: scale tensor '{grid.name}' has dtype {grid.dtype} "
                                         "(expected F32, BF16 or F8_E8M0)")
                out[name] = logical(info, name, info.shape, TAG)
                quantised.add(name)
            else:
                out[name] = info
        return out, quantised

    def _packed(self, reader, name: str) -> Packed:
        codes = reader.get(name)                            # float8_e4m3fn [N, K]
        grid = _grid(reader.get(name + "_scale_inv"))       # [ceil(N/bn), ceil(K/bk)]
        rows = expand_block_scales(grid, codes.shape[0], self.block[0])
        return Packed("fp8", self.block[1], codes.view(torch.uint8), rows, tuple(codes.shape))


def _grid(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint8 or str(t.dtype) == "torch.float8_e8m0fnu":
        return torch.pow(2.0, t.view(torch.uint8).float() - 127.0)
    return t.float()
