"""Every GPU figure in one run, written to one JSON file — the script to run on a machine lent
with a GPU:

    python -m probes.gpu_suite [--out gpu_suite.json] [--quick]

Measures PCIe H2D/D2H (pinned, pageable), VRAM copy, the expert copy path, the GPU expert kernel,
PCIe streaming concurrent with the CPU expert kernel, and — for comparison in the same run — the
DRAM and bf16 CPU-kernel figures alone. Without CUDA it writes {"skipped": true, "reason": ...}
and exits 0, so a CPU-only machine runs it cleanly.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

try:
    from probes import _common
except ImportError:                       # run as `python probes/gpu_suite.py`
    import _common  # type: ignore[no-redef]


def select(ctx):
    from freetoken_py.hw.registry import dram_probes, expert_probes, gpu_selection

    gpu, unavailable = gpu_selection(ctx)
    experts, why = expert_probes(ctx)
    unavailable.update(why)
    bf16 = [p for p in experts if p.names == ("cpu_expert_bf16",)]
    return dram_probes(ctx) + bf16 + gpu, unavailable


def suite(quick: bool = False) -> dict:
    ctx = _common.context()
    if not (ctx.gpu.torch_cuda_available and ctx.gpu.gpus):
        return {"skipped": True, "reason": ctx.gpu.status}
    t0 = time.perf_counter()
    result = _common.run(select, quick=quick, ctx=ctx)
    return {"skipped": False, "seconds": round(time.perf_counter() - t0, 2),
            "gpu": asdict(ctx.gpu), "cpu": asdict(ctx.cpu), **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_suite.json"))
    parser.add_argument("--quick", action="store_true", help="the start-up revalidation sizes")
    args = parser.parse_args(argv)
    result = suite(quick=args.quick)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True))
    if result["skipped"]:
        print(f"gpu_suite: skipped — {result['reason']}")
    else:
        print(json.dumps({n: round(f["gbps"], 2) for n, f in result["figures"].items()}, indent=1))
        for name, why in result["unavailable"].items():
            print(f"  {name}: {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
