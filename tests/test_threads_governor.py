"""The decode thread governor (engine/threads_governor.py): its decisions under scripted step
times, and the property it relies on — a decode step's logits do not depend on the thread count."""
from __future__ import annotations

import torch

from conftest import random_prompt
from freetoken_py.core import SamplingParams
from freetoken_py.engine.threads_governor import ThreadGovernor
from freetoken_py.llm import LLM


def _drive(gov: ThreadGovernor, cost, steps: int, rows: int = 1) -> list[int]:
    """Run `steps` decode steps where a step on n threads takes cost(step, n) seconds."""
    chosen = []
    for s in range(steps):
        n = gov.choose(rows)
        gov.record(rows, n, cost(s, n))
        chosen.append(n)
    return chosen


def test_candidates():
    assert ThreadGovernor(2).candidates == [2, 1]
    assert ThreadGovernor(1).candidates == [1]
    assert ThreadGovernor(16).candidates == [16, 15, 8]


def test_settles_on_the_faster_count_and_probes_less_while_it_loses():
    gov = ThreadGovernor(2, probe_every=16)
    chosen = _drive(gov, lambda s, n: {2: 0.010, 1: 0.016}[n], 256)
    assert chosen[:2] == [2, 1]  # each candidate timed once
    probes = [s for s, n in enumerate(chosen[2:], 2) if n == 1]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes and gaps == sorted(gaps) and gaps[-1] > 16  # re-timed, ever less often (1.6x slower)
    assert gov.best(1) == 2


def test_a_moderately_slower_count_is_probed_less_often_too():
    """One thread 1.35x slower (memory-bound decode on 2 cores): probes back off as for a collapse."""
    gov = ThreadGovernor(2, probe_every=16, max_interval=512)
    chosen = _drive(gov, lambda s, n: {2: 0.010, 1: 0.0135}[n], 1000)
    probes = [s for s, n in enumerate(chosen[2:], 2) if n == 1]
    assert len(probes) <= 8 and gov.best(1) == 2      # 16, 32, 64, ... 512 steps apart: not every 16
    gov2 = ThreadGovernor(2, probe_every=16)
    chosen2 = _drive(gov2, lambda s, n: {2: 0.010, 1: 0.0105}[n], 1000)
    assert sum(n == 1 for n in chosen2[2:]) >= 50      # within noise of the running count: still every 16


def test_follows_contention_both_ways():
    """2 threads collapse while another process holds a core (steps 40-139), then recover."""
    def cost(s, n):
        busy = 40 <= s < 140
        return {2: 0.200 if busy else 0.010, 1: 0.018 if busy else 0.016}[n]

    gov = ThreadGovernor(2, probe_every=8, max_interval=64)
    chosen = _drive(gov, cost, 300)
    busy_twos = [s for s in range(43, 140) if chosen[s] == 2]
    assert len(busy_twos) <= 4                      # from the 3rd busy step: 1 thread, 2 only as backed-off probes
    assert all(chosen[s] == 1 for s in range(43, 140) if s not in busy_twos)
    back = next(s for s in range(140, 300) if chosen[s:s + 20].count(2) >= 18)
    assert back <= 140 + 64 + 2 * 8                 # quiet again: back to 2 within one backed-off interval


def test_batch_sizes_are_timed_separately():
    gov = ThreadGovernor(2, probe_every=1000)
    # one row: 1 thread wins; eight rows: 2 threads win
    _drive(gov, lambda s, n: {2: 0.012, 1: 0.010}[n], 10, rows=1)
    _drive(gov, lambda s, n: {2: 0.020, 1: 0.035}[n], 10, rows=8)
    assert gov.best(1) == 1 and gov.best(8) == 2 and gov.best(7) == 2  # 5-8 rows share a bucket


def test_context_bands_are_timed_separately_and_reset_forgets():
    gov = ThreadGovernor(2, probe_every=1000)
    _drive(gov, lambda s, n: {2: 0.010, 1: 0.016}[n], 6)  # short context: 2 threads win
    for _ in range(6):  # a 4,000-token context: here 1 thread wins
        n = gov.choose(1, context=4000)
        gov.record(1, n, {2: 0.050, 1: 0.030}[n], context=4000)
    assert gov.best(1) == 2 and gov.best(1, context=4000) == 1 and gov.best(1, context=3000) == 1
    gov.reset()
    assert gov.snapshot() == {} and gov.choose(1) == 2  # timing starts over, from the full count


def test_one_outlier_does_not_flip_the_choice():
    gov = ThreadGovernor(2, probe_every=1000)
    _drive(gov, lambda s, n: {2: 0.010, 1: 0.016}[n], 10)
    gov.record(1, 2, 1.0)  # a single slow step (page fault, a GC pause)
    assert gov.best(1) == 2


def test_decode_logits_do_not_depend_on_the_thread_count(checkpoint_factory):
    """What lets the governor switch counts mid-request: every kernel reduces in a fixed order."""
    path = checkpoint_factory("qwen3_moe_step2")
    prompt = random_prompt(20, seed=7)
    outs = {}
    for n in (1, 2):
        llm = LLM(path, dtype="float32", backend="cpu", show_progress=False, kv_cache_bytes=1 << 22)
        assert llm.runner.fused is not None
        llm.runner.governor = None
        llm.runner._max_threads = n  # every decode step on n threads
        req = llm.add_request(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        logits = []
        while not req.finished:
            chunks = llm.scheduler.schedule()
            out = llm.runner.forward_batch(chunks)
            logits.append(out[0])
            req.output_token_ids.append(int(out[0].argmax()))
            if len(req.output_token_ids) >= 12:
                break
        outs[n] = torch.stack(logits)
    assert torch.equal(outs[1], outs[2])
