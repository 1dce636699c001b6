"""`freetoken quantize --to int4|fp8|nvfp4 SRC OUT`: write what we read, for cluster engines too.

    int4  compressed-tensors `pack-quantized`, symmetric, group 32 (`weight_packed` int32 [N, K/8],
          `weight_scale` [N, K/32]: bf16 for bf16 sources, else fp16, `weight_shape`), scale = amax / 7.5
          per group and q = round(w / scale) clamped to [-8, 7], as compressed-tensors' min-max
          observer and quantizer do
    fp8   block-scaled e4m3 (`quant_method: fp8`, `weight_block_size [128, 128]`, float32
          `weight_scale_inv`; the DeepSeek-V3 layout vLLM, SGLang and transformers load)
    nvfp4 compressed-tensors `nvfp4-pack-quantized` (`weight_packed` uint8 [N, K/2] e2m1 pairs,
          `weight_scale` e4m3 [N, K/16], `weight_global_scale` fp32 [1] = 448 * 6 / amax, as its
          min-max observer and NVFP4A16 preset; weights only)

Every linear of the model file is converted (attention, dense and shared MLPs, routed experts);
embeddings, norms, routers and lm_head stay as stored, and so does an int4 linear whose input width
is not a multiple of 32 (16 for nvfp4) (it joins the `ignore` list). One layer at a time, one shard per layer
(bounded memory: one layer's tensors at once), then the index; OUT must not exist yet.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from freetoken_py.errors import FreetokenError
from freetoken_py.models.loader import open_checkpoint
from freetoken_py.models.weights import expected_shapes
from freetoken_py.quant.fp8 import quantize_fp8_blocks
from freetoken_py.quant.nvfp4 import GROUP as NVFP4_GROUP
from freetoken_py.quant.nvfp4 import quantize_nvfp4, split_scales
from freetoken_py.utils.progress import progress_bar

TARGETS = ("int4", "fp8", "nvfp4")
INT4_GROUP = 32
FP8_BLOCK = (128, 128)


def pack_int4_ct(w: torch.Tensor, group: int = INT4_GROUP) -> dict[str, torch.Tensor]:
    """w [N, K] -> compressed-tensors pack-quantized tensors (symmetric int4, `group` columns per scale)."""
    n, k = w.shape
    wf = w.float().view(n, k // group, group)
    # bf16 sources keep bf16 scales; others get fp16 ones (what the int4 kernels hold, exactly)
    sdt = torch.bfloat16 if w.dtype == torch.bfloat16 else torch.float16
    scale = (wf.abs().amax(-1) / 7.5).clamp(min=torch.finfo(torch.float16).tiny).to(sdt)   # [N, K/g]
    q = torch.round(wf / scale.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int16).view(n, k) + 8  # 0..15
    nib = q.view(n, k // 2, 2)
    byte = (nib[..., 0] | (nib[..., 1] << 4)).to(torch.uint8)             # low nibble = even element
    return {"weight_packed": byte.view(torch.int32).contiguous(), "weight_scale": scale.contiguous(),
            "weight_shape": torch.tensor([n, k], dtype=torch.int64)}


def pack_nvfp4_ct(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """w [N, K] -> compressed-tensors nvfp4-pack-quantized tensors (one global scale per tensor)."""
    codes, scales = quantize_nvfp4(w, NVFP4_GROUP, per_tensor=True)
    s8, f = split_scales(scales)
    return {"weight_packed": codes, "weight_scale": s8.contiguous().view(torch.float8_e4m3fn),
            "weight_global_scale": (-f[:1, 0]).contiguous()}


def _linear_names(ckpt) -> set[str]:
    """The model file's linear weights (2-D `.weight` of attention, MLPs and experts)."""
    s = ckpt.scheme
    out = set()
    for name, shape in expected_shapes(ckpt.args, s).items():
        if len(shape) != 2 or not name.endswith(".weight") or name.endswith(s.router):
            continue
        if name.startswith("model.embed_tokens") or name == "lm_head.weight":
            continue
        out.add(name)
    return out


def quantize_checkpoint(src: Path, out: Path, to: str, show_progress: bool = True) -> Path:
    if to not in TARGETS:
        raise FreetokenError(f"--to must be one of {', '.join(TARGETS)} (got {to!r})")
    if out.exists():
        raise FreetokenError(f"{out}: already exists; quantize writes a new directory and never overwrites one")
    ckpt = open_checkpoint(src)
    if ckpt.decoder.exec_format is not None:
        raise FreetokenError(f"{src}: already quantised ({ckpt.decoder.describe()}); quantize reads float checkpoints")
    linears, ignore = _linear_names(ckpt), ["lm_head"]
    groups = _by_layer(ckpt)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    reader, weight_map = ckpt.reader(), {}
    try:
        with progress_bar(f"Quantising {src.name} to {to}", total=len(groups), enabled=show_progress) as advance:
            for i, names in enumerate(groups):
                shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                tensors = {}
                for name in names:
                    tensors.update(_convert(name, reader.get(name), to, name in linears, ignore))
                _save(tensors, tmp / shard)
                weight_map.update({n: shard for n in tensors})
                advance()
    finally:
        reader.close()
    _write_config(src, tmp, to, ignore)
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    tmp.rename(out)
    return out


def _by_layer(ckpt) -> list[list[str]]:
    """Tensor names per shard: everything outside the layers first, then one shard per layer."""
    head, _, tail = ckpt.scheme.layer.partition("{i}")
    layers: dict[int, list[str]] = {}
    rest = []
    for name in ckpt.logical:
        idx = name[len(head):].split(tail, 1)[0] if name.startswith(head) else ""
        (layers.setdefault(int(idx), []) if idx.isdigit() else rest).append(name)
    return [rest] + [layers[i] for i in sorted(layers)]


def _convert(name: str, w: torch.Tensor, to: str, linear: bool, ignore: list) -> dict[str, torch.Tensor]:
    if not linear:
        return {name: w.contiguous()}
    if to == "fp8":
        q, s = quantize_fp8_blocks(w, FP8_BLOCK)
        return {name: q, name + "_scale_inv": s}
    if w.shape[1] % (INT4_GROUP if to == "int4" else NVFP4_GROUP):
        ignore.append(name.removesuffix(".weight"))
        return {name: w.contiguous()}
    base = name.removesuffix("weight")
    return {base + k: v for k, v in (pack_int4_ct(w) if to == "int4" else pack_nvfp4_ct(w)).items()}


def _save(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def _ct_config(fmt: str, ignore: list, **weights) -> dict:
    """A compressed-tensors `quantization_config`: one group of static, symmetric 4-bit weights
    on every Linear (`weights` adds type, strategy, group_size), no activation quantisation."""
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                          "weights": {"num_bits": 4, "symmetric": True, "dynamic": False,
                                                      "observer": "minmax", **weights}}},
            "ignore": ignore}


def _write_config(src: Path, dst: Path, to: str, ignore: list) -> None:
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    if to == "fp8":
        q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK),
             "modules_to_not_convert": ignore}
    elif to == "nvfp4":
        q = _ct_config("nvfp4-pack-quantized", ignore, type="float", strategy="tensor_group", group_size=NVFP4_GROUP)
    else:
        q = _ct_config("pack-quantized", ignore, type="int", strategy="group", group_size=INT4_GROUP)
    cfg["quantization_config"] = q
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))

