"""One thread budget for numba and torch (see docs/kernels.md, "Threads").

numba's kernels and torch's ops run one after the other on the decode path, never at the same
time, so each gets every core while it runs. They are two OpenMP pools (numba's `omp` layer links
the system libgomp, torch its bundled copy); neither may be larger than the cores, or its spinning
workers steal cores from the other. On a host where another process keeps a core busy, pass n=1
(or set OMP_WAIT_POLICY=passive before start): libgomp's spinning barrier then costs ~10x.
"""
from __future__ import annotations

import os


def default_threads() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                      # not Linux
        return os.cpu_count() or 1


def configure_threads(n: int | None = None) -> int:
    """Set numba's and torch's intra-op thread counts to n (default: the usable cores); returns n."""
    import numba
    import torch

    n = default_threads() if n is None else int(n)
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    n = min(n, numba.config.NUMBA_NUM_THREADS)  # numba's pool size is fixed at its first use
    numba.set_num_threads(n)
    torch.set_num_threads(n)
    return n
