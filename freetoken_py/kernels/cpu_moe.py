"""CPU routed-expert execution: an `ExpertBank` per MoE layer and `moe_experts` to run it.

    bank = ExpertBank.from_weights(gate, up, down, fmt="int4", group_size=32)   # once, at load
    out = moe_experts(bank, x, topk_ids, topk_weights, activation="silu")       # every forward

out[t] = sum_j w[t, j] * down_e(act(gate_e x_t) * (up_e x_t)), e = topk_ids[t, j], in fp32.
The kernels (``_moe_kernels``) stream each routed expert's weights once per call, parallel over
weight rows so both cores read memory; see docs/kernels.md for layouts and measurements.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numba
import numpy as np
import torch

from freetoken_py.kernels._buffers import (R16_ROWS, R16_SCALES, decode_rows, empty_rows, encode_rows, host_array,
                                           is_r16_scales, r16_fits, r16_pack, r16_unpack, scale_dtype)
from freetoken_py.kernels._dots import ACTIVATIONS, FORMATS, r16_ok
from freetoken_py.kernels._moe_kernels import moe_rows
from freetoken_py.kernels.cpu_linear import torch_bf16, use_torch_bf16


@dataclass(frozen=True, eq=False)
class ExpertBank:
    """One layer's routed experts in execution format (contiguous, page-aligned).

    w13  [E, 2I, D]   gate rows 0..I-1 then up rows I..2I-1; float32 | uint16 (bf16 bits) | int8,
                      or uint8 [E, 2I, D/2] for int4 (low nibble = even column, value + 8)
    s13  [E, 2I, G]           scales: float32, G = 0 (fp32, bf16) or 1 (int8, per row); int4: fp16 bits as
                              uint16, G = D/group_size (_buffers.scale_dtype)
    w2   [E, D, I]    down rows, same encoding (uint8 [E, D, I/2] for int4)
    s2   [E, D, G']           as s13

    layout "rows" (above) or "r16" (int4 / nvfp4 on AVX2 and AVX-512 VNNI CPUs, int8 on AVX-512 VNNI,
    fp8 on AVX512-BF16 + VBMI ones: `preferred_layout`): the same shapes and bytes, each slab of 16 rows permuted within
    itself so one vector load serves 16 rows, the scales held as int16 / int8 / int32 (_buffers.r16_pack,
    _simd "int4 / nvfp4 weights in 16-row interleaved slabs" and the fp8 / int8 slab notes); the
    scales' dtype is the layout, so the kernels pick their loops from the arrays.
    `dequantized()` undoes it; the accelerator tiers take "rows" only.
    """

    fmt: str
    group_size: int
    w13: np.ndarray
    s13: np.ndarray
    w2: np.ndarray
    s2: np.ndarray
    # biases (gpt-oss): b13 [E, 2I] gate then up, b2 [E, D], float32; 0 rows: none
    b13: np.ndarray = field(default_factory=lambda: _NO_BIAS)
    b2: np.ndarray = field(default_factory=lambda: _NO_BIAS)

    def __post_init__(self):
        if self.layout == "r16":
            _check_r16(self.fmt, self.inter, self.hidden, self.group_size)

    def with_biases(self, b13, b2) -> "ExpertBank":
        """This bank with the experts' biases (torch or numpy [E, 2I] and [E, D], any float dtype)."""
        arr = lambda b: np.ascontiguousarray(_cpu(b).float().numpy())  # noqa: E731
        return replace(self, b13=arr(b13), b2=arr(b2))

    @property
    def layout(self) -> str:
        """"r16" (16-row slabs: int4 int16, nvfp4 int8, fp8 / int8 int32 scales) or "rows"."""
        return "r16" if is_r16_scales(self.s13) else "rows"

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def inter(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def hidden(self) -> int:
        return self.w2.shape[1]

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.s13.nbytes + self.w2.nbytes + self.s2.nbytes

    @property
    def bytes_per_expert(self) -> int:
        return self.nbytes // self.num_experts

    @classmethod
    def from_weights(cls, gate, up, down, fmt: str = "bf16", group_size: int = 32, layout: str = "rows") -> "ExpertBank":
        """gate, up [E, I, D] and down [E, D, I] (torch, any float dtype) -> bank in `fmt`.

        Converts one expert at a time, so no full-size high-precision copy is kept or made.
        """
        if fmt not in FORMATS:
            raise ValueError(f"unknown expert format {fmt!r}; expected one of {FORMATS}")
        num_e, inter, hidden = gate.shape
        if tuple(up.shape) != (num_e, inter, hidden) or tuple(down.shape) != (num_e, hidden, inter):
            raise ValueError(f"expected gate/up [E, I, D] and down [E, D, I], got {tuple(gate.shape)}, "
                             f"{tuple(up.shape)}, {tuple(down.shape)}")
        bank = cls.empty(fmt, num_e, inter, hidden, group_size, layout)
        for e in range(num_e):
            bank.set_expert(e, gate[e], up[e], down[e])
        return bank

    @classmethod
    def empty(cls, fmt: str, num_experts: int, inter: int, hidden: int, group_size: int = 32,
              layout: str = "rows") -> "ExpertBank":
        """Uninitialised page-aligned bank of `num_experts` experts; fill it with `set_expert`."""
        if fmt not in FORMATS:
            raise ValueError(f"unknown expert format {fmt!r}; expected one of {FORMATS}")
        if layout not in ("rows", "r16"):
            raise ValueError(f"unknown bank layout {layout!r}; expected 'rows' or 'r16'")
        if layout == "r16":
            _check_r16(fmt, inter, hidden, group_size)
        w13, s13 = empty_rows(fmt, (num_experts, 2 * inter), hidden, group_size)
        w2, s2 = empty_rows(fmt, (num_experts, hidden), inter, group_size)
        if layout == "r16":
            s13, s2 = s13.view(R16_SCALES[fmt]), s2.view(R16_SCALES[fmt])
        return cls(fmt, group_size, w13, s13, w2, s2)

    def _row_scales(self) -> tuple[np.ndarray, np.ndarray]:
        """(s13, s2) as the row layout's encoders write them (r16's int16 scales seen as uint16)."""
        if self.layout == "r16":
            return self.s13.view(scale_dtype(self.fmt)), self.s2.view(scale_dtype(self.fmt))
        return self.s13, self.s2

    def _to_layout(self, e: int) -> None:
        """Expert e, just written in the row layout, into this bank's layout (in place)."""
        if self.layout == "r16":
            s13, s2 = self._row_scales()
            self.w13[e], self.s13[e] = r16_pack(self.w13[e], s13[e])
            self.w2[e], self.s2[e] = r16_pack(self.w2[e], s2[e])

    def set_expert(self, e: int, gate, up, down) -> None:
        """Encode one expert: gate, up [I, D] and down [D, I] (torch, any float dtype)."""
        inter = self.inter
        s13, s2 = self._row_scales()
        encode_rows(_cpu(gate), self.fmt, self.group_size, self.w13[e, :inter], s13[e, :inter])
        encode_rows(_cpu(up), self.fmt, self.group_size, self.w13[e, inter:], s13[e, inter:])
        encode_rows(_cpu(down), self.fmt, self.group_size, self.w2[e], s2[e])
        self._to_layout(e)

    def set_expert_packed(self, e: int, gate, up, down) -> None:
        """Copy one expert already in this bank's format (formats.Packed gate, up [I, D], down
        [D, I]: a checkpoint's fp8 / int4 codes and scales) as it is, bit for bit."""
        inter = self.inter
        s13, s2 = self._row_scales()
        for p, w, s in ((gate, self.w13[e, :inter], s13[e, :inter]), (up, self.w13[e, inter:], s13[e, inter:]),
                        (down, self.w2[e], s2[e])):
            if (p.fmt, p.group_size) != (self.fmt, self.group_size):
                raise ValueError(f"a {p.fmt} g{p.group_size} weight in a {self.fmt} g{self.group_size} bank")
            codes, scales = p.arrays()
            w[...], s[...] = codes, scales
        self._to_layout(e)

    @classmethod
    def view_of(cls, w13: torch.Tensor, w2: torch.Tensor) -> "ExpertBank":
        """A bank over existing torch weights, without a copy: w13 [E, 2I, D] (gate rows then up
        rows) and w2 [E, D, I], both contiguous bf16 or fp32 on the host. The bank shares their
        memory (the residency tiers keep one host copy that the PCIe streamer and the CPU
        kernels both read)."""
        fmt = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(w13.dtype)
        if fmt is None or w2.dtype != w13.dtype:
            raise ValueError(f"a bank view needs bf16 or fp32 weights, got {w13.dtype} / {w2.dtype}")
        if w13.device.type != "cpu" or not (w13.is_contiguous() and w2.is_contiguous()):
            raise ValueError("a bank view needs contiguous host tensors")
        num_e, two_i, hidden = w13.shape
        if two_i % 2 or tuple(w2.shape) != (num_e, hidden, two_i // 2):
            raise ValueError(f"expected w13 [E, 2I, D] and w2 [E, D, I], got {tuple(w13.shape)}, {tuple(w2.shape)}")

        def arr(t: torch.Tensor) -> np.ndarray:
            return t.numpy() if fmt == "fp32" else t.view(torch.int16).numpy().view(np.uint16)

        no_scales = np.zeros((num_e, two_i, 0), np.float32), np.zeros((num_e, hidden, 0), np.float32)
        return cls(fmt, 32, arr(w13), no_scales[0], arr(w2), no_scales[1])

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 fp32 [E, 2I, D], w2 fp32 [E, D, I]) as the kernels see them, for references."""
        return (decode_rows(*self.row_arrays(self.w13, self.s13), self.fmt, self.group_size),
                decode_rows(*self.row_arrays(self.w2, self.s2), self.fmt, self.group_size))

    def row_arrays(self, w: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(weights, scales) of this bank (all or some experts) in the row layout: as they are, or
        unpacked from "r16" (a copy)."""
        return r16_unpack(w, s) if self.layout == "r16" else (w, s)


def r16_layout_fits(fmt: str, inter: int, hidden: int, group_size: int) -> bool:
    """True where experts of these widths can be stored in the "r16" layout (gate and up halves
    in whole slabs, whole blocks of 32 columns both ways)."""
    return (inter % R16_ROWS == 0 and r16_fits(fmt, 2 * inter, hidden, group_size)
            and r16_fits(fmt, hidden, inter, group_size))


def preferred_layout(fmt: str, inter: int, hidden: int, group_size: int) -> str:
    """"r16" where this process's CPU kernels run it (int4 / nvfp4: AVX2 or AVX-512 VNNI, int8 activations; int8:
    AVX-512 VNNI; fp8: AVX512-BF16 + VBMI, bf16 activations) and the widths fit, else "rows". A bank that only the CPU
    reads takes this; the accelerator tiers keep "rows"."""
    return "r16" if r16_ok(fmt) and r16_layout_fits(fmt, inter, hidden, group_size) else "rows"


def _check_r16(fmt: str, inter: int, hidden: int, group_size: int) -> None:
    if not r16_ok(fmt):
        raise ValueError(f"the r16 layout runs int4 / nvfp4 with int8 activations (AVX2 or AVX-512 VNNI), int8 on AVX-512 "
                         f"VNNI and fp8 on AVX512-BF16 + VBMI CPUs with bf16 activations only; this process cannot run {fmt} in it "
                         "(FREETOKEN_SIMD / FREETOKEN_INT_ACT / FREETOKEN_BF16_ACT or the CPU rule it out)")
    if not r16_layout_fits(fmt, inter, hidden, group_size):
        raise ValueError(f"the r16 layout takes int4 / nvfp4 / fp8 / int8 experts with I and D multiples of 32 (int4 groups "
                         f"and fp8 blocks of whole 32-blocks, nvfp4: 16), got {fmt} I={inter} D={hidden} g{group_size}")


_NO_BIAS = np.zeros((0, 0), np.float32)


def _cpu(t) -> torch.Tensor:
    t = torch.as_tensor(t) if not isinstance(t, torch.Tensor) else t
    return t.detach().to("cpu")


def moe_experts(bank: ExpertBank, x, topk_ids, topk_weights, activation: str = "silu"):
    """x [T, D] float32 (torch or numpy), topk_ids [T, k] int, topk_weights [T, k] -> out [T, D].

    Returns the kind of array x is (torch tensor or numpy array), float32. The decode hot path:
    about 10 us of Python around the kernel, so argument checks are shape tests only (expert ids
    are range-checked inside the kernel).
    """
    kind = ACTIVATIONS.get(activation)
    if kind is None:
        raise ValueError(f"unknown activation {activation!r}; expected one of {sorted(ACTIVATIONS)}")
    xs = host_array(x, np.float32)
    ids = host_array(topk_ids, np.int64)
    wts = host_array(topk_weights, np.float32)
    if xs.ndim != 2 or xs.shape[1] != bank.hidden or ids.ndim != 2 or ids.shape != wts.shape \
            or ids.shape[0] != xs.shape[0]:
        raise ValueError(f"shape mismatch: x {xs.shape} (bank hidden {bank.hidden}), topk_ids {ids.shape}, "
                         f"topk_weights {wts.shape}")
    out = np.zeros(xs.shape, np.float32)
    if ids.size:
        add_moe_experts(bank, xs, ids, wts, out, kind)
    return torch.from_numpy(out) if isinstance(x, torch.Tensor) else out


def add_moe_experts(bank: ExpertBank, x: np.ndarray, topk_ids: np.ndarray, topk_weights: np.ndarray,
                    out: np.ndarray, activation: int = ACTIVATIONS["silu"]) -> None:
    """out [T, D] += the routed experts of x (numpy float32 / int64 / float32, C-contiguous; no
    checks beyond the kernel's own id range check): the fused decode path adds the experts
    straight into the residual stream. `activation` is an `ACTIVATIONS` code. bf16 banks with bf16
    activations (AVX512-BF16) and SwiGLU take torch's bf16 GEMMs per expert from
    cpu_linear.TORCH_BF16_MIN_TOKENS rows (prefill)."""
    if activation == ACTIVATIONS["silu"] and not bank.b13.shape[0] and use_torch_bf16(bank.fmt, x.shape[0]):
        _add_experts_torch_bf16(bank, x, topk_ids, topk_weights, out)
        return
    moe_rows(bank.w13, bank.s13, bank.w2, bank.s2, x, topk_ids, topk_weights, activation, bank.group_size,
             numba.get_num_threads(), out, bank.b13, bank.b2)


def _add_experts_torch_bf16(bank: ExpertBank, x: np.ndarray, ids: np.ndarray, wts: np.ndarray, out: np.ndarray) -> None:
    """out += the routed SwiGLU experts through torch's bf16 GEMMs: per expert hit, its tokens'
    rows gathered, [n, D] x w13^T -> gate / up (rounded to bf16 by the GEMM), silu(g) * u rounded
    to bf16, x w2^T, times the routing weight, added into out (the kernels' own numerics but for
    the GEMMs' bf16 outputs)."""
    num_e = bank.num_experts
    flat = ids.reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= num_e):
        raise ValueError("expert id out of range")
    k = ids.shape[1]
    order = np.argsort(flat, kind="stable")
    bounds = np.searchsorted(flat[order], np.arange(num_e + 1))
    w13, w2 = torch_bf16(bank.w13), torch_bf16(bank.w2)
    xb = torch.from_numpy(x).bfloat16()
    o = torch.from_numpy(out)
    fw = torch.from_numpy(wts.reshape(-1))
    for e in range(num_e):
        if bounds[e] == bounds[e + 1]:
            continue
        pairs = torch.from_numpy(order[bounds[e]:bounds[e + 1]])
        tok = pairs // k
        g, u = (xb[tok] @ w13[e].T).float().chunk(2, dim=-1)
        hid = (torch.nn.functional.silu(g) * u).bfloat16()
        o.index_add_(0, tok, (hid @ w2[e].T).float() * fw[pairs][:, None])
