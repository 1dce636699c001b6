"""gpt-oss (`gpt_oss`) against transformers' GptOssForCausalLM (eager attention) on tiny random fp32
checkpoints (tests/gpt_oss_util.py: window 4 far below the prompts, sliding / full layers
alternating and mixed, YaRN, randomised sinks, norms and every bias), on both backends (torch:
MoeTransformer.forward; cpu: the numba kernels, the fused decode step with sinks, per-layer windows
and the top-k router in kernels/cpu_decode.py, experts with their biases and the clamped SwiGLU in
kernels/_moe_kernels.py). transformers' own cached decode equals its full forward on these
configs (test_transformers_own_cached_decode_is_consistent)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import gpt_oss_util as gu
import parity_util
from freetoken_py.core import SamplingParams
from freetoken_py.errors import ModelLoadError
from freetoken_py.kernels._dots import INT_ACT
from freetoken_py.llm import LLM

ARCHS = ["gpt_oss", "gpt_oss_mixed"]
ckpt = parity_util.checkpoint_cache(gu.build)


def _prompt(n: int, seed: int) -> list[int]:
    return parity_util.random_prompt(gu.VOCAB, n, seed)


def _theirs(path, ids: list[int], start: int) -> torch.Tensor:
    with torch.no_grad():
        return gu.reference(path)(torch.tensor([ids])).logits[0, start:]


def _llm(path, backend, **kw):
    return LLM(path, dtype="float32", show_progress=False, backend=backend, **kw)


def _parity(llm, path, prompt, steps=32) -> float:
    tokens, ours = parity_util.drive(llm, prompt, steps)
    return (ours - _theirs(path, prompt + tokens[:-1], len(prompt) - 1)).abs().max().item()


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_own_cached_decode_is_consistent(arch, ckpt):
    """The reference is only trusted where its cached decode (16 + 1-token steps) equals its full forward."""
    path, ids = ckpt(arch), torch.tensor([_prompt(40, seed=1)])
    model = gu.reference(path)
    with torch.no_grad():
        full = model(ids).logits[0]
        out = model(ids[:, :16], use_cache=True)
        steps, cache = [out.logits[0]], out.past_key_values
        for t in range(16, 40):
            out = model(ids[:, t:t + 1], past_key_values=cache)
            steps.append(out.logits[0])
            cache = out.past_key_values
    assert (full - torch.cat(steps)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_32_cached_decode_steps_match_transformers(arch, backend, ckpt):
    path = ckpt(arch)
    llm = _llm(path, backend, page_size=16)
    # cpu: decode through the fused numba step (sinks in its softmax, each layer's window, the top-k router)
    assert (backend == "cpu") == (type(llm.runner.fused).__name__ == "FusedDecoder")
    assert _parity(llm, path, _prompt(21, seed=1)) <= 1e-4


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_chunked_prefill_across_the_window_matches_transformers(backend, ckpt):
    """Chunks of 3 and 5 tokens around the window of 4: a chunk's windowed layers read keys of earlier chunks."""
    path = ckpt("gpt_oss")
    for chunk in (3, 5):
        assert _parity(_llm(path, backend, max_num_batched_tokens=chunk, page_size=8), path,
                       _prompt(19, seed=3), 8) <= 1e-4


