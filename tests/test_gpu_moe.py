"""kernels/gpu_moe.py (the accelerator tier's Triton experts) against the torch reference the
executor uses otherwise. Without a GPU the kernels run in Triton's CPU interpreter
(TRITON_INTERPRET=1, set here before Triton is imported): this checks their arithmetic and
addressing, not their speed. Skipped where Triton is not installed."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r'''
import os, sys, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
from freetoken_py.kernels import gpu_moe
from freetoken_py.residency.formats import swiglu as _swiglu

dev = "cuda" if torch.cuda.is_available() else "cpu"
assert gpu_moe.available(dev)
g = torch.Generator().manual_seed(0)

def case(dtype, tokens, hidden, inter, pairs_of, tol, strided=False):
    # experts in separate tensors (slot chunks, staging), some used by several pairs
    w13 = [(torch.randn(2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype).to(dev) for _ in range(4)]
    w2 = [(torch.randn(hidden, inter, generator=g) / inter ** 0.5).to(dtype).to(dev) for _ in range(4)]
    chunk = torch.stack(w13[:2])                       # two experts side by side in one chunk
    w13[0], w13[1] = chunk[0], chunk[1]
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(dev)
    if strided:                                        # columns two apart: made contiguous first
        wide = torch.zeros(tokens, 2 * hidden, dtype=dtype, device=dev)
        wide[:, ::2] = x
        x = wide[:, ::2]
    rows = torch.tensor([t for t, _ in pairs_of], dtype=torch.int64, device=dev)
    wts = torch.rand(len(pairs_of), generator=g).to(dev)
    out = torch.randn(tokens, hidden, generator=g).to(dtype).to(dev)   # added into, not overwritten
    ref = out.float().clone()
    for (t, e), w in zip(pairs_of, wts.tolist()):
        ref[t] += w * _swiglu(x[t:t + 1].float(), w13[e].float(), w2[e].float())[0]
    gpu_moe.moe_pairs(out, x, rows, wts, [w13[e] for _, e in pairs_of], [w2[e] for _, e in pairs_of])
    err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
    assert err <= tol, (dtype, tokens, hidden, inter, err)
    return err

errs = [
    case(torch.float32, 1, 64, 48, [(0, 0), (0, 1), (0, 2), (0, 3)], 1e-5),      # decode: one token, 4 experts
    case(torch.float32, 3, 80, 40, [(0, 1), (2, 1), (1, 3), (2, 0), (0, 2)], 1e-5),  # sizes off the block grid
    case(torch.bfloat16, 2, 128, 96, [(0, 0), (1, 0), (1, 2)], 1e-2),           # bf16 weights and activations
    case(torch.float32, 2, 64, 32, [(1, 3), (0, 3)], 1e-5, strided=True),         # a strided view of x
]
try:
    gpu_moe.moe_pairs(torch.zeros(1, 64), torch.zeros(1, 64), torch.zeros(1, dtype=torch.int64), torch.ones(1),
                      [torch.zeros(10, 64)], [torch.zeros(64, 6)])
    raise AssertionError("a misshapen expert was accepted")
except ValueError as exc:
    assert "contiguous" in str(exc)
# the probe's step for the gpu_expert_kernel figure (hw/measure_gpu.py): the next top-k experts
# of a [E, I, D] bank through the kernels, rotating, equal to torch's sum over the same experts
from freetoken_py.hw.measure_gpu import triton_expert_step
gate, up = (torch.randn(6, 32, 64, generator=g).to(dev) / 8 for _ in range(2))
down = torch.randn(6, 64, 32, generator=g).to(dev) / 6
xs = torch.randn(1, 64, generator=g).to(dev)
step = triton_expert_step(gate, up, down, xs, 4)
for first in (0, 4):                                   # the second step wraps around the bank
    got = step()
    want = sum(torch.nn.functional.silu(xs @ gate[e % 6].T) * (xs @ up[e % 6].T) @ down[e % 6].T
               for e in range(first, first + 4)) / 4
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), first

# the int4 probe's step (gpu_expert_kernel_int4): the next top-k int4 experts through the
# quantised kernels, equal to the torch path's sum over the same experts
from freetoken_py.hw.measure_gpu import triton_expert_step_int4
from freetoken_py.kernels import ExpertBank
from freetoken_py.residency.formats import ExpertFormat as _Fmt, bank_parts as _parts
qbank = ExpertBank.from_weights(gate.cpu(), up.cpu(), down.cpu(), fmt="int4")
qparts = tuple(t.to(dev) for t in _parts(qbank))
qfmt = _Fmt.of_bank(qbank)
tol4 = 1e-5 if dev == "cpu" else 2e-3          # (on a GPU: room for h rounded a step apart near a tie)
for use_triton in (True, False):               # (the probe's torch fallback: the executor's other path)
    step = triton_expert_step_int4(qparts, xs, 4, triton=use_triton)
    for first in (0, 4):
        got = step()
        want = sum(qfmt.compute(xs, tuple(p[e % 6] for p in qparts)) for e in range(first, first + 4)) / 4
        assert (got - want).abs().max().item() <= tol4 * want.abs().max().item(), (use_triton, first)

# the executor's gate: Triton there and the self-check passing; a failing self-check (here integer
# weights, which moe_pairs refuses) is a warning naming the problem and the torch path, not an error
import warnings
from freetoken_py.residency.executor import _fused_ok
from freetoken_py.residency.formats import ExpertFormat, bank_parts

def float_format(dtype):
    return ExpertFormat("float", 32, 64, (((64, 64), dtype), ((64, 32), dtype)))

assert _fused_ok(torch.device(dev), float_format(torch.float32)) is True
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert _fused_ok(torch.device(dev), float_format(torch.int32)) is False
assert any("keeps the torch path" in str(w.message) and "torch.int32" in str(w.message) for w in caught), \
    [str(w.message) for w in caught]

# quantised experts (int8, int4 at three group sizes): moe_pairs_quant against the torch path the
# executor takes otherwise (ExpertFormat.compute: dequantised weights, activations rounded alike),
# experts side by side in one bank (a slot chunk) and one copied out alone (staging)
from freetoken_py.kernels import ExpertBank
# (int8 at D = 72, I = 40: partial tiles on both axes; on a GPU the sums run in another order, and
# an element of h within rounding of an int8 tie may land a step away: ~1e-3 at these sizes)
qtol = 1e-5 if dev == "cpu" else 2e-3
for fmt, group, inter, hidden in (("int8", 32, 40, 72), ("int8", 32, 64, 96), ("int4", 32, 64, 96),
                                  ("int4", 64, 128, 128), ("int4", 128, 256, 256)):
    bank = ExpertBank.from_weights(*(torch.randn(4, *shape, generator=g) / 8 for shape in
                                     ((inter, hidden), (inter, hidden), (hidden, inter))), fmt=fmt, group_size=group)
    f, host = ExpertFormat.of_bank(bank), [t.to(dev) for t in bank_parts(bank)]
    experts = [tuple(t[e] for t in host) for e in range(4)]
    experts[3] = tuple(t.clone() for t in experts[3])
    pairs_of = [(0, 0), (0, 3), (1, 1), (2, 3), (1, 2)]
    x = torch.randn(3, hidden, generator=g).to(dev)
    rows = torch.tensor([t for t, _ in pairs_of], device=dev)
    wts = torch.rand(len(pairs_of), generator=g).to(dev)
    out = torch.zeros(3, hidden, device=dev)
    gpu_moe.moe_pairs_quant(out, x, rows, wts, [experts[e] for _, e in pairs_of], fmt, group)
    ref = torch.zeros(3, hidden, device=dev)
    for (t, e), w in zip(pairs_of, wts.tolist()):
        ref[t] += w * f.compute(x[t:t + 1], experts[e])[0]
    err = (out - ref).abs().max().item() / ref.abs().max().item()
    assert err <= qtol, (fmt, group, err)
    errs.append(err)
    assert gpu_moe.self_check_quant(dev, fmt, group) is None
    assert _fused_ok(torch.device(dev), f) is True
try:                                               # (the last case: int4, g = 128, D = 256)
    gpu_moe.moe_pairs_quant(torch.zeros(1, 256), torch.zeros(1, 256), torch.zeros(1, dtype=torch.int64),
                            torch.ones(1), [(experts[0][0][:, :10], *experts[0][1:])], "int4", 128)
    raise AssertionError("a misshapen quantised expert was accepted")
except ValueError as exc:
    assert "contiguous" in str(exc), exc
print("ok", errs)
'''


def test_triton_experts_match_the_torch_reference():
    """In a fresh process: TRITON_INTERPRET must be set before Triton is imported, and this
    session's other tests import it without."""
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok"), proc.stdout


