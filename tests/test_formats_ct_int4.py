"""compressed-tensors pack-quantized INT4 checkpoints (written by compressed-tensors' own
compressor) go straight into the int4 banks, bit for bit, with their scales kept exact.

References: compressed-tensors' own `PackedQuantizationCompressor.decompress` (fp32), run through
transformers as a plain checkpoint; transformers with its compressed-tensors integration too, at
the tolerance its bf16 experts allow (it decompresses fused experts to bf16 and runs them so)."""
from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import formats_util
from formats_util import ct_reference, reference_logits, write_ct_int4

pytest.importorskip("compressed_tensors")
ARCH = "qwen3_moe_step2"     # every input width a multiple of 32
first_logits = partial(formats_util.first_logits, expert_cache="off")


@pytest.fixture(scope="module")
def ct_ckpt(checkpoint_factory, tmp_path_factory):
    return write_ct_int4(checkpoint_factory(ARCH), tmp_path_factory.mktemp("ct") / "m", short_scales=True)


@pytest.fixture(scope="module")
def ct_plain(ct_ckpt, tmp_path_factory):
    """The same model with every packed weight replaced by compressed-tensors' decompression."""
    dst = tmp_path_factory.mktemp("ct_plain")
    t = load_file(ct_ckpt / "model.safetensors")
    out = {n: v for n, v in t.items() if not n.endswith(("weight_packed", "weight_scale", "weight_shape"))}
    for n in t:
        if n.endswith("weight_packed"):
            w = n[: -len("_packed")]
            out[w] = ct_reference(ct_ckpt, w)
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((ct_ckpt / "config.json").read_text())
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_ct_int4_logits_match_compressed_tensors_decompression(ct_ckpt, ct_plain):
    ours, _ = first_logits(ct_ckpt, "torch")
    assert (ours - reference_logits(ct_plain)).abs().max().item() <= 1e-4


def test_ct_int4_logits_against_transformers_compressed_tensors_integration(ct_ckpt, ct_plain, checkpoint_factory):
    ours, _ = first_logits(ct_ckpt, "torch")
    theirs = reference_logits(ct_ckpt)
    # transformers runs the decompressed experts in bf16 (measured 1.1e-3 here); a nibble-order or
    # scale bug moves the logits by ~0.5 (the int4 rounding alone moves them by 0.66)
    assert (ours - theirs).abs().max().item() <= 5e-3
    assert (reference_logits(checkpoint_factory(ARCH)) - theirs).abs().max().item() > 0.1


def test_ct_int4_banks_are_the_checkpoint_bytes(ct_ckpt):
    _, llm = first_logits(ct_ckpt, "cpu")
    a = llm.args
    t = load_file(ct_ckpt / "model.safetensors")
    for layer in (i for i, s in enumerate(a.sparse_layers) if s):
        bank = llm.loaded.expert_store.banks[layer]
        assert (bank.fmt, bank.group_size) == ("int4", 32)
        w13, w2 = bank.dequantized()
        inter = bank.inter
        for e in range(a.num_experts):
            x = f"model.layers.{layer}.mlp.experts.{e}."
            for rows, name, deq in ((slice(0, inter), "gate_proj", w13[e, :inter]),
                                    (slice(inter, None), "up_proj", w13[e, inter:]),
                                    (slice(None), "down_proj", w2[e])):
                packed = t[f"{x}{name}.weight_packed"].view(torch.uint8).numpy()
                # in the row layout: the bank's own (r16 slabs with int8 activations: AVX2 / AVX-512 VNNI) undone exactly
                w_rows, s_rows = (bank.row_arrays(bank.w13[e], bank.s13[e]) if name != "down_proj" else
                                  bank.row_arrays(bank.w2[e], bank.s2[e]))
                codes, scales = w_rows[rows], s_rows[rows]
                assert np.array_equal(codes, packed)
                s = t[f"{x}{name}.weight_scale"]
                assert torch.equal(torch.from_numpy(scales.view(np.float16).copy()).to(s.dtype), s)   # exact
                assert torch.equal(deq, ct_reference(ct_ckpt, f"{x}{name}.weight"))


