"""Record the routing traces bench/residency_sim.py replays (evaluation + calibration pairs).

    python bench/record_traces.py --out bench/_work/traces [--tokens 160]

Writes, per model, `<name>_eval.jsonl` and `<name>_calib.jsonl` (two different prompts or seeds,
so a policy calibrated on one is evaluated on the other):

    demo       the bundled demo model, two text prompts, temperature 0.7
    qwen3_moe  the tests' tiny Qwen3-MoE checkpoint (random weights, built locally), seeds 0 / 1,
               temperature 1.0
    mixtral    the tests' tiny Mixtral checkpoint, likewise

Each trace is what `freetoken run --record-routing FILE` writes: the real router decisions of one
prefill and `--tokens` - 1 decode steps (the prefill samples the first token), and the look-ahead predictions (the next layer's router on
each layer's input) the simulator replays for `ours`. Prints one JSON line per trace (path, steps, routed pairs).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

PROMPTS = ("Write a Python function that parses a CSV file and returns the rows as dictionaries.",
           "Explain how a hash map handles collisions, with an example in C.")


def record(model_dir: Path, prompt, out: Path, tokens: int, temperature: float, seed: int) -> dict:
    from freetoken_py.core import SamplingParams
    from freetoken_py.llm import LLM
    from freetoken_py.residency.stats import RoutingTrace

    llm = LLM(model_dir, backend="torch", record_routing=str(out), show_progress=False)
    llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=temperature, seed=seed,
                                          ignore_eos=True))
    llm.save_routing()
    trace = RoutingTrace.load(out)
    return {"trace": str(out), "model": str(model_dir), "steps": len(trace.steps), "pairs": trace.num_pairs()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/_work/traces", help="directory for the .jsonl traces")
    ap.add_argument("--tokens", type=int, default=160, help="decode tokens per trace")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from conftest import build_checkpoint, random_prompt

    from freetoken_py.cli import DEMO_MODEL

    with tempfile.TemporaryDirectory() as tmp:
        jobs = [("demo", DEMO_MODEL, PROMPTS[0], PROMPTS[1], 0.7)]
        for name in ("qwen3_moe", "mixtral"):
            ckpt = build_checkpoint(name, Path(tmp) / name)
            jobs.append((name, ckpt, random_prompt(24, 0), random_prompt(24, 1), 1.0))
        for name, model_dir, p_eval, p_calib, temp in jobs:
            for split, prompt, seed in (("eval", p_eval, 0), ("calib", p_calib, 1)):
                row = record(Path(model_dir), prompt, out / f"{name}_{split}.jsonl", args.tokens, temp, seed)
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
