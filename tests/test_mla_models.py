"""MLA families (deepseek_v3 / kimi_k2, kimi_k25, glm4_moe_lite) against transformers on tiny random checkpoints
(tests/mla_util.py: fp32, YaRN or default RoPE, with and without q_lora_rank, interleaved and
half-split RoPE, v_head_dim != qk_nope_head_dim, n_group > 1, randomised norms and correction
bias), on both backends (torch: layers/mla.py; cpu: numba projections + engine/fused_mla.py's
absorbed decode over the latent pages)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import mla_util
import parity_util
from freetoken_py.core import SamplingParams
from freetoken_py.errors import FreetokenError
from freetoken_py.llm import LLM

ARCHS = ["deepseek_v3", "deepseek_v3_plain", "glm4_moe_lite", "kimi_k25"]
ckpt = parity_util.checkpoint_cache(mla_util.build)


def _prompt(n: int, seed: int) -> list[int]:
    return parity_util.random_prompt(mla_util.VOCAB, n, seed)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_32_cached_decode_steps_match_transformers(arch, backend, ckpt):
    path = ckpt(arch)
    prompt = _prompt(21, seed=1)
    llm = LLM(path, dtype="float32", show_progress=False, backend=backend, page_size=16)
    assert (backend == "cpu") == (type(llm.runner.fused).__name__ == "MlaDecoder")
    tokens, ours = parity_util.drive(llm, prompt, 32)
    with torch.no_grad():
        theirs = mla_util.reference(arch, path)(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    assert (ours - theirs).abs().max().item() <= 1e-4


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe_lite"])
def test_64_greedy_tokens_identical_to_transformers_generate(arch, backend, ckpt):
    path = ckpt(arch)
    prompt = _prompt(9, seed=2)
    with torch.no_grad():
        expected = mla_util.reference(arch, path).generate(
            torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False, eos_token_id=None,
            pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(path, dtype="float32", show_progress=False, backend=backend)
    got = llm.generate([prompt], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0].token_ids
    assert got == expected


def test_latent_pool_holds_kv_lora_plus_rope_values_per_token_per_layer(ckpt):
    llm = LLM(ckpt("deepseek_v3"), dtype="float32", show_progress=False, backend="torch")
    cache, cfg = llm.runner.cache, llm.args.mla
    assert cache.k.shape[2:] == (1, cfg.kv_lora_rank) and cache.v.shape[2:] == (1, cfg.qk_rope_head_dim)
    per_token = llm.args.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)  # 2 x (32 + 16)
    assert cache.bytes_per_token == per_token * 4 == llm.kv_bytes_per_token
    assert LLM(ckpt("deepseek_v3"), dtype="float32", show_progress=False, backend="torch",
               kv_dtype="fp8").kv_bytes_per_token == per_token
    from freetoken_py.hw.model_bytes import read_model_bytes
    bf16 = LLM(ckpt("deepseek_v3"), dtype="float32", show_progress=False, backend="torch", kv_dtype="bf16")
    assert read_model_bytes(ckpt("deepseek_v3")).kv_bytes_per_token == bf16.kv_bytes_per_token == per_token * 2
    assert read_model_bytes(ckpt("kimi_k25")).kv_bytes_per_token == per_token * 2  # (from text_config)


def test_stats_line_reports_the_pools_kv_bytes_per_token(ckpt, capsys):
    from freetoken_py.cli_run import _print_stats
    llm = LLM(ckpt("glm4_moe_lite"), dtype="float32", show_progress=False, backend="torch")
    out = llm.generate([_prompt(5, seed=1)], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    _print_stats(out, llm.kv_bytes_per_token)
    assert f"| KV {2 * (32 + 16) * 4} B/tok |" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_batch_equals_each_alone(backend, ckpt):
    path = ckpt("deepseek_v3")
    prompts = [_prompt(n, seed=n) for n in (3, 17, 30, 8)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    llm = LLM(path, dtype="float32", show_progress=False, backend=backend)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    batched = LLM(path, dtype="float32", show_progress=False, max_num_seqs=4, backend=backend).generate(prompts, params)
    assert [o.token_ids for o in batched] == alone


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_prefix_cache_hit_on_latent_pages_gives_the_same_tokens(backend, ckpt):
    path = ckpt("glm4_moe_lite")
    prompt = _prompt(40, seed=5)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    cold = LLM(path, dtype="float32", show_progress=False, backend=backend, enable_prefix_cache=False)
    expected = cold.generate([prompt], params)[0].token_ids
    llm = LLM(path, dtype="float32", show_progress=False, backend=backend, page_size=16)
    first = llm.generate([prompt], params)[0]
    second = llm.generate([prompt + [1]], params)[0]  # shares the prompt's whole pages
    assert first.token_ids == expected
    assert second.num_cached_tokens == 32
    assert llm.generate([prompt], params)[0].token_ids == expected


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


# measured on this checkpoint: mean KL(fp32 KV || fp8 KV) over prefill + 32 decode steps = 2.1e-4 on
# both backends (2026-12-01); the budget leaves ~10x room, far below what a wrong scale gives
FP8_KL_BUDGET = 2e-3


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_fp8_latent_cache_within_a_kl_budget(backend, ckpt):
    path = ckpt("deepseek_v3")
    prompt = _prompt(24, seed=3)
    ref_tokens, ref = parity_util.drive(LLM(path, dtype="float32", show_progress=False, backend=backend), prompt, 32)
    llm = LLM(path, dtype="float32", show_progress=False, backend=backend, kv_dtype="fp8")
    assert llm.runner.cache.quantized and llm.runner.cache.k_scale.shape == (2, 1)
    req = llm.add_request(prompt, SamplingParams(max_tokens=33, temperature=0, ignore_eos=True))
    steps = []
    for t in ref_tokens[:33]:  # teacher-forced on the fp32 run's tokens
        steps.append(llm.runner.forward_batch(llm.scheduler.schedule())[0])
        req.output_token_ids.append(t)
    kl = _kl(ref, torch.stack(steps))
    assert 0 < kl <= FP8_KL_BUDGET


def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_bad_input_is_one_line_naming_the_field_or_tensor(ckpt, tmp_path):
    src = ckpt("deepseek_v3")
    cases = [
        (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope type 'longrope'"),
        (dict(index_topk=4), "'index_topk'"),
        (dict(kv_lora_rank=None), "'kv_lora_rank'"),
    ]
    for i, (change, needle) in enumerate(cases):
        with pytest.raises(FreetokenError) as err:
            LLM(_edit_config(src, tmp_path / f"c{i}", **change), show_progress=False, backend="torch")
        assert needle in str(err.value) and "\n" not in str(err.value)
    missing = mla_util.rename_tensors(src, tmp_path / "missing", lambda n: n.replace("kv_b_proj", "kv_b_gone"))
    with pytest.raises(FreetokenError, match="missing tensor 'model.layers.0.self_attn.kv_b_proj.weight'"):
        LLM(missing, show_progress=False, backend="torch")


def test_kimi_k2_spelling_and_mtp_layers_load(ckpt, tmp_path):
    """model_type kimi_k2 (Kimi K2 text configs) loads as deepseek_v3; an MTP layer's tensors
    (model.layers.{num_hidden_layers}.*) are ignored."""
    src = ckpt("deepseek_v3")
    dst = _edit_config(src, tmp_path / "k2", model_type="kimi_k2")
    from safetensors.torch import load_file, save_file
    f = next(dst.glob("*.safetensors"))
    tensors = load_file(f)
    tensors.update({k.replace("layers.1.", "layers.2."): v.clone() for k, v in tensors.items() if "layers.1." in k})
    save_file(tensors, f, metadata={"format": "pt"})
    prompt = _prompt(9, seed=4)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = LLM(src, dtype="float32", show_progress=False, backend="torch").generate([prompt], params)[0].token_ids
    assert LLM(dst, dtype="float32", show_progress=False, backend="torch").generate([prompt], params)[0].token_ids == want


def test_kimi_k25_real_release_names_and_wrapper_errors(ckpt, tmp_path, capfd):
    """transformers saves the text layers as language_model.model.blocks.N; the real K2.5 / K2.6
    releases say language_model.model.layers.N: both load to the same tokens; the vision tower is
    skipped with one note; a wrapper without a text config is a one-line error."""
    src = ckpt("kimi_k25")
    real = mla_util.rename_tensors(src, tmp_path / "real", lambda n: n.replace("model.blocks.", "model.layers."))
    prompt = _prompt(9, seed=6)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    saved = LLM(src, dtype="float32", show_progress=False, backend="torch").generate([prompt], params)[0].token_ids
    capfd.readouterr()
    assert LLM(real, dtype="float32", show_progress=False, backend="cpu").generate([prompt], params)[0].token_ids == saved
    assert "vision tower / projector tensors not loaded" in capfd.readouterr().err
    cfg = json.loads((src / "config.json").read_text())
    del cfg["text_config"]
    bad = _edit_config(src, tmp_path / "no_text")
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FreetokenError, match="needs a 'text_config'"):
        LLM(bad, show_progress=False, backend="torch")


def test_cpu_decode_reads_a_bf16_kv_b_in_place_without_fp32_copies(tmp_path):
    """A bf16 checkpoint on the cpu backend: W_UK / W_UV are kv_b_proj's own bf16 storage, read by
    the decode kernel in place (2 bytes per element; before: kv_b widened to fp32 plus fp32 split
    copies, 8 bytes), and the logits still match transformers on the same weights within 1e-4."""
    import numpy as np

    path = mla_util.build("deepseek_v3", tmp_path / "bf16", dtype=torch.bfloat16)
    llm = LLM(path, show_progress=False, backend="cpu", kv_dtype="fp32", page_size=16)
    dec = llm.runner.fused
    assert type(dec).__name__ == "MlaDecoder"
    kv_bs = [lw.mla.kv_b for lw in dec.model.weights.layers]
    assert all(t.dtype == torch.bfloat16 for t in kv_bs)
    n = sum(t.numel() for t in kv_bs)
    assert dec.absorb_bytes == 2 * n   # the old scheme held 8 * n: saved 6 bytes per kv_b element
    assert all(np.shares_memory(a, t.view(torch.int16).numpy()) for a, t in zip(dec.kv_b, kv_bs))
    prompt = _prompt(21, seed=1)
    tokens, ours = parity_util.drive(llm, prompt, 16)
    with torch.no_grad():
        theirs = mla_util.reference("deepseek_v3", path)(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    assert (ours - theirs).abs().max().item() <= 1e-4
