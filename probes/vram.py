"""CUDA only: VRAM device-to-device copy, the expert copy path (pinned host bank -> VRAM slots)
and the GPU expert kernel at batch 1. Without CUDA the figures are reported unavailable.
`python -m probes.vram [--quick]` prints JSON; `measure()` returns {figure: GB/s}."""
from __future__ import annotations

import sys

try:
    from probes import _common
except ImportError:                       # run as `python probes/vram.py`
    import _common  # type: ignore[no-redef]

NAMES = ("vram_d2d", "gpu_expert_gather", "gpu_expert_kernel")


select = _common.gpu_select(NAMES)


def measure(quick: bool = False) -> dict[str, float]:
    return _common.measure(select, quick)


if __name__ == "__main__":
    sys.exit(_common.main(select))