def test_ct_int4_cpu_backend_close_to_the_exact_path(ct_ckpt):
    """The int4 kernels quantise activations to int8 per 32-block on AVX2 CPUs (docs/kernels.md):
    the same KL budget as the int4 experts of the float checkpoints."""
    ref, _ = first_logits(ct_ckpt, "torch")
    ours, llm = first_logits(ct_ckpt, "cpu")
    assert llm.model.weights.layers[0].qkv.dense.fmt == "int4"
    kl = torch.nn.functional.kl_div(torch.log_softmax(ours, -1), torch.log_softmax(ref, -1), log_target=True,
                                    reduction="sum").item()
    assert kl <= 2.5e-4
    assert (ours - ref).abs().max().item() <= 0.1


def test_full_precision_bf16_scales_load_exactly(checkpoint_factory, tmp_path):
    src = write_ct_int4(checkpoint_factory(ARCH), tmp_path / "m", only_experts=True)   # scales: all 8 bf16 bits
    _, llm = first_logits(src, "cpu")
    layer = next(i for i, s in enumerate(llm.args.sparse_layers) if s)
    w13, _ = llm.loaded.expert_store.banks[layer].dequantized()
    name = f"model.layers.{layer}.mlp.experts.3.gate_proj.weight"
    assert torch.equal(w13[3, :llm.loaded.expert_store.banks[layer].inter], ct_reference(src, name))
    assert llm.model.weights.layers[0].qkv.dense.fmt == "fp32"   # attention on the ignore list: stays float


def test_the_residency_tiers_run_a_ct_int4_checkpoint_in_its_own_bytes(ct_ckpt):
    """`--residency emulate` on a compressed-tensors INT4 checkpoint, no --expert-dtype: the banks
    and slots hold the checkpoint's nibbles and scales as stored, and the logits stay within the
    int4 kernels' KL budget of the exact path (compressed-tensors' decompression on the torch
    backend): the tiers compute the experts with the activations the int4 kernels see, the dense
    weights (through the torch loader here) exactly. A nibble-order or scale bug moves them ~0.5."""
    from freetoken_py.core import SamplingParams
    from freetoken_py.llm import LLM

    from conftest import random_prompt

    llm = LLM(ct_ckpt, dtype="float32", show_progress=False, residency="emulate", expert_cache="off",
              enable_prefix_cache=False)
    ex = llm.residency
    t = load_file(ct_ckpt / "model.safetensors")
    layer = next(i for i, s in enumerate(llm.args.sparse_layers) if s)
    bank = ex.cpu_banks[layer]
    assert ex.fmt.name == "int4" and (bank.fmt, bank.group_size) == ("int4", 32)
    assert ex.slots.slot_bytes == bank.bytes_per_expert
    packed = t[f"model.layers.{layer}.mlp.experts.0.down_proj.weight_packed"].view(torch.uint8).numpy()
    assert np.array_equal(bank.w2[0], packed)
    prompt = random_prompt(12, 1)
    llm.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    ours = llm.runner.forward_batch(llm.scheduler.schedule())[0]
    ref, _ = first_logits(ct_ckpt, "torch")
    kl = torch.nn.functional.kl_div(torch.log_softmax(ours, -1), torch.log_softmax(ref, -1), log_target=True,
                                    reduction="sum").item()
    assert kl <= 2.5e-4 and (ours - ref).abs().max().item() <= 0.1
    tel = ex.telemetry.totals()
    assert tel.hit_pairs + tel.stream_pairs > 0   # the accelerator tier computed from the slots
    assert tel.pcie_bytes > 0 and tel.pcie_bytes % ex.slots.slot_bytes == 0   # copies at the checkpoint's bytes
