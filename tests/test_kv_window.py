"""Windowed layers with their own pages (kvcache/window.py, spec.PagedWindowKV), next to full ones.

Tiny gpt-oss checkpoints built with transformers' GptOssForCausalLM (tests/gpt_oss_util.py:
sliding / full layers alternating or mixed, randomised sinks and norms, a window of 4 or 8 far
below the prompts). Page sizes that divide the window (4, 2) make pages go behind the window
within a few tokens, so every test below runs with pages given back while it decodes:

- logits equal transformers' (<= 1e-4, test_gpt_oss's tolerance) over prefill and 32 cached
  decode steps, chunked prefill with chunk borders inside and outside the window, a batch equal
  to each request alone, prefix-cache hits (a second turn, and a prompt whose earlier windowed
  pages were given back: the match stops where the window's pages are cached), FP8 KV;
- measured from the two pools' allocators after every step: a sequence holds at most window +
  one page of rows in each windowed layer (ceil((W - 1) / S) + 1 pages) while the full layers
  hold its whole context;
- a windowed page taken from under a request is caught by the engine's integrity check.
"""
from __future__ import annotations

import pytest
import torch

import gpt_oss_util as gu
import parity_util
from freetoken_py.core import FinishReason, SamplingParams
from freetoken_py.kvcache import spec
from freetoken_py.kvcache.spec import window_pages_per_seq
from freetoken_py.llm import LLM


def _build(name, out):
    return gu.build("gpt_oss", out, sliding_window=8) if name == "gpt_oss_w8" else gu.build(name, out)


ckpt = parity_util.checkpoint_cache(_build)
WINDOWS = {"gpt_oss": 4, "gpt_oss_mixed": 4, "gpt_oss_w8": 8}


def _llm(path, backend, **kw):
    return LLM(path, dtype="float32", show_progress=False, backend=backend, **kw)


def _prompt(n: int, seed: int) -> list[int]:
    return parity_util.random_prompt(gu.VOCAB, n, seed)


def _theirs(path, ids: list[int], start: int) -> torch.Tensor:
    with torch.no_grad():
        return gu.reference(path)(torch.tensor([ids])).logits[0, start:]


def _rows(llm) -> tuple[int, int]:
    """Rows held in each windowed layer and in each full layer, counted from the two pools'
    allocators (a page holds page_size rows of every layer of its pool)."""
    w, ps = llm.runner.cache.windows, llm.config.page_size
    return ((w.allocator.num_pages - w.allocator.num_free) * ps,
            (llm.allocator.num_pages - llm.allocator.num_free) * ps)


