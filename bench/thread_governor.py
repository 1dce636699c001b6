"""Decode tokens/s with the thread governor (adaptive) and with the thread count pinned (fixed),
on a quiet machine and while another process keeps one core busy (a pure-Python spin loop, as a
browser tab or a build would), interleaved rounds on the same engine.

    python bench/thread_governor.py [--rounds 3] [--decode-tokens 128] [--threads 2]

Prints one JSON line: per condition the median tokens/s of each mode, their ratio, and the thread
counts the governor timed (median seconds per step).
"""
from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def _spin(stop) -> None:
    while not stop.is_set():
        sum(range(1000))


def _decode_tps(llm, n: int) -> float:
    from freetoken_py.core import SamplingParams

    out = llm.generate([list(range(100, 116))], SamplingParams(max_tokens=n + 1, temperature=0, ignore_eos=True))[0]
    return n / (out.total_s - out.ttft_s)


def main() -> None:
    ap = common.bench_args(__doc__)
    ap.set_defaults(decode_tokens=128)
    ap.add_argument("--precision", default="int4", choices=["bf16", "int8", "int4"])
    args = ap.parse_args()
    model_dir, _ = common.setup(args)
    from freetoken_py.llm import LLM

    llm = LLM(model_dir, dtype="bfloat16", backend="cpu", expert_dtype=args.precision, dense_dtype=args.precision,
              max_num_seqs=1, max_model_len=2048, show_progress=False, enable_prefix_cache=False)
    governor = llm.runner.governor
    if governor is None:
        raise SystemExit("the thread governor is off (FREETOKEN_ADAPTIVE_THREADS=0)")
    _decode_tps(llm, 8)  # warm-up
    out = {"bench": "thread_governor", "threads": args.threads, "precision": args.precision,
           "decode_tokens": args.decode_tokens, "rounds": args.rounds, "conditions": {}}
    for condition in ("quiet", "one_core_busy"):
        stop = mp.Event()
        hog = mp.Process(target=_spin, args=(stop,), daemon=True) if condition != "quiet" else None
        if hog:
            hog.start()
        samples = {"fixed": [], "adaptive": []}
        try:
            for r in range(args.rounds):
                for mode in samples:
                    llm.runner.governor = governor if mode == "adaptive" else None
                    samples[mode].append(_decode_tps(llm, args.decode_tokens))
                    common.log(f"{condition} round {r} {mode}: {samples[mode][-1]:.1f} tok/s")
        finally:
            stop.set()
            if hog:
                hog.join()
        fixed, adaptive = common.median(samples["fixed"]), common.median(samples["adaptive"])
        out["conditions"][condition] = {
            "fixed_tps": round(fixed, 2), "adaptive_tps": round(adaptive, 2), "ratio": round(adaptive / fixed, 3),
            "samples": {k: [round(x, 2) for x in v] for k, v in samples.items()},
            "governor_s_per_step": {f"rows_band{b[0]}_ctx_band{b[1]}": {str(n): round(s, 5) for n, s in d.items()}
                                    for b, d in governor.snapshot().items()}}
    common.emit(out)


if __name__ == "__main__":
    main()
