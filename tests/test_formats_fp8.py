"""FP8 block-scaled checkpoints (quant_method fp8, weight_scale_inv) run in their own format.

References: transformers' own FP8 dequantisation (on CPU it dequantises, with `accelerate`) where
every dimension is a multiple of the block; elsewhere (edge blocks, which transformers mis-sizes,
see FAMILIES.md F1) transformers on a plain checkpoint holding our torch dequantisation of the
same tensors. The banks and dense weights the kernels read are compared element by element with
the checkpoint's dequantised values."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from formats_util import first_logits, fp8_reference, quantisable, reference_logits, write_fp8

pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def fp8_ckpt(checkpoint_factory, tmp_path_factory):
    return write_fp8(checkpoint_factory("qwen3_moe"), tmp_path_factory.mktemp("fp8") / "m", block=(16, 16))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_fp8_logits_match_transformers_dequantised(fp8_ckpt, checkpoint_factory, backend):
    ours, _ = first_logits(fp8_ckpt, backend, expert_cache="off")
    theirs = reference_logits(fp8_ckpt)
    assert (ours - theirs).abs().max().item() <= 1e-4
    plain = reference_logits(checkpoint_factory("qwen3_moe"))
    assert (theirs - plain).abs().max().item() > 1e-3   # the fp8 values are in effect, not the float ones


def test_fp8_banks_and_dense_weights_equal_the_checkpoint_exactly(fp8_ckpt):
    _, llm = first_logits(fp8_ckpt, "cpu", expert_cache="off")
    a, store = llm.args, llm.loaded.expert_store
    layer = next(i for i, s in enumerate(a.sparse_layers) if s)
    bank = store.banks[layer]
    assert bank.fmt == "fp8" and bank.w13.dtype.itemsize == 1
    w13, w2 = bank.dequantized()
    p = f"model.layers.{layer}."
    for e in range(a.num_experts):
        x = f"{p}mlp.experts.{e}."
        want13 = torch.cat([fp8_reference(fp8_ckpt, x + "gate_proj.weight"), fp8_reference(fp8_ckpt, x + "up_proj.weight")])
        assert torch.equal(w13[e], want13)
        assert torch.equal(w2[e], fp8_reference(fp8_ckpt, x + "down_proj.weight"))
    qkv = llm.model.weights.layers[layer].qkv.dense
    assert qkv.fmt == "fp8"
    want = torch.cat([fp8_reference(fp8_ckpt, f"{p}self_attn.{n}_proj.weight") for n in "qkv"])
    assert torch.equal(qkv.dequantized(), want)
    assert llm.model.weights.layers[layer].o.dense.fmt == "fp32"   # o_proj is on the ignore list: stays float


def _plain_copy(fp8_dir, dst):
    """The same checkpoint with every fp8 weight replaced by our torch dequantisation (float32)."""
    dst.mkdir()
    t = load_file(fp8_dir / "model.safetensors")
    out = {n: (fp8_reference(fp8_dir, n) if n + "_scale_inv" in t else v) for n, v in t.items()
           if not n.endswith("_scale_inv")}
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((fp8_dir / "config.json").read_text())
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("block,ue8m0", [((32, 32), False), ((128, 128), True), ((32, 64), False)])
def test_fp8_edge_blocks_against_our_torch_dequantisation(checkpoint_factory, tmp_path, block, ue8m0):
    # qwen3_moe's widths 48 / 96 / 16 / 32 are not multiples of 32 / 64, and every one is below 128
    src = write_fp8(checkpoint_factory("qwen3_moe"), tmp_path / "fp8", block=block, ue8m0=ue8m0)
    if ue8m0:
        s = load_file(src / "model.safetensors")["model.layers.0.mlp.experts.0.up_proj.weight_scale_inv"]
        assert torch.equal(torch.log2(s), torch.log2(s).round())    # powers of two
    theirs = reference_logits(_plain_copy(src, tmp_path / "plain"))
    for backend in ("torch", "cpu"):
        ours, _ = first_logits(src, backend, expert_cache="off")
        assert (ours - theirs).abs().max().item() <= 1e-4, backend


def test_fp8_expert_cache_is_mapped_on_the_next_start(fp8_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path))
    first, llm = first_logits(fp8_ckpt, "cpu")
    assert llm.loaded.expert_store.source == "built" and "fp8-g16" in llm.loaded.expert_store.path.name
    again, llm2 = first_logits(fp8_ckpt, "cpu")
    assert llm2.loaded.expert_store.source == "cache"
    assert torch.equal(first, again)
    llm.loaded.expert_store.path.unlink()


def test_expert_dtype_converts_on_request_and_says_so(fp8_ckpt):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ours, llm = first_logits(fp8_ckpt, "cpu", expert_cache="off", expert_dtype="int8")
    notes = [str(w.message) for w in seen if "converting" in str(w.message)]
    assert len(notes) == 1 and "fp8" in notes[0] and "int8" in notes[0] and "\n" not in notes[0]
    layer = next(i for i, s in enumerate(llm.args.sparse_layers) if s)
    assert llm.loaded.expert_store.banks[layer].fmt == "int8"
    assert (ours - reference_logits(fp8_ckpt)).abs().max().item() < 0.5   # int8 of the fp8 values: close, not equal


def test_writer_marks_only_linears():
    assert quantisable("model.layers.0.self_attn.q_proj.weight")
    assert not quantisable("model.layers.0.mlp.gate.weight") and not quantisable("lm_head.weight")


def test_probe_reads_the_format_and_names_one_that_does_not_load(fp8_ckpt, tmp_path):
    import shutil

    from freetoken_py.hw.model_bytes import read_model_bytes
    from freetoken_py.hw.report import model_notes

    mb = read_model_bytes(fp8_ckpt)
    assert mb.weight_format == "fp8 block [16, 16]" and mb.format_error is None
    assert mb.expert_dtype == "F8_E4M3"           # the real bytes: one per weight (+ the scale grid)
    assert "fp8 block" in model_notes(mb, [])[0]
    bad = tmp_path / "gptq"
    shutil.copytree(fp8_ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (bad / "config.json").write_text(json.dumps(cfg))
    mb = read_model_bytes(bad)
    assert mb.weight_format == "not loadable" and "GPTQ" in mb.format_error
    assert "cannot load" in model_notes(mb, [])[0]


def test_fp8_kernel_decodes_every_e4m3_byte_exactly():
    """The kernels decode e4m3 by bit placement (no table); every byte, subnormals included,
    against torch's float8_e4m3fn, and a GEMV over all 256 codes against the dequantised matmul."""
    import numpy as np
    from numba import njit

    from freetoken_py.kernels import DenseWeight, dense_linear
    from freetoken_py.kernels._dots import e4m3_value

    @njit
    def decode_all(out):
        for b in range(256):
            out[b] = e4m3_value(np.uint8(b))

    got = np.empty(256, np.float32)
    decode_all(got)
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok], want[ok])
    codes = np.tile(np.arange(256, dtype=np.uint8), (3, 1))
    codes[codes == 0x7F], codes[codes == 0xFF] = 0, 0
    scales = np.array([[0.5, 2.0], [1.0, 0.25], [3.0, 1.0]], np.float32)     # one per 128 columns
    dw = DenseWeight.from_arrays("fp8", 128, codes, scales, 256)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    # fp32 sums in another order than torch's: the bound is a few ulps of the sum of |products| (a
    # cancelling row once missed a fixed atol); the second matrix holds only the subnormal codes
    # (exponent field 0), so a misdecoded one is far outside its own bound
    for dw in (dw, DenseWeight.from_arrays("fp8", 128, codes & 0x87, scales, 256)):
        w = dw.dequantized().double()
        bound = 1e-6 * (x.double().abs() @ w.abs().T)
        assert bool(((dense_linear(dw, x).double() - x.double() @ w.T).abs() <= bound).all())


