"""ResidencyExecutor under the EMULATED accelerator (the GPU tier's code on CPU tensors, times from
an injected profile): outputs do not depend on placement, every routed (token, expert) pair is
computed exactly once, elastic VRAM shrinks and grows without changing outputs.

Reference: transformers' logits on the conftest tiny checkpoints (fp32), as in
test_models_vs_transformers.py. The CUDA path (device="cuda") is the same code and is not run here.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import StandInCudart, random_prompt, reference_model
from freetoken_py.cli import DEMO_MODEL
from freetoken_py.config import EngineConfig
from freetoken_py.core import SamplingParams
from freetoken_py.errors import FreetokenError
from freetoken_py.llm import LLM
from freetoken_py.residency.elastic import ElasticVram
from freetoken_py.residency.planner import CostModel
from freetoken_py.residency.stats import RoutingRecorder, RoutingTrace

ROOT = Path(__file__).resolve().parents[1]
PROMPT = random_prompt(19, seed=4)
NUM_DECODE = 10
# name -> LLM overrides. vram_budget_bytes=1: no slot, everything on the CPU; "static" with an
# unbounded budget: every expert resident from the start; the others mix hits, copies and CPU.
PLACEMENTS = {
    "all_cpu": dict(residency_policy="ours", vram_budget_bytes=1),
    "all_resident": dict(residency_policy="static", vram_budget_bytes=10**12),
    "mixed_laptop": dict(residency_policy="ours", residency_profile="rtx4060-laptop-8g"),
    "mixed_5090_lru": dict(residency_policy="lru", residency_profile="rtx5090"),
}


def drive(path, **overrides):
    llm = LLM(path, dtype="float32", show_progress=False, **overrides)
    if llm.residency is not None:   # on a GPU too: plan from the given profile, not from live timings
        llm.residency.measure_live = False   # of these tiny experts (which tiers get used is asserted)
    return drive_llm(llm)


def drive_llm(llm):
    """Greedy decode of PROMPT, NUM_DECODE tokens: (llm, tokens, logits of every step)."""
    req = llm.add_request(PROMPT, SamplingParams(max_tokens=NUM_DECODE + 1, temperature=0, ignore_eos=True))
    steps = []
    while len(req.output_token_ids) <= NUM_DECODE:
        logits = llm.runner.forward_batch(llm.scheduler.schedule())  # [1, V]
        steps.append(logits[0])
        req.output_token_ids.append(int(logits[0].argmax()))
    return llm, req.output_token_ids, torch.stack(steps)


def transformers_logits(path, tokens):
    ref = reference_model(path)
    with torch.no_grad():
        return ref(torch.tensor([PROMPT + tokens[:-1]])).logits[0, len(PROMPT) - 1:]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a GPU machine)")


@pytest.mark.parametrize("mode", ["emulate", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_logits_do_not_depend_on_placement(arch, mode, checkpoint_factory):
    """Under the emulated accelerator everywhere; on the real GPU tiers (VRAM slots, the copy
    stream, pinned banks) where one is present."""
    path = checkpoint_factory(arch)
    placements = PLACEMENTS
    if mode == "cuda":   # there a budget of 0 means "the VRAM left": give the mixed runs emulation's half
        slots = LLM(path, dtype="float32", show_progress=False, residency="emulate").residency.slots
        half = slots.num_slots * slots.slot_bytes
        placements = {name: {"vram_budget_bytes": half, **kw} for name, kw in PLACEMENTS.items()}
    runs = {name: drive(path, residency=mode, **kw) for name, kw in placements.items()}
    tokens = runs["all_cpu"][1]
    theirs = transformers_logits(path, tokens)
    for name, (llm, toks, ours) in runs.items():
        assert toks == tokens, name
        assert (ours - theirs).abs().max().item() <= 1e-4, name
    s = {name: run[0].residency.telemetry.summary() for name, run in runs.items()}
    # the CPU tier is the numba expert kernels, reading the same host weights the streamer copies
    for llm, _, _ in runs.values():
        ex = llm.residency
        assert ex.cpu_banks and [b is None for b in ex.cpu_banks] == [h is None for h in ex.host]
    if mode == "cuda":    # dense weights, activations and the KV cache in VRAM; experts in pinned host banks
        for llm, _, _ in runs.values():
            assert llm.runner.cache.k.is_cuda and llm.model.weights.layers[0].qkv.weight.is_cuda
            assert all(h is None or all(w.is_pinned() for w in h) for h in llm.residency.host)
    assert s["all_cpu"]["cpu_share"] == 1.0
    assert s["all_cpu"]["label"].startswith("emulated:") if mode == "emulate" else s["all_cpu"]["label"] == "cuda"
    assert s["all_resident"]["hit_rate"] == 1.0 and s["all_resident"]["pcie_bytes"] == 0
    for name in ("mixed_laptop", "mixed_5090_lru"):     # all three tiers were really used
        assert s[name]["hit_rate"] > 0 and s[name]["stream_share"] > 0 and s[name]["cpu_share"] > 0, (name, s[name])
    # ours also cut experts between the two sides (planner decision 5); lru never does
    assert s["mixed_laptop"]["split_share"] > 0 and s["mixed_5090_lru"]["split_share"] == 0
    assert s["all_cpu"]["split_share"] == 0 and s["all_resident"]["split_share"] == 0


@pytest.mark.parametrize("mode", ["emulate", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("arch,fmt", [("mixtral", "int4"), ("qwen3_moe_step2", "int8"), ("qwen3_moe", "int8")])
def test_quantised_experts_do_not_depend_on_placement(arch, fmt, mode, checkpoint_factory):
    """--expert-dtype int8 / int4 in the tiers: the expert store's banks are the host banks (the
    streamer copies their packed weights and scales, the numba kernels read them in place), the
    slots hold the quantised bytes, and every placement gives the cpu backend's logits for the
    same expert format (numba kernels for every pair) within 1e-4. The mixed runs use both
    sides' bandwidths only (no fixed call costs), so the planner also cuts experts where the
    width allows one (I = 64: two 32-column blocks; qwen3_moe's I = 48 has one: a planned cut
    sends the whole expert to one side)."""
    from dataclasses import replace

    path = checkpoint_factory(arch)
    reference = drive(path, backend="cpu", expert_dtype=fmt, expert_cache="off")
    placements = dict(PLACEMENTS)
    if mode == "cuda":   # there a budget of 0 means "the VRAM left": give the mixed runs emulation's half
        slots = LLM(path, dtype="float32", show_progress=False, residency="emulate", expert_dtype=fmt,
                    expert_cache="off").residency.slots
        placements = {name: {"vram_budget_bytes": slots.num_slots * slots.slot_bytes, **kw}
                      for name, kw in PLACEMENTS.items()}
    runs = {}
    for name, kw in placements.items():
        llm = LLM(path, dtype="float32", show_progress=False, residency=mode, expert_dtype=fmt, expert_cache="off",
                  **kw)
        ex = llm.residency
        ex.measure_live = False
        if name.startswith("mixed"):
            ex.cost = replace(ex.cost, profile=replace(ex.cost.profile, cpu_call_s=0.0, copy_call_s=0.0))
        runs[name] = drive_llm(llm)
        assert ex.fmt.name == fmt and ex.slots.slot_bytes == ex.cpu_banks[1].bytes_per_expert
        store = llm.loaded.expert_store.banks
        assert all((h is None) == (b is None) for h, b in zip(ex.host, store))
        assert all(h is None or h[0].data_ptr() == b.w13.ctypes.data for h, b in zip(ex.host, store))
        if mode == "cuda":   # the store page-locks its banks in place: the copies are asynchronous DMA
            assert all(h is None or all(w.is_pinned() for w in h) for h in ex.host)
    # on a GPU the dense layers and the accelerator's experts sum in another order than the
    # host's: near a rounding tie of the int8 activations one value may land a step away
    tol = 1e-4 if mode == "emulate" else 1e-3
    for name, (llm, toks, ours) in runs.items():
        assert toks == reference[1], name
        assert (ours - reference[2]).abs().max().item() <= tol, name
    s = {name: run[0].residency.telemetry.summary() for name, run in runs.items()}
    assert s["all_cpu"]["cpu_share"] == 1.0 and s["all_resident"]["hit_rate"] == 1.0
    for name in ("mixed_laptop", "mixed_5090_lru"):
        assert s[name]["hit_rate"] > 0 and s[name]["stream_share"] > 0 and s[name]["cpu_share"] > 0, name
    if runs["all_cpu"][0].residency.fmt.inter >= 64:   # (I = 48: a planned cut goes whole to one side)
        assert s["mixed_laptop"]["split_share"] > 0, s["mixed_laptop"]


def test_every_routed_pair_is_computed_exactly_once(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe")
    llm = LLM(path, dtype="float32", show_progress=False, residency="emulate", residency_profile="rtx4060-laptop-8g")
    ex = llm.residency
    ex.audit = []
    recorder = RoutingRecorder(ex, llm.args.num_layers, llm.args.num_experts, llm.args.top_k)
    llm.model.experts = recorder
    llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    computed: dict[tuple, Counter] = {}
    tiers = Counter()
    for step, layer, token, expert, tier in ex.audit:
        computed.setdefault((step, layer), Counter())[(token, expert)] += 1
        tiers[tier] += 1
    routed = {(s, l): Counter((t, int(e)) for t, row in enumerate(ids.tolist()) for e in row)
              for s, step in enumerate(recorder.trace.steps) for l, ids in step.items()}
    assert computed == routed
    assert set(tiers) == {"hit", "stream", "cpu", "split"}   # split: one expert cut between the two sides


def test_elastic_vram_shrinks_and_grows_back_without_changing_outputs(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe")
    _, tokens, base = drive(path, residency="emulate", residency_policy="ours", vram_budget_bytes=1)
    llm = LLM(path, dtype="float32", show_progress=False, residency="emulate", vram_budget_bytes=10**12)
    ex = llm.residency
    slot = ex.slots.slot_bytes
    # another process takes memory after step 3 and frees it after step 7
    free = iter([10**9] * 3 + [0] * 4 + [10**9] * 100)
    ex.elastic = ElasticVram(slot, max_slots=ex.slots.num_slots, reserve_bytes=2 * slot, grow_margin_bytes=slot)
    ex.memory_probe = lambda: next(free)
    req = llm.add_request(PROMPT, SamplingParams(max_tokens=NUM_DECODE + 1, temperature=0, ignore_eos=True))
    steps, sizes = [], []
    while len(req.output_token_ids) <= NUM_DECODE:
        logits = llm.runner.forward_batch(llm.scheduler.schedule())
        steps.append(logits[0])
        sizes.append(ex.slots.num_slots)
        req.output_token_ids.append(int(logits[0].argmax()))
        assert len(ex.policy.keys) <= ex.slots.num_slots and set(ex.slots.slot_of) == ex.policy.keys
    full = ex.elastic.max_slots
    assert sizes[:3] == [full] * 3 and min(sizes) < full and sizes[-1] == full
    assert req.output_token_ids == tokens
    assert (torch.stack(steps) - base).abs().max().item() <= 1e-5


def test_allocation_failure_shrinks_and_retries(checkpoint_factory):
    path = checkpoint_factory("mixtral")
    llm = LLM(path, dtype="float32", show_progress=False, residency="emulate")
    ex = llm.residency
    real_alloc, calls = ex.slots._alloc, []

    def flaky(shape, **kw):                      # the first allocation of the grow fails
        calls.append(shape[0])
        if len(calls) == 1:
            raise torch.OutOfMemoryError("emulated: CUDA out of memory")
        return real_alloc(shape, **kw)

    ex.slots._alloc = flaky
    assert ex.resize(12) == 6 and ex.slots.num_slots == 6 and ex.telemetry.oom_retries == 1
    out = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    ref = LLM(path, dtype="float32", show_progress=False, backend="torch")
    assert out.token_ids == ref.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].token_ids


def freetoken(*args):
    return subprocess.run([sys.executable, "-m", "freetoken_py", "run", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_stats_and_record_routing(tmp_path):
    trace_file = tmp_path / "routing.jsonl"
    proc = freetoken("import os\n", "--json", "--max-tokens", "6", "--temperature", "0", "--dtype", "float32",
                     "--emulate-gpu", "rtx4090", "--stats", "--record-routing", str(trace_file))
    assert proc.returncode == 0, proc.stderr
    demo = LLM(DEMO_MODEL, dtype="float32", show_progress=False, backend="torch")
    expected = demo.generate(["import os\n"], SamplingParams(max_tokens=6, temperature=0))[0]
    assert json.loads(proc.stdout)["token_ids"] == expected.token_ids
    assert "EMULATED accelerator" in proc.stderr and "prefetch%" in proc.stderr and "  all " in proc.stderr
    trace = RoutingTrace.load(trace_file)
    assert trace.top_k == 2 and len(trace.steps) == len(expected.token_ids)   # prefill + one per decode
    assert trace.steps[0][0].shape[0] > 1 and all(s[0].shape == (1, 2) for s in trace.steps[1:])


def test_cli_runs_int4_experts_on_the_tiers():
    """`freetoken run --emulate-gpu PROFILE --expert-dtype int4`: the demo model's experts in int4
    on every tier, the same greedy tokens as the cpu backend with int4 experts."""
    proc = freetoken("import os\n", "--json", "--max-tokens", "6", "--temperature", "0", "--dtype", "float32",
                     "--emulate-gpu", "rtx4090", "--expert-dtype", "int4", "--expert-cache", "off", "--stats")
    assert proc.returncode == 0, proc.stderr
    demo = LLM(DEMO_MODEL, dtype="float32", show_progress=False, backend="cpu", expert_dtype="int4",
               expert_cache="off")
    expected = demo.generate(["import os\n"], SamplingParams(max_tokens=6, temperature=0))[0]
    assert json.loads(proc.stdout)["token_ids"] == expected.token_ids
    assert "EMULATED accelerator" in proc.stderr and "  all " in proc.stderr


def test_bad_residency_options_are_one_line_errors():
    proc = freetoken("x", "--emulate-gpu", "h100")
    assert proc.returncode == 2 and "unknown hardware profile 'h100'" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "freetoken_py", "serve", "--emulate-gpu", "h100", "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown hardware profile 'h100'" in proc.stderr and "Traceback" not in proc.stderr
    proc = freetoken("x", "--gpu-experts", "--emulate-gpu", "rtx4090")
    assert proc.returncode == 2 and "not both" in proc.stderr and "Traceback" not in proc.stderr
    proc = freetoken("x", "--emulate-gpu", "--stats")     # the next flag taken as the profile: say which value is missing
    assert proc.returncode == 2 and "--emulate-gpu takes a hardware profile name, got '--stats'" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip().splitlines()[-1].startswith("freetoken: error: --emulate-gpu")
    if not torch.cuda.is_available():   # one check (EngineConfig), met by run and by serve before it listens
        proc = freetoken("x", "--gpu-experts")
        assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr
        proc = subprocess.run([sys.executable, "-m", "freetoken_py", "serve", "--gpu-experts", "--port", "0"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr
    with pytest.raises(FreetokenError, match="needs residency=cuda"):
        EngineConfig(model="m", residency="emulate", residency_profile="measured")
    with pytest.raises(FreetokenError, match="drop --backend cpu"):
        EngineConfig(model="m", residency="emulate", backend="cpu")
    with pytest.raises(FreetokenError, match="--dense-dtype"):     # the tiers' dense weights are torch's
        EngineConfig(model="m", residency="emulate", dense_dtype="int8")
    with pytest.raises(FreetokenError, match="--expert-dtype needs the cpu backend or the residency tiers"):
        EngineConfig(model="m", backend="torch", expert_dtype="int4")
    EngineConfig(model="m", residency="emulate", expert_dtype="int4")   # the tiers take quantised experts
    with pytest.raises(FreetokenError, match="residency must be off, emulate or cuda"):
        EngineConfig(model="m", residency="gpu")
    with pytest.raises(FreetokenError, match="residency policy"):
        EngineConfig(model="m", residency="emulate", residency_policy="fifo")
    # a trace path that cannot be written is said before the model loads, not after the run
    proc = freetoken("x", "--record-routing", "/nonexistent-dir/t.jsonl")
    assert proc.returncode == 2 and "cannot write into /nonexistent-dir" in proc.stderr
    assert "Traceback" not in proc.stderr and "TTFT" not in proc.stderr + proc.stdout
    with pytest.raises(FreetokenError, match="is a directory"):
        EngineConfig(model="m", record_routing=str(ROOT))


def test_measured_cpu_speed_feeds_the_cost_model(checkpoint_factory):
    # opt-in under emulation: the CPU tier's wall time on this machine moves the CPU figure away
    # from its prior, towards what this machine does, without changing outputs. The priors are set
    # out of reach of any machine (1 PB/s above, 1 kB/s below) so the direction does not depend on
    # how fast this one is (a tiny expert ran at 100 GB/s, from cache, on one CI box)
    from dataclasses import replace

    path = checkpoint_factory("mixtral")
    llm = LLM(path, dtype="float32", show_progress=False, residency="emulate", vram_budget_bytes=1,
              residency_profile="rtx4060-laptop-8g")
    ex = llm.residency
    ex.measure_live = True
    ex.cost = replace(ex.cost, cpu_expert_gbps=1e6)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert 0 < ex.cost.cpu_expert_gbps < 1e6
    ex.cost = replace(ex.cost, cpu_expert_gbps=1e-6)
    llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert ex.cost.cpu_expert_gbps > 1e-6
    ref = LLM(path, dtype="float32", show_progress=False, backend="torch")
    assert out.token_ids == ref.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].token_ids
    # the rate is observed net of the fixed cost per call (the planner adds cpu_call_s itself): a
    # fixed cost longer than any call leaves nothing to observe
    prior = 35.0
    ex.cost = replace(ex.cost, profile=replace(ex.cost.profile, cpu_call_s=10.0), cpu_expert_gbps=prior)
    llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert ex.cost.cpu_expert_gbps == prior and ex.telemetry.totals().cpu_tier_s > 0


def test_serve_with_emulated_tiers_reports_residency_in_stats():
    """`freetoken serve --emulate-gpu`: real HTTP on loopback, the same greedy completion as the
    plain torch backend, and the residency telemetry in /v1/freetoken/stats."""
    import httpx

    from server_util import ServerThread

    body = {"model": "demo", "messages": [{"role": "user", "content": "def add(a, b):"}],
            "max_tokens": 12, "temperature": 0}
    texts, stats = {}, {}
    for name, engine in {"plain": dict(backend="torch"),
                         "tiers": dict(residency="emulate", residency_profile="rtx4060-laptop-8g")}.items():
        with ServerThread(**engine) as srv:
            r = httpx.post(srv.base_url + "/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            texts[name] = r.json()["choices"][0]["message"]["content"]
            stats[name] = srv.stats()
    assert texts["tiers"] == texts["plain"]
    assert "residency" not in stats["plain"]
    res = stats["tiers"]["residency"]
    assert res["label"] == "emulated:rtx4060-laptop-8g" and res["steps"] >= 12 and res["expert_slots"] > 0
    for c in res["layers"].values():
        assert c["hit_pairs"] + c["stream_pairs"] + c["cpu_pairs"] + c["split_pairs"] == c["routed_pairs"] > 0
    total = sum(c["routed_pairs"] for c in res["layers"].values())
    assert res["hit_rate"] == pytest.approx(sum(c["hit_pairs"] for c in res["layers"].values()) / total)


@pytest.mark.parametrize("expert_dtype", ["auto", "int8"])
def test_gpu_check_script_runs_its_pipeline_under_emulation(checkpoint_factory, tmp_path, expert_dtype):
    """bench/residency_gpu.py (the check to run when a GPU is lent): under --emulate it decodes on
    the tiers, records routing, replays it in the simulator and reports both, marked not
    comparable; without a GPU and without --emulate it skips cleanly. With --expert-dtype the
    tiers hold the experts in that format (int8: a byte a weight, a quarter of fp32's)."""
    path = checkpoint_factory("qwen3_moe")
    script = str(ROOT / "bench" / "residency_gpu.py")
    proc = subprocess.run([sys.executable, script, "--emulate", "rtx4090", "--model", str(path), "--decode-tokens", "8",
                           "--threads", "1", "--expert-dtype", expert_dtype, "--out", str(tmp_path / "gpu.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    row = json.loads((tmp_path / "gpu.json").read_text())
    if expert_dtype == "int8":   # the checkpoint's expert (D = 64, I = 48): a byte a weight, an fp32 scale a row
        assert row["expert_format"] == "int8" and row["expert_bytes"] == 3 * 64 * 48 + 4 * (2 * 48 + 64)
    else:                        # as stored: fp32
        assert row["expert_format"] == "float32" and row["expert_bytes"] == 3 * 64 * 48 * 4
    assert row["mode"] == "emulate" and row["comparable"] is False and row["within_25pct"] is None
    assert row["label"] == "emulated:rtx4090" and row["expert_slots"] > 0
    assert row["dense_on"] == row["kv_on"] == "cpu" and row["simulator_decode_tok_s"] > 0
    ms = row["expert_ms_per_token"]
    assert ms["measured"] > 0 and ms["planner"] > 0 and ms["simulator"] > 0
    # the live planner and the replay share the cost model: close, though prefetch differs
    assert 0.5 <= ms["planner"] / ms["simulator"] <= 2.0
    # every routed pair is a hit, a stream, on the CPU, or cut (cpu_share holds the CPU's part of
    # the cut ones): the shares add up to between 1 - split and 1 (rounded to 3 places)
    whole = row["hit_rate"] + row["stream_share"] + row["cpu_share"]
    assert 1 - row["split_share"] - 2e-3 <= whole <= 1 + 2e-3
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and json.loads(proc.stdout)["skipped"] is True


def test_cpu_only_check_measures_the_cpu_tier_against_its_prior(checkpoint_factory, tmp_path):
    """bench/residency_gpu.py --cpu-only: no slots, every routed expert on the CPU tier (this
    machine's kernels), the predictions from the given CPU rate; the row compares them, and the
    simulator replayed with the rate the run measured lands closer than an absurd prior."""
    path = checkpoint_factory("qwen3_moe")

    def check(*extra):
        out = tmp_path / "cpu.json"
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "residency_gpu.py"), "--cpu-only", "--cpu-gbps",
                               "1000", "--model", str(path), "--decode-tokens", "6", "--threads", "1", "--out", str(out),
                               *extra], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        row = json.loads(out.read_text())
        assert row["mode"] == "cpu-only" and row["comparable"] == "cpu tier" and row["expert_slots"] == 0
        assert row["cpu_share"] == 1.0 and row["hit_rate"] == row["stream_share"] == 0.0
        assert row["cpu_gbps_prior"] == 1000 and row["profile"]["cpu_expert_gbps"] == 1000
        ms = row["expert_ms_per_token"]
        assert ms["planner"] == pytest.approx(ms["simulator"], abs=2e-3)
        return row, ms, row["corrected"]

    # bandwidths only: 1000 GB/s predicts far too little time; the measured rate predicts more, nearer the truth
    row, ms, fixed = check("--no-host-costs")
    assert row["host_costs_prior"] is None and row["cpu_tier_gbps"] <= fixed["cpu_gbps"] < 1000
    assert row["within_25pct"] is False and ms["simulator"] < fixed["simulator_ms_per_token"]
    assert abs(fixed["measured_over_simulator"] - 1) < abs(row["measured_over_simulator"] - 1)
    # by default this machine's fixed host costs are measured first and are in the prediction (with
    # these tiny experts they are most of it); the measured rate is then net of the fixed cost per call
    row, ms, fixed = check()
    host = row["host_costs_prior"]
    assert host["host_layer_ms"] > 0 and host["cpu_call_ms"] >= 0
    assert ms["simulator"] > host["host_layer_ms"] + host["cpu_call_ms"]
    assert row["cpu_tier_gbps"] <= fixed["cpu_gbps"]


def test_dense_weights_move_to_the_accelerator_and_experts_stay(checkpoint_factory):
    """`MoeTransformer.to_accelerator` (what --gpu-experts does before the KV cache is built) moves
    every dense weight and nothing else. Run with the `meta` device, so it is checked here
    without a GPU: a weight the move forgot would stay on the host and fail this. The weights
    checked are every field of LayerWeights but the two expert tensors, so a field added later
    is checked too."""
    import dataclasses

    from freetoken_py.kvcache import KVCache
    from freetoken_py.layers.linear import TorchLinear
    from freetoken_py.models.loader import load_model

    model = load_model(checkpoint_factory("qwen3_moe"), "float32", show_progress=False)
    model.to_accelerator("meta")
    w = model.weights

    def tensors(obj):
        return [obj.weight] + ([obj.bias] if obj.bias is not None else []) if isinstance(obj, TorchLinear) else [obj]

    dense = [w.final_norm, *tensors(w.lm_head)]
    for lw in w.layers:
        for f in dataclasses.fields(lw):
            if f.name not in ("w13", "w2") and getattr(lw, f.name) is not None:
                dense += tensors(getattr(lw, f.name))
    assert len(dense) > 4 * len(w.layers) and all(t.device.type == "meta" for t in dense)
    assert w.embed.device.type == "cpu"                          # looked up on the host, one row per token
    assert all(t.device.type == "cpu" for lw in w.layers for t in (lw.w13, lw.w2) if t is not None)
    assert model.device.type == "meta"
    a = model.args
    assert KVCache(a.num_layers, 2, 16, a.num_kv_heads, a.head_dim, torch.float32, model.device).k.device.type == "meta"


def test_float_expert_stacks_are_page_locked_where_they_lie(checkpoint_factory, monkeypatch):
    """--gpu-experts on a float checkpoint page-locks the model's own expert stacks (no pinned
    copy, which PyTorch would round up to a power of two): each stack registered once, the host
    banks the streamer copies from are those very tensors, unregistered when they go. The CUDA
    runtime is a stand-in (conftest.StandInCudart: a CPU build has none)."""
    import gc

    from freetoken_py.models.loader import load_model
    from freetoken_py.residency.attach import _pin_in_place

    rt = StandInCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    model = load_model(checkpoint_factory("qwen3_moe"), "float32", show_progress=False)
    layers = model.weights.layers
    moe = [i for i, lw in enumerate(layers) if lw.w13 is not None]
    before = {i: (layers[i].w13.data_ptr(), layers[i].w2.data_ptr()) for i in moe}
    host = [None] * len(layers)
    _pin_in_place(model, moe, host)
    assert all(host[i] == (layers[i].w13, layers[i].w2) for i in moe) and model.experts is None
    assert {i: (layers[i].w13.data_ptr(), layers[i].w2.data_ptr()) for i in moe} == before
    want = [(p, layers[i].w13.nbytes if p == before[i][0] else layers[i].w2.nbytes, 1)
            for i in moe for p in before[i]]
    assert rt.calls == want and rt.unregistered == []
    del model, layers, host
    gc.collect()
    assert sorted(rt.unregistered) == sorted(p for ptrs in before.values() for p in ptrs)


def test_a_float_expert_stack_viewing_a_file_is_copied_before_it_is_page_locked(checkpoint_factory, monkeypatch,
                                                                                 tmp_path):
    """A stack that views a file mapping (a checkpoint stored fused in the load dtype) is never
    registered (that hung on the H200 box): it is copied into the process's own memory, the copy
    registered and made the model's and the streamer's stack, with the same values."""
    import numpy as np

    from freetoken_py.models.loader import load_model
    from freetoken_py.residency.attach import _pin_in_place
    from freetoken_py.utils import host_memory

    rt = StandInCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    model = load_model(checkpoint_factory("qwen3_moe"), "float32", show_progress=False)
    layers = model.weights.layers
    i = next(i for i, lw in enumerate(layers) if lw.w13 is not None)
    f = tmp_path / "w13.bin"
    layers[i].w13.numpy().tofile(f)
    mapped = torch.from_numpy(np.memmap(f, np.float32, "c", shape=tuple(layers[i].w13.shape)))
    assert host_memory.file_mapped(mapped.data_ptr())
    layers[i].w13 = mapped
    host = [None] * len(layers)
    _pin_in_place(model, [i], host)
    w13 = layers[i].w13
    assert not host_memory.file_mapped(w13.data_ptr()) and torch.equal(w13, mapped) and host[i][0] is w13
    assert [c[0] for c in rt.calls] == [w13.data_ptr(), layers[i].w2.data_ptr()]


def test_out_of_memory_inside_a_forward_shrinks_the_slots_and_retries(checkpoint_factory, tmp_path):
    """An allocation failure in the middle of a forward (here raised once by a router, standing
    in for a prefill's activations on a GPU another process filled) gives back half the expert
    slots and runs the same step again: same tokens as the plain torch backend, the prefix cache
    and the request untouched, no exception; the telemetry counts the step once (the same
    routed pairs per layer and steps as a run without the failure)."""
    path = checkpoint_factory("qwen3_moe")
    ref = LLM(path, dtype="float32", show_progress=False, backend="torch")
    want = ref.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    llm = LLM(path, dtype="float32", show_progress=False, residency="emulate", vram_budget_bytes=10**12,
              record_routing=str(tmp_path / "routing.jsonl"))
    ex = llm.residency
    before = ex.slots.num_slots
    moe_layers = [i for i, lw in enumerate(llm.model.weights.layers) if lw.router is not None]
    layer = llm.model.weights.layers[moe_layers[-1]]        # the failure comes after earlier layers ran
    router, raised = layer.router, []

    def router_once_oom(x):
        if x.shape[0] > 1 and not raised:                    # the prefill's first MoE layer, once
            raised.append(True)
            raise torch.OutOfMemoryError("emulated: CUDA out of memory")
        return router(x)

    layer.router = router_once_oom
    ex.audit = []
    out = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert raised and out.token_ids == want
    assert ex.slots.num_slots <= before // 2 + ex.slots.chunk_slots and ex.telemetry.oom_retries == 1
    assert set(ex.slots.slot_of) == ex.policy.keys
    # the failed pass left no step in the routing trace: one prefill, then one step per decode
    steps = llm.routing_recorder.trace.steps
    assert len(steps) == 6 and [len(s[moe_layers[0]]) for s in steps] == [len(PROMPT)] + [1] * 5
    assert all(sorted(s) == moe_layers for s in steps)
    plain = LLM(path, dtype="float32", show_progress=False, residency="emulate", vram_budget_bytes=10**12)
    plain.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    want_tel = plain.residency.telemetry
    assert {l: c.routed_pairs for l, c in ex.telemetry.layers.items()} == \
           {l: c.routed_pairs for l, c in want_tel.layers.items()}
    assert ex.telemetry.steps == want_tel.steps == 6
    # the audit holds every routed pair once: the failed pass's entries were dropped
    assert len(ex.audit) == sum(ids.size for s in steps for ids in s.values())


def test_a_forward_that_never_fits_gives_up_and_the_slots_stay_down(checkpoint_factory):
    """Every retry gives back at least one chunk, so a pass that cannot fit ends with the error
    once no slot is left, not a loop; after a retry that fits, the free-memory probe does not
    grow the slots back into the memory the pass needs."""
    path = checkpoint_factory("qwen3_moe")
    llm = LLM(path, dtype="float32", show_progress=False, residency="emulate", vram_budget_bytes=10**12)
    ex = llm.residency
    layer = next(lw for lw in llm.model.weights.layers if lw.router is not None)
    router = layer.router

    def always_oom(x):
        if x.shape[0] > 1:
            raise torch.OutOfMemoryError("emulated: CUDA out of memory")
        return router(x)

    layer.router = always_oom
    with pytest.raises(torch.OutOfMemoryError):
        llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    sizes = [n for _, n in ex.telemetry.resizes]
    assert ex.slots.num_slots == 0 and sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)

    llm = LLM(path, dtype="float32", show_progress=False, residency="emulate", vram_budget_bytes=10**12)
    ex = llm.residency
    slot = ex.slots.slot_bytes
    ex.elastic = ElasticVram(slot, max_slots=ex.slots.num_slots, reserve_bytes=slot, grow_margin_bytes=slot)
    ex.memory_probe = lambda: 10**12                         # the probe always sees plenty free
    layer = next(lw for lw in llm.model.weights.layers if lw.router is not None)
    router, raised = layer.router, []

    def once_oom(x):
        if x.shape[0] > 1 and not raised:
            raised.append(True)
            raise torch.OutOfMemoryError("emulated: CUDA out of memory")
        return router(x)

    layer.router = once_oom
    full = ex.slots.num_slots
    llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert raised and ex.slots.num_slots < full and ex.elastic.max_slots == ex.slots.num_slots


def test_elastic_target_inside_a_chunk_resizes_once(checkpoint_factory):
    """A target that falls inside a chunk holds the whole chunk: one resize, then none, and no
    expert evicted that the shrink did not free room for."""
    path = checkpoint_factory("qwen3_moe")
    llm = LLM(path, dtype="float32", show_progress=False, residency="emulate", vram_budget_bytes=10**12)
    ex = llm.residency
    slots = ex.slots
    assert slots.chunk_slots >= 2
    slot = slots.slot_bytes
    want = slots.num_slots - slots.chunk_slots - 1          # one slot into the second-to-last chunk
    edge = min(b for b in slots.boundaries() if b > want)    # the chunk edge just above it
    ex.elastic = ElasticVram(slot, max_slots=slots.num_slots, reserve_bytes=0, grow_margin_bytes=10**12)
    ex.memory_probe = lambda: (want - ex.slots.num_slots) * slot if want < ex.slots.num_slots else 0
    llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    held = edge
    assert slots.held_after_shrink(want) == held > want
    assert ex.slots.num_slots == held and len(ex.telemetry.resizes) == 1
    assert len(ex.policy.keys) <= held and ex.policy.capacity == held


# ---- the KV/slot split: two 24-token prompts that outgrow a KV cache of 5 pages ---------------
KV_PROMPTS = [random_prompt(24, seed=s) for s in (1, 2)]
KV_PAGES = 5     # 16-token pages: both prompts fit (2 pages each), not both at 48 tokens (3 each)


def kv_engines(path, **tiered):
    """(plain torch engine, emulated-tier engine with a KV cache of KV_PAGES pages)."""
    from freetoken_py.kvcache import KVCache

    plain = LLM(path, dtype="float32", show_progress=False, backend="torch")
    a, page = plain.args, plain.config.page_size
    assert page == 16
    small = KVCache.bytes_per_page(a.num_layers, page, a.num_kv_heads, a.head_dim, torch.float32) * KV_PAGES
    llm = LLM(path, dtype="float32", show_progress=False, residency="emulate", vram_budget_bytes=10**12,
              kv_cache_bytes=small, **tiered)
    return plain, llm, small


def test_kv_cache_grows_into_expert_slot_memory_instead_of_preempting(checkpoint_factory):
    """The KV/slot split re-decided while running: two requests outgrow a small KV cache. The
    plain engine preempts one (and recomputes it); with the residency tiers the KV cache grows
    by taking memory from the expert slots, nobody is preempted, stored tokens survive the
    move, and the outputs are the plain engine's."""
    path = checkpoint_factory("qwen3_moe")
    prompts, params = KV_PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    _, llm, small = kv_engines(path)
    plain = LLM(path, dtype="float32", show_progress=False, backend="torch", kv_cache_bytes=small)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert plain.scheduler.num_preemptions > 0               # the small cache does force a preemption
    ex = llm.residency
    slots_before, pages_before = ex.slots.num_slots, llm.allocator.num_pages
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert llm.scheduler.num_preemptions == 0 and ex.telemetry.kv_grows
    assert llm.allocator.num_pages > pages_before and llm.runner.cache.num_pages == llm.allocator.num_pages
    assert ex.slots.num_slots < slots_before and ex.slots.num_slots >= slots_before // 4
    assert set(ex.slots.slot_of) == ex.policy.keys


def test_a_kv_grow_that_fails_costs_the_slots_once_and_preempts_as_before(checkpoint_factory):
    """The KV cache's reallocation fails (the memory was not there as one block): the request is
    preempted as without the tiers, the slots are given up once, and no grow is tried again for
    a while (the elastic sizing brings the slots back on a GPU)."""
    path = checkpoint_factory("qwen3_moe")
    prompts, params = KV_PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref, llm, _ = kv_engines(path)
    ex = llm.residency

    def no_memory(num_pages):
        raise torch.OutOfMemoryError("emulated: CUDA out of memory")

    llm.runner.cache.grow = no_memory
    pages = llm.allocator.num_pages
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == [o.token_ids for o in ref.generate(prompts, params)]
    assert llm.scheduler.num_preemptions > 0 and not ex.telemetry.kv_grows and llm.allocator.num_pages == pages
    assert len(ex.telemetry.resizes) == 1            # one try, then none for a while


def test_kv_cache_gives_its_growth_back_to_the_slots_and_keeps_the_prefix_cache(checkpoint_factory):
    """The KV/slot split re-decided both ways: two requests make the KV cache grow into slot
    memory; once the requests hold at most half the start-up pages for a few steps, the cache
    goes back to its start-up size and the slots get the memory. Held pages above that size move
    below it first: the running request's (its tokens are the plain engine's) and the prefix
    cache's (the next turn of that conversation starts from the moved page and gives the plain
    engine's tokens); the prefix cache gives back its least recently used pages to make room."""
    path = checkpoint_factory("qwen3_moe")
    prompts, params = KV_PROMPTS, SamplingParams(max_tokens=26, temperature=0, ignore_eos=True)
    plain, llm, _ = kv_engines(path)
    llm.kv_return_after_steps = 3
    ex = llm.residency
    base = llm.allocator.num_pages
    first = llm.generate(prompts, params)
    assert ex.telemetry.kv_grows and llm.allocator.num_pages > base and llm.scheduler.num_preemptions == 0
    assert not ex.telemetry.kv_shrinks             # while they ran they held more than half: no shrink
    slots_grown = ex.slots.num_slots

    def path_tokens(node):
        keys = []
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        return [t for k in reversed(keys) for t in k]

    convs = [list(o.prompt_token_ids) + list(o.token_ids) for o in first]
    high = [path_tokens(n) for n in llm.prefix_cache._nodes() if n.page >= base]
    assert high                                    # a cached page lives in the growth: it must move
    short = [random_prompt(6, seed=9)]
    p1 = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert llm.generate(short, p1)[0].token_ids == plain.generate(short, p1)[0].token_ids
    assert ex.telemetry.kv_shrinks and llm.allocator.num_pages == base == llm.runner.cache.num_pages
    assert ex.slots.num_slots > slots_grown and set(ex.slots.slot_of) == ex.policy.keys
    assert all(p < base for p in llm.prefix_cache.cached_pages())
    # a conversation whose page above the start-up size was moved (not evicted) still matches
    # through it; its next turn, served first, starts from it and gives the plain engine's tokens
    ns = (llm._namespace_base, None)
    kept = [i for i, c in enumerate(convs) for h in high
            if c[:len(h)] == h and llm.prefix_cache.match(ns, c).num_tokens >= len(h)]
    assert kept
    p2 = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i in kept[:1] + [j for j in range(len(convs)) if j not in kept[:1]]:
        turn = [convs[i] + random_prompt(5, seed=3)]
        got = llm.generate(turn, p2)[0]
        assert got.token_ids == plain.generate(turn, p2)[0].token_ids
        if i == kept[0]:
            assert got.num_cached_tokens >= min(len(h) for h in high if convs[i][:len(h)] == h)
    assert llm.scheduler.num_preemptions == 0


def test_a_kv_shrink_whose_copy_runs_out_of_memory_changes_nothing(checkpoint_factory):
    """Moving the pages down fails (out of memory in the copy): nothing moved, no page leaked,
    the cache keeps its grown size and the tokens are the plain engine's; the next try, as long
    after, succeeds."""
    path = checkpoint_factory("qwen3_moe")
    prompts, params = KV_PROMPTS, SamplingParams(max_tokens=26, temperature=0, ignore_eos=True)
    plain, llm, _ = kv_engines(path)
    llm.kv_return_after_steps = 3
    llm.generate(prompts, params)
    grown, ex = llm.allocator.num_pages, llm.residency
    real_copy, calls = llm.runner.cache.copy_pages, []

    def no_memory(src, dst):
        calls.append(len(src))
        raise torch.OutOfMemoryError("emulated: CUDA out of memory")

    llm.runner.cache.copy_pages = no_memory
    short = [random_prompt(6, seed=9)]
    p1 = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert llm.generate(short, p1)[0].token_ids == plain.generate(short, p1)[0].token_ids
    assert calls and not ex.telemetry.kv_shrinks and llm.allocator.num_pages == grown
    assert all(llm.allocator.refcount(p) == 0 for p in range(grown)
               if p not in llm.prefix_cache.cached_pages())          # nothing leaked
    llm.runner.cache.copy_pages = real_copy
    p2 = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert llm.generate(short, p2)[0].token_ids == plain.generate(short, p2)[0].token_ids
    assert ex.telemetry.kv_shrinks and llm.allocator.num_pages == llm.runner.cache.num_pages < grown


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script runs the real check")
def test_gpu_session_script_stops_at_once_without_a_gpu(tmp_path):
    """bench/gpu_session.sh (the one-command device check): without a CUDA GPU it says so in
    $OUT/steps.txt and exits 3 before any step; without $OUT it refuses."""
    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_session.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(tmp_path)},
                          cwd=script.parents[1])
    assert proc.returncode == 3, proc.stderr
    assert "no CUDA GPU" in (tmp_path / "steps.txt").read_text()
    assert not (tmp_path / "probe.json").exists()
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}, cwd=script.parents[1])
    assert proc.returncode != 0 and "OUT" in proc.stderr


