"""`freetoken quantize` round trip: its output is read back by compressed-tensors' own
decompressor and by transformers, and by us; logits agree."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import random_prompt, reference_model
from formats_util import assert_matches
from freetoken_py.core import SamplingParams
from freetoken_py.llm import LLM

pytest.importorskip("compressed_tensors")
pytest.importorskip("accelerate")


def first_logits(path, backend="torch"):
    llm = LLM(path, dtype="float32", show_progress=False, backend=backend, enable_prefix_cache=False, expert_cache="off")
    llm.add_request(random_prompt(12, 1), SamplingParams(max_tokens=1, temperature=0))
    return llm.runner.forward_batch(llm.scheduler.schedule())[0]


def theirs(path):
    with torch.no_grad():
        return reference_model(path)(torch.tensor([random_prompt(12, 1)])).logits[0, -1]


def _quantize(src, out, to):
    proc = subprocess.run([sys.executable, "-m", "freetoken_py", "quantize", str(src), str(out), "--to", to],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out


def _shards(path):
    t = {}
    for f in sorted(path.glob("*.safetensors")):
        t.update(load_file(f))
    return t


def test_quantize_int4_round_trip(checkpoint_factory, tmp_path):
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    out = _quantize(checkpoint_factory("qwen3_moe_step2"), tmp_path / "q4", "int4")   # every width % 32 == 0
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "pack-quantized" and cfg["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert cfg["ignore"] == ["lm_head"]
    assert len(list(out.glob("model-*.safetensors"))) == 5          # outside the layers + one per layer
    t = _shards(out)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True,
                                                                             strategy="group", group_size=32))
    from freetoken_py.models.loader import open_checkpoint

    ckpt = open_checkpoint(out)
    reader = ckpt.reader()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.5.up_proj.weight"):
        b = name.removesuffix("weight")
        sd = {k: t[b + k] for k in ("weight_packed", "weight_scale", "weight_shape")}
        sd["weight_scale"] = sd["weight_scale"].float()
        ref = PackedQuantizationCompressor.decompress(sd, scheme)["weight"].float()
        assert torch.equal(reader.packed(name).dequantize(), ref)      # compressed-tensors reads what we read
    ours = first_logits(out)
    assert (ours - theirs(out)).abs().max().item() <= 5e-3          # transformers: CT integration, bf16 experts
    assert (first_logits(out, "cpu") - ours).abs().max().item() <= 0.1


def test_quantize_int4_keeps_a_width_the_group_does_not_divide_float(checkpoint_factory, tmp_path):
    # qwen3_moe's experts are 48 wide: their down projections stay float and join the ignore list
    out = _quantize(checkpoint_factory("qwen3_moe"), tmp_path / "q4", "int4")
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.1.mlp.experts.0.down_proj" in cfg["ignore"]
    t = _shards(out)
    assert t["model.layers.1.mlp.experts.0.down_proj.weight"].dtype == torch.float32
    assert "model.layers.1.mlp.experts.0.up_proj.weight_packed" in t
    first_logits(out)   # loads (the bank is built from float rows where the checkpoint has no packed ones)


def test_quantize_fp8_round_trip(checkpoint_factory, tmp_path):
    out = _quantize(checkpoint_factory("qwen3_moe"), tmp_path / "f8", "fp8")
    t = _shards(out)
    assert t["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert t["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (1, 1)
    ours = first_logits(out)
    assert (ours - theirs(out)).abs().max().item() <= 1e-4           # transformers' own fp8 dequantisation
    assert (first_logits(out, "cpu") - ours).abs().max().item() <= 1e-4


def test_quantize_refuses_to_overwrite_and_bad_target(checkpoint_factory, tmp_path):
    src = checkpoint_factory("qwen3_moe")
    (tmp_path / "exists").mkdir()
    for args, want in (([str(tmp_path / "exists"), "--to", "int4"], "already exists"),
                       ([str(tmp_path / "new"), "--to", "int3"], "--to must be one of")):
        proc = subprocess.run([sys.executable, "-m", "freetoken_py", "quantize", str(src), *args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and want in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "new").exists()


def _decompressed_copy(out, dst, decompress):
    """`out` with every packed weight replaced by compressed-tensors' own decompression (fp32),
    as a plain checkpoint transformers runs without any quantisation code."""
    from safetensors.torch import save_file

    t = _shards(out)
    plain = {n: v for n, v in t.items() if not n.endswith(("weight_packed", "weight_scale", "weight_shape",
                                                            "weight_global_scale"))}
    for n in t:
        if n.endswith("weight_packed"):
            plain[n.removesuffix("_packed")] = decompress(t, n.removesuffix("weight_packed"))
    dst.mkdir()
    save_file(plain, dst / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_quantize_int4_logits_equal_compressed_tensors_decompression(checkpoint_factory, tmp_path):
    """The 1e-4 check of the round trip: transformers on compressed-tensors' own fp32
    decompression of our output (its CT integration runs the experts in bf16: 5e-3 above)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True,
                                                                             strategy="group", group_size=32))

    def decompress(t, b):
        sd = {k: t[b + k] for k in ("weight_packed", "weight_scale", "weight_shape")}
        sd["weight_scale"] = sd["weight_scale"].float()
        return PackedQuantizationCompressor.decompress(sd, scheme)["weight"].float()

    src = checkpoint_factory("qwen3_moe_step2", torch.bfloat16)          # bf16 scales, as a bf16 release has
    out = _quantize(src, tmp_path / "q4", "int4")
    ref = theirs(_decompressed_copy(out, tmp_path / "plain", decompress))
    assert (first_logits(out) - ref).abs().max().item() <= 1e-4


def test_quantize_nvfp4_round_trip(checkpoint_factory, tmp_path):
    """--to nvfp4 writes compressed-tensors nvfp4-pack-quantized: its decompressor reads exactly
    our values (and its bf16 output is ours rounded), its config parses, and the logits of both
    backends equal transformers on the decompressed weights within 1e-4."""
    from compressed_tensors.compressors import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    from freetoken_py.models.loader import open_checkpoint

    out = _quantize(checkpoint_factory("qwen3_moe"), tmp_path / "fp4", "nvfp4")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)                       # compressed-tensors reads the config
    assert parsed.format == CompressionFormat.nvfp4_pack_quantized.value and qc["ignore"] == ["lm_head"]
    args = parsed.config_groups["group_0"].weights
    scheme = QuantizationScheme(targets=["Linear"], weights=args)

    def decompress(t, b):
        p = t[b + "weight_packed"]
        x = unpack_fp4_from_uint8(p, p.shape[0], p.shape[1] * 2, dtype=torch.float32)
        return dequantize(x_q=x, scale=t[b + "weight_scale"].float(), args=args,
                          global_scale=t[b + "weight_global_scale"], dtype=torch.float32)

    t = _shards(out)
    reader = open_checkpoint(out).reader()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.5.down_proj.weight"):
        b = name.removesuffix("weight")
        mine = reader.packed(name).dequantize()
        assert torch.equal(mine, decompress(t, b))
        sd = {k: t[b + k] for k in ("weight_packed", "weight_scale", "weight_global_scale")}
        assert torch.equal(NVFP4PackedCompressor.decompress(sd, scheme)["weight"], mine.to(torch.bfloat16))
    ref = theirs(_decompressed_copy(out, tmp_path / "plain", decompress))
    for backend in ("torch", "cpu"):          # cpu: int8 activations on AVX2 (formats_util.assert_matches)
        assert_matches(first_logits(out, backend), ref, backend)