def _run(llm, prompt: list[int], steps: int, forced: list[int] | None = None):
    """Greedy (or teacher-forced: `forced` tokens): the engine's own order per step (schedule,
    forward, publish_prompts, which gives back the pages behind each window). Returns the
    request, the logits of each sampled position and (tokens computed, windowed rows, full rows,
    windowed rows of the request's own table) after every step."""
    req = llm.add_request(prompt, SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
    logits, held = [], []
    while len(req.output_token_ids) <= steps:
        chunks = llm.scheduler.schedule()
        out = llm.runner.forward_batch(chunks)
        llm.scheduler.publish_prompts(chunks)
        held.append((req.num_computed, *_rows(llm),
                     len(llm.runner.cache.windows.held(req.request_id)) * llm.config.page_size))
        if len(out):
            logits.append(out[0])
            req.output_token_ids.append(int(out[0].argmax()) if forced is None else forced[len(logits) - 1])
    llm.scheduler.finish(req)   # (publishes its pages, gives every page back)
    return req, torch.stack(logits), held


def _parity(path, req, logits) -> float:
    ids = req.all_token_ids[:-1]
    return (logits - _theirs(path, ids, len(req.prompt_token_ids) - 1)).abs().max().item()


def _bound(window: int, page_size: int) -> int:
    return window_pages_per_seq(window, page_size) * page_size


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("arch,page_size", [("gpt_oss", 4), ("gpt_oss_w8", 4), ("gpt_oss_mixed", 2)])
def test_prefill_and_32_decode_steps_match_transformers_with_pages_given_back(backend, arch, page_size, ckpt):
    path, W = ckpt(arch), WINDOWS[arch]
    llm = _llm(path, backend, page_size=page_size, enable_prefix_cache=False)
    req, logits, held = _run(llm, _prompt(42, seed=1), 32)
    assert _parity(path, req, logits) <= 1e-4
    assert W + page_size == _bound(W, page_size)   # the page size divides the window
    for computed, wrows, frows, _ in held:
        assert wrows <= W + page_size, (computed, wrows)            # the window + one page
        assert frows == -(-computed // page_size) * page_size       # the whole context
    assert held[-1][1] < held[-1][2] // 4


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("chunk", [3, 4, 6, 9])
def test_chunked_prefill_borders_inside_and_outside_the_window(backend, chunk, ckpt):
    """Chunks shorter than, equal to and longer than the window of 4 (page 4): a chunk's
    windowed layers read keys of the chunk before, whose pages behind the window are gone."""
    path = ckpt("gpt_oss")
    llm = _llm(path, backend, page_size=4, max_num_batched_tokens=chunk, enable_prefix_cache=False)
    req, logits, held = _run(llm, _prompt(30, seed=7), 32)
    assert _parity(path, req, logits) <= 1e-4
    assert all(wrows <= 4 + 4 for _, wrows, _, _ in held)      # between steps: the window + one page


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_batch_equals_each_alone(backend, ckpt):
    path = ckpt("gpt_oss_mixed")
    prompts = [_prompt(n, seed=n) for n in (3, 17, 30, 8)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    alone = [_llm(path, backend, page_size=2).generate([p], params)[0].token_ids for p in prompts]
    llm = _llm(path, backend, max_num_seqs=4, page_size=2, enable_prefix_cache=False)
    reqs = [llm.add_request(p, params) for p in prompts]
    while llm.scheduler.has_work:
        llm.step()
        running = len(llm.scheduler.running)
        assert _rows(llm)[0] <= running * (4 + 2)
    assert [r.output_token_ids for r in reqs] == alone


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_second_turn_resumes_from_the_cached_window(backend, ckpt):
    """Turn 1 (40 prompt tokens, 10 generated) publishes its pages when it finishes, its
    windowed pages only where it still held them (its last window, and its prompt's window
    published when the prompt was computed); turn 2 re-sends everything and adds 5 tokens:
    it resumes at the last page boundary (48 tokens), exact."""
    path = ckpt("gpt_oss")
    llm = _llm(path, backend, page_size=4)
    first = llm.generate([_prompt(40, seed=3)], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    turn2 = first.prompt_token_ids + first.token_ids + [5, 6, 7, 8, 9]
    w = llm.runner.cache.windows
    cached_windowed = w.allocator.num_pages - w.allocator.num_free
    assert 0 < cached_windowed < len(llm.prefix_cache.cached_pages())   # only some nodes kept one
    req, logits, _ = _run(llm, turn2, 8)
    assert req.num_cached_tokens == 48
    assert _parity(path, req, logits) <= 1e-4


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_hit_stops_where_the_windowed_pages_were_given_back(backend, ckpt):
    """A prompt prefilled in chunks of 8 gives back its windowed pages behind each chunk's
    window before its prompt is published, so the cache holds the full pages of all 40 tokens
    but the windowed ones of the last window only. A prompt sharing its first 30 tokens
    matches 7 full pages (28 tokens), but resuming at any of those boundaries would read
    windowed rows nobody kept: it takes no hit and computes from 0 (exact). Prefilled in one
    pass instead, the same prompt leaves every window cached and the second one resumes at 28."""
    path = ckpt("gpt_oss")
    first, second = _prompt(40, seed=4), _prompt(40, seed=4)[:30] + _prompt(12, seed=5)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for chunk, expect in ((8, 0), (64, 28)):
        llm = _llm(path, backend, page_size=4, max_num_batched_tokens=chunk)
        llm.generate([first], one)
        assert len(llm.prefix_cache.cached_pages()) == 10
        req, logits, _ = _run(llm, second, 4)
        assert req.num_cached_tokens == expect
        assert _parity(path, req, logits) <= 1e-4


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_fp8_kv_with_pages_given_back(backend, ckpt):
    """FP8 K/V in both pools (one scale per layer and head, windowed layers included): mean
    KL(fp32-KV || fp8-KV) over prefill + 32 decode steps (teacher-forced) within test_kvcache_fp8's budget (5e-3),
    the window bound as with fp32, and a prefix hit under FP8 equal to the cold FP8 run."""
    path = ckpt("gpt_oss_mixed")
    prompt = _prompt(42, seed=9)
    ref = _run(_llm(path, backend, page_size=2, enable_prefix_cache=False), prompt, 32)
    llm = _llm(path, backend, page_size=2, kv_dtype="fp8")
    assert llm.runner.cache.quantized and llm.runner.cache.calibrated
    req, logits, held = _run(llm, prompt, 32, forced=ref[0].output_token_ids)   # teacher-forced
    a, b = torch.log_softmax(ref[1], -1), torch.log_softmax(logits, -1)
    kl = (a.exp() * (a - b)).sum(-1).mean().item()
    print(f"gpt_oss_mixed {backend} fp8 KV, pages given back: mean KL {kl:.3g}")
    assert 0 < kl <= 5e-3, kl
    assert all(own <= 4 + 2 for *_, own in held)   # its own (the prefix cache holds the prompt's too)
    again, cold = (_run(e, prompt + [1, 2, 3], 4) for e in (llm, _llm(path, backend, page_size=2, kv_dtype="fp8")))
    assert again[0].num_cached_tokens == 42 and cold[0].num_cached_tokens == 0
    assert again[0].output_token_ids == cold[0].output_token_ids


def test_rows_held_per_layer_measured_from_the_pools(ckpt):
    """The docs/kvcache.md figures: 42 prompt tokens then 20 decoded, prefix cache off, rows in
    each layer after every step. Page 16 over a window of 4: 2 pages (32 rows, the bound
    ceil(3 / 16) + 1 pages), where every layer held 48-64 before; page 4: window + one page (8)."""
    path = ckpt("gpt_oss")
    for page_size, bound in ((16, 32), (4, 8)):
        llm = _llm(path, "torch", page_size=page_size, enable_prefix_cache=False)
        req, _, held = _run(llm, _prompt(42, seed=0), 20)
        assert max(w for _, w, _, _ in held) == bound == _bound(4, page_size)
        assert held[-1][2] == -(-req.num_computed // page_size) * page_size == 64
        print(f"page {page_size}: windowed rows per layer {[w for _, w, _, _ in held]}, full {held[-1][2]}")
    assert _bound(128, 16) == 144   # gpt-oss's window 128 at 16-token pages: 9 pages a sequence


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_windowed_page_taken_from_under_a_request_aborts_it_alone(backend, ckpt):
    path = ckpt("gpt_oss")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [_prompt(20, seed=11), _prompt(23, seed=12)]
    alone = _llm(path, backend, page_size=4).generate([prompts[1]], params)[0].token_ids
    llm = _llm(path, backend, page_size=4, max_num_seqs=2)
    victim, other = (llm.add_request(p, params) for p in prompts)
    for _ in range(3):
        llm.step()
    w = llm.runner.cache.windows
    w.allocator.tags_np[w.held(victim.request_id)[0]] += 1   # as if it had been freed and handed out again
    while llm.scheduler.has_work:
        llm.step()
    assert victim.finish_reason == FinishReason.ABORT and "integrity" in victim.stop_reason
    assert other.output_token_ids == alone
    llm.prefix_cache.evict(1 << 30)
    # every windowed page came back but the one taken from the victim (never freed twice)
    assert w.allocator.num_free == w.allocator.num_pages - 1


def test_the_plan_sums_the_kinds_and_bounds_the_windowed_pool(ckpt):
    """engine/memory.py: full layers get pages per token of context, the windowed layers' pool
    its bound per sequence (spec.window_pool_pages); the bytes add up to the budget."""
    from freetoken_py.engine.memory import WINDOW_CHUNK_FLOOR

    llm = _llm(ckpt("gpt_oss"), "torch", page_size=4, max_num_seqs=2, max_num_batched_tokens=64,
               kv_cache_bytes=1 << 20)
    cache, plan = llm.runner.cache, llm.memory
    bound = spec.window_pool_pages(4, 4, 2, max(64, WINDOW_CHUNK_FLOOR))
    assert cache.num_window_pages == plan.window_pages == bound == 2 * (2 + 1) + 128
    assert llm.allocator.num_pages == plan.num_pages > 2 * bound   # what the window does not need goes to context
    per_row = 2 * 2 * 16 * 4   # K and V, 2 heads of 16, fp32: one layer's row
    assert (plan.num_pages * 2 + bound * 2) * 4 * per_row <= 1 << 20   # 2 full + 2 windowed layers
    assert cache.windows.allocator.num_pages == bound


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_small_windowed_pool_gives_back_the_caches_windows_first(backend, ckpt):
    """A windowed pool of 8 pages (2 sequences' bound at page 4 over W 4 is 6 plus a chunk)
    under a prefix cache that keeps windows of every published prompt: the cache gives back
    its windowed pages (LRU) before anything else, hits stop where windows are left, and the
    tokens stay those of an engine with a mirrored pool."""
    from freetoken_py.core import Request
    from freetoken_py.engine.runner import ModelRunner
    from freetoken_py.kvcache import PageAllocator
    from freetoken_py.kvcache.radix import RadixCache
    from freetoken_py.scheduler.scheduler import Scheduler

    path = ckpt("gpt_oss")
    ref = _llm(path, backend, page_size=4)
    small = ModelRunner(ref.model, 64, 4, torch.float32, fused_decode=(backend == "cpu"), window_pages=8)
    w = small.cache.windows
    alloc = PageAllocator(64)
    cache = RadixCache(alloc, 4)
    sched = Scheduler(alloc, 4, 2, 8, cache, windows=w)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    base = _prompt(24, seed=21)
    prompts = [base + _prompt(n, seed=30 + n) for n in (5, 9, 3, 7)] + [base + [1, 2]]
    want = [o.token_ids for o in ref.generate(prompts, params)]
    reqs = [Request(p, params) for p in prompts]
    for r in reqs:
        sched.add(r)
    while sched.has_work:
        chunks = sched.schedule()
        sampling = [c for c in chunks if c.samples]   # (before the pass moves num_computed)
        logits = small.forward_batch(chunks)
        sched.publish_prompts(chunks)
        for ch, row in zip(sampling, logits):
            ch.req.output_token_ids.append(int(row.argmax()))
            if len(ch.req.output_token_ids) == params.max_tokens:
                sched.finish(ch.req)
        assert w.allocator.num_free >= 0
    assert [r.output_token_ids for r in reqs] == want
    assert cache.num_windows_evicted > 0 and cache.num_evicted == 0   # windows went, full pages stayed
    assert any(r.num_cached_tokens for r in reqs)   # hits still happen where windows were left


def test_probe_figures_are_what_the_pools_hold(ckpt):
    """`freetoken probe --model`'s KV figures (hw/model_bytes.py, from the config alone) against
    the pools at the default page size: per token only the full layers' rows; per request, the
    most rows a sequence's windowed layers held while it decoded across page borders."""
    from freetoken_py.hw.model_bytes import read_model_bytes

    path = ckpt("gpt_oss_mixed")
    m = read_model_bytes(path)
    llm = _llm(path, "torch", enable_prefix_cache=False)
    _, _, held = _run(llm, _prompt(42, seed=3), 40)
    a = llm.args
    windowed = sum(k == "sliding_attention" for k in a.layer_kinds)
    row = 2 * a.num_kv_heads * a.head_dim * 2      # bf16 K and V of one layer, one token
    assert 0 < windowed < a.num_layers
    assert m.kv_bytes_per_token == (a.num_layers - windowed) * row
    assert m.window_bytes_per_request == windowed * row * max(rows for *_, rows in held)
    assert m.kv_bytes(4096) == 4096 * m.kv_bytes_per_token + m.window_bytes_per_request

