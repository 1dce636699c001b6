"""FP8 KV scales calibrated on the shipped real text (the start-up default) against the old
calibration on 64 pseudo-random token ids: mean / p99 / max KL(bf16-KV || fp8-KV) and clipped
values, teacher-forced over the shipped corpus (freetoken eval kld's windows, decode steps).

    python bench/kv_calibration.py [--model demo|real|bench|DIR] [--layers 4] [--window 256] [--windows 16] [--threads 2]
    python bench/kv_calibration.py --model real --tiny      # smoke (bench/asymmetric_precision.py's tiny widths)

`real` is Qwen3-30B-A3B's layer widths (hidden 2048, 32 query / 4 KV heads of 128, 128 experts
of width 768; --layers of them; random weights, the demo tokenizer: bench/asymmetric_precision.py
builds it); `bench` the ~0.49B qwen3_moe of bench/common.py. The reference is the same checkpoint
with a bf16 KV cache. Both calibrations are measured on the same windows: the shipped-text one
(the start-up default, 512 tokens of data/corpus/calib_*.txt) and the old 64 random ids. Prints
one JSON line; `passed` says whether the shipped-text calibration's mean KLD is within the
issue's budget (0.005).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def old_calibration_ids(llm, n: int = 64) -> list[int]:
    """What _calibrate_kv prefilled before: 64 ids from torch's generator seeded 0."""
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, llm.args.vocab_size, (n,), generator=g).tolist()


def main() -> None:
    ap = common.bench_args(__doc__)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    if args.tiny:
        args.window, args.windows = 64, 2
    from freetoken_py.evals.kld import DEFAULT_TEXTS, compare, read_windows
    from freetoken_py.kernels import configure_threads
    from freetoken_py.llm import LLM

    configure_threads(args.threads)
    if args.model == "real":
        from asymmetric_precision import build_real_geometry

        model = build_real_geometry(args.layers, args.tiny)
    else:
        model = {"demo": common.DEMO, "bench": None}.get(args.model, Path(args.model))
        model = model or common.build_qwen3_moe(common.WORK / "qwen3moe-0.5b-bf16")
    kw = dict(max_num_seqs=1, enable_prefix_cache=False, show_progress=False)
    ref = LLM(model, kv_dtype="bf16", **kw)
    fp8 = LLM(model, kv_dtype="fp8", **kw)
    windows = read_windows(ref.tokenizer, DEFAULT_TEXTS, args.window, args.windows)
    a = ref.args
    out = {"bench": "kv_calibration", "model": str(model), "window": args.window, "windows": len(windows),
           "threads": args.threads, "layers": a.num_layers, "hidden": a.hidden_size, "kv_heads": a.num_kv_heads,
           "head_dim": a.head_dim}
    for name, ids in (("corpus", fp8.calibration_ids()[0]), ("random_ids", old_calibration_ids(fp8))):
        fp8.calibrate_kv(ids)
        res = compare(fp8, ref, windows, chunk=1)
        out[name] = {**{k: round(v, 7) if isinstance(v, float) else v for k, v in res.as_dict().items()},
                     "calibration_tokens": len(ids), "clipped": fp8.runner.cache.clipped}
        common.log(f"{name}: mean KLD {res.mean_kld:.6f}, clipped {fp8.runner.cache.clipped}")
    out["budget"] = 0.005
    out["passed"] = out["corpus"]["mean_kld"] <= out["budget"]
    common.emit(out)


if __name__ == "__main__":
    main()
