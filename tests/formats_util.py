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


# ---- NVFP4: compressed-tensors nvfp4-pack-quantized (its own compressor) and ModelOpt (the documented rule) ----
def _nvfp4_args():
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", symmetric=True, dynamic=False,
                            group_size=16, scale_dtype=torch.float8_e4m3fn)


def _nvfp4_scales(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(group scales e4m3 [N, K/16], global scale gs fp32 [1]) as compressed-tensors' min-max
    observer makes them: gs = 448 * 6 / amax(tensor), scale = amax(group) / 6 * gs in e4m3."""
    n, k = t.shape
    gs = (448.0 * 6.0 / t.float().abs().amax()).reshape(1).to(torch.float32)
    amax = t.float().view(n, k // 16, 16).abs().amax(-1)
    return (amax / 6.0 * gs).clamp(min=2.0 ** -9, max=448.0).to(torch.float8_e4m3fn), gs


def ct_nvfp4_config(ignore: tuple[str, ...] = ()) -> dict:
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                          "weights": {"num_bits": 4, "type": "float", "symmetric": True,
                                                      "strategy": "tensor_group", "group_size": 16,
                                                      "dynamic": False, "observer": "minmax"}}},
            "ignore": ["lm_head", *[f"re:.*{i}.*" for i in ignore]]}


def write_ct_nvfp4(src: Path, dst: Path, ignore: tuple[str, ...] = ("self_attn.o_proj",)) -> Path:
    """Every targeted linear compressed by compressed-tensors' own NVFP4PackedCompressor."""
    from compressed_tensors.compressors import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=_nvfp4_args())
    cfg = _copy_side_files(src, dst)
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            if not quantisable(name, ignore):
                out[name] = t
                continue
            scale, gs = _nvfp4_scales(t)
            packed = NVFP4PackedCompressor.compress(
                {"weight": t.float(), "weight_scale": scale.float(), "weight_global_scale": gs}, scheme)
            base = name[: -len("weight")]
            for key, v in packed.items():
                out[base + key] = v.contiguous()
    save_file(out, dst / "model.safetensors")
    cfg["quantization_config"] = ct_nvfp4_config(ignore)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def ct_nvfp4_reference(path: Path, name: str) -> torch.Tensor:
    """compressed-tensors' own dequantisation of `name`, in fp32: its unpacker and its dequantize
    (the pieces NVFP4PackedCompressor.decompress runs, which then rounds the result to bf16)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    t = load_file(path / "model.safetensors")
    base = name[: -len("weight")]
    packed = t[base + "weight_packed"]
    m, n = packed.shape
    x = unpack_fp4_from_uint8(packed, m, n * 2, dtype=torch.float32)
    return dequantize(x_q=x, scale=t[base + "weight_scale"].float(), args=_nvfp4_args(),
                      global_scale=t[base + "weight_global_scale"], dtype=torch.float32)


def ct_nvfp4_decompress(path: Path, name: str) -> torch.Tensor:
    """NVFP4PackedCompressor.decompress's own output for `name` (bf16, as it returns it)."""
    from compressed_tensors.compressors import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme

    t = load_file(path / "model.safetensors")
    base = name[: -len("weight")]
    sd = {k: t[base + k] for k in ("weight_packed", "weight_scale", "weight_global_scale")}
    return NVFP4PackedCompressor.decompress(sd, QuantizationScheme(targets=["Linear"], weights=_nvfp4_args()))["weight"]


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def write_modelopt_nvfp4(src: Path, dst: Path, ignore: tuple[str, ...] = ("self_attn.o_proj",),
                         in_config: bool = False, select=None, exclude_modules: list[str] | None = None) -> Path:
    """ModelOpt's NVFP4 layout by its documented rule: weight_scale_2 = amax / (6 * 448) (a
    multiplier), weight_scale = e4m3(amax(group) / 6 / weight_scale_2), codes = nearest e2m1 of
    w / (weight_scale * weight_scale_2) (compressed-tensors' rounding, written with its packer),
    plus an input_scale; the config in hf_quant_config.json (or config.json's quantization_config).
    `select(name)`: which weights to pack, instead of `quantisable(name, ignore)` (e.g. MLA and indexer
    names, which `_LINEAR` does not know); `exclude_modules`: the config's list, written as given."""
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization.lifecycle.forward import quantize

    cfg = _copy_side_files(src, dst)
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            if not (select(name) if select is not None else quantisable(name, ignore)):
                out[name] = t
                continue
            n, k = t.shape
            ws2 = (t.float().abs().amax() / (6.0 * 448.0)).reshape(())
            amax = t.float().view(n, k // 16, 16).abs().amax(-1)
            ws = (amax / 6.0 / ws2).clamp(min=2.0 ** -9, max=448.0).to(torch.float8_e4m3fn)
            q = quantize(x=t.float(), scale=ws.float() * ws2, zero_point=None, args=_nvfp4_args(), global_scale=None)
            base = name[: -len("weight")]
            out[name] = pack_fp4_to_uint8(q)
            out[base + "weight_scale"], out[base + "weight_scale_2"] = ws, ws2.to(torch.float32)
            out[base + "input_scale"] = torch.tensor(1.0 / 448.0)
    save_file(out, dst / "model.safetensors")
    if exclude_modules is None:
        exclude_modules = ["lm_head", *[f"*{i}*" for i in ignore]]
    q = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": exclude_modules}
    if in_config:
        cfg["quantization_config"] = {"quant_method": "modelopt", **q}
    else:
        (dst / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt", "version": "0.29.0"},
                                                              "quantization": q}))
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def modelopt_reference(path: Path, name: str) -> torch.Tensor:
    """ModelOpt's documented dequantisation: e2m1 * (weight_scale * weight_scale_2), fp32."""
    t = load_file(path / "model.safetensors")
    base = name[: -len("weight")]
    c = t[name].to(torch.int64)
    v = torch.stack((_E2M1[c & 15], _E2M1[c >> 4]), -1).reshape(c.shape[0], -1)
    eff = t[base + "weight_scale"].float() * t[base + "weight_scale_2"].float()
    return v * eff.repeat_interleave(16, 1)


