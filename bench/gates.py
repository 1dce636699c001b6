"""Regression gates run by .ci/run after the tests: fail (exit 1) when

  (a) decode on the bench model (bench/common.py's ~0.49B qwen3_moe, bf16, cpu backend) reads
      weights at less than `min_fraction` of this machine's DRAM read rate, measured in the same
      run, interleaved with the decode rounds (best of each: noise only ever slows a round, so a
      noisy machine does not fail it and a 2x regression does);
  (b) mean KLD of the int8 / int4 experts or the FP8 KV cache against the demo model's own
      precision (freetoken eval kld's computation, shipped corpus, decode steps) exceeds its budget;
  (c) tool-call validity on the demo model (freetoken eval tools' suite, scored by the server's
      own parser and jsonschema; unconstrained, under the tool_choice auto grammar and required)
      drops below its recorded floor;
  (d) each weight format's expert kernel (bench/expert_roofline.py: the production kernel at
      Qwen3-30B-A3B's expert widths, batch 1, a rotated bank) reads weights at less than its
      floor's share of the DRAM read rate of the same run (one thread: a parallel region on a
      shared 2-vCPU box measures the neighbours; best sample over best DRAM sample).

The thresholds live in bench/gates.json with the date and command that set them.

    python bench/gates.py [--only decode,kld,tools,experts] [--record]

--record measures, writes the figures and the thresholds derived from them (decode: 0.6 x the
measured fraction; KLD: 4 x the measured mean, FP8 KV at most 0.005; tools: the measured share
of valid calls minus TOOLS_SLACK, two flips of the suite's 8 outputs; experts: EXPERT_SLACK x each
format's measured share, loose because CI's CPU varies: Zen 3 AVX2 / Zen 5 / Xeon 6) into
gates.json, and passes.
Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

GATES = Path(__file__).resolve().parent / "gates.json"
DECODE_SLACK, KLD_SLACK, FP8_KV_CAP, TOOLS_SLACK, EXPERT_SLACK = 0.6, 4.0, 0.005, 0.25, 0.4
TOOL_RUNS = ("unconstrained", "constrained", "required")


def dram_best_gbps(threads: int) -> float:
    """Best pass of this machine's DRAM read (freetoken probe's kernel and buffer sizing)."""
    import psutil

    from freetoken_py.hw.measure_dram import buffer_bytes, make_buffer, measure_dram_read

    buf = make_buffer(buffer_bytes(None, psutil.virtual_memory().available, quick=True))
    return measure_dram_read(buf, threads, "dram_read_all_cores", reps=5, budget_s=1.5).best_gbps


def decode_tps(llm, prompt: list[int], n: int, after_step=None) -> float:
    """Greedy decode rate of n tokens after `prompt` (prefill untimed); `after_step` runs after
    each decode step (the gate's tests plant a slowdown there)."""
    from freetoken_py.core import SamplingParams

    req = llm.add_request(prompt, SamplingParams(max_tokens=n + 1, temperature=0, ignore_eos=True))
    while not req.output_token_ids:
        llm.step()
    t0 = time.perf_counter()
    while not req.finished:
        llm.step()
        if after_step is not None:
            after_step()
    return n / (time.perf_counter() - t0)


def decode_gate(cfg: dict, model_dir: Path | None = None, after_step=None) -> dict:
    """Decode weight-read rate as a fraction of DRAM's, best of `rounds` interleaved with DRAM passes."""
    from cpu_decode import _bytes_per_token

    from freetoken_py.kernels import configure_threads
    from freetoken_py.llm import LLM

    threads = configure_threads(None)
    model_dir = model_dir or common.build_qwen3_moe(common.WORK / "qwen3moe-0.5b-bf16")
    llm = LLM(model_dir, backend="cpu", max_num_seqs=1, max_model_len=1024, show_progress=False,
              enable_prefix_cache=False)
    prompt = [(7 * i + 3) % llm.args.vocab_size for i in range(cfg["prompt_len"])]
    decode_tps(llm, prompt, 2)                                   # warm: kernels, page-in
    dram, tps = [], []
    for _ in range(cfg["rounds"]):
        dram.append(dram_best_gbps(threads))
        tps.append(decode_tps(llm, prompt, cfg["decode_tokens"], after_step))
    bpt = _bytes_per_token(llm)
    fraction = max(tps) * bpt / 1e9 / max(dram)
    return {"fraction": round(fraction, 4), "min_fraction": cfg.get("min_fraction"), "threads": threads,
            "decode_tps": [round(t, 2) for t in tps], "dram_gbps": [round(d, 2) for d in dram],
            "bytes_per_token": bpt, "passed": cfg.get("min_fraction") is None or fraction >= cfg["min_fraction"]}


def kld_gate(cfg: dict, model_dir: Path = common.DEMO, only: tuple[str, ...] = (), tamper=None) -> dict:
    """Mean KLD of each fast configuration in cfg["configs"] against the checkpoint's precision;
    `tamper(name, llm)` may alter a fast engine before it is measured (the gate's tests)."""
    from freetoken_py.evals.kld import DEFAULT_TEXTS, compare, read_windows
    from freetoken_py.llm import LLM

    kw = dict(max_num_seqs=1, enable_prefix_cache=False, show_progress=False)
    ref = LLM(model_dir, **kw)
    windows = read_windows(ref.tokenizer, DEFAULT_TEXTS, cfg["window"], cfg["windows"])
    rows = {}
    for name, overrides in cfg["configs"].items():
        if only and name not in only:
            continue
        fast = LLM(model_dir, **kw, **overrides)
        if tamper is not None:
            tamper(name, fast)
        res = compare(fast, ref, windows, cfg["chunk"])
        budget = cfg.get("budgets", {}).get(name)
        rows[name] = {"mean_kld": res.mean_kld, "p99_kld": res.p99_kld, "same_top1": round(res.same_top1, 4),
                      "budget": budget, "passed": budget is None or res.mean_kld <= budget}
    return {"configs": rows, "passed": all(r["passed"] for r in rows.values())}


def experts_gate(cfg: dict) -> dict:
    """Each format's expert-kernel share of the DRAM read rate (expert_roofline.measure at
    cfg's shape / bank / rounds / threads) against its floor."""
    import expert_roofline

    lines = expert_roofline.measure(cfg["formats"], [cfg["shape"]], cfg["rounds"], cfg["bank_mib"],
                                    cfg.get("sample_s", 0.25), cfg["threads"])
    floors, rows = cfg.get("floors", {}), {}
    for line in lines:
        f, sh = line["format"], line["shapes"][cfg["shape"]]
        floor = floors.get(f)
        rows[f] = {"share": sh["best_share_of_dram"], "median_share": sh["share_of_dram"], "gbps": sh["gbps"],
                   "act": line["act"], "floor": floor, "passed": floor is None or sh["best_share_of_dram"] >= floor}
    head = lines[0] if lines else {}
    return {"formats": rows, "cpu": head.get("cpu"), "isa": head.get("isa"), "dram_gbps": head.get("dram_gbps"),
            "passed": all(r["passed"] for r in rows.values())}


def tools_gate(cfg: dict, model_dir: Path = common.DEMO) -> dict:
    """Share of valid tool calls (of the outputs that start one; none started counts 0) of each
    run of freetoken eval tools' suite against its floor. The suite's sampling is seeded."""
    from freetoken_py.evals.tools import ToolsEvalOptions, run_tools_eval

    out = run_tools_eval(ToolsEvalOptions(model_dir, samples=cfg["samples"], num_requests=cfg["requests"],
                                          max_tokens=cfg["max_tokens"], as_json=True, json_runs=False))
    floors, rows = cfg.get("floors", {}), {}
    for run in TOOL_RUNS:
        s = out.get(run)
        if s is None:          # no grammar for this model's tool format
            continue
        valid = s["valid"] or 0.0
        floor = floors.get(run)
        rows[run] = {"valid": valid, "parseable": s["parseable"], "attempts": s["attempts"], "outputs": s["outputs"],
                     "floor": floor, "passed": floor is None or valid >= floor}
    return {"runs": rows, "tool_format": out["tool_format"], "passed": all(r["passed"] for r in rows.values())}


def record(gates: dict, results: dict, command: str) -> dict:
    """The thresholds derived from this run's figures, with the date and command (per gate; the
    file's own "set" when every gate was measured)."""
    gates = json.loads(json.dumps(gates))
    when = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "command": command}
    if "decode" in results:
        frac = results["decode"]["fraction"]
        gates["decode"].update(recorded_fraction=frac, min_fraction=round(DECODE_SLACK * frac, 4))
    if "kld" in results:
        rec = {n: r["mean_kld"] for n, r in results["kld"]["configs"].items()}
        gates["kld"]["recorded"] = {n: float(f"{v:.3g}") for n, v in rec.items()}
        gates["kld"]["budgets"] = {n: float(f"{min(KLD_SLACK * v, FP8_KV_CAP) if n == 'fp8_kv' else KLD_SLACK * v:.3g}")
                                   for n, v in rec.items()}
    if "tools" in results:
        rec = {n: r["valid"] for n, r in results["tools"]["runs"].items()}
        gates["tools"]["recorded"] = rec
        gates["tools"]["floors"] = {n: round(max(0.0, v - TOOLS_SLACK), 4) for n, v in rec.items()}
    if "experts" in results:
        rec = {f: r["share"] for f, r in results["experts"]["formats"].items()}
        gates["experts"].update(recorded=rec, floors={f: round(EXPERT_SLACK * v, 3) for f, v in rec.items()},
                                cpu=results["experts"]["cpu"], isa=results["experts"]["isa"])
    for name in results:
        gates[name]["set"] = when
    if {"decode", "kld", "tools"} <= set(results) or "tools" not in gates:
        gates["set"] = when
    return gates


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="decode,kld,tools,experts")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args(argv)
    gates = json.loads(GATES.read_text())
    t0, results = time.perf_counter(), {}
    for name in args.only.split(","):
        common.log(f"gate {name}")
        results[name] = {"decode": decode_gate, "kld": kld_gate, "tools": tools_gate,
                         "experts": experts_gate}[name](gates[name])
    if args.record:
        command = "python bench/gates.py --record" + ("" if args.only == "decode,kld,tools,experts" else f" --only {args.only}")
        GATES.write_text(json.dumps(record(gates, results, command), indent=2) + "\n")
        results = {n: {**r, "passed": True} for n, r in results.items()}
    passed = all(r["passed"] for r in results.values())
    common.emit({"bench": "gates", "passed": passed, "seconds": round(time.perf_counter() - t0, 1),
                 "set": gates.get("set"), **results})
    for name, r in results.items():
        if not r["passed"]:
            common.log(f"GATE FAILED: {name}: {json.dumps(r)}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
