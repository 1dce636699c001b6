"""The GPU check for the expert residency tiers: real VRAM slots, PCIe streaming and the CPU tier
on a model whose experts do not fit the VRAM budget given, measured next to the simulator.

    python bench/residency_gpu.py [--budget-share 0.25] [--decode-tokens 48] [--threads 0] [--out FILE]
    python bench/residency_gpu.py --emulate rtx4090 [--model DIR]     # the same pipeline, no GPU

On a CUDA machine: the ~0.5B bf16 qwen3_moe (or --model), residency="cuda" with this machine's
measured profile (`freetoken probe`, cached), expert slots for --budget-share of the experts.
It decodes --decode-tokens greedy tokens and records the routing, then reports:

- decode tokens/s, next to the simulator's prediction of it (its replay of the recorded trace,
  policy "ours", same slots and profile, the look-ahead prefetch replayed from the trace's
  predictions with the leads the run ended with (its EMA's last values: close to, not exactly,
  what each step used), plus the dense weights read from VRAM at the
  profile's rate, as `simulate` counts them), with `within_25pct_tok_s`; the look-ahead copies
  per token, run and replay (`prefetch_copies_per_token`);
- the experts' wall time per decoded token (the executor's calls, the accelerator's part waited
  for), next to the planner's prediction for the same layer-steps and the simulator's replay,
  with `within_25pct` (the expert part alone);
- counted by wrapping torch's dispatcher and the Triton launches (residency/transfers.counting)
  over the decode layer-steps of a pass of their own (`counted_tokens` tokens after the measured
  run: counting costs host time): `host_reads_per_token`, `launches_per_token` (of them
  `triton_launches_per_token`), `pageable_copies_per_token`, `pinned_copies_per_token`; from the
  measured run the executor's host time per MoE layer-step less its wait in the routing read
  (`host_us_per_layer`, `read_wait_us_per_layer`); the fixed costs the simulator used
  (`simulator_fixed_us`).

`--policy ours|lru|static` picks the cache policy (issue 40's comparison where the model does
not fit).

With residency="cuda" the dense weights, the activations and the KV cache live in VRAM; the
routed experts live in pinned host banks, the slot cache and the CPU tier. The simulator models
bandwidth only: per-token launch and Python costs are not in it, so on a small model the
tokens/s comparison shows how large those are. Threads default to every core (what the probe
measured the CPU tier with).

Without CUDA and without --emulate it prints {"skipped": true, ...} and exits 0. Under --emulate
the accelerator tier runs on CPU tensors with the named profile's times: the pipeline is
exercised, but measured and predicted describe different machines (`comparable: false`).

`--cpu-only` is the half of the check a machine without a GPU can make: no expert slots, so every
routed expert runs on the CPU tier (real numba kernels, this machine), and the cost model's CPU
side is this machine's own probe figure (`cpu_expert_<dtype>`, or `--cpu-gbps`) with this
machine's fixed host costs measured just before the run (`residency.calibrate`: `host_layer_s`
per layer-step, `cpu_call_s` per CPU-tier call; `--no-host-costs` leaves them out, bandwidths
only). The row then compares the experts' measured time per token with the planner's and the
simulator's predictions from that prior (`within_25pct`, `comparable: "cpu tier"`), and again
with the simulator given the CPU tier's rate measured in the run (`corrected`: what the
executor's live EMA converges to), and shows the executor's host time outside the tier measured
in the run, next to the calibrated prior.
"""
from __future__ import annotations

import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402


