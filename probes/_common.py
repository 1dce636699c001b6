"""Shared plumbing for the probe scripts: build the context, run chosen probes, print JSON."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:        # `python probes/x.py` from a checkout puts probes/ first
    sys.path.insert(0, str(ROOT))


def context():
    from freetoken_py.hw.registry import ProbeContext
    from freetoken_py.hw.sysinfo import collect_cpu, collect_gpus, collect_memory

    return ProbeContext(collect_cpu(), collect_memory(), collect_gpus())


def run(select: Callable[[Any], tuple[list, dict]], quick: bool = False,
        progress: bool = True, ctx: Any = None) -> dict[str, Any]:
    """{"figures": {name: Figure dict}, "unavailable": {name: why}, "gpu_status": ...} for the
    selected probes."""
    from dataclasses import asdict

    from freetoken_py.hw.runner import measure_all, run_probes

    ctx = ctx or context()
    try:
        probes, unavailable = select(ctx)
        if quick:
            outcome = run_probes(probes, quick=True, step=lambda label: None)
        else:
            outcome = measure_all(probes, progress=progress and sys.stderr.isatty())
    finally:
        ctx.close()
    unavailable.update(outcome.unavailable)
    return {"figures": {n: asdict(f) for n, f in outcome.figures.items()},
            "unavailable": unavailable, "gpu_status": ctx.gpu.status}


def gbps(result: dict[str, Any]) -> dict[str, float]:
    return {n: f["gbps"] for n, f in result["figures"].items()}


def gpu_select(names: tuple[str, ...]) -> Callable[[Any], tuple[list, dict]]:
    """The probe selection of a CUDA-only script: its figures, or each one unavailable with the reason."""
    def select(ctx):
        from freetoken_py.hw.registry import gpu_selection

        return gpu_selection(ctx, names)

    return select


def measure(select: Callable[[Any], tuple[list, dict]], quick: bool = False) -> dict[str, float]:
    return gbps(run(select, quick=quick, progress=False))


def main(select: Callable[[Any], tuple[list, dict]], argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    result = run(select, quick="--quick" in args)
    print(json.dumps(result, indent=1, sort_keys=True))
    return 0
