"""Counted, not timed: the residency executor's host round trips per MoE layer of a decode step.

On the emulated accelerator (the GPU tier's code on CPU tensors) every device -> host read,
host -> device copy and kernel launch the executor makes is counted by wrapping torch's
dispatcher (`transfers.counting`: an operation on a tensor the accelerator holds is a launch, a
copy or a read of one to the host is a read, a host tensor reaching one is a copy) and
`gpu_moe`'s one launch function. A decode layer-step must read from the device at most
once (ids, weights, the look-ahead's logits and x in one packed read), copy nothing from pageable
memory, and queue at most 4 kernels per MoE layer on average over a decode step (with the Triton
experts, run here in Triton's interpreter). The outputs stay those of the plain engine
(tests/test_residency_executor.py checks logits; here the greedy tokens).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import random_prompt
from freetoken_py.core import SamplingParams
from freetoken_py.llm import LLM
from freetoken_py.residency import transfers
from freetoken_py.residency.transfers import Counts, Transfers

PROMPT = random_prompt(19, seed=4)
PLACEMENTS = {
    "all_cpu": dict(residency_policy="ours", vram_budget_bytes=1),
    "all_resident": dict(residency_policy="static", vram_budget_bytes=10**12),
    "mixed_laptop": dict(residency_policy="ours", residency_profile="rtx4060-laptop-8g"),
    "mixed_5090_lru": dict(residency_policy="lru", residency_profile="rtx5090"),
}


def decode_counts(llm, tokens: int = 8) -> tuple[list[int], list[list[Counts]]]:
    """Greedy decode after PROMPT: (the tokens, per decode step the counts of each MoE layer-step),
    observed around each call of the executor (which runs unchanged)."""
    ex, per_call = llm.residency, []

    def observed(layer, x, ids, weights):
        with transfers.counting():
            before = transfers.COUNTS.snapshot()
            out = ex(layer, x, ids, weights)
            per_call.append(transfers.COUNTS.snapshot() - before)
        return out

    llm.model.experts = observed
    req = llm.add_request(PROMPT, SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True))
    steps = []
    while len(req.output_token_ids) <= tokens:
        per_call.clear()
        logits = llm.runner.forward_batch(llm.scheduler.schedule())
        if len(req.output_token_ids) > 0:       # (the prefill pass is not a decode step)
            steps.append(list(per_call))
        req.output_token_ids.append(int(logits[0].argmax()))
    return req.output_token_ids, steps


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_a_decode_layer_step_reads_the_device_once_and_copies_from_pinned_staging(placement, checkpoint_factory):
    path = checkpoint_factory("qwen3_moe")
    want = LLM(path, dtype="float32", show_progress=False, backend="torch").generate(
        [PROMPT], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))[0].token_ids
    llm = LLM(path, dtype="float32", show_progress=False, residency="emulate", **PLACEMENTS[placement])
    tokens, steps = decode_counts(llm)
    assert tokens == want
    moe_layers = sum(h is not None for h in llm.residency.host)
    assert steps and all(len(calls) == moe_layers for calls in steps)
    for calls in steps:
        for c in calls:
            assert c.d2h_reads <= 1 and c.h2d_pageable == 0, (placement, c)
    # the accelerator's work goes there from staging: some pinned copies where it has any
    if placement != "all_cpu":
        assert sum(c.h2d_pinned for calls in steps for c in calls) > 0


def test_the_counts_see_a_second_read_and_a_pageable_copy():
    """The counters count what passes through torch: two reads are two (one of them a stray
    `.tolist()` of an accelerator tensor), a host tensor handed to an accelerator operation is an
    implicit pageable copy, and every operation on the accelerator's tensors is a launch (the
    check that the decode test can fail)."""
    t = Transfers("cpu")
    dev = torch.arange(6).view(2, 3)
    with transfers.counting():
        transfers.on_device(dev)
        before = transfers.COUNTS.snapshot()
        (a, b), out = t.read_packed([dev, (dev[0] * 0.5).to(torch.bfloat16)], out_like=torch.ones(2, 4))
        assert a.tolist() == [[0, 1, 2], [3, 4, 5]] and b.tolist() == [0, 0.5, 1]    # (host views)
        d = transfers.COUNTS.snapshot() - before
        # the scaling and the cast (two), the packing (one); one read; no copy to the device
        assert (d.d2h_reads, d.h2d_pinned, d.h2d_pageable, d.launches) == (1, 0, 0, 3)
        before = transfers.COUNTS.snapshot()
        assert out.eq(0).all()             # the zeroed output is the accelerator's: a kernel, a kernel, a read
        d = transfers.COUNTS.snapshot() - before
        assert (d.d2h_reads, d.launches) == (1, 2)
        before = transfers.COUNTS.snapshot()
        assert dev.sum(1).tolist() == [3, 12]                    # a stray read: counted
        (r, w), = [t.to_device([torch.tensor([3, 1]), torch.tensor([0.25, 0.5])])]
        assert r.tolist() == [3, 1] and w.tolist() == [0.25, 0.5]  # (two more reads)
        r.add_(torch.tensor([1, 1]))                            # a host tensor into a device op
        d = transfers.COUNTS.snapshot() - before
        assert (d.d2h_reads, d.h2d_pinned, d.h2d_pageable, d.launches) == (3, 1, 1, 2)
        before = transfers.COUNTS.snapshot()
        with transfers.counting():                              # (nested: counted once)
            dev.add_(1)
        assert (transfers.COUNTS.snapshot() - before).launches == 1
        before = transfers.COUNTS.snapshot()                    # sizes that depend on the data: a read each
        assert dev[dev > 3].tolist() == [4, 5, 6] and torch.nonzero(dev > 5).tolist() == [[1, 2]]
        d = transfers.COUNTS.snapshot() - before
        assert (d.d2h_reads, d.launches) == (4, 4), d                # (and the two .tolist())
        reps = torch.tensor([1, 2])                             # repeats on the device: a read to size
        transfers.on_device(reps)                               # the output, unless it is given
        before = transfers.COUNTS.snapshot()
        assert dev.repeat_interleave(reps, dim=0).shape == (3, 3)
        assert (transfers.COUNTS.snapshot() - before).d2h_reads == 1
        before = transfers.COUNTS.snapshot()
        assert dev.repeat_interleave(reps, dim=0, output_size=3).shape == (3, 3)
        assert (transfers.COUNTS.snapshot() - before).d2h_reads == 0
        host = torch.ones(3)                                    # (host work is not counted)
        before = transfers.COUNTS.snapshot()
        assert (host * 2).sum().item() == 6.0
        d = transfers.COUNTS.snapshot() - before
        assert (d.d2h_reads, d.h2d_pinned, d.h2d_pageable, d.launches) == (0, 0, 0, 0)


LAUNCH_SCRIPT = r'''
import os, sys, tempfile
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, sys.argv[1])
import torch
from pathlib import Path
from conftest import build_checkpoint
from freetoken_py.llm import LLM
from test_residency_transfers import decode_counts, PLACEMENTS

path = build_checkpoint("qwen3_moe", Path(tempfile.mkdtemp()), torch.float32)
for name in ("all_resident", "mixed_5090_lru"):
    llm = LLM(path, dtype="float32", show_progress=False, residency="emulate", **PLACEMENTS[name])
    llm.residency.fused_accel = True          # the Triton experts, in the interpreter
    _, steps = decode_counts(llm, 6)
    for calls in steps:
        per_layer = sum(c.launches for c in calls) / len(calls)
        worst = max(c.launches for c in calls)
        print(name, per_layer, worst, max(c.d2h_reads for c in calls), sum(c.h2d_pageable for c in calls))
        assert per_layer <= 4 and worst <= 5 and max(c.d2h_reads for c in calls) <= 1, (name, calls)
        assert sum(c.h2d_pageable for c in calls) == 0 and all(c.triton_launches in (0, 2) for c in calls), calls
print("ok")
'''


def test_a_decode_step_queues_at_most_four_launches_per_moe_layer():
    """With the Triton experts (Triton's interpreter on the emulated accelerator): the look-ahead's
    router, the packed read (which also zeroes the output) and the experts' two kernels, counted
    as torch and Triton see them; a layer whose CPU tier also has work adds its part (one more:
    5 at worst, at most 4 a layer over a step)."""
    pytest.importorskip("triton")
    tests = Path(__file__).resolve().parent
    proc = subprocess.run([sys.executable, "-c", LAUNCH_SCRIPT, str(tests)], capture_output=True, text=True,
                          timeout=600, cwd=tests)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