def _fused_fp8(real_dir, dst, block):
    """A Qwen3.5-MoE checkpoint in the released layout (fused `experts.gate_up_proj [E, 2I, D]` /
    `down_proj [E, D, I]`, no `.weight`) with the fused experts in FP8 block by the documented rule,
    each expert's matrix in its own blocks; the scales as transformers' FP8 experts name them
    (`gate_up_proj_scale_inv [E, 2I/bn, D/bk]`). Returns it and a plain (float32) copy holding our
    torch dequantisation of the same codes."""
    from freetoken_py.quant.fp8 import quantize_fp8_blocks

    t = load_file(real_dir / "model.safetensors")
    q, plain = {}, {}
    bn, bk = block
    for n, w in t.items():
        if not n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            q[n] = plain[n] = w
            continue
        codes, scales = zip(*(quantize_fp8_blocks(w[e].float(), block) for e in range(w.shape[0])))
        q[n], q[n + "_scale_inv"] = torch.stack(codes), torch.stack(scales)
        plain[n] = torch.stack([c.float() * s.repeat_interleave(bn, 0)[: c.shape[0]].repeat_interleave(bk, 1)
                                [:, : c.shape[1]] for c, s in zip(codes, scales)])
    cfg = json.loads((real_dir / "config.json").read_text())
    for d, tensors, qc in ((dst / "fp8", q, True), (dst / "plain", plain, False)):
        d.mkdir(parents=True)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        c = dict(cfg)
        if qc:
            c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]}
        (d / "config.json").write_text(json.dumps(c))
    return dst / "fp8", dst / "plain"


