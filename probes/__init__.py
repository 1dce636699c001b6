"""Bandwidth micro-benchmarks, one script per measurement, each bounded in time.

These are thin entry points: the measurements live in `freetoken_py.hw` (so an installed
freetoken, which ships only `freetoken_py`, measures the same way). Run from a checkout:

    python -m probes.dram            # host DRAM, all physical cores and one core
    python -m probes.expert_kernel   # the production CPU expert kernel, every format
    python -m probes.pcie            # CUDA: H2D/D2H pinned/pageable, PCIe + CPU kernel together
    python -m probes.vram            # CUDA: VRAM copy, expert copy path, GPU expert kernel
    python -m probes.gpu_suite       # CUDA: all GPU figures into one JSON file

Each prints one JSON object; `measure()` in each module returns {figure: GB/s}.
"""