def simulated_expert_s(trace_path: Path, ex, first_decode_step: int) -> tuple[float, int, int]:
    """The simulator's replay of the recorded trace with the executor's profile and slot count,
    and its look-ahead prefetch (the trace's predictions, with the lead the run measured):
    (expert seconds over the decode steps from `first_decode_step`, decode steps counted, the
    look-ahead copies over those steps)."""
    from freetoken_py.residency.adaptive import AdaptivePolicy
    from freetoken_py.residency.simulate import simulate
    from freetoken_py.residency.stats import RoutingTrace

    trace = RoutingTrace.load(trace_path)
    policy = AdaptivePolicy(trace.moe_layers, trace.num_experts, ex.slots.num_slots)
    head = RoutingTrace(trace.num_layers, trace.num_experts, trace.top_k, trace.source)
    head.steps, head.predicted, head.decode = trace.steps[:first_decode_step], trace.predicted, trace.decode
    # the leads the run ended with (it measured them as it went: an EMA, seeded by its first gap)
    leads = {"lead_s": ex.lead(True), "prefill_lead_s": ex.lead(False)}
    simulate(head, policy, ex.cost, 0, prefetch=True, **leads)       # the warm-up steps, as in the run
    tail = RoutingTrace(trace.num_layers, trace.num_experts, trace.top_k, trace.source)
    # empty steps in front keep the step numbers absolute (the policy's recency and decay use them)
    tail.steps, tail.predicted = [{}] * first_decode_step + trace.steps[first_decode_step:], trace.predicted
    tail.decode = trace.decode
    r = simulate(tail, policy, ex.cost, 0, prefetch=True, **leads)   # dense bytes 0: expert time only
    return r.decode_seconds, r.decode_tokens, r.prefetch_copies


