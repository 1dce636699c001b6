"""Host DRAM read bandwidth: numba sum over a buffer >> L3, one thread per physical core, and one
thread. `python -m probes.dram [--quick]` prints JSON; `measure()` returns {figure: GB/s}."""
from __future__ import annotations

import sys

try:
    from probes import _common
except ImportError:                       # run as `python probes/dram.py`
    import _common  # type: ignore[no-redef]


def select(ctx):
    from freetoken_py.hw.registry import dram_probes

    return dram_probes(ctx), {}


def measure(quick: bool = False) -> dict[str, float]:
    return _common.measure(select, quick)


if __name__ == "__main__":
    sys.exit(_common.main(select))
