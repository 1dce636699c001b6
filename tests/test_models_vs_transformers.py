"""Our engine against transformers on tiny random checkpoints of every supported architecture.

Reference: transformers' own model classes loading the same safetensors (fp32)."""
from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, random_prompt, reference_model
from freetoken_py.core import SamplingParams
from freetoken_py.engine.runner import ModelRunner
from freetoken_py.kvcache import PageAllocator
from freetoken_py.llm import LLM
from freetoken_py.scheduler.scheduler import Scheduler

PAGE = 16
GREEDY = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)


def drive_greedy(path, prompt: list[int], num_decode: int, page_size: int = PAGE):
    """Prefill + cached decode through the real scheduler and runner; returns (tokens, per-step logits)."""
    llm = LLM(path, dtype="float32", page_size=page_size, show_progress=False)
    req = llm.add_request(prompt, SamplingParams(max_tokens=num_decode + 1, temperature=0, ignore_eos=True))
    logits_steps = []
    while len(req.output_token_ids) <= num_decode:
        chunks = llm.scheduler.schedule()
        logits = llm.runner.forward_batch(chunks)  # [1, V]
        logits_steps.append(logits[0])
        req.output_token_ids.append(int(logits[0].argmax()))
    return req.output_token_ids, torch.stack(logits_steps)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_32_cached_decode_steps_match_transformers(arch, checkpoint_factory):
    path = checkpoint_factory(arch)
    prompt = random_prompt(21, seed=1)
    tokens, ours = drive_greedy(path, prompt, num_decode=32)
    ref = reference_model(path)
    full = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        theirs = ref(full).logits[0, len(prompt) - 1:]  # logits that chose each of our tokens
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_64_greedy_tokens_identical_to_transformers_generate(arch, checkpoint_factory):
    path = checkpoint_factory(arch)
    prompt = random_prompt(9, seed=2)
    ref = reference_model(path)
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(path, dtype="float32", show_progress=False)
    assert llm.generate([prompt], GREEDY)[0].token_ids == expected


@pytest.mark.parametrize("length", [PAGE - 1, PAGE, PAGE + 1, 2 * PAGE])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral_swa"])
def test_page_boundaries(arch, length, checkpoint_factory):
    """Prompt lengths around the page size: a slot-mapping bug shows up as a logit mismatch."""
    path = checkpoint_factory(arch)
    prompt = random_prompt(length, seed=length)
    tokens, ours = drive_greedy(path, prompt, num_decode=PAGE + 2)
    with torch.no_grad():
        theirs = reference_model(path)(torch.tensor([prompt + tokens[:-1]])).logits[0, length - 1:]
    assert (ours - theirs).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral_swa", "olmoe"])
def test_batch_of_four_equals_each_alone(arch, checkpoint_factory):
    path = checkpoint_factory(arch)
    prompts = [random_prompt(n, seed=n) for n in (3, 17, 30, 8)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [LLM(path, dtype="float32", show_progress=False).generate([p], params)[0].token_ids for p in prompts]
    batched = LLM(path, dtype="float32", show_progress=False, max_num_seqs=4).generate(prompts, params)
    assert [o.token_ids for o in batched] == alone


def test_continuous_batching_with_chunked_prefill_and_preemption(checkpoint_factory):
    """Tiny token budget (chunked prefill) and a KV pool too small for all four requests at once
    (forces recompute preemption): outputs must still equal each prompt run alone."""
    path = checkpoint_factory("qwen3_moe")
    prompts = [random_prompt(n, seed=100 + n) for n in (5, 29, 13, 40)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    alone = [LLM(path, dtype="float32", show_progress=False).generate([p], params)[0].token_ids for p in prompts]
    page_bytes = 2 * 4 * 16 * 2 * 16 * 4  # 2 (K,V) x layers x page x kv heads x head_dim x fp32
    llm = LLM(path, dtype="float32", show_progress=False, max_num_seqs=4, max_num_batched_tokens=16,
              kv_cache_bytes=8 * page_bytes)
    assert llm.allocator.num_pages == 8
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    assert llm.scheduler.num_preemptions > 0
    assert llm.allocator.num_free == llm.allocator.num_pages  # every page came back


def test_requests_join_and_leave_between_steps(checkpoint_factory):
    path = checkpoint_factory("olmoe")
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    p1, p2 = random_prompt(7, seed=7), random_prompt(12, seed=12)
    alone = [LLM(path, dtype="float32", show_progress=False).generate([p], params)[0].token_ids for p in (p1, p2)]
    llm = LLM(path, dtype="float32", show_progress=False)
    r1 = llm.add_request(p1, params)
    for _ in range(4):
        llm.step()
    r2 = llm.add_request(p2, params)  # joins while r1 is decoding
    while llm.has_unfinished:
        llm.step()
    assert [r1.output_token_ids, r2.output_token_ids] == alone


def test_sharded_and_bf16_checkpoints(checkpoint_factory):
    """A sharded (index.json) bf16 checkpoint computed in fp32 equals transformers upcasting it."""
    path = checkpoint_factory("qwen3_moe", dtype=torch.bfloat16, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").exists()
    prompt = random_prompt(11, seed=3)
    tokens, ours = drive_greedy(path, prompt, num_decode=4)
    with torch.no_grad():
        theirs = reference_model(path, torch.float32)(torch.tensor([prompt + tokens[:-1]])).logits[0, 10:]
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_bf16_compute_close_to_fp32(checkpoint_factory):
    path = checkpoint_factory("mixtral", dtype=torch.bfloat16)
    prompt = random_prompt(16, seed=4)
    llm32 = LLM(path, dtype="float32", show_progress=False)
    llm16 = LLM(path, dtype="auto", show_progress=False)
    assert llm16.model.dtype == torch.bfloat16
    one = SamplingParams(max_tokens=1, temperature=0)
    a = llm32.generate([prompt], one)[0].token_ids
    b = llm16.generate([prompt], one)[0].token_ids
    assert a == b