@pytest.mark.parametrize("step_status,pytest_says,want", [(0, "6 passed", 0), (0, "6 skipped", 1),
                                                            (0, "5 passed, 1 skipped", 1), (1, "", 1)])
def test_gpu_session_script_reports_failed_steps_in_its_exit_status(tmp_path, step_status, pytest_says, want):
    """bench/gpu_session.sh runs every step under its limit and logs each status; its own exit
    status is 1 when any step failed or the cuda placement variants were skipped, 0 when all
    passed (driven by a stand-in interpreter that passes the environment check, ends every step
    with `step_status` and prints `pytest_says` as pytest's summary). Every step's output lands
    in at most eight files, all the device tool returns."""
    fake = tmp_path / "fakepy"
    fake.write_text(f'#!/bin/bash\nif [ "$1" = "-" ]; then cat > /dev/null; echo "fake GPU"; exit 0; fi\n'
                    f'echo "ran $*"; [ "$2" = pytest ] && echo "{pytest_says}"; exit {step_status}\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_session.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "OUT": str(out)}, cwd=script.parents[1])
    assert proc.returncode == want, proc.stdout + proc.stderr
    steps = (out / "steps.txt").read_text()
    for name in ("probe", "placement test", "triton experts test", "triton experts bench", "residency_gpu (ours)",
                 "residency_gpu (lru)", "residency_gpu (static)", "residency_gpu (torch experts)",
                 "residency_gpu (int4 experts)"):
        assert f"{name} rc={step_status}" in steps
    log = (out / "log.txt").read_text()
    assert "-k (placement and cuda) or cuda_registration" in log and "=== residency_gpu (int4 experts)" in log
    # the kernel bench's 16 cases (4 formats x 2 geometries x T 1, 8), sized to the session's 10 minutes
    assert "gpu_moe_kernels.py --models qwen3-30b-a3b,deepseek-v3 --tokens 1,8" in (out / "gpu_moe_kernels.json").read_text()
    assert "EMULATED" not in steps
    assert len(list(out.iterdir())) <= 8     # what the device tool brings back (it dropped the rest on the H200)


def test_gpu_session_script_dry_runs_on_the_emulated_accelerator(tmp_path):
    """FREETOKEN_GPU_SESSION_EMULATE=1: without a GPU (the stand-in's environment check says so,
    status 3) the script goes on, every step on the emulated accelerator, and says EMULATED."""
    fake = tmp_path / "fakepy"
    fake.write_text('#!/bin/bash\nif [ "$1" = "-" ]; then cat > /dev/null; echo "no CUDA GPU visible to torch"; exit 3; fi\n'
                    'echo "ran $*"; exit 0\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_session.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, cwd=script.parents[1],
                          env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "OUT": str(out),
                               "FREETOKEN_GPU_SESSION_EMULATE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps, log = (out / "steps.txt").read_text(), (out / "log.txt").read_text()
    assert steps.splitlines()[0].endswith("no figure is GPU speed") and "EMULATED" in steps.splitlines()[0]
    assert "residency_gpu (int4 experts) rc=0" in steps
    assert "-k placement and emulate" in log and "--interpret" in (out / "gpu_moe_kernels.json").read_text()
    assert len(list(out.iterdir())) <= 8


def test_an_error_between_a_layers_copies_leaves_the_slots_and_the_policy_in_step(checkpoint_factory):
    """The policy admits a layer-step's streamed experts in one call, before they are copied. An
    out-of-memory error while they are copied and run (here raised once by the first streamed
    expert's compute in the prefill, with more streamed after it) must leave no admitted expert
    without a slot and no victim holding one: the pass runs again and gives the plain engine's
    tokens, and the slots and the policy agree throughout."""
    path = checkpoint_factory("qwen3_moe")
    ref = LLM(path, dtype="float32", show_progress=False, backend="torch")
    want = ref.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    llm = LLM(path, dtype="float32", show_progress=False, residency="emulate", residency_profile="rtx5090")
    ex = llm.residency
    run, raised = ex._run, []

    def run_once_oom(out, x, rows, parts, layer, expert, tier, *rest):
        if tier == "stream" and x.shape[0] > 1 and not raised:
            raised.append(layer)
            raise torch.OutOfMemoryError("emulated: CUDA out of memory")
        return run(out, x, rows, parts, layer, expert, tier, *rest)

    ex._run = run_once_oom
    req = llm.add_request(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    while not req.finished:
        llm.step()
        assert set(ex.slots.slot_of) == ex.policy.keys
    assert raised and req.output_token_ids == want and ex.telemetry.oom_retries == 1


def test_lru_streaming_more_experts_than_it_has_slots_in_one_layer_step(checkpoint_factory):
    """FreeToken-style global LRU with two slots: a prefill layer-step streams more experts than
    that, so an expert admitted early in the step is evicted by a later one before its copy; it
    runs from staging, and the outputs are the plain engine's."""
    path = checkpoint_factory("qwen3_moe")
    ref = LLM(path, dtype="float32", show_progress=False, backend="torch")
    want = ref.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].token_ids
    slot = LLM(path, dtype="float32", show_progress=False, residency="emulate").residency.slots.slot_bytes
    llm = LLM(path, dtype="float32", show_progress=False, residency="emulate", residency_profile="rtx5090",
              residency_policy="lru", vram_budget_bytes=2 * slot)
    ex = llm.residency
    assert ex.slots.num_slots == 2
    out = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == want and set(ex.slots.slot_of) == ex.policy.keys
    assert ex.telemetry.totals().stream_pairs > 2


@pytest.mark.parametrize("ids", [[[5, 1, 7, 3]], [[2, 2, 0, 1]], [[4, 0, 6, 1], [1, 6, 3, 5], [0, 4, 2, 7]]])
def test_grouping_of_routed_pairs_matches_a_plain_scan(ids):
    """`_group` (a shortcut for one token with distinct experts, a sort otherwise): for every
    expert, the rows routed to it and their weights, in row order, keyed in expert order."""
    from freetoken_py.residency.executor import ResidencyExecutor

    ids_t = torch.tensor(ids)
    weights = torch.rand(ids_t.shape)
    one = ids[0] if len(ids) == 1 and len(set(ids[0])) == len(ids[0]) else None   # as __call__ passes it
    got = ResidencyExecutor._group(ids_t, weights, one)
    want = {}
    for t, row in enumerate(ids):
        for j, e in enumerate(row):
            want.setdefault(e, ([], []))[0].append(t)
            want[e][1].append(weights[t, j].item())
    assert list(got) == sorted(want)
    for e, (rows, wts) in want.items():
        assert got[e][0].tolist() == rows and got[e][1].tolist() == pytest.approx(wts)


def test_an_idle_engine_gives_the_kv_growth_back_at_once(checkpoint_factory):
    """`LLM.idle()` (a server with nothing to run): a KV cache grown into slot memory goes back
    to its start-up size without waiting for the next request's steps; once per idle spell. Over
    real HTTP, the server's engine thread does it `idle_after_s` after the last request, however
    often the stats are polled meanwhile."""
    import threading

    import httpx

    from server_util import ServerThread

    path = checkpoint_factory("qwen3_moe")
    params = SamplingParams(max_tokens=26, temperature=0, ignore_eos=True)
    plain, llm, small = kv_engines(path)
    base, ex = llm.allocator.num_pages, llm.residency
    slots_start = ex.slots.num_slots
    llm.generate(KV_PROMPTS, params)
    grown, slots_grown = llm.allocator.num_pages, ex.slots.num_slots
    assert grown > base and slots_grown < slots_start and llm.idle_work
    assert llm.idle() == grown - base and llm.allocator.num_pages == llm.runner.cache.num_pages == base
    # with no elastic sizing (emulated) the slots get back all the grows took, chunk rounding too
    assert ex.slots.num_slots == slots_start and ex.telemetry.kv_shrinks and not llm.idle_work
    assert llm.idle() == 0
    # the engine still serves (and grows again when it must): the plain engine's tokens
    want = [o.token_ids for o in plain.generate(KV_PROMPTS, params)]
    assert [o.token_ids for o in llm.generate(KV_PROMPTS, params)] == want

    with ServerThread(model_dir=path, residency="emulate", vram_budget_bytes=10**12, kv_cache_bytes=small) as srv:
        srv.state.engine.idle_after_s = 0.2
        outs = []

        def complete(prompt):
            r = httpx.post(srv.base_url + "/completions", timeout=120,
                           json={"model": "m", "prompt": prompt, "max_tokens": 26, "temperature": 0})
            outs.append(r.status_code)

        threads = [threading.Thread(target=complete, args=(p,)) for p in KV_PROMPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert outs == [200, 200]
        deadline = time.monotonic() + 30        # polled far more often than idle_after_s: polls
        while srv.stats()["num_pages"] != base and time.monotonic() < deadline:   # do not delay it
            time.sleep(0.01)
        stats = srv.stats()
        assert stats["residency"]["kv_grows"] >= 1 and stats["residency"]["kv_shrinks"] >= 1
        assert stats["num_pages"] == base


def test_calibrated_host_costs_are_measured_and_reach_the_prediction_not_the_decisions(checkpoint_factory):
    """residency.calibrate times the real executor's fixed host work on this machine; a profile
    carrying `host_layer_s` adds it to every layer-step's predicted time (as the simulator
    does) and changes no decision of the planner (the look-ahead's lead held fixed)."""
    from dataclasses import replace

    from freetoken_py.residency.calibrate import measure_host_costs, with_host_costs
    from freetoken_py.residency.formats import ExpertFormat
    from freetoken_py.residency.profiles import PROFILES

    host_s, call_s = measure_host_costs(16, 4, 64, 10.0, 1 << 20, torch.float32, calls=8, warmup=2)
    assert 0 < host_s < 0.5 and 0 <= call_s < 0.5
    fmt = ExpertFormat.of_float(torch.zeros(8, 64, 32), torch.zeros(8, 32, 32))   # w13 [E, 2I, D], w2 [E, D, I]
    measured = with_host_costs(PROFILES["rtx4090"], 8, fmt, top_k=2, calls=8)
    assert measured.host_layer_s > 0 and measured.cpu_call_s >= 0 and measured.pcie_gbps == PROFILES["rtx4090"].pcie_gbps
    for expert_format, group in (("int4", 32), ("fp8", 128), ("nvfp4", 16)):   # the formats a checkpoint brings
        q_s, q_call_s = measure_host_costs(16, 4, 64, 10.0, 1 << 20, calls=8, warmup=2, expert_format=expert_format,
                                           group_size=group)
        assert 0 < q_s < 0.5 and 0 <= q_call_s < 0.5, expert_format
    with pytest.raises(ValueError, match="top_k"):
        measure_host_costs(4, 8, 64, 10.0, 1 << 20)

    path = checkpoint_factory("qwen3_moe")

    def run(host_layer_s: float):
        llm = LLM(path, dtype="float32", show_progress=False, residency="emulate", residency_profile="rtx4060-laptop-8g")
        ex = llm.residency
        ex.cost = replace(ex.cost, profile=replace(ex.cost.profile, host_layer_s=host_layer_s))
        ex.fix_lead(0.0)   # (the profile's lead counts the host work: more time to copy ahead in)
        toks = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
        return toks, ex.telemetry

    (toks_a, a), (toks_b, b) = run(0.0), run(1e-3)
    assert toks_a == toks_b and a.steps == b.steps and a.layers.keys() == b.layers.keys()
    for layer, ca in a.layers.items():
        cb = b.layers[layer]
        assert (ca.hit_pairs, ca.stream_pairs, ca.cpu_pairs, ca.split_pairs, ca.pcie_bytes) == \
            (cb.hit_pairs, cb.stream_pairs, cb.cpu_pairs, cb.split_pairs, cb.pcie_bytes)
        assert cb.predicted_s - ca.predicted_s == pytest.approx(1e-3 * a.steps, rel=1e-6)


def _predict_reference(logits: torch.Tensor, k: int) -> list[int]:
    """The look-ahead rule written out: the experts some token routes to (its top-k), by most
    tokens, then most routing probability summed over the tokens."""
    counts = Counter(int(e) for row in torch.topk(logits.double(), k, dim=-1).indices.tolist() for e in row)
    mass = torch.softmax(logits.double(), dim=-1).sum(0).tolist()
    return sorted(counts, key=lambda e: (-counts[e], -mass[e], e))


def test_recorded_predictions_are_the_next_router_on_this_layers_input(checkpoint_factory, tmp_path):
    """`--record-routing` writes the look-ahead prediction of every MoE layer but the first: the
    next layer's router applied to this layer's MoE input (the plain engine's recorder computes
    it, the residency executor makes it itself). Reference: transformers' own input to
    each sparse MoE block (a forward pre-hook), through the next block's gate weights."""
    path = checkpoint_factory("qwen3_moe")
    llm = LLM(path, dtype="float32", show_progress=False, record_routing=str(tmp_path / "t.jsonl"))
    first = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0].token_ids[0]
    llm.save_routing()
    trace = RoutingTrace.load(tmp_path / "t.jsonl")
    ref = reference_model(path)
    inputs = {}
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0][0]))
             for i, layer in enumerate(ref.model.layers)]
    with torch.no_grad():
        ref(torch.tensor([PROMPT + [first]]))        # the prefill's tokens and the first decode token
    for h in hooks:
        h.remove()
    moe = trace.moe_layers
    assert trace.has_predictions and trace.prediction(0, moe[0]) is None and trace.prediction(1, moe[0]) is None
    for prev, nxt in zip(moe, moe[1:]):
        gate = ref.model.layers[nxt].mlp.gate.weight
        prefill = _predict_reference(inputs[prev][:-1] @ gate.T, trace.top_k)
        decode = _predict_reference(inputs[prev][-1:] @ gate.T, trace.top_k)
        assert trace.prediction(0, nxt) == prefill and len(prefill) > trace.top_k, nxt   # a prefill: more than k
        assert trace.prediction(1, nxt) == decode and len(decode) == trace.top_k, nxt
    # on the residency tiers the trace holds the executor's own predictions: the same ones
    tiers = LLM(path, dtype="float32", show_progress=False, residency="emulate", record_routing=str(tmp_path / "r.jsonl"))
    tiers.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert tiers.routing_recorder.trace.predicted == trace.predicted


