"""Checkpoint weight formats: one decoder per `quant_method` / format, between the tensors a
checkpoint stores and the logical tensors a model file names (`...q_proj.weight`).

    decoder = decoder_for(quant_config, stored, where)   # stored: name -> TensorInfo (safetensors headers)
    decoder.logical          # logical name -> TensorInfo with the logical shape (what weights.validate checks)
    decoder.packed(reader, name)   # a `Packed` weight in an execution format (fp8, int4, nvfp4), or None if stored plain
    decoder.get(reader, name)      # the float tensor (dequantised where packed)

A model family names only logical tensors, so every family gets every format. Decoders import
nothing above `quant`; see docs/formats.md for the layouts and what each one checks.
"""
from __future__ import annotations

from freetoken_py.errors import ModelLoadError
from freetoken_py.formats.base import PlainDecoder
from freetoken_py.formats.packed import EXEC_FORMATS, Packed, cat_rows

LOADS = ("unquantised bf16 / fp16 / fp32", "fp8 (block-scaled e4m3, weight_scale_inv)",
         "compressed-tensors pack-quantized int4 (symmetric, group 32 / 64 / 128)",
         "compressed-tensors nvfp4-pack-quantized (group 16)", "ModelOpt NVFP4 (group 16)",
         "mxfp4 (e8m0 scales per 32, gpt-oss)")
LATER = {"gptq": "GPTQ", "awq": "AWQ", "bitsandbytes": "bitsandbytes", "gguf": "GGUF",
         "hqq": "HQQ", "eetq": "EETQ", "fbgemm_fp8": "FBGEMM FP8", "torchao": "torchao", "quark": "Quark"}

LOGICAL_TAGS = ("FP8_BLOCK", "CT_INT4", "NVFP4", "MXFP4")   # the dtype a decoder gives its packed logical tensors

__all__ = ["EXEC_FORMATS", "LOADS", "LOGICAL_TAGS", "Packed", "cat_rows", "decoder_for", "find_quant_config", "unsupported"]


def unsupported(field: str, what: str) -> ModelLoadError:
    """One line: the field, what it holds, and the formats that do load."""
    return ModelLoadError(f"{field}: {what} is not supported; the formats that load: {'; '.join(LOADS)}")


def find_quant_config(cfg: dict, extra: dict | None = None) -> tuple[dict | None, str]:
    """(quantization_config, the field it came from): config.json's own, a multimodal wrapper's
    text_config's (Kimi K2.5 / K2.6), or hf_quant_config.json's (`extra`, ModelOpt)."""
    for key, holder in (("quantization_config", cfg), ("text_config.quantization_config", cfg.get("text_config"))):
        q = holder.get("quantization_config") if isinstance(holder, dict) else None
        if q is not None:
            if not isinstance(q, dict):
                raise ModelLoadError(f"config.json: {key} must be an object")
            return q, f"config.json: {key}"
    if extra:
        return extra.get("quantization", extra), "hf_quant_config.json"
    return None, "config.json"


def decoder_for(qcfg: dict | None, stored: dict, field: str = "config.json: quantization_config"):
    """The decoder of this checkpoint's format (a one-line ModelLoadError for one that does not load)."""
    if qcfg is None:
        return PlainDecoder(stored)
    method = qcfg.get("quant_method", qcfg.get("quant_algo"))
    if method == "fp8":
        from freetoken_py.formats.fp8 import Fp8BlockDecoder

        return Fp8BlockDecoder(qcfg, stored, field)
    if method == "mxfp4":
        from freetoken_py.formats.mxfp4 import mxfp4_decoder

        return mxfp4_decoder(qcfg, stored, field)
    if method == "compressed-tensors":
        from freetoken_py.formats.ct_int4 import ct_decoder

        return ct_decoder(qcfg, stored, field)
    if isinstance(method, str) and (method.lower() == "modelopt" or "quant_algo" in qcfg):
        from freetoken_py.formats.nvfp4 import modelopt_decoder

        return modelopt_decoder(qcfg, stored, field)
    if isinstance(method, str) and method.lower() in LATER:
        raise unsupported(f"{field}.quant_method", f"'{method}' ({LATER[method.lower()]}, planned for a later release)")
    raise unsupported(f"{field}.quant_method", f"{method!r}")
