"""Effective bandwidth of the production CPU expert kernel (freetoken_py.kernels.cpu_moe) at
batch 1, for every format it supports, experts rotated over a bank >> L3.
`python -m probes.expert_kernel [--quick]` prints JSON; `measure()` returns {figure: GB/s}."""
from __future__ import annotations

import sys

try:
    from probes import _common
except ImportError:                       # run as `python probes/expert_kernel.py`
    import _common  # type: ignore[no-redef]


def select(ctx):
    from freetoken_py.hw.registry import expert_probes

    return expert_probes(ctx)


def measure(quick: bool = False) -> dict[str, float]:
    return _common.measure(select, quick)


if __name__ == "__main__":
    sys.exit(_common.main(select))