def test_look_ahead_copies_only_what_fits_and_is_scored_like_the_trace(checkpoint_factory, tmp_path):
    """The executor scores its look-ahead on decode steps as the recorded trace gives it
    (predicted experts, and of those the routed ones), copies ahead nothing when a copy
    outlasts any idle time and some with a long lead, and the outputs do not depend on it.
    Emulated, the lead is the profile's (a layer's dense read), not this host's timing."""
    path = checkpoint_factory("qwen3_moe")

    def run(pcie_gbps=None, lead=None):
        llm = LLM(path, dtype="float32", show_progress=False, residency="emulate", residency_profile="rtx4090",
                  record_routing=str(tmp_path / "t.jsonl"))
        ex = llm.residency
        ex.measure_live = False
        assert ex.dense_layer_bytes > 0 and 0 < ex.lead(True) < 1e-3          # the profile's dense read
        if lead is not None:
            ex.fix_lead(lead)
        if pcie_gbps is not None:
            ex.cost = CostModel(ex.cost.profile, ex.cost.expert_bytes, ex.cost.expert_flops_per_token,
                                pcie_gbps=pcie_gbps)
        out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        return out[0].token_ids, ex, llm.routing_recorder.trace

    tokens, ex, trace = run(lead=1.0)          # a second between layers: every prediction fits
    predicted = correct = 0
    for s, step in enumerate(trace.steps):
        for layer, ids in step.items():
            guess = trace.prediction(s, layer)
            if guess is not None and ids.shape[0] == 1:
                predicted += len(guess)
                correct += len(set(guess) & set(ids.ravel().tolist()))
    totals = ex.telemetry.totals()
    assert (totals.prefetch_predicted, totals.prefetch_correct) == (predicted, correct) and predicted > 0
    assert totals.prefetch_copies > 0
    slow_tokens, slow, _ = run(pcie_gbps=1e-6)       # a copy takes ~forever: never worth it ahead
    assert slow.telemetry.totals().prefetch_copies == 0 and slow.telemetry.totals().prefetch_predicted > 0
    assert slow_tokens == tokens


