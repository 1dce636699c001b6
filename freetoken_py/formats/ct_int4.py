"""compressed-tensors `pack-quantized` INT4 (Kimi K2-Thinking / K2.5 / K2.6 experts; llm-compressor's
GPTQ / AWQ output): symmetric, group-wise, no zero point.

Stored per linear X: `X.weight_packed` int32 [out, in/8] (element j in bits 4j..4j+3 of word
j // 8, low nibble first, q + 8), `X.weight_scale` [out, in/g] (bf16 / fp16 / fp32) and
`X.weight_shape` [2]. Read as bytes (little-endian) the words are exactly the int4 banks' layout
(low nibble = even column, q + 8), so the codes are copied, not re-quantised. The kernels hold
scales as fp16: a scale fp16 cannot hold exactly is refused by name, never rounded.
"""
from __future__ import annotations

import torch

from freetoken_py.errors import ModelLoadError
from freetoken_py.formats.base import QuantDecoder, logical
from freetoken_py.formats.packed import Packed

TAG = "CT_INT4"
GROUP_SIZES = (32, 64, 128)
_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")


def ct_decoder(qcfg: dict, stored: dict, field: str):
    from freetoken_py.formats import unsupported

    fmt = qcfg.get("format")
    groups = qcfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError(f"{field}.config_groups: missing or empty")
    fmts = set()
    for gname, group in groups.items():
        fmt_g = group.get("format", fmt) if isinstance(group, dict) else fmt
        if fmt_g not in ("pack-quantized", "nvfp4-pack-quantized"):
            later = " (planned for a later release)" if fmt_g == "mxfp4-pack-quantized" else ""
            raise unsupported(f"{field}.format", f"compressed-tensors format {fmt_g!r}{later}")
        fmts.add(fmt_g)
    if len(fmts) > 1:
        raise ModelLoadError(f"{field}.config_groups: several formats {sorted(fmts)} (one per checkpoint is supported)")
    if fmts == {"nvfp4-pack-quantized"}:
        from freetoken_py.formats.nvfp4 import CtNvfp4Decoder, check_ct_weights

        for g, grp in groups.items():
            check_ct_weights(f"{field}.config_groups.{g}.weights", grp.get("weights") if isinstance(grp, dict) else None)
        return CtNvfp4Decoder(stored, field)
    sizes = {_check_group(f"{field}.config_groups.{g}.weights", grp.get("weights")) for g, grp in groups.items()}
    if len(sizes) > 1:
        raise ModelLoadError(f"{field}.config_groups: several int4 group sizes {sorted(sizes)} (one is supported)")
    return CtInt4Decoder(sizes.pop(), stored, field)


def _check_group(field: str, w) -> int:
    from freetoken_py.formats import unsupported

    if not isinstance(w, dict):
        raise ModelLoadError(f"{field}: missing")
    want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    for key, value in want.items():
        if w.get(key) != value:
            raise unsupported(f"{field}.{key}", f"{w.get(key)!r} (pack-quantized loads {want})")
    g = w.get("group_size")
    if g not in GROUP_SIZES:
        raise ModelLoadError(f"{field}.group_size: {g!r} is not supported (int4 kernels: group "
                             f"{', '.join(map(str, GROUP_SIZES))})")
    return g


class CtInt4Decoder(QuantDecoder):
    name = "ct-int4"
    exec_format = "int4"
    tag = TAG

    def __init__(self, group_size: int, stored: dict, field: str):
        self.group_size = group_size
        super().__init__(stored, field)

    def describe(self) -> str:
        return f"compressed-tensors int4 g{self.group_size}"

    def scan(self) -> tuple[dict, set]:
        out, quantised = {}, set()
        for name, info in self.stored.items():
            if not name.endswith(_SUFFIXES):
                out[name] = info
                continue
            if not name.endswith("weight_packed"):
                continue
            base = name[: -len("_packed")]              # X.weight
            if base + "_zero_point" in self.stored:
                raise ModelLoadError(f"{info.file}: '{base}_zero_point': asymmetric int4 is not supported")
            scale = self.need(base + "_scale")
            k = info.shape[1] * 8 if len(info.shape) == 2 else 0
            want = (info.shape[0], k // self.group_size) if k else None
            if info.dtype != "I32" or want is None:
                raise ModelLoadError(f"{info.file}: '{name}' must be int32 [out, in/8], got {info.dtype} "
                                     f"{list(info.shape)}")
            if tuple(scale.shape) != want or k % self.group_size:
                raise ModelLoadError(f"{scale.file}: scale tensor '{scale.name}' has shape {list(scale.shape)}, "
                                     f"but '{name}' {list(info.shape)} at group {self.group_size} needs {list(want)}")
            out[base] = logical(info, base, (info.shape[0], k), TAG)
            quantised.add(base)
        return out, quantised

    def _packed(self, reader, name: str) -> Packed:
        words = reader.get(name + "_packed")                       # int32 [N, K/8]
        scale = reader.get(name + "_scale")                        # [N, K/g]
        s16 = scale.to(torch.float16)
        if not torch.equal(s16.to(scale.dtype), scale):
            bad = int((s16.to(scale.dtype) != scale).sum())
            raise ModelLoadError(f"scale tensor '{name}_scale': {bad} of its {scale.dtype} values are not exact "
                                 "in fp16, the int4 kernels' scale type (not rounded; not supported yet)")
        codes = words.contiguous().view(torch.uint8)               # [N, K/2]: little-endian words
        return Packed("int4", self.group_size, codes, s16, (words.shape[0], words.shape[1] * 8))
