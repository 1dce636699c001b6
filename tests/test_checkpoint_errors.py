"""Malformed checkpoints give one-line errors that name the file and the tensor."""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken_py.errors import ModelLoadError, UnsupportedModelError
from freetoken_py.models.loader import load_model


@pytest.fixture
def ckpt(checkpoint_factory, tmp_path):
    src = checkpoint_factory("qwen3_moe")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _rewrite(path, mutate):
    tensors = load_file(path)
    mutate(tensors)
    save_file(tensors, path)


def _load_error(path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(path, "float32", show_progress=False)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_truncated_safetensors(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    msg = _load_error(ckpt)
    assert "model.safetensors" in msg and "truncated" in msg and "'" in msg  # names the tensor


def test_truncated_header(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    assert "model.safetensors" in _load_error(ckpt)


def test_wrong_shape(ckpt):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    _rewrite(ckpt / "model.safetensors", lambda t: t.__setitem__(name, torch.zeros(47, 64)))
    msg = _load_error(ckpt)
    assert name in msg and "[47, 64]" in msg and "[48, 64]" in msg and "model.safetensors" in msg


def test_missing_tensor(ckpt):
    name = "model.layers.0.self_attn.k_norm.weight"
    _rewrite(ckpt / "model.safetensors", lambda t: t.pop(name))
    msg = _load_error(ckpt)
    assert "missing tensor" in msg and name in msg


def test_extra_tensor(ckpt):
    _rewrite(ckpt / "model.safetensors", lambda t: t.__setitem__("model.layers.0.mystery.weight", torch.zeros(2)))
    msg = _load_error(ckpt)
    assert "model.layers.0.mystery.weight" in msg and "model.safetensors" in msg


def test_unsupported_dtype(ckpt):
    name = "model.norm.weight"
    _rewrite(ckpt / "model.safetensors", lambda t: t.__setitem__(name, torch.zeros(64, dtype=torch.int32)))
    msg = _load_error(ckpt)
    assert name in msg and "I32" in msg


def test_bad_config_missing_key(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["num_experts_per_tok"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    msg = _load_error(ckpt)
    assert "config.json" in msg and "num_experts_per_tok" in msg


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    assert "config.json" in _load_error(ckpt)


def test_config_shape_mismatch_is_reported_against_weights(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["moe_intermediate_size"] = 50
    (ckpt / "config.json").write_text(json.dumps(cfg))
    msg = _load_error(ckpt)
    assert "config.json implies" in msg


def test_unknown_architecture_lists_supported(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama4_ultra"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as info:
        load_model(ckpt, "float32", show_progress=False)
    msg = str(info.value)
    assert "llama4_ultra" in msg and "qwen3_moe" in msg and "mixtral" in msg and "olmoe" in msg


def test_sharded_index_names_missing_shard(checkpoint_factory, tmp_path):
    src = checkpoint_factory("qwen3_moe", dtype=torch.bfloat16, max_shard_size="100KB")
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    shard = sorted(dst.glob("*.safetensors"))[-1]
    shard.unlink()
    msg = _load_error(dst)
    assert shard.name in msg


def test_pickle_checkpoints_are_refused(tmp_path, checkpoint_factory):
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(checkpoint_factory("qwen3_moe") / "config.json", d)
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    msg = _load_error(d)
    assert "safetensors" in msg


def test_cli_reports_one_line_and_exit_code_2(ckpt):
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", 10**9))
    proc = subprocess.run([sys.executable, "-m", "freetoken_py", "run", "hello", "--model", str(ckpt)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("freetoken: error:") and "model.safetensors" in lines[-1]
    assert "Traceback" not in proc.stderr


def test_cli_missing_model_dir(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "freetoken_py", "run", "hi", "--model", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no such directory" in proc.stderr and "Traceback" not in proc.stderr


def _file_backed(ptr: int, files: set[str]) -> bool:
    """Whether address `ptr` lies in a mapping of one of `files` (Linux /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() in files:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                if start <= ptr < end:
                    return True
    return False


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe", "glm4_moe", "minimax_m2"])
@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_weights_larger_than_memory_fail_before_loading_with_the_fix(checkpoint_factory, monkeypatch, arch, stored):
    """The memory a float32 load holds (`weights.held_bytes`) is what the loaded model's tensors
    take outside the checkpoint's file mappings (read off /proc/self/maps: a tensor stored as
    float32 and used as is stays a view of the file, a cast or concatenated one is a copy); a
    machine that cannot hold that plus the stacking moment gets a one-line error with the fix
    before any weight is read, one that can loads."""
    import os

    from freetoken_py.models import loader
    from freetoken_py.models.weights import held_bytes

    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs Linux's /proc/self/maps")
    path = checkpoint_factory(arch, dtype=stored)
    files = {str(f.resolve()) for f in path.glob("*.safetensors")}
    model = loader.load_model(path, "float32", show_progress=False)
    w = model.weights
    tensors = [w.embed, w.final_norm, w.lm_head.weight]
    for lw in w.layers:
        tensors += [t for t in (lw.input_norm, lw.post_norm, lw.q_norm, lw.k_norm, lw.router_bias, lw.w13, lw.w2)
                    if t is not None]
        for lin in (lw.qkv, lw.o, lw.router, lw.mlp13, lw.mlp2, lw.shared13, lw.shared2):
            if lin is not None:
                tensors += [t for t in (lin.weight, lin.bias) if t is not None]
    unique = {t.data_ptr(): t for t in tensors}
    copies = sum(t.nbytes for p, t in unique.items() if not _file_backed(p, files))
    views = sum(t.nbytes for p, t in unique.items() if _file_backed(p, files))
    args, scheme = model.args, loader.model_module(model.args.model_type).SCHEME
    tensor_infos = loader.list_checkpoint_tensors(path)
    held, moment = held_bytes(args, scheme, tensor_infos, torch.float32)
    assert held == copies and (views > 0) == (stored == torch.float32)
    experts = sum(lw.w13.nbytes + lw.w2.nbytes for lw in w.layers if lw.w13 is not None)
    assert 0 < moment < experts and held_bytes(args, scheme, tensor_infos, torch.float32, True) == (held - experts, 0)
    del model, w, tensors, unique
    monkeypatch.setattr(loader, "host_memory_bytes", lambda: held + moment - 1)
    with pytest.raises(ModelLoadError) as err:
        loader.load_model(path, "float32", show_progress=False)
    msg = str(err.value)
    assert "\n" not in msg and "--expert-dtype int4" in msg and "--dtype bfloat16" in msg and "float32" in msg
    loader.load_model(path, "float32", show_progress=False, experts="skip")      # the dense part fits
    monkeypatch.setattr(loader, "host_memory_bytes", lambda: held + moment)
    loader.load_model(path, "float32", show_progress=False)


def test_cgroup_memory_limit_is_the_lowest_on_the_process_path(tmp_path):
    """cgroup_memory_limit on a hand-made cgroup tree: v2 takes the lowest `memory.max` on the
    process's path and its ancestors ("max": none), v1 the memory controller's
    `limit_in_bytes` (the kernel's huge "unlimited": none); no memory controller, or no
    /proc/self/cgroup, gives None."""
    from freetoken_py.models.loader import cgroup_memory_limit

    def tree(proc_lines, files):
        root, proc = tmp_path / f"fs{len(list(tmp_path.iterdir()))}", tmp_path / f"cgroup{len(list(tmp_path.iterdir()))}"
        for rel, value in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(value + "\n")
        proc.write_text("\n".join(proc_lines) + "\n")
        return cgroup_memory_limit(root, proc)

    assert tree(["0::/a/b"], {"a/b/memory.max": "max", "a/memory.max": str(1 << 30), "memory.max": "max"}) == 1 << 30
    assert tree(["0::/a/b"], {"a/b/memory.max": str(1 << 29), "a/memory.max": str(1 << 30)}) == 1 << 29
    assert tree(["5:memory:/x", "4:cpu,cpuacct:/x"], {"memory/x/memory.limit_in_bytes": "9223372036854771712",
                                                      "memory/memory.limit_in_bytes": str(2 << 30)}) == 2 << 30
    assert tree(["4:cpu:/x"], {}) is None
    assert tree(["0::/"], {"memory.max": "max"}) is None
    assert cgroup_memory_limit(tmp_path, tmp_path / "absent") is None


# ---- quantised checkpoints: one line naming the field or tensor and the formats that load ----
def _set_quant(ckpt, qcfg):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (ckpt / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("method,named", [("gptq", "GPTQ"), ("awq", "AWQ"), ("banana", "banana")])
def test_unknown_or_later_quant_method_names_the_field_and_what_loads(ckpt, method, named):
    _set_quant(ckpt, {"quant_method": method, "bits": 4})
    msg = _load_error(ckpt)
    assert "quantization_config.quant_method" in msg and named in msg
    assert "fp8" in msg and "pack-quantized int4" in msg and "mxfp4" in msg   # the formats that do load


def test_mxfp4_compressed_tensors_is_named_as_not_loading_yet(ckpt):
    from formats_util import ct_int4_config

    _set_quant(ckpt, dict(ct_int4_config(), format="mxfp4-pack-quantized"))
    msg = _load_error(ckpt)
    assert "mxfp4-pack-quantized" in msg and "later" in msg and "config.json: quantization_config.format" in msg
    assert "nvfp4" in msg                                          # the formats that do load


def _fp8_ckpt(ckpt, block=(16, 16)):
    from formats_util import write_fp8

    dst = ckpt.parent / "fp8"
    write_fp8(ckpt, dst, block=block)
    return dst


def test_fp8_missing_scale_tensor_is_named(ckpt):
    dst = _fp8_ckpt(ckpt)
    name = "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"
    _rewrite(dst / "model.safetensors", lambda t: t.pop(name))
    msg = _load_error(dst)
    assert f"missing scale tensor '{name}'" in msg and "fp8" in msg


def test_fp8_scale_grid_that_does_not_match_the_weight_is_named(ckpt):
    dst = _fp8_ckpt(ckpt)
    name = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    _rewrite(dst / "model.safetensors", lambda t: t.__setitem__(name, torch.ones(3, 4)))
    msg = _load_error(dst)
    assert name in msg and "[3, 4]" in msg and "[4, 4]" in msg    # q_proj [64, 64] in 16 x 16 blocks


def test_fp8_per_tensor_or_bad_block_is_named(ckpt):
    dst = _fp8_ckpt(ckpt)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"].pop("weight_block_size")
    (dst / "config.json").write_text(json.dumps(cfg))
    msg = _load_error(dst)
    assert "weight_block_size" in msg and "not supported" in msg


def _ct_ckpt(checkpoint_factory, tmp_path, **kw):
    from formats_util import write_ct_int4

    return write_ct_int4(checkpoint_factory("qwen3_moe_step2"), tmp_path / "ct", **kw)


def test_ct_int4_unsupported_group_size_is_named(checkpoint_factory, tmp_path):
    dst = _ct_ckpt(checkpoint_factory, tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16
    (dst / "config.json").write_text(json.dumps(cfg))
    msg = _load_error(dst)
    assert "config_groups.group_0.weights.group_size" in msg and "16" in msg and "32" in msg


def test_ct_int4_missing_scale_and_wrong_grid_are_named(checkpoint_factory, tmp_path):
    dst = _ct_ckpt(checkpoint_factory, tmp_path)
    name = "model.layers.1.mlp.experts.2.down_proj.weight_scale"
    _rewrite(dst / "model.safetensors", lambda t: t.__setitem__(name, t[name][:, :1].contiguous()))
    msg = _load_error(dst)
    assert name in msg and "[64, 1]" in msg and "[64, 2]" in msg
    _rewrite(dst / "model.safetensors", lambda t: t.pop(name))
    assert f"missing scale tensor '{name}'" in _load_error(dst)


def test_ct_int4_asymmetric_is_named(checkpoint_factory, tmp_path):
    dst = _ct_ckpt(checkpoint_factory, tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False
    (dst / "config.json").write_text(json.dumps(cfg))
    msg = _load_error(dst)
    assert "weights.symmetric" in msg and "pack-quantized int4" in msg


def test_ct_int4_scale_fp16_cannot_hold_is_refused_not_rounded(checkpoint_factory, tmp_path):
    dst = _ct_ckpt(checkpoint_factory, tmp_path)
    name = "model.layers.1.mlp.experts.0.gate_proj.weight_scale"
    _rewrite(dst / "model.safetensors",
             lambda t: t.__setitem__(name, torch.full_like(t[name], 3.0e-7, dtype=torch.bfloat16)))
    with pytest.raises(ModelLoadError) as info:
        from freetoken_py.llm import LLM
        LLM(dst, dtype="float32", show_progress=False, backend="cpu", expert_cache="off")
    msg = str(info.value)
    assert "\n" not in msg and name in msg and "fp16" in msg


def _dsa_ckpt(tmp_path, **config_changes):
    """A tiny GLM-5.2-style checkpoint (tests/dsa_util.py: full / shared indexer layers), config edited."""
    import dsa_util

    path = dsa_util.build("glm_moe_dsa", tmp_path / "glm5")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(config_changes)
    for key in [k for k, v in config_changes.items() if v is None]:
        del cfg[key]
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("change,needle", [
    (dict(index_topk=None), "missing required key 'index_topk'"),
    (dict(indexer_types=["shared", "full", "full", "shared"]), "'indexer_types': layer 0 is 'shared'"),
    (dict(indexer_types=["full", "sparse", "full", "shared"]), "'indexer_types' must list 'full' or 'shared'"),
    (dict(index_head_dim=16), "'index_head_dim' (16) must exceed qk_rope_head_dim (16)"),
])
def test_dsa_config_errors_name_the_field(tmp_path, change, needle):
    assert needle in _load_error(_dsa_ckpt(tmp_path, **change))


def test_dsa_missing_indexer_tensor_on_a_full_layer_is_named(tmp_path):
    path = _dsa_ckpt(tmp_path)
    name = "model.layers.2.self_attn.indexer.k_norm.bias"
    _rewrite(path / "model.safetensors", lambda t: t.pop(name))
    assert f"missing tensor '{name}'" in _load_error(path)
