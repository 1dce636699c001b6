"""What one routed expert is made of in the residency tiers, and how the accelerator tier computes it.

An expert is a tuple of *parts*, one tensor each; a layer's host bank is the same tuple with
the expert index in front ([E, ...] per part). The slot cache holds one set of parts per slot,
the streamer copies part by part, and the CPU tier's numba kernels read the host bank in place.

    float (the checkpoint's weights as loaded; bf16, fp16 or fp32)
        w13 [2I, D]  gate rows then up rows          w2 [D, I]  down
    int8 / int4 (`--expert-dtype`, the expert store's `kernels.cpu_moe.ExpertBank` layouts)
        q13 [2I, D | D/2] int8 | uint8 (two nibbles)  s13 [2I, 1 | D/g] fp32 | fp16 bits (int16)
        q2  [D, I | I/2]                              s2  [D, 1 | I/g]
    nvfp4 (an NVFP4 checkpoint's own bank: e2m1 nibbles, e4m3 group-16 scale bytes + the row's fp32
        factor, quant/nvfp4.py): q13 [2I, D/2] uint8, s13 [2I, D/16 + 4] uint8, q2 [D, I/2], s2
        [D, I/16 + 4]; computed from its dequantised weights with fp32 activations, as the numba
        kernel reads them; not cut (each scale row ends in its factor); Triton kernel: scales
        decoded arithmetically (`kernels._triton_moe`)
    fp8 (an FP8 block-scaled checkpoint's own bank: e4m3 bytes, one fp32 scale per row and block of
        g columns, the checkpoint's g x g block scale repeated on its rows, kernels.cpu_moe): q13
        [2I, D] uint8, s13 [2I, ceil(D/g)] fp32, q2 [D, I], s2 [D, ceil(I/g)]; computed from its
        dequantised weights with the activations exact in fp32, as the numba fp8 kernel takes
        them; cut in whole column blocks; Triton kernel: native e4m3 on sm89+, a bit-exact
        decode below (`kernels._triton_moe`)

The accelerator tier computes a quantised expert (`compute`, torch; on a GPU at decode, the
same arithmetic in `kernels.gpu_moe.moe_pairs_quant`'s Triton kernels) from its dequantised
weights, in fp32, with its activations seen exactly as the CPU kernels see them (`kernels._dots.INT_ACT`: on AVX2, x and h
rounded through the per-32-block int8 quantiser, `quant.roundtrip_act_q8`), so a pair gives the
same result whichever tier computes it (up to fp32 rounding, which near a tie of the int8
rounding of h may move one value a step): outputs do not depend on placement.

A cut expert (planner decision 5) is split along its intermediate dimension I: the accelerator
computes columns [0, cols), the CPU [cols, I). `cut_block` is the granularity a cut must keep:
32 (the activation blocks of h), and an int4 scale group's width where that is larger.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from freetoken_py.kernels.gpu_moe import quant_swiglu
from freetoken_py.residency.slots import parts_bytes

Parts = tuple  # one expert's tensors (views of a host bank or of a slot)

QUANTISED = ("int8", "int4", "nvfp4", "fp8")
GROUPED = ("int4", "fp8")     # scales per group of columns: a cut takes whole groups of the down part


@dataclass(frozen=True)
class ExpertFormat:
    name: str                 # "float", "int8", "int4", "nvfp4" or "fp8"
    inter: int                # I
    hidden: int               # D
    specs: tuple              # per part: (shape of one expert's part, dtype)
    group_size: int = 32      # int4's scale group; fp8's column block

    @property
    def dtype(self) -> torch.dtype:
        """The float weights' dtype (the Triton experts' check); a quantised format's first part's."""
        return self.specs[0][1]

    @property
    def expert_bytes(self) -> int:
        return parts_bytes(self.specs)

    @property
    def cut_block(self) -> int:
        if self.name == "nvfp4":    # whole experts only: a scale row's factor sits at its end
            return self.inter
        return math.lcm(32, self.group_size) if self.name in GROUPED else 32

    # ---- building --------------------------------------------------------------------------
    @classmethod
    def of_float(cls, w13: torch.Tensor, w2: torch.Tensor) -> "ExpertFormat":
        """The format of a layer's float experts w13 [E, 2I, D], w2 [E, D, I]."""
        return cls("float", w2.shape[-1], w2.shape[-2], ((tuple(w13.shape[1:]), w13.dtype),
                                                         (tuple(w2.shape[1:]), w2.dtype)))

    @classmethod
    def of_bank(cls, bank) -> "ExpertFormat":
        """The format of a `kernels.cpu_moe.ExpertBank`'s experts (its host parts: `bank_parts`)."""
        parts = bank_parts(bank)
        if bank.fmt in ("bf16", "fp32"):
            return cls.of_float(*parts)
        return cls(bank.fmt, bank.inter, bank.hidden, tuple((tuple(p.shape[1:]), p.dtype) for p in parts),
                   bank.group_size)

    # ---- computing -------------------------------------------------------------------------
    def compute(self, x: torch.Tensor, parts: Parts) -> torch.Tensor:
        """SwiGLU expert: x [n, D] -> down(silu(gate x) * up x) [n, D] in x's dtype."""
        if self.name == "float":
            if parts[0].dtype == x.dtype:
                return swiglu(x, *parts)
            # (`--expert-dtype bf16` under fp32 activations: in fp32, as the CPU kernels widen them)
            return swiglu(x.float(), *(p.float() for p in parts)).to(x.dtype)
        return quant_swiglu(x, parts, self.name, self.group_size)

    # ---- cutting along I -------------------------------------------------------------------
    def _down_cols(self, cols: int) -> tuple[int, int]:
        """(columns of the down part's weights, of its scales) that hold h's first `cols`."""
        if self.name == "float":
            return cols, 0
        if cols % self.cut_block and cols not in (0, self.inter):
            raise ValueError(f"a {self.name} expert is cut in blocks of {self.cut_block} columns, not at {cols}")
        if self.name == "int8":
            return cols, 1          # one scale per row: the whole (1) column goes with either side
        return (cols if self.name == "fp8" else cols // 2), cols // self.group_size

    def column_pieces(self, parts: Parts, cols: int) -> list[list[torch.Tensor]]:
        """The first `cols` columns of I (host views), per part as pieces stacked along dim 0:
        gate rows [0, cols) then up rows [I, I + cols); the down part's first columns (strided:
        the streamer gathers them)."""
        inter, (wc, sc) = self.inter, self._down_cols(cols)
        rows = lambda t: [t[:cols], t[inter:inter + cols]]   # noqa: E731
        if self.name == "float":
            w13, w2 = parts
            return [rows(w13), [w2[:, :wc]]]
        q13, s13, q2, s2 = parts
        return [rows(q13), rows(s13), [q2[:, :wc]], [s2[:, :sc] if self.name in GROUPED else s2]]

    def column_shapes(self, cols: int) -> list[tuple[int, ...]]:
        """The shapes `column_pieces(parts, cols)` stack into, per part."""
        return [(sum(p.shape[0] for p in pieces), *pieces[0].shape[1:])
                for pieces in self.column_pieces(self._shape_parts(), cols)]

    def rest(self, parts: Parts, cols: int) -> Parts:
        """The columns [cols, I) of one expert (host views; the CPU's side of a cut)."""
        inter, (wc, sc) = self.inter, self._down_cols(cols)
        rows = lambda t: torch.cat([t[cols:inter], t[inter + cols:]])   # noqa: E731
        if self.name == "float":
            w13, w2 = parts
            return rows(w13), w2[:, wc:]
        q13, s13, q2, s2 = parts
        return rows(q13), rows(s13), q2[:, wc:], s2[:, sc:] if self.name in GROUPED else s2

    def _shape_parts(self) -> Parts:
        return tuple(torch.empty(shape, dtype=dt, device="meta") for shape, dt in self.specs)


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x [n, D], w13 [2I, D] (gate rows, then up), w2 [D, I] -> [n, D]."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)  # [n, I] each
    return F.linear(F.silu(gate) * up, w2)


def bank_parts(bank) -> Parts:
    """A `kernels.cpu_moe.ExpertBank`'s arrays as torch tensors sharing their memory: (w13, w2)
    in bf16 / fp32 for the float formats, (q13, s13, q2, s2) for int8 / int4 / nvfp4 / fp8. Banks in
    the row layout only (the cpu backend's r16 slabs are not what the accelerator kernels read)."""
    if bank.layout != "rows":
        raise ValueError(f"a {bank.fmt} bank in the {bank.layout} layout cannot feed the accelerator tiers; "
                         "open the expert store with layout='rows'")
    if bank.fmt == "fp32":
        return torch.from_numpy(bank.w13), torch.from_numpy(bank.w2)
    if bank.fmt == "bf16":   # uint16 bits -> the same bytes as bf16
        return tuple(torch.from_numpy(a.view("int16")).view(torch.bfloat16) for a in (bank.w13, bank.w2))
    # int4's fp16 scale bits (uint16 for numba, which has no float16) as int16: the same bytes, in a
    # dtype every torch device copies and views
    return tuple(torch.from_numpy(a.view("int16") if a.dtype == "uint16" else a)
                 for a in (bank.w13, bank.s13, bank.w2, bank.s2))
