"""Before / after a refactor: the same checkpoints decoded by two source trees, interleaved in one run.

    python bench/redesign_ab.py --before REV [--after REV] [--models qwen3,mla,hybrid] [--precisions bf16,int4]
                                [--rounds 5] [--decode-tokens 32] [--prompt-len 256] [--threads 2]

Each REV (a commit) is checked out into bench/_work/tree-REV (a git worktree; --after defaults to
this working tree, uncommitted changes included); each tree runs in its
own worker process (PYTHONPATH = that tree) holding an `LLM` over the same checkpoint, and the
rounds alternate between the two workers, so drift in the machine's memory bandwidth hits both
alike. Checkpoints are the engine benches' own at real widths, fewer layers: bench/cpu_decode.py's
Qwen3-MoE (hidden 1024, 8 layers, 64 experts), bench/mla_decode.py's DeepSeek-V3 widths (2 layers,
8 experts), bench/hybrid_decode.py's Qwen3.6-35B-A3B widths (4 layers: 3 GDN + 1 attention, 32
experts). Prints one JSON line: per model and precision the median decode and prefill tok/s of
both trees, every sample, and after / before ratios; the CPU is named (issue 41: "no bench line
regresses beyond noise").
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402
from cpu_decode import PAIRS  # noqa: E402


def _model_dir(kind: str) -> tuple[Path, int]:
    """(checkpoint, vocab size) of one engine bench's geometry, built once under bench/_work."""
    if kind == "qwen3":
        return common.build_qwen3_moe(common.WORK / "qwen3moe-0.5b-bf16"), common.QWEN3_05B["vocab_size"]
    if kind == "mla":
        import mla_decode
        return mla_decode.build(common.WORK / "deepseek-mla-real-l2-e8", mla_decode.REAL, 2, 8), mla_decode.REAL["vocab_size"]
    import hybrid_decode
    return (hybrid_decode.build(common.WORK / "qwen35moe-real-l4-e32", hybrid_decode.REAL, 4, 32),
            hybrid_decode.REAL["vocab_size"])


def _tree(rev: str) -> Path:
    out = common.WORK / f"tree-{rev}"
    if not out.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(out), rev], check=True,
                       capture_output=True)
    return out


class Worker:
    """One tree's engine in its own process: `prefill(prompt)` and `decode(prompt, n)` in tok/s."""

    def __init__(self, tree: Path, model_dir: Path, precision: str, threads: int):
        env = dict(os.environ, PYTHONPATH=str(tree), FREETOKEN_AB_TREE=str(tree))
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", str(model_dir), precision, str(threads)],
                                     cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline()
        if not ready.startswith("ready"):
            raise RuntimeError(f"worker in {tree} did not start: {ready!r}")
        self.source = ready.split()[1]

    def _ask(self, line: dict) -> float:
        self.proc.stdin.write(json.dumps(line) + "\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def prefill(self, prompt: list[int]) -> float:
        return self._ask({"op": "prefill", "prompt": prompt})

    def decode(self, prompt: list[int], n: int) -> float:
        return self._ask({"op": "decode", "prompt": prompt, "n": n})

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def worker(model_dir: str, precision: str, threads: str) -> None:
    """The worker's side: load, say which package it imported, then answer timing requests."""
    from freetoken_py.kernels import configure_threads
    from freetoken_py.llm import LLM
    import freetoken_py

    configure_threads(int(threads))
    expert, dense, _ = PAIRS[precision]
    llm = LLM(model_dir, dtype="bfloat16", backend="cpu", expert_dtype=expert, dense_dtype=dense, max_num_seqs=1,
              max_model_len=2048, show_progress=False, enable_prefix_cache=False)
    prefill, decode = common.freetoken_timers(llm)
    print("ready", Path(freetoken_py.__file__).parent, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        value = prefill(req["prompt"]) if req["op"] == "prefill" else decode(req["prompt"], req["n"])
        print(value, flush=True)


def main() -> None:
    sys.path.insert(1, str(ROOT))   # (the parent, not the workers: it names the CPU with this tree's package)
    ap = common.bench_args(__doc__)
    ap.add_argument("--before", required=True, help="the commit to compare against")
    ap.add_argument("--after", default=None, help="a commit (default: this working tree as it is)")
    ap.add_argument("--models", default="qwen3,mla,hybrid")
    ap.add_argument("--precisions", default="bf16,int4")
    ap.set_defaults(rounds=5, prompt_len=256)
    args = ap.parse_args()
    trees = {"before": _tree(args.before), "after": _tree(args.after) if args.after else ROOT}
    out = {"bench": "redesign_ab", "before": args.before,
           "after": args.after or "working tree at " + subprocess.run(
               ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "threads": args.threads, "rounds": args.rounds, "decode_tokens": args.decode_tokens,
           "prompt_len": args.prompt_len, **common.cpu_fields(), "models": {}}
    for kind in args.models.split(","):
        model_dir, vocab = _model_dir(kind)
        prompt = common.random_prompt(vocab, args.prompt_len)
        for p in args.precisions.split(","):
            workers = {name: Worker(tree, model_dir, p, args.threads) for name, tree in trees.items()}
            assert len({w.source for w in workers.values()}) == 2, "both workers imported the same package"
            samples = common.time_rounds({name: (w.prefill, w.decode) for name, w in workers.items()}, prompt,
                                         args.decode_tokens, args.rounds, digits=2)
            for w in workers.values():
                w.close()
            row = {}
            for name in trees:
                row[f"{name}_decode_tps"] = round(common.median(samples[name]["decode"]), 2)
                row[f"{name}_prefill_tps"] = round(common.median(samples[name]["prefill"]), 1)
                row[f"{name}_decode_samples"] = [round(x, 2) for x in samples[name]["decode"]]
            row["decode_ratio"] = round(row["after_decode_tps"] / row["before_decode_tps"], 3)
            row["prefill_ratio"] = round(row["after_prefill_tps"] / row["before_prefill_tps"], 3)
            out["models"][f"{kind}-{p}"] = row
    common.emit(out)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
    else:
        main()
