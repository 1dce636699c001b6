"""NVFP4 checkpoints (compressed-tensors nvfp4-pack-quantized, written by its own
NVFP4PackedCompressor; ModelOpt NVFP4, written by its documented rule) run in the `nvfp4`
execution format with the checkpoint's own values.

References: compressed-tensors' own dequantisation (its unpacker + dequantize, fp32; and
NVFP4PackedCompressor.decompress's bf16 output), ModelOpt's documented rule, each run through
transformers as a plain checkpoint holding those values. transformers' own CT-nvfp4 integration
is no reference on CPU (FAMILIES.md F4: off by 2.68 on MoE experts)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from formats_util import (assert_matches, ct_nvfp4_decompress, ct_nvfp4_reference, dequantised_copy, first_logits, modelopt_reference,
                          reference_logits, write_ct_nvfp4, write_modelopt_nvfp4)
from freetoken_py.errors import ModelLoadError
from freetoken_py.kernels._dots import INT_ACT
from freetoken_py.models.loader import load_model
from freetoken_py.quant import roundtrip_act_q8

pytest.importorskip("compressed_tensors")

CT = (ct_nvfp4_reference, ("weight_packed", "weight_scale", "weight_global_scale"), "weight_packed")
MO = (modelopt_reference, ("weight_scale", "weight_scale_2", "input_scale"), "weight")


def _pair(checkpoint_factory, tmp_path_factory, arch: str, kind: str, **kw):
    src = checkpoint_factory(arch)
    base = tmp_path_factory.mktemp(f"{kind}_{arch}")
    if kind == "ct":
        q, (ref, stored, codes) = write_ct_nvfp4(src, base / "q", **kw), CT
    else:
        q, (ref, stored, codes) = write_modelopt_nvfp4(src, base / "q", **kw), MO
    return q, dequantised_copy(q, base / "plain", ref, stored, codes), ref


@pytest.fixture(scope="module")
def ct_qwen(checkpoint_factory, tmp_path_factory):
    return _pair(checkpoint_factory, tmp_path_factory, "qwen3_moe", "ct")


@pytest.fixture(scope="module")
def mo_qwen(checkpoint_factory, tmp_path_factory):
    return _pair(checkpoint_factory, tmp_path_factory, "qwen3_moe", "mo")


@pytest.mark.parametrize("which", ["ct", "mo"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_nvfp4_logits_match_the_dequantised_reference(ct_qwen, mo_qwen, checkpoint_factory, which, backend):
    q, plain, _ = ct_qwen if which == "ct" else mo_qwen
    ours, _ = first_logits(q, backend, expert_cache="off")
    theirs = reference_logits(plain)
    assert_matches(ours, theirs, backend)
    assert (theirs - reference_logits(checkpoint_factory("qwen3_moe"))).abs().max().item() > 1e-2   # fp4 in effect


@pytest.mark.parametrize("kind,kw", [("ct", {}), ("mo", {"in_config": True})])
def test_nvfp4_on_glm4_moe(checkpoint_factory, tmp_path_factory, kind, kw):
    """GLM-4.5 (issue #21's family: sigmoid router, shared expert, dense layer 0), both formats;
    ModelOpt's config in config.json (quant_method modelopt) this time."""
    q, plain, _ = _pair(checkpoint_factory, tmp_path_factory, "glm4_moe", kind, **kw)
    theirs = reference_logits(plain)
    for backend in ("torch", "cpu"):
        ours, _ = first_logits(q, backend, expert_cache="off")
        assert_matches(ours, theirs, backend)


@pytest.mark.parametrize("which", ["ct", "mo"])
def test_nvfp4_banks_and_dense_weights_equal_the_checkpoint_exactly(ct_qwen, mo_qwen, which):
    q, _, ref = ct_qwen if which == "ct" else mo_qwen
    _, llm = first_logits(q, "cpu", expert_cache="off")
    a, t = llm.args, load_file(q / "model.safetensors")
    codes_key = "weight_packed" if which == "ct" else "weight"
    for layer in (i for i, s in enumerate(a.sparse_layers) if s):
        bank = llm.loaded.expert_store.banks[layer]
        assert (bank.fmt, bank.group_size, bank.w13.dtype) == ("nvfp4", 16, np.uint8)
        assert bank.s13.dtype == (np.int8 if bank.layout == "r16" else np.uint8)   # r16: 16-row slabs (AVX2 / AVX-512 VNNI)
        w13, w2 = bank.dequantized()
        inter = bank.inter
        for e in range(a.num_experts):
            x = f"model.layers.{layer}.mlp.experts.{e}."
            (c13, s13), (c2, s2) = bank.row_arrays(bank.w13[e], bank.s13[e]), bank.row_arrays(bank.w2[e], bank.s2[e])
            for rows, name, deq, codes, scales in (
                    (slice(0, inter), "gate_proj", w13[e, :inter], c13, s13),
                    (slice(inter, None), "up_proj", w13[e, inter:], c13, s13),
                    (slice(None), "down_proj", w2[e], c2, s2)):
                assert np.array_equal(codes[rows], t[f"{x}{name}.{codes_key}"].numpy())        # the bytes, copied
                g = scales.shape[1] - 4
                assert np.array_equal(scales[rows][:, :g], t[f"{x}{name}.weight_scale"].view(torch.uint8).numpy())
                assert torch.equal(deq, ref(q, f"{x}{name}.weight"))                           # element by element
        if which == "ct":   # and the decompressor's own (bf16) output
            name = f"model.layers.{layer}.mlp.experts.5.down_proj.weight"
            assert torch.equal(w2[5].to(torch.bfloat16), ct_nvfp4_decompress(q, name))
    lw = llm.model.weights.layers[0]
    assert lw.qkv.dense.fmt == "nvfp4"
    want = torch.cat([ref(q, f"model.layers.0.self_attn.{n}_proj.weight") for n in "qkv"])
    assert torch.equal(lw.qkv.dense.dequantized(), want)
    assert lw.o.dense.fmt == "fp32"                       # o_proj on the ignore list: stored float, stays float
    dense = next(w for w in llm.model.weights.layers if w.mlp13 is not None)   # the mlp_only layer
    assert dense.mlp13.dense.fmt == "nvfp4"


def test_nvfp4_bytes_per_weight(ct_qwen):
    """4 bits + one e4m3 byte per 16 weights + 4 bytes per row: what a token streams."""
    _, llm = first_logits(ct_qwen[0], "cpu", expert_cache="off")
    bank = next(b for b in llm.loaded.expert_store.banks if b is not None)
    weights = bank.num_experts * 3 * bank.inter * bank.hidden
    rows = bank.num_experts * (2 * bank.inter + bank.hidden)
    assert bank.nbytes == weights // 2 + weights // 16 + 4 * rows


def test_nvfp4_expert_cache_is_mapped_on_the_next_start(ct_qwen, tmp_path, monkeypatch):
    from freetoken_py.engine import expert_store

    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path))
    first, llm = first_logits(ct_qwen[0], "cpu")
    assert llm.loaded.expert_store.source == "built" and "nvfp4-g16" in llm.loaded.expert_store.path.name
    builds = expert_store.LAYER_BUILDS
    again, llm2 = first_logits(ct_qwen[0], "cpu")
    assert llm2.loaded.expert_store.source == "cache" and expert_store.LAYER_BUILDS == builds
    assert torch.equal(first, again)
    llm.loaded.expert_store.path.unlink()