EXECUTOR_SCRIPT = r'''
import os, sys, tempfile, collections
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, sys.argv[1])
import torch
from pathlib import Path
from conftest import build_checkpoint, random_prompt, reference_model
from freetoken_py.core import SamplingParams
from freetoken_py.kernels import gpu_moe
from freetoken_py.llm import LLM
from freetoken_py.residency.stats import RoutingRecorder

calls = collections.Counter()

real_run = gpu_moe.run

def counted(out, x, rows, weights, plan, *rest):     # (the executor's planned steps, by format)
    calls["launches" if plan.table.fmt == "float" else "quant_launches"] += 1
    calls["pairs"] += rows.numel()
    return real_run(out, x, rows, weights, plan, *rest)

gpu_moe.run = counted
import freetoken_py.residency.executor as executor_module
real_build = executor_module.build_table

def built(*args, **kw):                             # (the executor's slot tables: built when the slots change)
    calls["tables"] += 1
    return real_build(*args, **kw)

executor_module.build_table = built

path = build_checkpoint("qwen3_moe", Path(tempfile.mkdtemp()), torch.float32)
prompt = random_prompt(19, seed=4)

def run(fused, path=path, shrink_at=None, grow_at=None, **kw):
    llm = LLM(path, dtype="float32", show_progress=False, residency="emulate", residency_profile="rtx4060-laptop-8g",
              **kw)
    ex = llm.residency
    assert ex.fused_accel is False                  # never on by itself under emulation
    ex.fused_accel, ex.audit = fused, []
    rec = RoutingRecorder(ex, llm.args.num_layers, llm.args.num_experts, llm.args.top_k)
    llm.model.experts = rec
    req = llm.add_request(prompt, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
    steps = []
    while len(req.output_token_ids) <= 8:
        if len(req.output_token_ids) == shrink_at:    # (slots move between chunks: the slot table is rebuilt)
            version = ex.slots.layout_version
            assert ex.resize(ex.slots.num_slots // 2) < ex.slots.num_slots * 2 and ex.slots.layout_version != version
        if len(req.output_token_ids) == grow_at:      # (new chunks elsewhere in memory)
            ex.resize(ex.slots.num_slots * 2)
        logits = llm.runner.forward_batch(llm.scheduler.schedule())
        steps.append(logits[0])
        req.output_token_ids.append(int(logits[0].argmax()))
    computed = collections.Counter((s, l, t, e) for s, l, t, e, _ in ex.audit)
    routed = collections.Counter((s, l, t, int(e)) for s, step in enumerate(rec.trace.steps)
                                 for l, ids in step.items() for t, row in enumerate(ids.tolist()) for e in row)
    assert computed == routed, "a routed pair was computed twice or never"
    tiers = collections.Counter(tier for *_, tier in ex.audit)
    return req.output_token_ids, torch.stack(steps), tiers

toks0, base, _ = run(False)
assert calls["launches"] == 0
toks1, fused, tiers = run(True)
assert toks1 == toks0 and calls["launches"] > 0 and tiers["hit"] > 0 and tiers["stream"] > 0, (calls, tiers)
assert calls["tables"] == 1, calls                  # one table for the whole run, not one a step
assert (fused - base).abs().max().item() <= 1e-5
ref = reference_model(path)
with torch.no_grad():
    theirs = ref(torch.tensor([prompt + toks1[:-1]])).logits[0, len(prompt) - 1:]
assert (fused - theirs).abs().max().item() <= 1e-4
# the slot cache halved mid-decode (experts move to other slots and chunks), then grown back
# (new chunks): the same tokens
toks2, shrunk, _ = run(True, shrink_at=3, grow_at=6)
assert toks2 == toks0 and (shrunk - base).abs().max().item() <= 1e-5
assert calls["tables"] == 1 + 3, calls             # this run: at its start, after the shrink, after the grow
# int4 experts (mixtral: I = 64): the quantised kernels, the same tokens and logits as the torch path
mixtral = build_checkpoint("mixtral", Path(tempfile.mkdtemp()), torch.float32)
before = calls["launches"]
toks_q0, base_q, _ = run(False, mixtral, expert_dtype="int4", expert_cache="off")
assert calls["quant_launches"] == 0
toks_q1, fused_q, tiers_q = run(True, mixtral, expert_dtype="int4", expert_cache="off")
assert toks_q1 == toks_q0 and calls["quant_launches"] > 0 and tiers_q["hit"] > 0, (calls, tiers_q)
assert calls["launches"] == before            # (the float kernels: not for int4 experts)
assert (fused_q - base_q).abs().max().item() <= 1e-4
print("ok", dict(calls), dict(tiers))
'''