def dequantised_copy(path: Path, dst: Path, reference, stored_suffixes: tuple[str, ...], codes_suffix: str) -> Path:
    """The same model with every packed weight replaced by `reference(path, name)` (no quantization_config)."""
    dst.mkdir(parents=True, exist_ok=True)
    t = load_file(path / "model.safetensors")
    out = {n: v for n, v in t.items() if not n.endswith(stored_suffixes)}
    for n, v in t.items():
        if n.endswith(codes_suffix) and v.dtype == torch.uint8:
            w = n[: -len(codes_suffix)] + "weight"
            out[w] = reference(path, w)
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    for side in path.iterdir():
        if side.suffix != ".safetensors" and side.name not in ("config.json", "hf_quant_config.json"):
            shutil.copy(side, dst / side.name)
    return dst


def assert_matches(ours, theirs, backend):
    """nvfp4 logits against their reference: the torch backend, and the cpu kernels with fp32
    activations (FREETOKEN_INT_ACT=fp32, CPUs without AVX2), within 1e-4; the cpu kernels with int8
    activations (x86 AVX2, docs/kernels.md) within the KL budget of the int4 experts
    (tests/test_formats_ct_int4.py). A wrong nibble, scale or group moves the logits by far more
    (fp4 against the float model: > 1e-2 max, tests/test_formats_nvfp4.py)."""
    from freetoken_py.kernels._dots import INT_ACT

    if backend == "torch" or INT_ACT != "int8":
        assert (ours - theirs).abs().max().item() <= 1e-4, backend
        return
    kl = torch.nn.functional.kl_div(torch.log_softmax(ours, -1), torch.log_softmax(theirs, -1), log_target=True,
                                    reduction="sum").item()
    assert kl <= 2.5e-4 and (ours - theirs).abs().max().item() <= 0.1, (kl, backend)