def test_expert_dtype_converts_nvfp4_on_request_and_says_so(mo_qwen):
    q, plain, _ = mo_qwen
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ours, llm = first_logits(q, "cpu", expert_cache="off", expert_dtype="int8")
    notes = [str(w.message) for w in seen if "converting" in str(w.message)]
    assert len(notes) == 1 and "nvfp4" in notes[0] and "int8" in notes[0] and "\n" not in notes[0]
    assert next(b for b in llm.loaded.expert_store.banks if b is not None).fmt == "int8"
    assert (ours - reference_logits(plain)).abs().max().item() < 0.5


def test_nvfp4_kernel_decodes_every_nibble_and_both_factor_kinds():
    """Every e2m1 nibble against the table, every e4m3 scale byte, a multiplier row and a
    reciprocal row: the GEMV against the dequantised matmul."""
    from numba import njit

    from freetoken_py.kernels import DenseWeight, dense_linear
    from freetoken_py.kernels._dots import e2m1_value
    from freetoken_py.quant.nvfp4 import E2M1, exec_scales

    @njit
    def decode_all(out):
        for n in range(16):
            out[n] = e2m1_value(np.uint8(n))

    got = np.empty(16, np.float32)
    decode_all(got)
    assert np.array_equal(got, E2M1.numpy()) and np.array_equal(np.signbit(got), np.signbit(E2M1.numpy()))
    codes = np.tile(np.arange(256, dtype=np.uint8), (4, 1))                 # K = 512: every byte, 32 groups
    sbytes = torch.tensor([b for b in range(128) if b != 0x7F][:32] * 4, dtype=torch.uint8).view(4, 32)
    s = exec_scales(sbytes, torch.tensor([0.37, -3.3e3, 1.0, -448.0 * 6 / 0.9]))
    dw = DenseWeight.from_arrays("nvfp4", 16, codes, s.numpy(), 512)
    x = torch.randn(5, 512)
    seen = roundtrip_act_q8(x) if INT_ACT == "int8" else x       # the activations as the kernel rounds them
    assert torch.allclose(dense_linear(dw, x), seen @ dw.dequantized().T, rtol=1e-5, atol=1e-5)


