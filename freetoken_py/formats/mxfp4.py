"""MXFP4 checkpoints (`quant_method: mxfp4`, gpt-oss's experts): e2m1 values with an e8m0 scale per 32.

Per linear X (a model file's `expand` gives each expert its own, models/gpt_oss.py):
    `X.weight_blocks` U8 [out, in/32, 16]: block of 32 values = 16 bytes, byte b holds element 2b in
        its low nibble and 2b + 1 in its high one (nibble = sign bit 3 | e2m1 magnitude index)
    `X.weight_scales` U8 [out, in/32]: e8m0, the block's scale 2^(byte - 127)
    W[n, k] = e2m1(code) * 2^(scales[n, k // 32] - 127)
Everything else (attention, router, embeddings, lm_head: `modules_to_not_convert`) is stored plain.

Execution form: `nvfp4` (quant/nvfp4.py) with the codes as stored (the nibbles are the same) and
each e8m0 scale written as two e4m3 group-16 scales times the row's fp32 factor, all powers of two:
row factor f = 2^(emax - 8) (emax: the row's largest block exponent), e4m3 scale 2^(e - emax + 8).
e4m3 holds the powers of two 2^-9 .. 2^8, so this is exact whenever a row's block exponents span at
most 17 octaves; blocks of zeros (whose scale does not matter) are left out of the span. A block
further below its row's largest is re-rounded to e2m1 at 2^-9 of the row scale (a change of at most
2^-18 of the row's largest magnitude) with a one-line note naming the tensor; --expert-dtype bf16
keeps such a checkpoint exact. 4.5 bits per weight in this form (4.25 as stored).
"""
from __future__ import annotations

import sys

import torch

from freetoken_py.errors import ModelLoadError
from freetoken_py.formats.base import QuantDecoder, logical
from freetoken_py.formats.packed import Packed
from freetoken_py.quant.nvfp4 import E2M1, _round_e2m1, exec_scales, unpack_e2m1

TAG = "MXFP4"
BLOCK = 32
SPAN = 17        # e4m3 powers of two: 2^-9 (subnormal) .. 2^8


def _e4m3_power_byte(p: torch.Tensor) -> torch.Tensor:
    """int [-9, 8] -> the e4m3fn byte of 2^p (subnormals below 2^-6)."""
    normal = ((p + 7).clamp(min=0) << 3)
    sub = torch.where(p == -7, 4, torch.where(p == -8, 2, 1))
    return torch.where(p >= -6, normal, sub).to(torch.uint8)


def mxfp4_to_nvfp4(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """blocks uint8 [N, K/32, 16], scales uint8 [N, K/32] -> (codes uint8 [N, K/2], nvfp4 scales
    uint8 [N, K/16 + 4], the number of blocks re-rounded because they lie more than SPAN octaves
    below their row's largest)."""
    n, g = scales.shape
    codes = blocks.reshape(n, g * 16).clone()
    e = scales.to(torch.int32) - 127                                           # [N, G]
    live = (blocks.reshape(n, g, 16) & 0x77).amax(dim=-1) > 0                  # a nonzero value in the block
    emax = torch.where(live, e, torch.full_like(e, -1000)).amax(dim=1, keepdim=True)
    emax = torch.where(emax < -500, torch.zeros_like(emax), emax)             # all-zero rows: any factor
    rel = (e - emax + 8).clamp(max=8)
    low = live & (rel < -9)
    flushed = int(low.sum())
    if flushed:   # re-round those blocks' values at the smallest scale the row can give them
        rows, cols = low.nonzero(as_tuple=True)
        vals = unpack_e2m1(blocks[rows, cols]) * torch.pow(2.0, (e[rows, cols] - emax[rows, 0] + 17)
                                                            .float())[:, None]   # at the scale 2^(emax - 17)
        q = _round_e2m1(vals)
        packed = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
        codes.view(n, g, 16)[rows, cols] = packed
    rel = torch.where(live, rel.clamp(min=-9), torch.zeros_like(rel))
    s8 = _e4m3_power_byte(rel).repeat_interleave(2, dim=1)                     # [N, K/16]
    f = torch.pow(2.0, (emax[:, 0] - 8).double()).float()
    return codes, exec_scales(s8, f), flushed


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The format's own decode (F3): uint8 [N, K/32, 16] and [N, K/32] -> float32 [N, K]."""
    n, g = scales.shape
    v = unpack_e2m1(blocks.reshape(n, g * 16)).view(n, g, BLOCK)
    return (v * torch.pow(2.0, scales.to(torch.float32) - 127)[..., None]).view(n, g * BLOCK)


class Mxfp4Decoder(QuantDecoder):
    name = "mxfp4"
    exec_format = "nvfp4"
    tag = TAG
    group_size = 16

    def describe(self) -> str:
        return "mxfp4 (e8m0 scales per 32)"

    def scan(self) -> tuple[dict, set]:
        out, quantised = {}, set()
        for name, info in self.stored.items():
            if name.endswith(".weight_scales"):
                continue
            if not name.endswith(".weight_blocks"):
                out[name] = info
                continue
            base = name[: -len("_blocks")]
            if info.dtype != "U8" or len(info.shape) != 3 or info.shape[2] != 16:
                raise ModelLoadError(f"{info.file}: '{info.name}' must be uint8 [out, in/32, 16] (MXFP4 blocks), "
                                     f"got {info.dtype} {list(info.shape)}")
            scale = self.need(base + "_scales")
            if scale.dtype != "U8" or tuple(scale.shape) != tuple(info.shape[:2]):
                raise ModelLoadError(f"{scale.file}: MXFP4 scales '{scale.name}' are {scale.dtype} "
                                     f"{list(scale.shape)}, but the blocks '{info.name}' {list(info.shape)} need "
                                     f"U8 {list(info.shape[:2])} (one e8m0 byte per 32 values)")
            out[base] = logical(info, base, (info.shape[0], info.shape[1] * BLOCK), TAG)
            quantised.add(base)
        return out, quantised

    def _packed(self, reader, name: str) -> Packed:
        blocks, scales = reader.get(name + "_blocks"), reader.get(name + "_scales")
        codes, s, flushed = mxfp4_to_nvfp4(blocks, scales)
        if flushed:
            print(f"freetoken: mxfp4: '{name}': {flushed} blocks lie more than {SPAN} octaves below their row's "
                  "largest and were re-rounded (at most 2^-18 of the row's largest magnitude); "
                  "--expert-dtype bf16 keeps them exact", file=sys.stderr)
        return Packed("nvfp4", 16, codes, s, (codes.shape[0], codes.shape[1] * 2))

    def get(self, reader, name: str) -> torch.Tensor:
        if name not in self._quantised:
            return reader.get(name)
        return dequantize_mxfp4(reader.get(name + "_blocks"), reader.get(name + "_scales"))


def mxfp4_decoder(qcfg: dict, stored: dict, field: str) -> Mxfp4Decoder:
    return Mxfp4Decoder(stored, field)


__all__ = ["E2M1", "Mxfp4Decoder", "dequantize_mxfp4", "mxfp4_decoder", "mxfp4_to_nvfp4"]