@pytest.mark.parametrize("policy_name,budget,leads", [
    ("ours", 0, None), ("ours", 0, (2e-5, 2e-5)), ("ours", 0, (1.0, 1.0)),
    ("ours", 0, (0.0, 1.0)),            # copies ahead in the prefill step only
    ("lru", 3, (1.0, 1.0)),             # three slots: weaker guesses evict better ones (the stop)
])
def test_the_simulator_replays_the_executors_decisions_exactly(checkpoint_factory, tmp_path, policy_name, budget,
                                                               leads):
    """A run on the emulated tiers, recorded, and its trace replayed by `simulate` with the same
    policy, cost model and leads (decode, prefill): the same totals of hits, copies, CPU and cut
    pairs, look-ahead copies and prefetch scores (the simulator's figures are the executor's
    decisions)."""
    from freetoken_py.residency.attach import make_policy
    from freetoken_py.residency.simulate import simulate

    path = checkpoint_factory("qwen3_moe")
    extra = {}
    if budget:     # slots for `budget` experts
        probe = LLM(path, dtype="float32", show_progress=False, residency="emulate")
        extra["vram_budget_bytes"] = budget * probe.residency.cost.expert_bytes
    llm = LLM(path, dtype="float32", show_progress=False, residency="emulate", residency_profile="rtx4090",
              residency_policy=policy_name, record_routing=str(tmp_path / "t.jsonl"), **extra)
    ex = llm.residency
    assert not budget or ex.slots.num_slots == budget
    ex.fix_lead(*(leads or (None,)))
    llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    trace = llm.routing_recorder.trace
    policy = make_policy(policy_name, trace.moe_layers, trace.num_experts, ex.slots.num_slots, ex.cost.profile)
    r = simulate(trace, policy, ex.cost, 0, prefetch=True, lead_s=ex.lead(True), prefill_lead_s=ex.lead(False))
    t = ex.telemetry.totals()
    assert (r.routed_pairs, r.hit_pairs, r.stream_pairs, r.cpu_pairs, r.split_pairs) == \
        (t.routed_pairs, t.hit_pairs, t.stream_pairs, t.cpu_pairs, t.split_pairs)
    assert (r.prefetch_copies, r.prefetch_predicted, r.prefetch_correct) == \
        (t.prefetch_copies, t.prefetch_predicted, t.prefetch_correct)
    # bytes: a cut expert is cut at whole columns in the run, at the planner's fraction in the replay
    assert r.pcie_bytes == pytest.approx(t.pcie_bytes, rel=0.01) and t.hit_pairs > 0 and t.cpu_pairs > 0
    if leads and max(leads) == 1.0:
        assert t.prefetch_copies > 0
    if leads == (0.0, 1.0):       # none at decode: every copy ahead was in the prefill step
        decode_only = simulate(trace, make_policy(policy_name, trace.moe_layers, trace.num_experts,
                                                  ex.slots.num_slots, ex.cost.profile),
                               ex.cost, 0, prefetch=True, lead_s=0.0, prefill_lead_s=0.0)
        assert decode_only.prefetch_copies == 0 and t.prefetch_copies > 0
    if policy_name == "lru":
        assert r.prefetch_stops > 0