def main(argv: list[str] | None = None) -> int:
    ap = common.bench_args(__doc__)
    ap.add_argument("--emulate", metavar="PROFILE", help="no GPU: run the pipeline on the emulated accelerator")
    ap.add_argument("--model", type=Path, help="checkpoint (default: the ~0.5B bench qwen3_moe, bf16)")
    ap.add_argument("--budget-share", type=float, default=0.25, help="expert slots for this share of the experts")
    ap.add_argument("--out", type=Path, help="also write the JSON line here")
    ap.add_argument("--cpu-only", action="store_true",
                    help="no GPU needed: every expert on the CPU tier, the cost model's CPU side from this "
                         "machine's probe, measured next to the predictions")
    ap.add_argument("--cpu-gbps", type=float, help="with --cpu-only: the CPU expert rate to predict with "
                                                   "(default: this machine's probe figure)")
    ap.add_argument("--torch-experts", action="store_true",
                    help="the accelerator's experts through torch, one expert at a time (default on a GPU: the "
                         "Triton kernels, kernels/gpu_moe.py, for decode-sized steps)")
    ap.add_argument("--policy", default="ours", choices=("ours", "lru", "static"),
                    help="the cache policy (ours: AdaptivePolicy; lru; static: llama.cpp's --n-cpu-moe)")
    ap.add_argument("--expert-dtype", default="auto", choices=("auto", "bf16", "fp32", "int8", "int4"),
                    help="the experts' format in the tiers (auto: the checkpoint's; int8 / int4 quantised on load, "
                         "through the expert store)")
    ap.add_argument("--no-host-costs", action="store_true",
                    help="with --cpu-only: predict without this machine's measured fixed host costs per layer-step "
                         "(residency.calibrate), bandwidths only")
    ap.set_defaults(decode_tokens=48, prompt_len=64, threads=0)
    args = ap.parse_args(argv)
    if args.cpu_gbps is not None and args.cpu_gbps <= 0:
        ap.error("--cpu-gbps must be a positive rate in GB/s")
    import torch

    if args.cpu_only:
        args.emulate = args.emulate or "rtx4090"          # (no slot: the accelerator's figures go unused)
        args.budget_share = 0.0
    if not args.emulate and not torch.cuda.is_available():
        return common.emit({"bench": "residency_gpu", "skipped": True,
                      "reason": "no CUDA GPU here; pass --emulate PROFILE to run the pipeline on CPU tensors"}, args.out)
    if args.model:                                          # no bench checkpoint to build
        from freetoken_py.kernels import configure_threads

        configure_threads(args.threads or None)
        model_dir = args.model
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, 1 << 30, (args.prompt_len,), generator=g).tolist()
    else:
        args.threads = args.threads or None                 # 0: every core, as the measured profile
        model_dir, prompt = common.setup(args)
    from freetoken_py.llm import LLM
    from freetoken_py.residency.attach import dense_weight_bytes

    mode = "emulate" if args.emulate else "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = Path(tmp) / "routing.jsonl"
        probe = LLM(model_dir, max_model_len=1024, show_progress=False, backend="torch")
        w13 = [lw.w13 for lw in probe.model.weights.layers if lw.w13 is not None]
        expert_bytes = sum(w.numel() * w.element_size() * 3 // 2 for w in w13)   # gate+up and down
        if args.expert_dtype != "auto":   # the bytes of the format the tiers will hold them in
            from freetoken_py.kernels import ExpertBank

            inter, hidden = w13[0].shape[1] // 2, w13[0].shape[2]
            one = ExpertBank.empty(args.expert_dtype, 1, inter, hidden).bytes_per_expert
            expert_bytes = one * sum(w.shape[0] for w in w13)
        dtype = str(probe.model.dtype).removeprefix("torch.")
        prompt = [t % probe.args.vocab_size for t in prompt]
        del probe
        llm = LLM(model_dir, max_model_len=1024, show_progress=False, enable_prefix_cache=False, dtype=dtype,
                  expert_dtype=args.expert_dtype, residency=mode, residency_profile=args.emulate or "measured",
                  residency_policy=args.policy,
                  vram_budget_bytes=max(1, int(args.budget_share * expert_bytes)), record_routing=str(trace_path))
        ex = llm.residency
        if args.torch_experts:
            ex.fused_accel = False
        prior_cpu_gbps = host_prior = None
        if args.cpu_only:
            prior_cpu_gbps = args.cpu_gbps or _probe_cpu_gbps(dtype if args.expert_dtype == "auto" else args.expert_dtype)
            ex.cost = _with_cpu(ex.cost, prior_cpu_gbps)
            if not args.no_host_costs:   # this machine's fixed host costs, measured before the run
                from freetoken_py.residency.calibrate import with_host_costs

                num_experts = next(h[0].shape[0] for h in ex.host if h is not None)
                ex.cost = replace(ex.cost, profile=with_host_costs(ex.cost.profile, num_experts, ex.fmt,
                                                                   llm.args.top_k, ex.cpu_banks is not None))
                p = ex.cost.profile
                host_prior = {"host_layer_ms": round(p.host_layer_s * 1e3, 4), "cpu_call_ms": round(p.cpu_call_s * 1e3, 4)}
            ex.telemetry.label = "emulated:cpu-only (the CPU tier is this machine's)"
        common.residency_decode(llm, ex, prompt, 4)          # warm: kernels, slots, allocator
        copies_before = list(ex.streamer.slot_copies)
        with _counted(llm) as timed:         # the executor's host time (and its wait in the routing read)
            run = common.residency_decode(llm, ex, prompt, args.decode_tokens)
        slot_copies = [n - b for n, b in zip(ex.streamer.slot_copies, copies_before)]   # the measured run's
        # the executor's figures as the measured run left them (the counted pass below goes on
        # updating the lead and, with live measuring, the cost model)
        cost_run, slots_run = ex.cost, ex.slots.num_slots
        lead_run = {"decode": round(ex.lead(True) * 1e3, 4), "prefill": round(ex.lead(False) * 1e3, 4)}
        llm.save_routing()
        sim_s, sim_tokens, sim_prefetch = simulated_expert_s(trace_path, ex, run["first_decode_step"])
        corrected = None
        if args.cpu_only and run["cpu_tier_s"]:   # the simulator with the CPU tier's measured rate
            # (net of the fixed cost per call the cost model already charges: every MoE layer-step
            # of a decode step calls the CPU tier once here)
            calls = run["tokens"] * sum(1 for h in ex.host if h is not None)
            tier_net_s = run["cpu_tier_s"] - calls * ex.cost.profile.cpu_call_s
            if tier_net_s <= 0:
                tier_net_s = run["cpu_tier_s"]
            measured_gbps = run["cpu_tier_bytes"] / tier_net_s / 1e9
            prior_cost, ex.cost = ex.cost, _with_cpu(ex.cost, measured_gbps)
            fixed_s, fixed_tokens, _ = simulated_expert_s(trace_path, ex, run["first_decode_step"])
            ex.cost = prior_cost
            corrected = {"cpu_gbps": round(measured_gbps, 2),
                         "simulator_ms_per_token": round(fixed_s / max(1, fixed_tokens) * 1e3, 3),
                         # the executor's host work outside the CPU tier (routing, planning,
                         # grouping, bookkeeping), measured in the run (the prior: host_layer_ms)
                         "host_outside_tier_ms_per_token": round((run["measured_s"] - run["cpu_tier_s"])
                                                                 / run["tokens"] * 1e3, 3)}
        # the reads, copies and launches, counted in a pass of their own, last (counting wraps
        # every torch operation in Python: it would inflate the measured run's host time)
        with _counted(llm, count=True) as counted:
            common.residency_decode(llm, ex, prompt, COUNTED_TOKENS)
    n = run["tokens"]
    measured, predicted = run["measured_s"] / n, run["predicted_s"] / n
    simulated = sim_s / max(1, sim_tokens)
    dense_s = dense_weight_bytes(llm.model) / (cost_run.profile.vram_gbps * 1e9)   # the simulator's dense term
    sim_tok_s = 1.0 / (simulated + dense_s) if simulated + dense_s > 0 else None
    tok_s = n / run["seconds"]
    routed = max(1, run["routed_pairs"])
    checked = mode == "cuda" or args.cpu_only      # measured and predicted describe this machine
    if corrected is not None:
        corrected["measured_over_simulator"] = round(measured * 1e3 / corrected["simulator_ms_per_token"], 3)
        corrected["within_25pct"] = abs(corrected["measured_over_simulator"] - 1) <= 0.25
    row = {
        "bench": "residency_gpu", "skipped": False, "mode": "cpu-only" if args.cpu_only else mode,
        "label": ex.telemetry.label,
        "comparable": "cpu tier" if args.cpu_only else mode == "cuda",
        "device": torch.cuda.get_device_name(0) if mode == "cuda" else f"EMULATED {args.emulate} (CPU tensors)",
        "model": str(model_dir), "expert_slots": slots_run, "budget_share": args.budget_share,
        "profile": {k: getattr(cost_run.profile, k) for k in ("pcie_gbps", "vram_gbps", "cpu_expert_gbps")},
        "dense_on": str(llm.model.device), "kv_on": str(llm.runner.cache.k.device),
        "accel_experts": "triton" if ex.fused_accel else "torch",
        "expert_format": ex.fmt.name if ex.fmt.name != "float" else str(ex.fmt.dtype).removeprefix("torch."),
        "expert_mb": round(ex.fmt.expert_bytes / 1e6, 3), "expert_bytes": ex.fmt.expert_bytes,
        "decode_tok_s": round(tok_s, 2),
        "simulator_decode_tok_s": round(sim_tok_s, 2) if sim_tok_s else None,
        "within_25pct_tok_s": bool(sim_tok_s and abs(tok_s / sim_tok_s - 1) <= 0.25) if mode == "cuda" else None,
        "expert_ms_per_token": {"measured": round(measured * 1e3, 3), "planner": round(predicted * 1e3, 3),
                                "simulator": round(simulated * 1e3, 3)},
        "measured_over_simulator": round(measured / simulated, 3) if simulated else None,
        "within_25pct": bool(simulated and abs(measured / simulated - 1) <= 0.25) if checked else None,
        "cpu_gbps_prior": round(prior_cpu_gbps, 2) if prior_cpu_gbps else None, "host_costs_prior": host_prior,
        "corrected": corrected,
        "hit_rate": round(run["hit_pairs"] / routed, 3), "stream_share": round(run["stream_pairs"] / routed, 3),
        "cpu_share": round((run["cpu_pairs"] + run["split_cpu_share"]) / routed, 3),
        "split_share": round(run["split_pairs"] / routed, 3),
        "pcie_mb_per_token": round(run["pcie_bytes"] / n / 1e6, 2),
        "prefetch_copies_per_token": {"run": round(run["prefetch_copies"] / n, 3),
                                      "simulator": round(sim_prefetch / max(1, sim_tokens), 3)},
        "prefetch_accuracy": (round(run["prefetch_correct"] / run["prefetch_predicted"], 3)
                              if run["prefetch_predicted"] else None),
        "lead_ms": lead_run,
        # copies into slots in the measured run: started at once (no queued compute reads the slot)
        # or after the compute queued before them (on a GPU; emulated, no sync: every one after)
        "slot_copies": {"at_once": slot_copies[0], "after_compute": slot_copies[1]},
        "cpu_tier_gbps": round(run["cpu_tier_bytes"] / run["cpu_tier_s"] / 1e9, 2) if run["cpu_tier_s"] else None,
        "policy": args.policy,
        # counted in a pass of their own (transfers.counting); host time from the measured run
        **_per_token(timed, counted),
        # the fixed costs the simulator's prediction used (planner.CostModel; profiles.H200_SEEDS
        # until the probe measures them)
        "simulator_fixed_us": {"gpu_step": round(cost_run.gpu_step_s * 1e6, 1),
                               "host_step": round(cost_run.host_step_s * 1e6, 1),
                               "host_layer": round(cost_run.profile.host_layer_s * 1e6, 1)},
    }
    return common.emit(row, args.out)


COUNTED_TOKENS = 4      # decode tokens of the counted pass


class _counted:
    """Around a decode run: per decode layer-step (one token), the executor call's wall time and
    wait in the routing read and, with `count`, the reads, copies and launches
    (`transfers.counting`), observed through a wrapper of the model's expert executor, which runs
    unchanged; the prompt's layer-steps are left out."""

    def __init__(self, llm, count: bool = False):
        from freetoken_py.residency.transfers import Counts

        self.llm, self.count, self.calls, self.tokens, self.wall_s, self.counts = llm, count, 0, 0, 0.0, Counts()

    def __enter__(self):
        import contextlib
        import time

        from freetoken_py.residency import transfers

        inner = self.llm.model.experts

        def observed(layer, x, ids, weights):
            with transfers.counting() if self.count else contextlib.nullcontext():
                before, t0 = transfers.COUNTS.snapshot(), time.perf_counter()
                out = inner(layer, x, ids, weights)
                wall, d = time.perf_counter() - t0, transfers.COUNTS.snapshot() - before
            if x.shape[0] == 1:
                self.wall_s += wall
                self.calls += 1
                self.tokens += layer == self.first
                for f in d.__dataclass_fields__:
                    setattr(self.counts, f, getattr(self.counts, f) + getattr(d, f))
            return out

        self.first = next(i for i, h in enumerate(self.llm.residency.host) if h is not None)
        self.inner, self.llm.model.experts = inner, observed
        return self

    def __exit__(self, *exc):
        self.llm.model.experts = self.inner


def _per_token(timed: _counted, counted: _counted) -> dict:
    d, tokens = counted.counts, max(1, counted.tokens)
    t, layers = timed.counts, max(1, timed.calls)
    return {"host_reads_per_token": round(d.d2h_reads / tokens, 2), "launches_per_token": round(d.launches / tokens, 2),
            "triton_launches_per_token": round(d.triton_launches / tokens, 2),
            "pageable_copies_per_token": round(d.h2d_pageable / tokens, 2),
            "pinned_copies_per_token": round(d.h2d_pinned / tokens, 2),
            "moe_layer_steps_per_token": round(counted.calls / tokens, 2),
            "counted_tokens": counted.tokens,
            # the executor's time per MoE layer-step on the host in the measured run, less its wait
            # in the routing read (the GPU finishing the layer's dense part), and that wait
            "host_us_per_layer": round((timed.wall_s - t.d2h_wait_s) / layers * 1e6, 1),
            "read_wait_us_per_layer": round(t.d2h_wait_s / layers * 1e6, 1)}


def _probe_cpu_gbps(dtype: str) -> float:
    """This machine's CPU expert kernel rate for `dtype` from `freetoken probe` (cached)."""
    from freetoken_py.hw import get_profile as machine_profile

    hw = machine_profile(progress=False)
    gbps = hw.gbps(f"cpu_expert_{ {'bfloat16': 'bf16', 'float32': 'fp32'}.get(dtype, dtype)}")
    if gbps is None:
        raise SystemExit(f"the probe has no CPU expert figure for {dtype}; pass --cpu-gbps")
    return gbps


def _with_cpu(cost, gbps: float):
    """The cost model with the CPU expert rate `gbps` (prior and current)."""
    return replace(cost, profile=replace(cost.profile, cpu_expert_gbps=gbps), cpu_expert_gbps=gbps)


if __name__ == "__main__":
    sys.exit(main())
