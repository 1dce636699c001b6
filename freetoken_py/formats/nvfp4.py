"""NVFP4 checkpoints: e2m1 values two per byte, e4m3 scales per 16 columns, one fp32 scale per tensor.

compressed-tensors `nvfp4-pack-quantized` (llm-compressor's NVFP4 / NVFP4A16 presets), per linear X:
    `X.weight_packed` U8 [out, in/2] (low nibble = even column; nibble = sign bit 3 | e2m1 index),
    `X.weight_scale` F8_E4M3 [out, in/16], `X.weight_global_scale` F32 [1], a reciprocal:
    W = e2m1 * (weight_scale / weight_global_scale)   (`input_global_scale`: dropped)
NVIDIA ModelOpt (`quant_method: modelopt`, `quant_algo: NVFP4`, in config.json or
hf_quant_config.json), per linear X:
    `X.weight` U8 [out, in/2] (same nibbles), `X.weight_scale` F8_E4M3 [out, in/16],
    `X.weight_scale_2` F32 scalar, a multiplier:  W = e2m1 * (weight_scale * weight_scale_2)
    (`input_scale`, `k_scale`, `v_scale`: static activation scales, dropped)

Both go to the `nvfp4` execution format as stored: the codes and e4m3 bytes copied, the
per-tensor scale folded into each row's fp32 factor (quant/nvfp4.py), so the values are the
checkpoint's own. What is stored unquantised (the ignore list: `ignore`, `exclude_modules`,
`modules_to_not_convert`) stays as stored.
"""
from __future__ import annotations

import torch

from freetoken_py.errors import ModelLoadError
from freetoken_py.formats.base import QuantDecoder, logical
from freetoken_py.formats.packed import Packed
from freetoken_py.quant.nvfp4 import GROUP, exec_scales

TAG = "NVFP4"
GROUP_SIZES = (GROUP,)


def _check_grid(scale, name: str, info, group: int) -> None:
    want = (info.shape[0], info.shape[1] * 2 // group) if len(info.shape) == 2 else None
    if want is None or tuple(scale.shape) != want or (info.shape[1] * 2) % group:
        raise ModelLoadError(f"{scale.file}: scale tensor '{scale.name}' has shape {list(scale.shape)}, but "
                             f"'{name}' {list(info.shape)} (two e2m1 values per byte) at group {group} needs "
                             f"{list(want) if want else '[out, in/16]'}")
    if scale.dtype != "F8_E4M3":
        raise ModelLoadError(f"{scale.file}: scale tensor '{scale.name}' has dtype {scale.dtype} (NVFP4 group "
                             "scales are F8_E4M3)")


def _check_global(info, what: str) -> None:
    if info.dtype != "F32" or len(info.shape) > 1 or (info.shape and info.shape[0] != 1):
        raise ModelLoadError(f"{info.file}: {what} '{info.name}' must be one F32 value, got {info.dtype} "
                             f"{list(info.shape)}")


def _factor(t: torch.Tensor, name: str) -> float:
    v = float(t.reshape(-1)[0])
    if not (v > 0 and v < float("inf")):
        raise ModelLoadError(f"'{name}' is {v} (a per-tensor NVFP4 scale must be positive and finite)")
    return v


class _Nvfp4Decoder(QuantDecoder):
    exec_format = "nvfp4"
    tag = TAG
    group_size = GROUP
    _codes = ""                 # the packed tensor's suffix after "X."
    _global = ""                # the per-tensor scale's suffix
    _dropped: tuple = ()

    def scan(self) -> tuple[dict, set]:
        out, quantised = {}, set()
        for name, info in self.stored.items():
            if name.endswith(self._dropped) or name.endswith((".weight_scale", "." + self._global)):
                continue
            base = name[: -len(self._codes)] + "weight" if name.endswith("." + self._codes) else None
            if base is None or (self._codes == "weight" and info.dtype != "U8"):
                out[name] = info
                continue
            if info.dtype != "U8" or len(info.shape) != 2:
                raise ModelLoadError(f"{info.file}: '{name}' must be uint8 [out, in/2] (two e2m1 values per byte), "
                                     f"got {info.dtype} {list(info.shape)}")
            stem = base[: -len("weight")]
            _check_grid(self.need(base + "_scale"), name, info, self.group_size)
            _check_global(self.need(stem + self._global, "global scale"), "global scale")
            out[base] = logical(info, base, (info.shape[0], info.shape[1] * 2), TAG)
            quantised.add(base)
        return out, quantised

    def _packed(self, reader, name: str) -> Packed:
        stem = name[: -len("weight")]
        codes = reader.get(stem + self._codes)                      # uint8 [N, K/2]
        scale = reader.get(name + "_scale")                         # float8_e4m3fn [N, K/16]
        f = self._row_factor(_factor(reader.get(stem + self._global), stem + self._global))
        return Packed("nvfp4", self.group_size, codes.contiguous(), exec_scales(scale, f),
                      (codes.shape[0], codes.shape[1] * 2))


class CtNvfp4Decoder(_Nvfp4Decoder):
    name = "ct-nvfp4"
    _codes = "weight_packed"
    _global = "weight_global_scale"
    _dropped = ("input_global_scale", "weight_zero_point", "weight_shape")

    def describe(self) -> str:
        return "compressed-tensors nvfp4 g16"

    @staticmethod
    def _row_factor(gs: float) -> float:
        return -gs            # a reciprocal: the kernels divide (quant/nvfp4.py)


class ModeloptNvfp4Decoder(_Nvfp4Decoder):
    name = "modelopt-nvfp4"
    _codes = "weight"
    _global = "weight_scale_2"
    _dropped = ("input_scale", "k_scale", "v_scale")

    def describe(self) -> str:
        return "ModelOpt nvfp4 g16"

    @staticmethod
    def _row_factor(ws2: float) -> float:
        return ws2            # a multiplier


def check_ct_weights(field: str, w) -> None:
    """compressed-tensors' NVFP4 weight args: 4-bit float, tensor_group, group 16, symmetric."""
    from freetoken_py.formats import unsupported

    if not isinstance(w, dict):
        raise ModelLoadError(f"{field}: missing")
    want = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "symmetric": True}
    for key, value in want.items():
        if w.get(key) != value:
            raise unsupported(f"{field}.{key}", f"{w.get(key)!r} (nvfp4-pack-quantized loads {want})")
    g = w.get("group_size")
    if g not in GROUP_SIZES:
        raise ModelLoadError(f"{field}.group_size: {g!r} is not supported (nvfp4 kernels: group 16)")
    sd = w.get("scale_dtype")
    if sd not in (None, "float8_e4m3fn", "torch.float8_e4m3fn"):
        raise ModelLoadError(f"{field}.scale_dtype: {sd!r} is not supported (nvfp4 loads float8_e4m3fn scales)")


def modelopt_decoder(qcfg: dict, stored: dict, field: str):
    from freetoken_py.formats import unsupported

    algo = qcfg.get("quant_algo")
    if not isinstance(algo, str) or algo.upper() != "NVFP4":
        later = " (planned for a later release)" if isinstance(algo, str) else ""
        raise unsupported(f"{field}.quant_algo", f"ModelOpt {algo!r}{later}")
    g = qcfg.get("group_size", GROUP)
    if g not in GROUP_SIZES:
        raise ModelLoadError(f"{field}.group_size: {g!r} is not supported (nvfp4 kernels: group 16)")
    return ModeloptNvfp4Decoder(stored, field)
