"""FP8 (e4m3) KV cache: page size in bytes, fixed per-head scales, and the model-level accuracy
bound — mean KL(bf16-KV || fp8-KV) <= 0.005 over a fixed token set, teacher-forced so every
decode position reads its history back from FP8. The reference is the same engine with a bf16 cache."""
from __future__ import annotations

import pytest
import torch

from conftest import random_prompt
from freetoken_py.core import Request, SamplingParams
from freetoken_py.engine.runner import ScheduledChunk
from freetoken_py.kvcache import KVCache
from freetoken_py.kvcache.pool import FP8
from freetoken_py.llm import LLM


def test_fp8_page_is_half_a_bf16_page_and_doubles_capacity(checkpoint_factory):
    args = (4, 16, 2, 16)
    assert KVCache.bytes_per_page(*args, FP8) * 2 == KVCache.bytes_per_page(*args, torch.bfloat16)
    path = checkpoint_factory("qwen3_moe")
    caps = {kv: LLM(path, kv_dtype=kv, kv_cache_bytes=1 << 20, show_progress=False, backend="torch").kv_capacity_tokens
            for kv in ("bf16", "fp8")}
    assert caps["fp8"] == 2 * caps["bf16"]


def test_scales_calibrated_once_then_fixed_and_values_saturate():
    cache = KVCache(1, 4, 4, 2, 8, FP8)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(4, 2, 8, generator=g) * torch.tensor([1.0, 10.0])[None, :, None]  # head 1 is 10x larger
    cache.write(0, torch.arange(4), k, k)
    scale = cache.k_scale.clone()
    assert torch.allclose(scale[0, 1] / scale[0, 0], k[:, 1].abs().max() / k[:, 0].abs().max())  # per head
    back, _ = cache.read(0, torch.arange(4))
    assert ((back - k).abs() <= k.abs() / 16 + 1e-6).all()  # e4m3: 3 mantissa bits, round to nearest
    cache.write(0, torch.arange(4, 8), k * 100, k * 100)  # far beyond the calibration range
    assert torch.equal(cache.k_scale, scale)  # never rescaled
    big, _ = cache.read(0, torch.arange(4, 8))
    assert torch.isfinite(big).all() and big.abs().max() <= 448 * scale.max() + 1e-6  # saturated, no NaN


def _teacher_forced_logprobs(llm: LLM, tokens: list[int], prefill: int) -> torch.Tensor:
    """Log-probs [len(tokens) - prefill, V] predicting each forced token; decode reads the cache."""
    req = Request(tokens[:prefill], SamplingParams())
    req.page_table = llm.allocator.allocate(-(-len(tokens) // llm.config.page_size))
    rows = [llm.runner.forward_batch([ScheduledChunk(req, prefill)])]
    for t in tokens[prefill:-1]:
        req.output_token_ids.append(t)
        rows.append(llm.runner.forward_batch([ScheduledChunk(req, 1)]))
    llm.allocator.release(req.page_table)
    return torch.log_softmax(torch.cat(rows), dim=-1)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fp8_kl_vs_bf16_cache(checkpoint_factory, arch):
    path = checkpoint_factory(arch)
    engines = {kv: LLM(path, kv_dtype=kv, backend="torch", show_progress=False, kv_cache_bytes=1 << 22)
               for kv in ("bf16", "fp8")}
    seqs = [random_prompt(48, seed=s) for s in range(3)]
    assert engines["fp8"].runner.cache.calibrated  # by LLM's warm-up, before any request
    kls = []
    for seq in seqs:
        ref, fp8 = (_teacher_forced_logprobs(engines[kv], seq, prefill=8) for kv in ("bf16", "fp8"))
        kls.append((ref.exp() * (ref - fp8)).sum(-1))  # [positions] KL(ref || fp8)
    kl = torch.cat(kls).mean().item()
    assert 0 < kl <= 0.005, kl  # > 0: the fp8 path really quantised


@pytest.mark.parametrize("dtype", [torch.float32, FP8])
def test_growing_the_kv_cache_keeps_every_stored_token(dtype):
    cache = KVCache(num_layers=2, num_pages=3, page_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    slots = torch.tensor([0, 5, 11])
    k, v = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 8, generator=g)
    for layer in range(2):
        cache.write(layer, slots, k, v)
    before = [cache.read(layer, slots) for layer in range(2)]
    cache.grow(5)
    assert cache.num_pages == 5 and cache.k.shape[1] == 5 * 4
    for layer in range(2):
        kk, vv = cache.read(layer, slots)
        assert torch.equal(kk, before[layer][0]) and torch.equal(vv, before[layer][1])
    cache.write(0, torch.tensor([19]), k[:1], v[:1])      # a slot of a new page works
    assert torch.equal(cache.read(0, torch.tensor([19]))[0], cache.read(0, torch.tensor([0]))[0])


@pytest.mark.parametrize("dtype", [torch.float32, FP8])
def test_copying_pages_down_and_shrinking_keeps_every_stored_token(dtype):
    """The KV cache gives its growth back: pages above the new size are copied into free pages
    below it (every layer, K and V), then the tensors shrink; tokens below stay as they were."""
    cache = KVCache(num_layers=2, num_pages=5, page_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    low, high = torch.tensor([1, 2]), torch.tensor([16, 19])      # page 0, and page 4 (above 3 pages)
    k, v = torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g)
    for layer in range(2):
        cache.write(layer, torch.cat([low, high]), k, v)
    before = [cache.read(layer, torch.cat([low, high])) for layer in range(2)]
    cache.copy_pages([4], [2])                     # page 4 -> page 2 (slots 8..11)
    cache.shrink(3)
    assert cache.num_pages == 3 and cache.k.shape[1] == cache.v.shape[1] == 3 * 4
    for layer in range(2):
        kk, vv = cache.read(layer, torch.cat([low, torch.tensor([8, 11])]))
        assert torch.equal(kk, before[layer][0]) and torch.equal(vv, before[layer][1])
    cache.grow(5)                                  # and it can grow again
    assert cache.num_pages == 5