# ---- bad input: one line naming the tensor or field ----
def _set(path, mutate_tensors=None, mutate_cfg=None, cfg_file="config.json"):
    if mutate_tensors:
        t = load_file(path / "model.safetensors")
        mutate_tensors(t)
        save_file(t, path / "model.safetensors")
    if mutate_cfg:
        cfg = json.loads((path / cfg_file).read_text())
        mutate_cfg(cfg)
        (path / cfg_file).write_text(json.dumps(cfg))


def _error(path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(path, "float32", show_progress=False)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


@pytest.fixture
def ct_copy(ct_qwen, tmp_path):
    import shutil

    return shutil.copytree(ct_qwen[0], tmp_path / "ct")


@pytest.fixture
def mo_copy(mo_qwen, tmp_path):
    import shutil

    return shutil.copytree(mo_qwen[0], tmp_path / "mo")


X = "model.layers.1.mlp.experts.3.up_proj."


def test_wrong_scale_grid_is_named(ct_copy, mo_copy):
    _set(ct_copy, lambda t: t.__setitem__(X + "weight_scale", torch.ones(48, 2).to(torch.float8_e4m3fn)))
    msg = _error(ct_copy)
    assert X + "weight_scale" in msg and "[48, 2]" in msg and "[48, 4]" in msg
    _set(mo_copy, lambda t: t.__setitem__(X + "weight_scale", torch.ones(48, 4, dtype=torch.float32)))
    msg = _error(mo_copy)
    assert X + "weight_scale" in msg and "F32" in msg and "F8_E4M3" in msg


def test_missing_global_scale_is_named(ct_copy, mo_copy):
    _set(ct_copy, lambda t: t.pop(X + "weight_global_scale"))
    msg = _error(ct_copy)
    assert f"missing global scale tensor '{X}weight_global_scale'" in msg and "nvfp4" in msg
    _set(mo_copy, lambda t: t.pop(X + "weight_scale_2"))
    assert f"'{X}weight_scale_2'" in _error(mo_copy)


def test_unsupported_group_size_is_named(ct_copy, mo_copy):
    _set(ct_copy, mutate_cfg=lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(
        group_size=32))
    msg = _error(ct_copy)
    assert "config_groups.group_0.weights.group_size" in msg and "32" in msg and "16" in msg
    _set(mo_copy, mutate_cfg=lambda c: c["quantization"].update(group_size=32), cfg_file="hf_quant_config.json")
    msg = _error(mo_copy)
    assert "hf_quant_config.json" in msg and "group_size" in msg and "32" in msg


def test_other_modelopt_and_ct_formats_are_named(ct_copy, mo_copy):
    _set(mo_copy, mutate_cfg=lambda c: c["quantization"].update(quant_algo="FP8"), cfg_file="hf_quant_config.json")
    msg = _error(mo_copy)
    assert "quant_algo" in msg and "FP8" in msg and "later" in msg and "ModelOpt NVFP4" in msg
    _set(ct_copy, mutate_cfg=lambda c: c["quantization_config"].update(format="mxfp4-pack-quantized"))
    msg = _error(ct_copy)
    assert "mxfp4-pack-quantized" in msg and "later" in msg and "nvfp4-pack-quantized" in msg


def test_a_non_positive_global_scale_is_named(ct_copy):
    _set(ct_copy, lambda t: t.__setitem__(X + "weight_global_scale", torch.zeros(1)))
    with pytest.raises(ModelLoadError) as info:
        first_logits(ct_copy, "torch", expert_cache="off")
    assert X + "weight_global_scale" in str(info.value) and "positive" in str(info.value)


@pytest.mark.parametrize("fmt", ["nvfp4", "int4", "fp8"])
def test_a_cpu_start_never_dequantises_the_packed_dense_weights(checkpoint_factory, tmp_path, fmt):
    """Start-up memory (issue #22): the dense linears a checkpoint stores packed reach the kernels
    as stored; the loader defers them and nothing dequantises them (counted in bytes), and the
    experts are copied into the banks. The torch backend, the reference, does dequantise them."""
    from freetoken_py.formats import packed
    from freetoken_py.loading.quantize import quantize_checkpoint

    q = quantize_checkpoint(checkpoint_factory("qwen3_moe_step2"), tmp_path / fmt, fmt, show_progress=False)
    before = packed.DEQUANTISED_BYTES
    ours, llm = first_logits(q, "cpu", expert_cache="off")
    assert packed.DEQUANTISED_BYTES == before
    lw = llm.model.weights.layers[1]
    assert {lw.qkv.dense.fmt, lw.o.dense.fmt, llm.model.weights.layers[0].mlp13.dense.fmt} == {fmt}
    ref, _ = first_logits(q, "torch", expert_cache="off")
    assert packed.DEQUANTISED_BYTES > before
    assert (ours - ref).abs().max().item() <= (1e-4 if fmt == "fp8" or INT_ACT != "int8" else 0.1)   # int8 activations on AVX2


def test_residency_tiers_hold_and_compute_nvfp4_experts_at_their_bytes():
    """The tiers' view of an nvfp4 bank: slots of the bank's bytes per expert, copies byte for
    byte, and the accelerator tier's torch compute equal to the numba kernels on the same experts."""
    from freetoken_py.kernels import ExpertBank, moe_experts
    from freetoken_py.residency.formats import ExpertFormat, bank_parts
    from freetoken_py.residency.slots import SlotCache
    from freetoken_py.residency.streamer import Streamer

    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(6, 64, 128, generator=g) * 0.1 for _ in range(2))
    bank = ExpertBank.from_weights(gate, up, torch.randn(6, 128, 64, generator=g) * 0.1, fmt="nvfp4", group_size=16)
    f, host = ExpertFormat.of_bank(bank), bank_parts(bank)
    assert f.name == "nvfp4" and f.expert_bytes == bank.bytes_per_expert and f.cut_block == bank.inter
    assert host[0].data_ptr() == bank.w13.ctypes.data and host[3].data_ptr() == bank.s2.ctypes.data
    slots = SlotCache(4, f.specs, chunk_slots=2)
    assert slots.slot_bytes == bank.bytes_per_expert
    st = Streamer(slots, [None, host], f)
    for e in range(4):
        st.to_slot(1, e)
        assert all(torch.equal(a, p[e]) for a, p in zip(slots.get((1, e)), host))
    x = torch.randn(3, 128, generator=g)
    for e in range(4):
        ours = f.compute(x, slots.get((1, e)))
        ids, w = torch.full((3, 1), e), torch.ones(3, 1)
        assert torch.allclose(ours, moe_experts(bank, x, ids, w), rtol=1e-4, atol=1e-5)
    whole = [torch.cat(p) for p in f.column_pieces(tuple(p[2] for p in host), bank.inter)]
    assert all(torch.equal(a, p[2]) for a, p in zip(whole, host))   # an uncut expert: every part whole