def test_fp8_fused_qwen35_experts_load_and_match_our_torch_dequantisation(tmp_path):
    """Qwen3.5 / 3.6 MoE FP8 as released: fused expert stacks with fused scale grids, split per
    expert by the loader; logits equal those of a plain checkpoint holding our dequantisation, and
    the banks equal the dequantised values element by element. A grid whose block rows cannot be
    halved (a block spanning gate and up rows) is a one-line error naming the tensor."""
    import hybrid_util
    from conftest import VOCAB

    from freetoken_py.errors import ModelLoadError
    from freetoken_py.models.loader import open_checkpoint

    real = hybrid_util.to_real_release_layout(hybrid_util.build("qwen3_5_moe", tmp_path / "src", vocab_size=VOCAB), tmp_path / "real")
    fp8, plain = _fused_fp8(real, tmp_path / "q", (16, 16))        # I = 32: two block rows each for gate and up
    want, ref_llm = first_logits(plain, "torch", expert_cache="off")
    for backend in ("torch", "cpu"):
        ours, llm = first_logits(fp8, backend, expert_cache="off")
        assert (ours - want).abs().max().item() <= 1e-4, backend
    a, bank = llm.args, llm.loaded.expert_store.banks[0]
    assert bank.fmt == "fp8"
    w13, w2 = bank.dequantized()
    stored = load_file(plain / "model.safetensors")
    assert torch.equal(w13, stored["model.language_model.layers.0.mlp.experts.gate_up_proj"].float())
    assert torch.equal(w2, stored["model.language_model.layers.0.mlp.experts.down_proj"].float())
    assert a.num_experts == w13.shape[0]

    odd, _ = _fused_fp8(real, tmp_path / "odd", (64, 16))          # 2I = 64 rows in one 64-row block
    with pytest.raises(ModelLoadError, match=r"gate_up_proj_scale_inv' has an odd block rows"):
        open_checkpoint(odd)


def test_the_residency_tiers_run_an_fp8_checkpoint_in_its_own_bytes(fp8_ckpt):
    """`--residency emulate` on an FP8 checkpoint, no --expert-dtype: the banks and the slots hold
    the checkpoint's e4m3 bytes and block scales (not a float copy), the tiers compute from
    them, and the logits equal transformers' dequantised reference within 1e-4."""
    from freetoken_py.core import SamplingParams
    from freetoken_py.llm import LLM

    from conftest import random_prompt

    llm = LLM(fp8_ckpt, dtype="float32", show_progress=False, residency="emulate", expert_cache="off",
              enable_prefix_cache=False)
    ex = llm.residency
    layer = next(i for i, s in enumerate(llm.args.sparse_layers) if s)
    bank = ex.cpu_banks[layer]
    assert ex.fmt.name == "fp8" and (bank.fmt, bank.group_size) == ("fp8", 16)
    a = llm.args
    weights = 3 * a.moe_intermediate_size * a.hidden_size
    assert ex.slots.slot_bytes == bank.bytes_per_expert < 2 * weights   # 1 byte a weight + scales; fp32 is 4
    llm.add_request(random_prompt(12, 1), SamplingParams(max_tokens=1, temperature=0))
    ours = llm.runner.forward_batch(llm.scheduler.schedule())[0]
    assert (ours - reference_logits(fp8_ckpt)).abs().max().item() <= 1e-4
    t = ex.telemetry.totals()
    assert t.hit_pairs + t.stream_pairs > 0   # the accelerator tier computed from the slots
    assert t.pcie_bytes > 0 and t.pcie_bytes % ex.slots.slot_bytes == 0   # copies at the checkpoint's bytes
