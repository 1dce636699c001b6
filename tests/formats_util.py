"""Writers of quantised tiny checkpoints in the real on-disk layouts (for tests/test_formats_*.py):
FP8 block by the documented rule (pure torch), compressed-tensors int4 with compressed-tensors'
own compressor."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from conftest import random_prompt, reference_model
from freetoken_py.core import SamplingParams
from freetoken_py.llm import LLM
from freetoken_py.quant.fp8 import quantize_fp8_blocks

_LINEAR = re.compile(r"(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|experts\.\d+\.(gate|up|down)_proj"
                     r"|experts\.\d+\.w[123]|shared_experts?\.(gate|up|down)_proj)\.weight$")


def first_logits(path, backend: str, **kw) -> tuple[torch.Tensor, LLM]:
    """Our last-position logits for the fixed 12-token prompt (float32, no prefix cache), and the LLM."""
    llm = LLM(path, dtype="float32", show_progress=False, backend=backend, enable_prefix_cache=False, **kw)
    llm.add_request(random_prompt(12, 1), SamplingParams(max_tokens=1, temperature=0))
    return llm.runner.forward_batch(llm.scheduler.schedule())[0], llm


def reference_logits(path) -> torch.Tensor:
    """transformers' last-position logits for the same prompt."""
    with torch.no_grad():
        return reference_model(path)(torch.tensor([random_prompt(12, 1)])).logits[0, -1]


def quantisable(name: str, ignore: tuple[str, ...] = ()) -> bool:
    return bool(_LINEAR.search(name)) and not any(i in name for i in ignore)


def _copy_side_files(src: Path, dst: Path) -> dict:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    return json.loads((src / "config.json").read_text())


def write_fp8(src: Path, dst: Path, block=(128, 128), ignore: tuple[str, ...] = ("self_attn.o_proj",),
              ue8m0: bool = False) -> Path:
    """Every targeted linear of `src` as e4m3 codes + weight_scale_inv (per tile amax / 448);
    the modules in `ignore` (and norms, embeddings, router, lm_head) stay as stored."""
    cfg = _copy_side_files(src, dst)
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            if not quantisable(name, ignore):
                out[name] = t
                continue
            w = t.float()
            if ue8m0:   # power-of-two scales (DeepSeek-V3.1's scale_fmt ue8m0)
                q, s = quantize_fp8_blocks(w, block)
                s = torch.pow(2.0, torch.ceil(torch.log2(s)))
                q = _requant(w, s, block)
            else:
                q, s = quantize_fp8_blocks(w, block)
            out[name], out[name + "_scale_inv"] = q, s
    save_file(out, dst / "model.safetensors")
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
          "modules_to_not_convert": ["lm_head", *ignore]}
    if ue8m0:
        qc["scale_fmt"] = "ue8m0"
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def _requant(w: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:
    bn, bk = block
    full = s.repeat_interleave(bn, 0)[: w.shape[0]].repeat_interleave(bk, 1)[:, : w.shape[1]]
    return (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)


def fp8_reference(path: Path, name: str) -> torch.Tensor:
    """The checkpoint's own dequantised value of `name`: w8 * s[r // bn, c // bk], float32."""
    cfg = json.loads((path / "config.json").read_text())
    bn, bk = cfg["quantization_config"]["weight_block_size"]
    t = load_file(path / "model.safetensors")
    w, s = t[name].float(), t[name + "_scale_inv"].float()
    return w * s.repeat_interleave(bn, 0)[: w.shape[0]].repeat_interleave(bk, 1)[:, : w.shape[1]]


def ct_int4_config(group_size: int = 32, ignore: tuple[str, ...] = ()) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": group_size,
                                                      "dynamic": False, "observer": "minmax"}}},
            "ignore": ["lm_head", *[f"re:.*{i}.*" for i in ignore]]}


def write_ct_int4(src: Path, dst: Path, group_size: int = 32, ignore: tuple[str, ...] = ("self_attn.o_proj",),
                  scale_dtype=torch.bfloat16, only_experts: bool = False, short_scales: bool = False) -> Path:
    """Every targeted linear packed by compressed-tensors' own PackedQuantizationCompressor
    (symmetric int4, scale = amax / 7.5 per group, as its min-max observer, in `scale_dtype`)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size))
    cfg = _copy_side_files(src, dst)
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            if not quantisable(name, ignore) or (only_experts and ".experts." not in name):
                out[name] = t
                continue
            n, k = t.shape
            amax = t.float().view(n, k // group_size, group_size).abs().amax(-1)
            scale = (amax / 7.5).clamp(min=1e-8)
            if short_scales:   # 4 significant bits: q * scale is exact even in bf16 (what CT's decompress computes in)
                e = torch.floor(torch.log2(scale))
                scale = torch.round(scale / 2**e * 8) / 8 * 2**e
            scale = scale.to(scale_dtype)
            packed = PackedQuantizationCompressor.compress(
                {"weight": t, "weight_scale": scale, "weight_zero_point": torch.zeros_like(scale, dtype=torch.int8)},
                scheme)
            base = name[: -len("weight")]
            for key, v in packed.items():
                out[base + key] = v
    save_file(out, dst / "model.safetensors")
    ignore_all = (*ignore, "self_attn", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj") if only_experts else ignore
    cfg["quantization_config"] = ct_int4_config(group_size, ignore_all)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def ct_reference(path: Path, name: str, group_size: int = 32) -> torch.Tensor:
    """compressed-tensors' own decompressor's value of `name` (float32)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size))
    t = load_file(path / "model.safetensors")
    base = name[: -len("weight")]
    sd = {k: t[base + k] for k in ("weight_packed", "weight_scale", "weight_shape")}
    sd["weight_scale"] = sd["weight_scale"].float()   # decompress computes in the scale's dtype: fp32 keeps q * s exact
    return PackedQuantizationCompressor.decompress(sd, scheme)["weight"].float()