def test_the_residency_tiers_run_an_nvfp4_checkpoint_in_its_own_bytes(ct_qwen):
    """`--residency emulate` on an NVFP4 checkpoint: the banks and slots hold the checkpoint's
    nvfp4 bytes (no --expert-dtype), and the logits equal the cpu backend's and the reference's."""
    from freetoken_py.core import SamplingParams
    from freetoken_py.llm import LLM

    from conftest import random_prompt

    q, plain, _ = ct_qwen
    llm = LLM(q, dtype="float32", show_progress=False, residency="emulate", expert_cache="off",
              enable_prefix_cache=False)
    ex = llm.residency
    assert ex.fmt.name == "nvfp4" and ex.slots.slot_bytes == ex.cpu_banks[1].bytes_per_expert
    llm.add_request(random_prompt(12, 1), SamplingParams(max_tokens=1, temperature=0))
    ours = llm.runner.forward_batch(llm.scheduler.schedule())[0]
    assert_matches(ours, reference_logits(plain), "cpu")


def test_probe_reads_both_nvfp4_formats(ct_qwen, mo_qwen):
    from freetoken_py.hw.model_bytes import read_model_bytes

    for (q, _, _), want in ((ct_qwen, "compressed-tensors nvfp4 g16"), (mo_qwen, "ModelOpt nvfp4 g16")):
        mb = read_model_bytes(q)
        assert mb.weight_format == want and mb.format_error is None
        assert mb.expert_dtype == "U8"                  # the real bytes: half a byte per weight (+ scales)


@pytest.mark.skipif(os.environ.get("FREETOKEN_INT_ACT") == "fp32", reason="this process already runs the exact path")
def test_cpu_kernels_with_fp32_activations_match_within_1e_4():
    """The exact path (FREETOKEN_INT_ACT=fp32: fp32 activations, what CPUs without AVX2 run) held
    to 1e-4 on both nvfp4 layouts, here too: the cpu parity test above, in a process that runs it
    (the mode is fixed at import), so the int8-activation default does not hide an exact-path bug."""
    env = {**os.environ, "FREETOKEN_INT_ACT": "fp32"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "test_nvfp4_logits_match_the_dequantised_reference and cpu"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and re.search(r"\b2 passed", proc.stdout), proc.stdout[-2000:] + proc.stderr[-2000:]