def test_executor_with_triton_experts_keeps_outputs_and_computes_each_pair_once():
    """The executor's decode steps with the accelerator's experts batched into the Triton
    kernels (interpreter, on the emulated accelerator's CPU tensors): the same tokens and logits
    within 1e-5 of the torch path and 1e-4 of transformers, every routed pair computed once; and
    with int4 experts (the quantised kernels) the torch path's tokens and logits within 1e-4."""
    tests = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", EXECUTOR_SCRIPT, tests], capture_output=True, text=True,
                          timeout=900, cwd=os.path.dirname(tests))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok"), proc.stdout


def test_kernel_bench_runs_in_the_interpreter(tmp_path):
    """bench/gpu_moe_kernels.py --interpret: the GPU bench's code path on CPU (tiny sizes, eager only),
    every format agreeing with the torch path, marked not comparable; --dry-run lists the cases
    anywhere, --registers the compiled kernels' registers and spills; a bad argument is exit 2 naming
    it; without a GPU and without these flags it skips."""
    import json

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "gpu_moe_kernels.py")
    out = tmp_path / "k.json"
    proc = subprocess.run([sys.executable, script, "--interpret", "--tokens", "1,2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(out.read_text())
    assert row["skipped"] is False and row["comparable"] is False and row["agree"] is True
    assert {(r["format"], r["tokens"]) for r in row["rows"]} == {(f, t) for f in ("bf16", "int4", "fp8", "nvfp4")
                                                                 for t in (1, 2)}
    assert all(r["eager_us"] > 0 and r["launches"] == 2 for r in row["rows"])
    dry = subprocess.run([sys.executable, script, "--dry-run", "--models", "deepseek-v3"], capture_output=True,
                         text=True, timeout=120)
    cases = json.loads(dry.stdout)["cases"]
    assert dry.returncode == 0 and len(cases) == 16
    assert all(c["slots"] * c["bytes_per_step"] / c["experts_per_step"] >= 4 * (50 << 20) for c in cases)
    regs = subprocess.run([sys.executable, script, "--registers", "80", "--formats", "fp8"], capture_output=True,
                          text=True, timeout=600)
    report = json.loads(regs.stdout)
    assert regs.returncode == 0 and report["spills"] == 0 and len(report["rows"]) == 4
    assert all(r["regs"] > 0 and r["wide_loads"] > 0 for r in report["rows"])
    bad = subprocess.run([sys.executable, script, "--tokens", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--tokens" in bad.stderr and "Traceback" not in bad.stderr
    import torch

    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and json.loads(proc.stdout)["skipped"] is True


def test_a_gpu_too_old_for_the_kernels_is_one_line_and_the_torch_path(monkeypatch):
    """Compute capability below 8.0 (a Turing or Volta card): `available` says no, `why_not` says
    why in one line, and the executor keeps torch's experts with that line as its warning
    (torch's capability query stands in for the card: no GPU here)."""
    import warnings

    import torch

    from freetoken_py.kernels import gpu_moe
    from freetoken_py.residency.executor import _fused_ok
    from freetoken_py.residency.formats import ExpertFormat

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert gpu_moe.available(torch.device("cuda")) is False
    why = gpu_moe.why_not()
    assert "7.5" in why and "8.0" in why and "\n" not in why
    fmt = ExpertFormat("float", 32, 64, (((64, 64), torch.bfloat16), ((64, 32), torch.bfloat16)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _fused_ok(torch.device("cuda"), fmt) is False
    assert [str(w.message) for w in caught] == [f"{why}; the accelerator tier runs torch's experts"]
    with warnings.catch_warnings(record=True) as caught:     # (the emulated accelerator: nothing to say)
        warnings.simplefilter("always")
        assert _fused_ok(torch.device("cpu"), fmt) is False
    assert not caught


def test_a_step_through_the_persistent_slot_table_reads_the_same_memory_as_a_per_call_table():
    """The executor's way of planning a step (the slot cache's one table, the plan packed against
    it, sent with the pairs from kept device buffers: `bench/gpu_step_host.py`'s
    `persistent_table`) and `moe_pairs`' way (a table of the step's experts built per call)
    point each group's kernels at the same bytes: for every group and weight part, base address +
    offset x element size agree, and the groups' pairs are the same; a second step of the same
    shape reuses the kept buffers and still plans its own slots."""
    import torch

    from freetoken_py.kernels import gpu_moe
    from freetoken_py.kernels.gpu_slots import build_table, packed_plan
    from freetoken_py.residency.slots import SlotCache
    from freetoken_py.residency.transfers import Transfers

    hidden, inter, slots = 64, 32, 12
    cache = SlotCache(slots, [((2 * inter, hidden), torch.bfloat16), ((hidden, inter), torch.bfloat16)], chunk_slots=5)
    table = build_table([cache.views(s) for s in range(slots)], "float").to_device("cpu")
    transfers = Transfers("cpu")
    rows, wts = torch.zeros(4, dtype=torch.long), torch.rand(4)

    def addresses(t, plan, k):
        base = t.bases[k]
        return [base.data_ptr() + int(t.offsets[k, s]) * base.element_size() for s in plan.slots.tolist()]

    kept = None
    for step in ([7, 2, 11, 2], [3, 10, 0, 3]):          # (a repeated slot: one group of two pairs)
        unique, pair_slots = gpu_moe._pair_slots([cache.views(s) for s in step])
        per_call = gpu_moe.prepare(build_table(unique, "float"), pair_slots, "cpu")
        host_plan, groups, nt = packed_plan(step, table)
        _, _, plan = transfers.to_device([rows, wts, host_plan], "fused", keep=True)
        kept = kept or plan.data_ptr()
        assert plan.data_ptr() == kept                    # (the same device buffer, rewritten)
        ours = gpu_moe.step_plan(table, plan, groups, nt, len(step))
        assert (ours.groups, ours.nt, ours.pairs.tolist()) == (per_call.groups, per_call.nt, per_call.pairs.tolist())
        for k in (0, 2):                                  # (w13, w2: a float expert has no scale parts)
            assert addresses(ours.table, ours, k) == addresses(per_call.table, per_call, k), (step, k)


DEVICE_SCRIPT = r'''
import os, sys, tempfile
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, sys.argv[1])
import torch
from pathlib import Path
from conftest import build_checkpoint, random_prompt
from freetoken_py.core import SamplingParams
from freetoken_py.llm import LLM
from freetoken_py.residency import transfers

path = build_checkpoint("qwen3_moe", Path(tempfile.mkdtemp()), torch.float32)
prompt = random_prompt(19, seed=4)

def run(device_path, swap_at=None):
    llm = LLM(path, dtype="float32", show_progress=False, residency="emulate", residency_policy="static",
              vram_budget_bytes=10**12)
    ex = llm.residency
    ex.fused_accel = True
    if not device_path:
        ex._device_step = lambda *args: None          # (the host path: the routing read, the planner)
    calls = []

    def observed(layer, x, ids, weights):
        with transfers.counting():
            before = transfers.COUNTS.snapshot()
            out = ex(layer, x, ids, weights)
            calls.append((x.shape[0], transfers.COUNTS.snapshot() - before))
        return out

    llm.model.experts = observed
    req = llm.add_request(prompt, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
    logits = []
    while len(req.output_token_ids) <= 8:
        if len(req.output_token_ids) == swap_at:      # layer 0's experts rotate their slots (copied again)
            E = ex.host[0][0].shape[0]
            before = [ex.slots.slot_of[(0, e)] for e in range(E)]
            for e in range(E):
                ex.slots.evict((0, e))
            for j in range(E):                         # (the j-th taken gets the j-th last freed)
                ex.streamer.to_slot(0, (E - 2 - j) % E)
            assert [ex.slots.slot_of[(0, e)] for e in range(E)] == [before[(e + 1) % E] for e in range(E)]
        step = llm.runner.forward_batch(llm.scheduler.schedule())
        logits.append(step[0])
        req.output_token_ids.append(int(step[0].argmax()))
    return req.output_token_ids, torch.stack(logits), [c for t, c in calls if t == 1], ex

toks_h, logits_h, _, ex_h = run(False)
assert ex_h.telemetry.totals().device_steps == 0
toks_d, logits_d, decode, ex_d = run(True, swap_at=4)
assert toks_d == toks_h and (logits_d - logits_h).abs().max().item() <= 1e-5, (logits_d - logits_h).abs().max()
t = ex_d.telemetry.totals()
assert t.device_steps == len(decode) > 0 and t.routed_pairs == t.hit_pairs, t
moe_layers = sum(h is not None for h in ex_d.host)
steps = [decode[i:i + moe_layers] for i in range(0, len(decode), moe_layers)]
for i, step in enumerate(steps[1:], 1):  # (after the first decode step, which made the slot maps)
    for c in step:
        assert (c.d2h_reads, c.h2d_pageable) == (0, 0) and c.launches <= 4, (i, c)
    # the swap (before decode step 3) changed two slots: layer 0's map is made again, one copy
    assert [c.h2d_pinned for c in step] == [int(i == 3 and j == 0) for j in range(moe_layers)], (i, step)
# slots one expert short of the whole model: the static policy (llama.cpp's --n-cpu-moe: whole
# layers from the last down) never evicts, so its resident layers still take the device path; a
# policy that evicts would need the statistics that path skips, so there it is the host path
E_all = sum(h[0].shape[0] for h in ex_d.host if h is not None)
short = LLM(path, dtype="float32", show_progress=False, residency="emulate", residency_policy="static",
            vram_budget_bytes=(E_all - 1) * ex_d.fmt.expert_bytes)
ex_s = short.residency
ex_s.fused_accel = True
got = short.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0].token_ids
assert got == toks_h[:5] and ex_s.slots.num_slots == E_all - 1, (got, ex_s.slots.num_slots)
fixed = ex_s.telemetry.totals().device_steps
assert fixed > 0, fixed
ex_s.policy.evicts = True
short.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
assert ex_s.telemetry.totals().device_steps == fixed
# a shrink drops the kept slot table and what holds views of the freed chunks
ex_d.resize(0)
assert ex_d._table is None and not ex_d._step_plans and not ex_d._slot_maps
print("ok", len(decode), max(c.launches for c in decode[moe_layers:]))
'''


def test_a_layer_with_every_expert_resident_is_routed_on_the_device():
    """Every expert of every MoE layer in a slot (the model fits): a decode layer-step runs from
    the routing's ids through the layer's slot map into the Triton experts (interpreter) with
    no read, no copy and at most 4 launches, and gives the host path's tokens and logits within
    1e-5; a layer's experts rotating their slots mid-decode remake that layer's map, and only
    its (a stale one reads the wrong experts: the logits differ, checked by disabling it)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", DEVICE_SCRIPT, tests], capture_output=True, text=True,
                          timeout=900, cwd=os.path.dirname(tests))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok"), proc.stdout
