"""The prefix cache end to end on the tiny checkpoints: greedy outputs identical with the cache on
and off (alone, in concurrent batches mixing cached and uncached requests, under eviction and
chunked prefill, on both backends), cached-token reporting across turns, and page-tag fault
injection. The reference is the same engine with the cache off (itself checked against
transformers in test_models_vs_transformers.py)."""
from __future__ import annotations

import pytest

from conftest import random_prompt
from freetoken_py.core import SamplingParams
from freetoken_py.llm import LLM

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PAGE = 8


def _llm(path, backend="torch", **kw):
    kw.setdefault("kv_cache_bytes", 24 * 2 * 4 * PAGE * 2 * 16 * 4)  # 24 pages of the qwen3_moe fixture
    return LLM(path, backend=backend, page_size=PAGE, show_progress=False, max_num_batched_tokens=40, **kw)


def _prompts():
    system = random_prompt(3 * PAGE + 3, seed=1)  # a shared "system prompt" ending mid-page
    tails = [random_prompt(n, seed=10 + n) for n in (1, PAGE - 1, PAGE, PAGE + 1, 2 * PAGE)]
    return [system + t for t in tails] + [random_prompt(2 * PAGE, seed=99)]  # plus one unrelated prompt


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_outputs_identical_with_cache_on_and_off(checkpoint_factory, backend):
    path = checkpoint_factory("qwen3_moe")
    prompts = _prompts()
    off = _llm(path, backend, enable_prefix_cache=False)
    expected = [o.token_ids for o in off.generate(prompts, GREEDY)]
    on = _llm(path, backend)
    alone = [on.generate([p], GREEDY)[0] for p in prompts]  # sequential: each turn hits the last ones
    assert [o.token_ids for o in alone] == expected
    assert [o.num_cached_tokens for o in alone][1:5] == [3 * PAGE] * 4  # full pages of the shared system
    batch = on.generate(prompts + prompts[:2], GREEDY)  # concurrent, cached and uncached mixed
    assert [o.token_ids for o in batch] == expected + expected[:2]
    assert on.prefix_cache.num_evicted > 0  # 24 pages were not enough: eviction ran in between
    assert on.tracker.num_mismatches == 0


def test_multi_turn_conversation_reuses_every_turn(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe")
    on, off = _llm(path, kv_cache_bytes=0), _llm(path, kv_cache_bytes=0, enable_prefix_cache=False)
    history = random_prompt(20, seed=3)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for turn in range(3):
        out = on.generate([history], params)[0]
        assert out.token_ids == off.generate([history], params)[0].token_ids
        if turn:  # everything but the new user message (and the partial last page) was cached
            assert out.num_cached_tokens == (prev_len + len(prev_out)) // PAGE * PAGE
        prev_len, prev_out = len(history), out.token_ids
        history = history + out.token_ids + random_prompt(5, seed=turn)


def test_fp8_cache_reuse_gives_the_same_tokens(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe")
    llm = _llm(path, kv_dtype="fp8")
    prompts = _prompts()
    first = llm.generate(prompts[:2], GREEDY)
    again = llm.generate(prompts[:2], GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert again[0].num_cached_tokens > 0


def _fault_run(llm, prompts, fault=None, victim=1, at_step=3):
    reqs = [llm.add_request(p, GREEDY) for p in prompts]
    outs, step = {}, 0
    while llm.has_unfinished:
        if step == at_step and fault is not None:
            fault(llm, reqs[victim])
        for o in llm.step():
            if o.finished:
                outs[o.request_id] = o
        step += 1
    return [outs[r.request_id] for r in reqs]


def _free_page(llm, req):
    page = req.page_table[-1]
    while llm.allocator.refcount(page):
        llm.allocator.release([page])


RETAGGED: set[int] = set()


def _retag_page(llm, req):
    """A bare re-tag has no new owner in this simulation, and the victim rightly refuses to free a
    page it lost, so the page stays allocated to nobody; the leak check below accounts for it."""
    llm.allocator.tags[req.page_table[0]] += 1
    RETAGGED.add(req.page_table[0])


@pytest.mark.parametrize("fault", [_free_page, _retag_page])
def test_fault_injection_aborts_only_the_victim(checkpoint_factory, fault):
    path = checkpoint_factory("qwen3_moe")
    prompts = [random_prompt(12 + 3 * i, seed=50 + i) for i in range(3)]  # distinct: no shared pages
    llm = _llm(path, kv_cache_bytes=0)
    clean = [o.token_ids for o in _fault_run(llm, prompts)]
    detected = 0
    for trial, (victim, at_step) in enumerate([(0, 1), (1, 3), (2, 5), (1, 8)]):
        mismatches = llm.tracker.num_mismatches
        outs = _fault_run(llm, prompts, fault, victim, at_step)
        assert outs[victim].finish_reason == "abort" and "integrity" in outs[victim].stop_reason
        detected += llm.tracker.num_mismatches == mismatches + 1
        for i, o in enumerate(outs):
            if i != victim:
                assert o.token_ids == clean[i], (trial, i)
        cached = set(llm.prefix_cache.cached_pages())
        orphans = {p for p in RETAGGED if p not in cached and llm.allocator.refcount(p) > 0}
        assert llm.allocator.num_free + len(cached) + len(orphans) == llm.allocator.num_pages  # nothing else leaked
    assert detected == 4  # every trial
