"""Hybrid linear-attention families (qwen3_next, qwen3_5_moe: Gated DeltaNet + gated full attention) against
transformers on tiny random fp32 checkpoints (tests/hybrid_util.py: zero-centred norms, the GDN output norm,
A_log and dt_bias randomised), on both backends: prefill longer than one prefill chunk and than GDN's
64-token chunk, 32 cached decode steps, 64 greedy tokens, batches, chunked prefill and recompute
preemption; the real releases' fused-expert VLM layout; per-request state memory; bad configs."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import hybrid_util
import parity_util
from freetoken_py.core import SamplingParams
from freetoken_py.errors import FreetokenError
from freetoken_py.layers.gated_deltanet import causal_conv, gdn_core
from freetoken_py.llm import LLM

ARCHS = ["qwen3_next", "qwen3_5_moe"]
ckpt = parity_util.checkpoint_cache(hybrid_util.build)
_EXPECTED: dict = {}


def _prompt(n: int, seed: int) -> list[int]:
    return parity_util.random_prompt(hybrid_util.VOCAB, n, seed)


def _llm(path, backend: str, **kw) -> LLM:
    return LLM(path, dtype="float32", show_progress=False, backend=backend, **kw)


def test_delta_rule_chunked_and_recurrent_match_transformers():
    """layers/gated_deltanet.gdn_core (chunked WY form for n > 1, one step for n == 1) and the causal conv
    against transformers' torch_chunk_gated_delta_rule / recurrent rule / causal_conv1d_fn, from a nonzero state."""
    from transformers.models.qwen3_next import modeling_qwen3_next as ref

    g = torch.Generator().manual_seed(0)
    n, hk, hv, dk, dv = 150, 2, 4, 16, 8
    q, k = torch.randn(n, hk, dk, generator=g), torch.randn(n, hk, dk, generator=g)
    v = torch.randn(n, hv, dv, generator=g)
    decay, beta = -torch.rand(n, hv, generator=g) * 2, torch.rand(n, hv, generator=g)
    s0 = torch.randn(hv, dk, dv, generator=g) * 0.1
    want, want_s = ref.torch_chunk_gated_delta_rule(q[None], k[None], v[None], decay[None], beta[None],
                                                    initial_state=s0[None].clone(), output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    state = s0.clone()
    assert (gdn_core(q, k, v, decay, beta, state) - want[0]).abs().max() < 1e-5
    assert (state - want_s[0]).abs().max() < 1e-5
    state = s0.clone()
    steps = torch.cat([gdn_core(q[i:i + 1], k[i:i + 1], v[i:i + 1], decay[i:i + 1], beta[i:i + 1], state)
                       for i in range(n)])
    assert (steps - want[0]).abs().max() < 1e-5 and (state - want_s[0]).abs().max() < 1e-5
    x, w = torch.randn(20, 6, generator=g), torch.randn(6, 4, generator=g)
    conv_state = torch.zeros(6, 3)
    parts = [causal_conv(x[a:b], w, conv_state) for a, b in ((0, 7), (7, 8), (8, 20))]  # continues from its state
    assert (torch.cat(parts) - ref.causal_conv1d_fn(x.T[None], w, activation="silu")[0].T).abs().max() < 1e-6
    assert torch.equal(conv_state, x[-3:].T)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_32_cached_decode_steps_match_transformers(arch, backend, ckpt):
    path = ckpt(arch)
    prompt = _prompt(90, seed=1)  # > GDN's 64-token chunk, and 3 prefill chunks of <= 40
    llm = _llm(path, backend, page_size=16, max_num_batched_tokens=40)
    assert llm.runner.states is not None and llm.runner.cache.k.shape[0] == 1  # one full-attention layer has pages
    tokens, ours = parity_util.drive(llm, prompt, 32)
    with torch.no_grad():
        theirs = hybrid_util.reference(path)(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-4


def _expected_greedy(arch: str, path, prompt: list[int]) -> list[int]:
    if arch not in _EXPECTED:
        with torch.no_grad():
            _EXPECTED[arch] = hybrid_util.reference(path).generate(
                torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False, eos_token_id=None,
                pad_token_id=0)[0, len(prompt):].tolist()
    return _EXPECTED[arch]


@pytest.mark.parametrize("arch,backend", [("qwen3_next", "torch"), ("qwen3_5_moe", "cpu")])  # each once
def test_64_greedy_tokens_identical_to_transformers_generate(arch, backend, ckpt):
    path = ckpt(arch)
    prompt = _prompt(70, seed=2)
    expected = _expected_greedy(arch, path, prompt)
    got = _llm(path, backend).generate([prompt], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    assert got[0].token_ids == expected
    assert got[0].num_cached_tokens == 0


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_batch_chunked_prefill_and_recompute_preemption_equal_each_alone(backend, ckpt):
    """Four requests at once with a 16-token budget (chunked prefill) and a page pool too small for all of
    them (recompute preemption): each equals its run alone; every page and state slot comes back."""
    path = ckpt("qwen3_5_moe")
    prompts = [_prompt(n, seed=100 + n) for n in (5, 29, 13, 70)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = _llm(path, backend)
    alone = [ref.generate([p], params)[0].token_ids for p in prompts]
    page = ref.runner.cache.bytes_per_token * 16
    llm = _llm(path, backend, max_num_seqs=4, max_num_batched_tokens=16, kv_cache_bytes=8 * page, page_size=16,
               enable_prefix_cache=False)
    assert llm.allocator.num_pages == 8
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    assert llm.scheduler.num_preemptions > 0
    assert llm.runner.states.num_free == llm.runner.states.num_slots
    assert all(o.num_cached_tokens == 0 for o in outs)   # no page hit without its recurrent state


def test_real_release_layout_loads_and_equals_the_saved_layout(ckpt, tmp_path, capfd):
    """model.language_model.* under a VLM config, fused gate_up_proj / down_proj experts without .weight
    (written from the save_pretrained checkpoint by the documented rule), vision and mtp tensors skipped."""
    src = ckpt("qwen3_5_moe")
    real = hybrid_util.to_real_release_layout(src, tmp_path / "real")
    prompt = _prompt(20, seed=6)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = _llm(src, "torch").generate([prompt], params)[0].token_ids
    capfd.readouterr()
    for backend in ("torch", "cpu"):
        assert _llm(real, backend).generate([prompt], params)[0].token_ids == want
    assert "vision tower / multi-token-prediction tensors not loaded" in capfd.readouterr().err


def test_a_dense_layer_explicit_layer_types_and_no_renormalisation_match_transformers(ckpt):
    path = ckpt("qwen3_next_mixed")
    prompt = _prompt(40, seed=3)
    tokens, ours = parity_util.drive(_llm(path, "torch"), prompt, 4)
    with torch.no_grad():
        theirs = hybrid_util.reference(path)(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_state_memory_per_request_and_kv_bytes_of_the_full_attention_layers_only(ckpt):
    from freetoken_py.hw.model_bytes import read_model_bytes

    path = ckpt("qwen3_next")
    llm = _llm(path, "torch", kv_dtype="fp32")
    cfg = json.loads((path / "config.json").read_text())
    linear = cfg["layer_types"].count("linear_attention")
    conv_dim = 2 * 2 * 16 + 4 * 16
    per_request = linear * 4 * (conv_dim * 3 + 4 * 16 * 16)   # conv (K-1 = 3 inputs) + [Hv, dk, dv], fp32
    per_token = (4 - linear) * 2 * 2 * 16 * 4                  # K and V of the full-attention layers only
    stats = llm.stats()
    assert stats["state_bytes_per_request"] == llm.state_bytes_per_request == per_request
    assert stats["kv_bytes_per_token"] == llm.kv_bytes_per_token == per_token
    assert stats["state_slots"] == stats["free_state_slots"] >= llm.config.max_num_seqs
    mb = read_model_bytes(path)   # freetoken probe --model, from config.json alone
    assert mb.state_bytes_per_request == per_request and mb.kv_bytes_per_token == per_token // 2  # (bf16 KV)
    assert mb.to_dict()["state_bytes_per_request"] == per_request


def test_run_stats_line_reports_state_bytes_per_request(ckpt, capsys):
    from freetoken_py.cli_run import _print_stats

    llm = _llm(ckpt("qwen3_next"), "torch")
    out = llm.generate([_prompt(5, seed=1)], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
    _print_stats(out, llm.kv_bytes_per_token, llm.state_bytes_per_request)
    err = capsys.readouterr().err
    assert f"| KV {llm.kv_bytes_per_token} B/tok | state {llm.state_bytes_per_request} B/req |" in err


def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_bad_hybrid_configs_are_one_line_errors_naming_the_field(ckpt, tmp_path):
    src = ckpt("qwen3_next")
    cases = [
        (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
         "'layer_types'[1] is 'sliding_attention'"),
        (dict(linear_num_value_heads=3), "'linear_num_value_heads' (3) must be a multiple of 'linear_num_key_heads' (2)"),
        (dict(layer_types=["full_attention"]), "'layer_types' must list one entry per layer (4)"),
        (dict(linear_key_head_dim=None), "'linear_key_head_dim'"),
    ]
    for i, (change, needle) in enumerate(cases):
        with pytest.raises(FreetokenError) as err:
            _llm(_edit_config(src, tmp_path / f"c{i}", **change), "torch")
        assert needle in str(err.value) and "\n" not in str(err.value)


def test_qwen35_template_renders_and_both_apis_switch_thinking(tmp_path):
    """A tiny qwen3_5_moe served with Qwen3.5's template (tests/data/templates/qwen3.5.jinja) and the demo
    tokenizer: OpenAI chat_template_kwargs.enable_thinking and Anthropic thinking switch the template's
    think block; prompt counts equal the tokenizer's count of the hand-rendered template."""
    import anthropic
    import openai

    from freetoken_py.cli import DEMO_MODEL
    from freetoken_py.tokenizer import Tokenizer
    from server_util import REPO, ServerThread

    d = hybrid_util.build("qwen3_5_moe", tmp_path / "q35", vocab_size=4096)
    shutil.copy(DEMO_MODEL / "tokenizer.json", d / "tokenizer.json")
    cfg = json.loads((DEMO_MODEL / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    shutil.copy(REPO / "tests" / "data" / "templates" / "qwen3.5.jinja", d / "chat_template.jinja")
    tok = Tokenizer(d)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    on_text = tok.apply_chat_template(messages)
    off_text = tok.apply_chat_template(messages, enable_thinking=False)
    assert on_text.endswith("<|im_start|>assistant\n<think>\n") and off_text.endswith("<think>\n\n</think>\n\n")
    on, off = len(tok.encode(on_text)), len(tok.encode(off_text))
    with ServerThread(model_dir=d, backend="torch") as srv:
        chat = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=120).chat.completions
        got_off = chat.create(model="m", messages=messages, max_tokens=2, temperature=0,
                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        got_on = chat.create(model="m", messages=messages, max_tokens=2, temperature=0)
        assert (got_off.usage.prompt_tokens, got_on.usage.prompt_tokens) == (off, on)
        client = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
        count = client.messages.count_tokens
        assert count(model="m", messages=messages, thinking={"type": "disabled"}).input_tokens == off
        assert count(model="m", messages=messages, thinking={"type": "enabled", "budget_tokens": 1024}).input_tokens == on
