"""How long `freetoken probe` takes, as a user sees it: the first run on a machine (an empty
profile cache: every figure measured) and the next one (the cached profile revalidated).

    python bench/probe_time.py [--cold-kernels]

Each run is `python -m freetoken_py probe --json` in a fresh process (imports included) with its
own FREETOKEN_CACHE_DIR. By default numba's kernel cache is warm: the kernels are compiled once
per install, and the first probe's figures then count `kernels_compiled` = 0. `--cold-kernels`
points numba at an empty cache directory instead: the first probe after an install (it then
also compiles every CPU expert kernel, ~150 s here). Reported per run: wall seconds, the
probe's own measuring seconds (`revalidation.seconds`), the sum of the figures' timed windows,
numba compiles, and per figure (compiles, first-call seconds, timed seconds). There is no peer:
llama.cpp has no bandwidth probe. Prints one JSON line.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def probe(cache: Path, env: dict) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "freetoken_py", "probe", "--json"], cwd=ROOT,
                          env={**env, "FREETOKEN_CACHE_DIR": str(cache)},
                          capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"probe failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    prof = json.loads(proc.stdout)["profile"]
    figs = prof["figures"]
    per = {k: {"compiled": f["params"].get("kernels_compiled"),
               "first_call_s": f["params"].get("first_call_s"), "seconds": f["seconds"]}
           for k, f in figs.items()}
    return {"wall_s": round(wall, 2), "mode": prof["revalidation"]["mode"],
            "probe_s": prof["revalidation"].get("seconds"),
            "timed_s": round(sum(f["seconds"] for f in figs.values()), 2),
            "kernels_compiled": sum(v["compiled"] or 0 for v in per.values()), "figures": per}


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cold-kernels", action="store_true",
                    help="an empty numba cache: the first probe after an install")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON line to this file")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory() as tmp:
        if args.cold_kernels:
            env["NUMBA_CACHE_DIR"] = str(Path(tmp) / "numba")
        else:
            common.log("warming numba's kernel cache (a throwaway probe)")
            probe(Path(tmp) / "warm", env)
        cache = Path(tmp) / "profile"
        first = probe(cache, env)
        second = probe(cache, env)
    cpu = os.cpu_count()
    return common.emit({"bench": "probe_time", "cold_kernels": args.cold_kernels,
                        "logical_cpus": cpu, "first_run": first, "next_run": second,
                        "target_first_run_s": 30.0}, args.out)


if __name__ == "__main__":
    sys.exit(main())