def test_requests_decoding_together_are_decode_steps_in_the_run_the_trace_and_the_replay(checkpoint_factory,
                                                                                         tmp_path):
    """Two requests decoding in one pass (a batch of two one-token rows) make a decode step: the
    executor scores its look-ahead there and gives it the decode lead, the trace file says so,
    and the simulator's replay of that file counts both tokens as decode tokens and makes the
    same copies ahead (decode lead long, prefill lead zero: the kind of step decides them)."""
    from freetoken_py.residency.attach import make_policy
    from freetoken_py.residency.simulate import simulate

    path = checkpoint_factory("qwen3_moe")
    out = tmp_path / "t.jsonl"
    llm = LLM(path, dtype="float32", show_progress=False, residency="emulate", residency_profile="rtx4090",
              record_routing=str(out))
    ex = llm.residency
    ex.fix_lead(1.0, 0.0)
    llm.generate([PROMPT, random_prompt(11, seed=9)], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    llm.save_routing()
    trace = RoutingTrace.load(out)
    kinds = [(trace.tokens(s), trace.is_decode(s)) for s in range(len(trace.steps))]
    assert (2, True) in kinds and all(d == (n == 2) for n, d in kinds if n > 1)   # prefill passes: 30 rows
    predicted = correct = 0
    for s, step in enumerate(trace.steps):
        for layer, ids in step.items():
            guess = trace.prediction(s, layer)
            if guess is not None and trace.is_decode(s):
                predicted += len(guess)
                correct += len(set(guess) & set(ids.ravel().tolist()))
    t = ex.telemetry.totals()
    assert (t.prefetch_predicted, t.prefetch_correct) == (predicted, correct) and predicted > 0
    policy = make_policy("ours", trace.moe_layers, trace.num_experts, ex.slots.num_slots, ex.cost.profile)
    r = simulate(trace, policy, ex.cost, 0, prefetch=True, lead_s=1.0, prefill_lead_s=0.0)
    assert r.decode_tokens == sum(n for n, d in kinds if d) == 2 * 5       # the first token came with the prefill
    assert (r.prefetch_predicted, r.prefetch_correct, r.prefetch_copies, r.hit_pairs) == \
        (t.prefetch_predicted, t.prefetch_correct, t.prefetch_copies, t.hit_pairs) and t.prefetch_copies > 0


def test_a_prompts_last_token_computed_alone_is_not_a_decode_step(checkpoint_factory, tmp_path):
    """A prompt whose other tokens come from the prefix cache computes its last token alone: a
    pass of one token that generates nothing yet, so not a decode step (the trace says
    `"decode": false`); the decode steps around it stay decode steps."""
    path = checkpoint_factory("qwen3_moe")
    out = tmp_path / "t.jsonl"
    llm = LLM(path, dtype="float32", show_progress=False, residency="emulate", record_routing=str(out))
    prompt, params = random_prompt(17, seed=3), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate([prompt], params)
    assert llm.generate([prompt], params)[0].num_cached_tokens == 16        # one full page reused
    llm.save_routing()
    trace = RoutingTrace.load(out)
    assert [(trace.tokens(s), trace.is_decode(s)) for s in range(len(trace.steps))] == \
        [(17, False), (1, True), (1, False), (1, True)]
    assert out.read_text().count('"decode": false') == 1


def test_the_trace_holds_only_the_predictions_the_executor_made(checkpoint_factory, tmp_path):
    """With no slots the executor predicts nothing (nothing to copy into): the recorded trace
    then carries no predictions for the simulator to replay."""
    path = checkpoint_factory("qwen3_moe")
    llm = LLM(path, dtype="float32", show_progress=False, residency="emulate", vram_budget_bytes=1,
              record_routing=str(tmp_path / "t.jsonl"))
    llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    trace = llm.routing_recorder.trace
    assert llm.residency.slots.num_slots == 0 and len(trace.steps) == 3 and not trace.has_predictions


def test_the_lead_is_measured_per_kind_of_step_and_seeded_by_the_first_gap(checkpoint_factory):
    """Without a fixed or profile lead the executor measures the time between two layers' calls
    on the host, decode steps and prefill apart; the first gap seeds the EMA. The CUDA pairs are
    read back only once both events have happened (stand-in events here)."""
    path = checkpoint_factory("qwen3_moe")
    llm = LLM(path, dtype="float32", show_progress=False, residency="emulate")
    ex = llm.residency
    ex.dense_layer_bytes = None                 # measure, as on a host without a profile lead
    llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert ex._lead_seen == {True: True, False: True} and ex.lead(True) > 0 and ex.lead(False) > 0
    ex._lead_seen, ex._lead = {True: False, False: False}, {True: 0.0, False: 0.0}
    ex._add_lead(True, 0.5)
    ex._add_lead(True, 1.0)
    assert ex.lead(True) == pytest.approx(0.6) and ex.lead(False) == 0.0

    class Event:        # what flush_timing asks of a CUDA event
        def __init__(self, t, done=True):
            self.t, self.done = t, done

        def query(self):
            return self.done

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    ex._lead_pending = [(Event(0.0), Event(0.25), False), (Event(1.0), Event(2.0, done=False), False)]
    ex.flush_timing(wait=False)
    assert ex.lead(False) == pytest.approx(0.25) and len(ex._lead_pending) == 1
    ex.fix_lead(3.0, 4.0)
    assert (ex.lead(True), ex.lead(False)) == (3.0, 4.0)
    ex.fix_lead(None)
    assert ex.lead(False) == pytest.approx(0.25)


def test_a_copy_waits_for_compute_only_into_a_slot_this_calls_compute_reads(checkpoint_factory):
    """The streamer's bookkeeping for the copy stream (the wait itself is CUDA's): after a routing
    read that waited for the GPU, a copy into a slot no queued compute reads starts at once; one
    into a slot a queued hit reads (its expert just evicted), or any copy when the reads are
    unknown (no sync, a resize), waits. In a run, every slot a call computes from is marked."""
    from freetoken_py.residency.formats import ExpertFormat
    from freetoken_py.residency.slots import SlotCache
    from freetoken_py.residency.streamer import Streamer

    host13, host2 = [torch.randn(4, 8, 16)], [torch.randn(4, 16, 4)]
    fmt = ExpertFormat.of_float(host13[0], host2[0])
    slots = SlotCache(2, fmt.specs, "cpu")     # free slots handed out 0, then 1
    st = Streamer(slots, [(host13[0], host2[0])], fmt)
    st.new_call(synced=True)
    st.to_slot(0, 0)                               # slot 0, free: no compute reads it
    assert slots.slot_of[(0, 0)] == 0 and st.slot_copies == [1, 0]
    st.mark_read((0, 0))                           # a hit of this call computes from slot 0
    slots.evict((0, 0))
    st.to_slot(0, 1)                               # slot 0 again, just freed: after that compute
    assert slots.slot_of[(0, 1)] == 0 and st.slot_copies == [1, 1]
    st.to_slot(0, 2)                               # slot 1, never read this call: at once
    assert slots.slot_of[(0, 2)] == 1 and st.slot_copies == [2, 1]
    st.new_call(synced=False)                      # reads unknown: every copy waits
    slots.evict((0, 2))
    st.to_slot(0, 3)
    assert st.slot_copies == [2, 2]
    assert torch.equal(slots.get((0, 3))[0], host13[0][3])    # the copies themselves are plain

    path = checkpoint_factory("qwen3_moe")
    # two slots, LRU: this layer's experts are the most recent, so the look-ahead's admissions
    # evict them, and its copies land in slots this call has just computed from
    probe = LLM(path, dtype="float32", show_progress=False, residency="emulate")
    llm = LLM(path, dtype="float32", show_progress=False, residency="emulate", residency_profile="rtx4060-laptop-8g",
              residency_policy="lru", vram_budget_bytes=2 * probe.residency.cost.expert_bytes)
    ex = llm.residency
    ex.audit = []
    st = ex.streamer
    read_now: set = set()            # slots this call's compute has read so far (from the compute itself)
    log = {"copies_into_read": 0, "waited": 0}
    new_call, mark_read, to_slot = st.new_call, st.mark_read, st.to_slot

    def on_new_call(synced):         # as on a GPU, where the routing read (ids.cpu()) syncs
        read_now.clear()
        new_call(True)

    def on_mark_read(key):
        mark_read(key)

    run = ex._run
    slot_ptrs = {ex.slots.views(i)[0].data_ptr(): i for i in range(ex.slots.num_slots)}

    def on_run(out, x, group, parts, *rest):   # what compute reads, told apart from the marks
        if parts[0].data_ptr() in slot_ptrs:
            read_now.add(slot_ptrs[parts[0].data_ptr()])
        return run(out, x, group, parts, *rest)

    ex._run = on_run

    def on_to_slot(layer, expert, ahead=False):
        before = list(st.slot_copies)
        out = to_slot(layer, expert, ahead)
        if ex.slots.slot_of[(layer, expert)] in read_now:      # this call computed from it before
            log["copies_into_read"] += 1
            log["waited"] += st.slot_copies[1] - before[1]
        return out

    st.new_call, st.mark_read, st.to_slot = on_new_call, on_mark_read, on_to_slot
    seen = []

    def spy(layer, x, ids, weights, call=ex.__call__):
        out = call(layer, x, ids, weights)
        # the experts this call computed from a slot: its hits and the streamed experts it kept
        read = {e for s, l, _, e, tier in ex.audit if (s, l) == (ex.step, layer) and tier in ("hit", "stream")}
        kept = {ex.slots.slot_of[(layer, e)] for e in read if (layer, e) in ex.slots.slot_of}
        seen.append((kept, set(st.reading)))
        return out

    llm.model.experts = spy
    ex.fix_lead(1.0)                 # look-ahead copies too (they may evict this call's hits)
    llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(seen) > 6 and any(kept for kept, _ in seen)
    for kept, reading in seen:
        assert kept <= reading
    assert log["waited"] == log["copies_into_read"] > 0  # every copy into a slot read this call waited
    assert st.slot_copies[0] > 0                         # and the others did not
    assert ex.slots.num_slots == 2
    ex.resize(ex.slots.num_slots // 2)         # slots move on the compute stream: reads unknown again
    assert ex.streamer.reading is None
