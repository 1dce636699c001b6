"""CUDA only: PCIe host->device and device->host with pinned and pageable memory, and PCIe
streaming while the CPU expert kernel runs (they contend for DRAM; the planner uses the
concurrent pair). Without CUDA the figures are reported unavailable, with the reason.
`python -m probes.pcie [--quick]` prints JSON; `measure()` returns {figure: GB/s}."""
from __future__ import annotations

import sys

try:
    from probes import _common
except ImportError:                       # run as `python probes/pcie.py`
    import _common  # type: ignore[no-redef]

NAMES = ("pcie_h2d_pinned", "pcie_h2d_pageable", "pcie_d2h_pinned", "pcie_d2h_pageable",
         "pcie_h2d_pinned_concurrent", "cpu_expert_bf16_concurrent")


select = _common.gpu_select(NAMES)


def measure(quick: bool = False) -> dict[str, float]:
    return _common.measure(select, quick)


if __name__ == "__main__":
    sys.exit(_common.main(select))
