"""DeepSeek sparse attention (deepseek_v32, glm_moe_dsa: GLM-5 / 5.1 / 5.2) against transformers on
tiny random fp32 checkpoints (tests/dsa_util.py: index_topk 6 far below the prompts, 16 indexer
heads so the selection has no near-ties, randomised norms, LayerNorm bias and correction bias;
GLM with full and shared indexer layers mixed, and without indexer_types), on both backends
(torch: layers/mla.py + layers/dsa.py; cpu: engine/fused_mla.py's absorbed decode over the
selected latents). transformers' own cached decode equals its full forward on these configs
(<= 2.4e-6, checked in test_transformers_own_cached_decode_is_consistent)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import dsa_util
import mla_util
import parity_util
from freetoken_py.core import SamplingParams
from freetoken_py.llm import LLM

ARCHS = ["deepseek_v32", "glm_moe_dsa", "glm_moe_dsa_shared2", "glm_moe_dsa_all_full"]
ckpt = parity_util.checkpoint_cache(dsa_util.build)


def _prompt(n: int, seed: int) -> list[int]:
    return parity_util.random_prompt(mla_util.VOCAB, n, seed)


def _theirs(arch, path, ids: list[int], start: int) -> torch.Tensor:
    with torch.no_grad():
        return dsa_util.reference(arch, path)(torch.tensor([ids])).logits[0, start:]


def _llm(path, backend, **kw):
    return LLM(path, dtype="float32", show_progress=False, backend=backend, **kw)


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_transformers_own_cached_decode_is_consistent(arch, ckpt):
    """The reference is only trusted where its cached decode (16 + 1-token steps) equals its full forward."""
    path, ids = ckpt(arch), torch.tensor([_prompt(40, seed=1)])
    model = dsa_util.reference(arch, path)
    with torch.no_grad():
        full = model(ids).logits[0]
        out = model(ids[:, :16], use_cache=True)
        steps = [out.logits[0]] + [model(ids[:, t:t + 1], past_key_values=out.past_key_values).logits[0]
                                   for t in range(16, 40)]
    assert (full - torch.cat(steps)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_32_cached_decode_steps_match_transformers(arch, backend, ckpt):
    path = ckpt(arch)
    prompt = _prompt(21, seed=1)
    llm = _llm(path, backend, page_size=16)
    assert (backend == "cpu") == (type(llm.runner.fused).__name__ == "MlaDecoder")
    tokens, ours = parity_util.drive(llm, prompt, 32)
    assert (ours - _theirs(arch, path, prompt + tokens[:-1], len(prompt) - 1)).abs().max().item() <= 1e-4


def test_the_selection_matters_dense_mla_is_far_from_the_reference(ckpt, tmp_path):
    """The same weights with index_topk beyond the context (dense MLA) miss transformers by far more
    than the tolerance: the parity tests above can fail on a selection that is not applied."""
    src = ckpt("glm_moe_dsa")
    dense = _edit_config(src, tmp_path / "dense", index_topk=4096)
    prompt = _prompt(21, seed=1)
    tokens, ours = parity_util.drive(_llm(dense, "torch"), prompt, 8)
    assert (ours - _theirs("glm_moe_dsa", src, prompt + tokens[:-1], len(prompt) - 1)).abs().max().item() > 1e-2


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_64_greedy_tokens_identical_to_transformers_generate(arch, backend, ckpt):
    path = ckpt(arch)
    prompt = _prompt(9, seed=2)
    with torch.no_grad():
        expected = dsa_util.reference(arch, path).generate(
            torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False, eos_token_id=None,
            pad_token_id=0)[0, len(prompt):].tolist()
    got = _llm(path, backend).generate([prompt], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    assert got[0].token_ids == expected


def _without_indexer(src, dst, model_type: str):
    """The same checkpoint as plain MLA (deepseek_v3 / glm4_moe_lite): DSA keys and indexer tensors gone."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.bin"))  # not the expert cache
    cfg = json.loads((dst / "config.json").read_text())
    for key in ("index_topk", "index_n_heads", "index_head_dim", "indexer_types", "layer_types"):
        cfg.pop(key, None)
    cfg["model_type"] = model_type
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in dst.glob("*.safetensors"):
        save_file({k: v for k, v in load_file(f).items() if ".indexer." not in k}, f, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("arch,plain", [("deepseek_v32", "deepseek_v3"), ("glm_moe_dsa", "glm4_moe_lite")])
def test_a_context_within_index_topk_is_plain_mla_bit_for_bit(arch, plain, backend, ckpt, tmp_path):
    src = ckpt(arch)
    prompt = _prompt(3, seed=7)  # 3 + 3 decode steps: every context <= index_topk (6)
    ours = parity_util.drive(_llm(src, backend), prompt, 3)[1]
    mla = parity_util.drive(_llm(_without_indexer(src, tmp_path / plain, plain), backend), prompt, 3)[1]
    assert torch.equal(ours, mla)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("chunk", [4, 5, 7])
def test_chunked_prefill_across_index_topk_matches_transformers(chunk, backend, ckpt):
    """Chunks of 4 / 5 end below index_topk (6) and the next ones above it; 7 crosses it at once."""
    path = ckpt("glm_moe_dsa")
    prompt = _prompt(30, seed=3)
    tokens, ours = parity_util.drive(_llm(path, backend, max_num_batched_tokens=chunk, page_size=8), prompt, 8)
    assert (ours - _theirs("glm_moe_dsa", path, prompt + tokens[:-1], len(prompt) - 1)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_batch_equals_each_alone(backend, ckpt):
    path = ckpt("glm_moe_dsa")
    prompts = [_prompt(n, seed=n) for n in (3, 17, 30, 8)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    llm = _llm(path, backend)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    batched = _llm(path, backend, max_num_seqs=4).generate(prompts, params)
    assert [o.token_ids for o in batched] == alone


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_prefix_cache_hit_keeps_index_keys_and_shared_selections_exact(backend, ckpt):
    """32 prompt tokens come from cached pages (latents and index keys); the new suffix's selection,
    run by full layers over cached index keys and reused by the shared layers, still matches."""
    path = ckpt("glm_moe_dsa")
    prompt, longer = _prompt(40, seed=5), _prompt(40, seed=5) + [1, 2, 3]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    cold = _llm(path, backend, enable_prefix_cache=False).generate([longer], params)[0].token_ids
    llm = _llm(path, backend, page_size=16)
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    again = llm.generate([longer], params)[0]
    assert again.num_cached_tokens == 32 and again.token_ids == cold
    tokens, ours = parity_util.drive(llm, longer, 8)  # a third run, its logits against transformers
    assert llm.scheduler.running[0].num_cached_tokens == 32
    assert (ours - _theirs("glm_moe_dsa", path, longer + tokens[:-1], len(longer) - 1)).abs().max().item() <= 1e-4


def test_index_keys_are_a_paged_row_of_the_full_layers_only(ckpt):
    """GLM-5.2 layout: full layers keep latent + rope key + index key per token, shared layers latent
    + rope key; the pool's bytes per token say so."""
    llm = _llm(ckpt("glm_moe_dsa"), "torch")
    cache, cfg, dsa = llm.runner.cache, llm.args.mla, llm.args.dsa
    kinds = [s.kind for s in llm.model.paged_specs()]
    assert kinds == ["paged_indexed_latent", "paged_latent", "paged_indexed_latent", "paged_latent"]
    assert cache.index.shape[0] == 2 and cache.index.shape[2:] == (1, dsa.head_dim)
    per_token = 4 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + 2 * dsa.head_dim
    assert cache.bytes_per_token == per_token * 4 == llm.kv_bytes_per_token
    assert llm._page_bytes == cache.bytes_per_token * llm.config.page_size  # the page budget counts the index keys
    from freetoken_py.hw.model_bytes import kv_bytes_per_token, read_model_bytes
    bf16 = _llm(ckpt("glm_moe_dsa"), "torch", kv_dtype="bf16")
    assert read_model_bytes(ckpt("glm_moe_dsa")).kv_bytes_per_token == bf16.kv_bytes_per_token == per_token * 2
    assert read_model_bytes(ckpt("deepseek_v32")).kv_bytes_per_token == 2 * 3 * (32 + 16 + 32)
    glm52 = dict(num_hidden_layers=78, kv_lora_rank=512, qk_rope_head_dim=64, index_topk=2048, index_head_dim=128,
                 indexer_types=["full"] * 21 + ["shared"] * 57)  # GLM-5.2's counts: 21 full, 57 shared
    assert kv_bytes_per_token(glm52, 78) == 2 * (78 * 576 + 21 * 128)
    fp8 = _llm(ckpt("glm_moe_dsa"), "torch", kv_dtype="fp8").runner.cache
    assert fp8.bytes_per_token == 4 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + 2 * dsa.head_dim * 2  # keys bf16


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


# measured (2026-12-05): mean KL(fp32 KV || fp8 KV) over prefill + 32 decode steps = 3.7e-3 on this
# GLM checkpoint on both backends (deepseek_v32's: 1.9e-2). The same weights as dense MLA give 2.2e-4
# (5.5e-4): the rest is top-k flips, the fp8 latents moving the next layers' index scores where only
# 6 keys of ~50 are kept. Storing the index keys at fp32 instead of bf16 changed nothing (same KL).
DSA_FP8_KL_BUDGET = 1.5e-2


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_fp8_latent_cache_with_bf16_index_keys_within_a_kl_budget(backend, ckpt):
    path = ckpt("glm_moe_dsa")
    prompt = _prompt(24, seed=3)
    ref_tokens, ref = parity_util.drive(_llm(path, backend), prompt, 32)
    llm = _llm(path, backend, kv_dtype="fp8")
    assert llm.runner.cache.quantized and llm.runner.cache.index.dtype == torch.bfloat16
    req = llm.add_request(prompt, SamplingParams(max_tokens=33, temperature=0, ignore_eos=True))
    steps = []
    for t in ref_tokens[:33]:  # teacher-forced on the fp32 run's tokens
        steps.append(llm.runner.forward_batch(llm.scheduler.schedule())[0])
        req.output_token_ids.append(t)
    assert 0 < _kl(ref, torch.stack(steps)) <= DSA_FP8_KL_BUDGET


def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.bin"))  # not the expert cache
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del cfg[key]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_numba_index_scores_read_the_paged_keys_in_place_and_match_the_reference(stored):
    """kernels/cpu_mla.index_scores (the cpu decode's selection) against layers/dsa.index_scores over
    the same stored keys, in a context gathered from scattered slots, and its partial top-k against
    torch.topk; the kernel's blocks of 256 keys end inside the context (1000 keys)."""
    import numpy as np

    from freetoken_py.kernels.cpu_mla import index_scores, top_slots
    from freetoken_py.layers.dsa import DsaConfig
    from freetoken_py.layers.dsa import index_scores as reference

    g = torch.Generator().manual_seed(0)
    cfg = DsaConfig(n_heads=16, head_dim=32, topk=40, rope_dim=16, interleave=True, layer_types=("full",))
    keys = torch.randn(4096, 1, 32, generator=g).to(stored)  # [S, 1, di]: one layer's index rows
    slots = torch.randperm(4096, generator=g)[:1000]
    q, w = torch.randn(1, 16, 32, generator=g), torch.randn(1, 16, generator=g)
    want = reference(cfg, q, w, keys[slots, 0])[0]
    view = keys.view(torch.int16).numpy().view(np.uint16) if stored == torch.bfloat16 else keys.numpy()
    got = np.empty(1000, np.float32)
    index_scores(q[0].numpy(), w[0].numpy(), view, slots.numpy(), cfg.head_dim ** -0.5, np.ones(1, np.float32), got)
    assert np.abs(got - want.numpy()).max() <= 1e-5 * float(want.abs().max())
    top = top_slots(got, slots.numpy(), cfg.topk)
    assert sorted(top.tolist()) == sorted(slots[want.topk(cfg.topk).indices].tolist())
    assert (np.diff([slots.tolist().index(s) for s in top]) > 0).all()  # in context order


def test_prefill_index_scores_in_query_blocks_match_transformers(ckpt, monkeypatch):
    """A prefill whose [rows, heads, ctx] scores exceed dsa.SCORE_BLOCK runs in blocks of query rows
    (here 3 rows of a 30-token prompt): the same logits as transformers."""
    import freetoken_py.layers.dsa as dsa

    monkeypatch.setattr(dsa, "SCORE_BLOCK", 16 * 30 * 3)
    path = ckpt("glm_moe_dsa")
    prompt = _prompt(30, seed=3)
    tokens, ours = parity_util.drive(_llm(path, "torch"), prompt, 4)
    assert (ours - _theirs("glm_moe_dsa", path, prompt + tokens[:-1], len(prompt) - 1)).abs().max().item() <= 1e-4


def test_mtp_layer_and_rope_parameters_nested_by_layer_type_load_to_the_same_tokens(ckpt, tmp_path):
    """An MTP layer's tensors (model.layers.{num_hidden_layers}.*, indexer included) are not read, and
    rope_parameters keyed by layer type ({"indexed_attention": {...}}) are the one set they hold."""
    src = ckpt("deepseek_v32")
    dst = tmp_path / "mtp"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.bin"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_parameters"] = {"indexed_attention": cfg["rope_parameters"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    f = next(dst.glob("*.safetensors"))
    tensors = load_file(f)
    tensors.update({k.replace("layers.2.", "layers.3."): v.clone() for k, v in tensors.items() if "layers.2." in k})
    assert any(k.startswith("model.layers.3.self_attn.indexer.") for k in tensors)
    save_file(tensors, f, metadata={"format": "pt"})
    prompt, params = _prompt(12, seed=4), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = _llm(src, "torch").generate([prompt], params)[0].token_ids
    assert _llm(dst, "torch").generate([prompt], params)[0].token_ids == want


def _fp8_ue8m0(src, dst, plain, block: int = 16):
    """DeepSeek-V3.2's published layout: every linear (MLA projections, indexer wq_b / wk, experts)
    as e4m3 blocks with power-of-two (ue8m0) weight_scale_inv; embeddings, norms, router, weights_proj
    and lm_head as stored. `plain`: the same checkpoint with those weights dequantised (float32)."""
    import re

    from freetoken_py.quant.fp8 import quantize_fp8_blocks

    keep = re.compile(r"(embed_tokens|lm_head|norm|mlp\.gate\.|weights_proj)")
    for d in (dst, plain):
        d.mkdir()
        for f in src.glob("*.json"):
            shutil.copy(f, d / f.name)
    out, deq = {}, {}
    for n, t in load_file(next(src.glob("*.safetensors"))).items():
        if t.dim() != 2 or keep.search(n):
            out[n] = deq[n] = t
            continue
        s = torch.pow(2.0, torch.ceil(torch.log2(quantize_fp8_blocks(t.float(), (block, block))[1])))
        full = s.repeat_interleave(block, 0)[:t.shape[0]].repeat_interleave(block, 1)[:, :t.shape[1]]
        q = (t.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        out[n], out[n + "_scale_inv"], deq[n] = q, s, q.float() * full
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    save_file(deq, plain / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block], "scale_fmt": "ue8m0"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst, plain


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_fp8_ue8m0_checkpoint_matches_transformers_on_its_dequantised_weights(backend, ckpt, tmp_path):
    src = ckpt("deepseek_v32")
    fp8, plain = _fp8_ue8m0(src, tmp_path / "fp8", tmp_path / "plain")
    assert "model.layers.0.self_attn.indexer.wq_b.weight_scale_inv" in load_file(fp8 / "model.safetensors")
    prompt = _prompt(21, seed=1)
    tokens, ours = parity_util.drive(_llm(fp8, backend, expert_cache="off"), prompt, 8)
    theirs = _theirs("deepseek_v32", plain, prompt + tokens[:-1], len(prompt) - 1)
    assert (ours - theirs).abs().max().item() <= 1e-4
    original = _theirs("deepseek_v32", src, prompt + tokens[:-1], len(prompt) - 1)
    assert (theirs - original).abs().max().item() > 1e-3  # the fp8 values are in effect
