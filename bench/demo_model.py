"""Load time and decode speed of the bundled demo model (or --model DIR), as `freetoken run` uses it:
LLM(model) on the default backend, then a greedy decode after the README's first prompt. Each
round runs in a fresh process (imports, load and the numba kernels' start-up are what a user's
first command pays); the first round may build the expert-store cache file, later ones map it.

    python bench/demo_model.py --rounds 3 --decode-tokens 128 --threads 1
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import DEMO, emit, log  # noqa: E402

PROMPT = "import os"  # the README's first command: freetoken run "import os" --max-tokens 64


def child(model_dir: str, threads: int, decode_tokens: int) -> None:
    t0 = time.perf_counter()
    from freetoken_py.core import SamplingParams
    from freetoken_py.kernels import configure_threads
    from freetoken_py.llm import LLM

    configure_threads(threads)
    t1 = time.perf_counter()
    llm = LLM(model_dir, show_progress=False)
    t2 = time.perf_counter()
    req = llm.add_request(PROMPT, SamplingParams(max_tokens=decode_tokens + 1, temperature=0, ignore_eos=True))
    while not req.output_token_ids:  # prefill + the first token
        llm.step()
    t3 = time.perf_counter()
    while not req.finished:
        llm.step()
    t4 = time.perf_counter()
    print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_token_s": t3 - t2,
                      "decode_tok_s": decode_tokens / (t4 - t3), "backend": llm.backend}))


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.model, args.threads, args.decode_tokens) or 0
    model = Path(args.model)
    cfg = json.loads((model / "config.json").read_text())
    runs = []
    for i in range(args.rounds):
        proc = subprocess.run([sys.executable, __file__, "--child", "--model", str(model), "--threads",
                               str(args.threads), "--decode-tokens", str(args.decode_tokens)],
                              capture_output=True, text=True, check=True)
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        log(f"round {i}: load {runs[-1]['load_s']:.2f} s, decode {runs[-1]['decode_tok_s']:.1f} tok/s")
    later = runs[1:] or runs  # round 0 may build the expert-store cache file
    med = lambda k, rs=later: round(statistics.median(r[k] for r in rs), 3)  # noqa: E731
    return emit({"bench": "demo_model", "model": model.name, "threads": args.threads,
                 "rounds": args.rounds, "decode_tokens": args.decode_tokens, "backend": runs[0]["backend"],
                 "model_mb": round((model / "model.safetensors").stat().st_size / 1e6, 1),
                 "hidden": cfg["hidden_size"], "layers": cfg["num_hidden_layers"],
                 "experts": cfg.get("num_experts", cfg.get("num_local_experts")),
                 "first_load_s": round(runs[0]["load_s"], 3), "load_s": med("load_s"),
                 "import_s": med("import_s"), "first_token_s": med("first_token_s"),
                 "decode_tok_s": med("decode_tok_s"), "decode_tok_s_all": [round(r["decode_tok_s"], 1) for r in runs]})


if __name__ == "__main__":
    sys.exit(main())