@pytest.mark.parametrize("change", ["sinks", "window"])
def test_sinks_and_window_are_in_effect(change, ckpt, tmp_path):
    """The same weights without the sinks (a sink of -inf: a plain softmax) or without the window
    miss transformers by far more than the tolerance: the parity tests above can fail on either."""
    src = ckpt("gpt_oss")
    dst = tmp_path / change
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.bin"))
    if change == "sinks":
        for f in dst.glob("*.safetensors"):
            tensors = load_file(f)
            save_file({k: (torch.full_like(v, -1e30) if k.endswith("sinks") else v) for k, v in tensors.items()}, f,
                      metadata={"format": "pt"})
    else:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["sliding_window"] = 4096
        (dst / "config.json").write_text(json.dumps(cfg))
    prompt = _prompt(21, seed=1)
    tokens, ours = parity_util.drive(_llm(dst, "torch"), prompt, 4)
    assert (ours - _theirs(src, prompt + tokens[:-1], len(prompt) - 1)).abs().max().item() > 1e-2


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_64_greedy_tokens_identical_to_transformers_generate(backend, ckpt):
    path = ckpt("gpt_oss")
    prompt = _prompt(9, seed=2)
    with torch.no_grad():
        expected = gu.reference(path).generate(
            torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False, eos_token_id=None,
            pad_token_id=0)[0, len(prompt):].tolist()
    got = _llm(path, backend).generate([prompt], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    assert got[0].token_ids == expected


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_batch_equals_each_alone(backend, ckpt):
    path = ckpt("gpt_oss_mixed")
    prompts = [_prompt(n, seed=n) for n in (3, 17, 30, 8)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    alone = [_llm(path, backend).generate([p], params)[0].token_ids for p in prompts]
    batched = _llm(path, backend, max_num_seqs=4).generate(prompts, params)
    assert [o.token_ids for o in batched] == alone


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_prefix_cache_hit_equals_cold(backend, ckpt):
    """32 prompt tokens from cached pages: the windowed layers' keys among them too."""
    path = ckpt("gpt_oss")
    prompt, longer = _prompt(40, seed=5), _prompt(40, seed=5) + [1, 2, 3]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    cold = _llm(path, backend, enable_prefix_cache=False).generate([longer], params)[0].token_ids
    llm = _llm(path, backend, page_size=16)
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    again = llm.generate([longer], params)[0]
    assert again.num_cached_tokens == 32 and again.token_ids == cold
    assert _parity(llm, path, longer, 8) <= 1e-4
    assert llm.scheduler.running[0].num_cached_tokens == 32


# --- MXFP4 experts as published (formats/mxfp4.py) ---

def _mx_reference(path):
    import transformers as tf

    # transformers dequantises mxfp4 to bf16 on a CPU (the values are exact in bf16), then fp32
    return tf.GptOssForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                quantization_config=tf.Mxfp4Config(dequantize=True)).eval()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_mxfp4_checkpoint_matches_transformers_dequantised_reference(backend, ckpt, tmp_path):
    """Hand-packed MXFP4 experts (gpt_oss_util.write_mxfp4: 12 octaves of block scales per row, zero
    blocks); the cpu backend runs them as the nvfp4 execution format (codes and scales copied, no
    re-rounding). cpu: <= 1e-4 with fp32 activations; the int8-activation default (AVX2) within 0.1."""
    path = gu.write_mxfp4(ckpt("gpt_oss"), tmp_path / "mx")
    prompt = _prompt(21, seed=1)
    llm = _llm(path, backend, page_size=16)
    if backend == "cpu":
        assert {b.fmt for b in llm.model.experts.banks} == {"nvfp4"}
    tokens, ours = parity_util.drive(llm, prompt, 32)
    with torch.no_grad():
        theirs = _mx_reference(path)(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    tol = 1e-4 if backend == "torch" or INT_ACT != "int8" else 0.1
    assert (ours - theirs).abs().max().item() <= tol
    assert (ours - _theirs(ckpt("gpt_oss"), prompt + tokens[:-1], len(prompt) - 1)).abs().max().item() > 1e-2


@pytest.mark.skipif(os.environ.get("FREETOKEN_INT_ACT") == "fp32", reason="this process already runs the exact path")
def test_mxfp4_cpu_with_fp32_activations_matches_within_1e_4():
    env = {**os.environ, "FREETOKEN_INT_ACT": "fp32"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "test_mxfp4_checkpoint_matches_transformers_dequantised_reference and cpu"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and re.search(r"\b1 passed", proc.stdout), proc.stdout[-2000:] + proc.stderr[-2000:]


def test_mxfp4_to_nvfp4_is_exact_within_17_octaves_and_bounded_beyond():
    """The conversion against the format's own decode (FAMILIES F3): bit for bit where each row's
    live block exponents span <= 17 octaves (e4m3 powers of two 2^-9..2^8 times a row factor), and
    within 2^-18 of the row's largest magnitude (re-rounded, counted) where they span more."""
    from freetoken_py.formats.mxfp4 import dequantize_mxfp4, mxfp4_to_nvfp4
    from freetoken_py.quant.nvfp4 import dequantize_nvfp4

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (64, 6, 16), generator=g, dtype=torch.uint8)
    blocks[::7, 2] = 0
    for span, exact in ((17, True), (25, False)):
        scales = (100 + torch.randint(0, span + 1, (64, 6), generator=g)).to(torch.uint8)
        scales[:, 0] = 100 + span   # every row reaches the full span
        scales[:, 1] = 100
        ref = dequantize_mxfp4(blocks, scales)
        codes, s, flushed = mxfp4_to_nvfp4(blocks, scales)
        ours = dequantize_nvfp4(codes, s, 16)
        if exact:
            assert flushed == 0 and torch.equal(ours, ref)
        else:
            assert flushed > 0
            bound = ref.abs().amax(dim=1, keepdim=True) * 2.0 ** -18
            assert ((ours - ref).abs() <= bound).all() and not torch.equal(ours, ref)


# --- bad input: one line naming the field or tensor ---

def _edited(src, dst, config=None, tensors=None):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.bin"))
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors:
        for f in dst.glob("*.safetensors"):
            save_file({k: tensors(k, v) for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    return dst


def _load_error(path) -> str:
    with pytest.raises(ModelLoadError) as e:
        _llm(path, "torch")
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_unknown_layer_type_is_one_line_naming_the_field(ckpt, tmp_path):
    path = _edited(ckpt("gpt_oss"), tmp_path / "m", config={
        "layer_types": ["sliding_attention", "full_attention", "chunked_attention", "full_attention"]})
    msg = _load_error(path)
    assert "'layer_types'[2]" in msg and "chunked_attention" in msg


def test_sink_tensor_of_the_wrong_shape_is_one_line_naming_it(ckpt, tmp_path):
    path = _edited(ckpt("gpt_oss"), tmp_path / "m",
                   tensors=lambda k, v: v[:-1].clone() if k == "model.layers.1.self_attn.sinks" else v)
    msg = _load_error(path)
    assert "model.layers.1.self_attn.sinks" in msg and "[3]" in msg and "[4]" in msg


def test_mxfp4_scales_that_do_not_match_the_blocks_are_one_line_naming_them(ckpt, tmp_path):
    mx = gu.write_mxfp4(ckpt("gpt_oss"), tmp_path / "mx")
    bad = _edited(mx, tmp_path / "bad", tensors=lambda k, v: v[:, :-2].clone()
                  if k == "model.layers.0.mlp.experts.down_proj_scales" else v)
    msg = _load_error(bad)
    assert "model.layers.0.mlp.experts.down_proj_scales" in msg and "down_proj_blocks" in msg


# --- freetoken probe: bytes per token from the real geometry ---

def test_probe_reads_gpt_oss_20b_geometry(tmp_path):
    """gpt-oss-20b's released tensors (headers only: MXFP4 experts, bf16 rest) and config: each
    decode token reads top-4 of 32 experts in 24 layers at their stored bytes (blocks + e8m0 scales
    + bf16 biases); the KV cache adds the 12 full layers x K and V x 8 heads x 64 x 2 bytes per
    token, and the 12 windowed layers a fixed 144 rows each per request (kvcache/window.py)."""
    from freetoken_py.hw.model_bytes import read_model_bytes
    from freetoken_py.models.checkpoint import TensorInfo

    D, I, E, H, KV, hd, V, L = 2880, 2880, 32, 64, 8, 64, 201088, 24
    cfg = {"model_type": "gpt_oss", "num_hidden_layers": L, "num_local_experts": E, "num_experts_per_tok": 4,
           "hidden_size": D, "intermediate_size": I, "head_dim": hd, "num_attention_heads": H,
           "num_key_value_heads": KV, "vocab_size": V, "sliding_window": 128, "tie_word_embeddings": False,
           "quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    f = tmp_path / "model.safetensors"
    nb = {"BF16": 2, "U8": 1}
    infos = {}

    def add(name, dtype, *shape):
        n = 1
        for s in shape:
            n *= s
        infos[name] = TensorInfo(name, f, dtype, tuple(shape), n * nb[dtype])

    add("model.embed_tokens.weight", "BF16", V, D)
    add("lm_head.weight", "BF16", V, D)
    add("model.norm.weight", "BF16", D)
    for i in range(L):
        p = f"model.layers.{i}."
        for x, rows in (("q", H * hd), ("k", KV * hd), ("v", KV * hd)):
            add(p + f"self_attn.{x}_proj.weight", "BF16", rows, D)
            add(p + f"self_attn.{x}_proj.bias", "BF16", rows)
        add(p + "self_attn.o_proj.weight", "BF16", D, H * hd)
        add(p + "self_attn.o_proj.bias", "BF16", D)
        add(p + "self_attn.sinks", "BF16", H)
        add(p + "input_layernorm.weight", "BF16", D)
        add(p + "post_attention_layernorm.weight", "BF16", D)
        add(p + "mlp.router.weight", "BF16", E, D)
        add(p + "mlp.router.bias", "BF16", E)
        add(p + "mlp.experts.gate_up_proj_blocks", "U8", E, 2 * I, D // 32, 16)
        add(p + "mlp.experts.gate_up_proj_scales", "U8", E, 2 * I, D // 32)
        add(p + "mlp.experts.gate_up_proj_bias", "BF16", E, 2 * I)
        add(p + "mlp.experts.down_proj_blocks", "U8", E, D, I // 32, 16)
        add(p + "mlp.experts.down_proj_scales", "U8", E, D, I // 32)
        add(p + "mlp.experts.down_proj_bias", "BF16", E, D)
    mb = read_model_bytes(tmp_path, infos=infos, label="gpt-oss-20b")
    per_expert = 2 * I * (D // 2 + D // 32) + D * (I // 2 + I // 32) + 2 * (2 * I + D)   # 13,236,480
    assert per_expert == 13_236_480
    assert mb.per_token["routed_experts"] == L * 4 * per_expert == 1_270_702_080
    # half the layers slide over 128 keys (transformers' default layer_types: even layers): per
    # token only the full layers' K/V; per request the windowed ones hold 128 keys + one page of 16
    assert mb.kv_bytes_per_token == L // 2 * 2 * KV * hd * 2 == 24_576
    assert mb.window_bytes_per_request == L // 2 * 2 * KV * hd * 2 * (128 + 16) == 3_538_944
    assert mb.weight_format == "mxfp4 (e8m0 scales per 32)" and mb.expert_dtype == "U8"
    dense = L * (2 * (H * hd + 2 * KV * hd) * (D + 1) + 2 * (D * H * hd + D) + 2 * H + 4 * D + 2 * E * (D + 1)) + 2 * D
    assert mb.per_token["dense"] == dense


# --- FP8 KV cache ---

def _teacher_forced_logprobs(llm, tokens: list[int], prefill: int) -> torch.Tensor:
    from freetoken_py.core import Request
    from freetoken_py.engine.runner import ScheduledChunk

    req = Request(tokens[:prefill], SamplingParams())
    req.page_table = llm.allocator.allocate(-(-len(tokens) // llm.config.page_size))
    rows = [llm.runner.forward_batch([ScheduledChunk(req, prefill)])]
    for t in tokens[prefill:-1]:
        req.output_token_ids.append(t)
        rows.append(llm.runner.forward_batch([ScheduledChunk(req, 1)]))
    llm.allocator.release(req.page_table)
    return torch.log_softmax(torch.cat(rows), dim=-1)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_fp8_kv_within_the_kl_budget_of_the_fp32_cache(backend, ckpt):
    """Mean KL(fp32-KV || fp8-KV) over 3 x 40 teacher-forced positions (8-token prefill, then decode
    steps reading their history, the windowed layers' included, back from FP8): measured 8.6e-4 on
    both backends (tiny random weights); held to test_kvcache_fp8's budget, 5e-3."""
    path = ckpt("gpt_oss_mixed")
    engines = {kv: _llm(path, backend, kv_dtype=kv, kv_cache_bytes=1 << 22) for kv in ("fp32", "fp8")}
    assert engines["fp8"].runner.cache.quantized and engines["fp8"].runner.cache.calibrated
    kls = []
    for s in range(3):
        seq = _prompt(48, seed=s)
        ref, fp8 = (_teacher_forced_logprobs(engines[kv], seq, prefill=8) for kv in ("fp32", "fp8"))
        kls.append((ref.exp() * (ref - fp8)).sum(-1))
    kl = torch.cat(kls).mean().item()
    print(f"gpt_oss {backend} fp8 KV: mean KL {kl:.3g}")
    assert 0 < kl <= 5e-3, kl


def test_rms_norm_multiplies_in_fp32_as_gpt_oss_does_in_bf16(ckpt):
    """gpt-oss's RMSNorm (FAMILIES §0 (b)): (w * x32_normed).to(bf16), not w * x_normed.to(bf16);
    ours on a bf16 load equals transformers' GptOssRMSNorm bit for bit (the other flavour differs)."""
    import transformers as tf

    from freetoken_py.layers.norm import rms_norm

    llm = LLM(ckpt("gpt_oss"), dtype="bfloat16", show_progress=False, backend="torch")
    w = llm.model.weights.layers[1].post_norm
    theirs = tf.models.gpt_oss.modeling_gpt_oss.GptOssRMSNorm(w.shape[0], eps=llm.args.rms_norm_eps)
    theirs.weight.data = w.clone()
    x = torch.randn(16, w.shape[0], generator=torch.Generator().manual_seed(0)).bfloat16() * 3
    ours = llm.model.arch.norm(x, w, llm.args.rms_norm_eps)   # the model file's RmsNorm kind
    assert torch.equal(ours, theirs(x))
    assert not torch.equal(rms_norm(x, w, llm.args.rms_norm_eps), theirs(x))
