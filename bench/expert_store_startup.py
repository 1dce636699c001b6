"""Cpu-backend start-up (load + experts) of the ~0.5B bench model: the old path vs the expert store
cold (build + write the cache), cached (map the file) and cache off. Each measurement runs in a
fresh process; prints seconds and peak RSS (VmHWM). The checkpoint's pages are in the page cache
for every run (its first read is not measured).

    taskset -c 1 python bench/expert_store_startup.py --formats bf16 int4 --threads 1
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import WORK, build_qwen3_moe, emit, log  # noqa: E402

MODES = ("old", "rebuild", "auto", "off")


def child(mode: str, fmt: str, model_dir: str, threads: int) -> None:
    from freetoken_py.kernels import configure_threads

    configure_threads(threads)
    from freetoken_py.engine.cpu_backend import load_cpu_model, use_cpu_kernels
    from freetoken_py.models.loader import load_model

    t0 = time.perf_counter()
    if mode == "old":
        use_cpu_kernels(load_model(model_dir, show_progress=False), fmt)
    else:
        load_cpu_model(model_dir, expert_format=fmt, expert_cache=mode, show_progress=False)
    seconds = time.perf_counter() - t0
    hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({"seconds": seconds, "peak_rss_mib": int(hwm.split()[1]) / 1024}))


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=["bf16", "int4"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="")
    args = ap.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], args.model, args.threads)
    src = build_qwen3_moe(WORK / "qwen3moe-0.5b-bf16")
    model_dir = WORK / "expert-store-startup"  # hard links: our cache files do not land next to the shared copy
    model_dir.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not (model_dir / f.name).exists():
            os.link(f, model_dir / f.name)
    rows: dict[str, dict] = {}
    for fmt in args.formats:
        for mode in MODES:
            proc = subprocess.run([sys.executable, __file__, "--child", mode, fmt, "--model", str(model_dir),
                                   "--threads", str(args.threads)], capture_output=True, text=True, check=True)
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.setdefault(fmt, {})[mode] = res
            log(f"{fmt:5s} {mode:8s} {res['seconds']:7.2f} s   peak RSS {res['peak_rss_mib']:7.0f} MiB")
        old = rows[fmt].get("old")  # the previous load path is the baseline of every other mode
        if old:
            for mode, res in rows[fmt].items():
                res["seconds_vs_old"] = round(res["seconds"] / old["seconds"], 3)
                res["peak_rss_vs_old"] = round(res["peak_rss_mib"] / old["peak_rss_mib"], 3)
    emit({"bench": "expert_store_startup", "threads": args.threads, "results": rows})


if __name__ == "__main__":
    main()
