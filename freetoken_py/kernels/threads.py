"""One thread budget for numba and torch (see docs/kernels.md, "Threads").

numba's kernels and torch's ops run one after the other on the decode path, never at the same
time, so each gets every core while it runs. They are two OpenMP pools (numba's `omp` layer links
the system libgomp, torch its bundled copy); neither may be larger than the cores, or its spinning
workers steal cores from the other. On a host where another process keeps a core busy, pass n=1
(or set OMP_WAIT_POLICY=passive before start): libgomp's spinning barrier then costs ~10x.
"""
from __future__ import annotations

import os

_configured: int | None = None  # the last configure_threads() count, for threads started later


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
    global _configured
    _configured = n
    return n


def configured_threads() -> int:
    """The configured budget (default: the usable cores, capped by numba's pool)."""
    import numba

    return _configured or min(default_threads(), numba.config.NUMBA_NUM_THREADS)


def set_kernel_threads(n: int) -> None:
    """numba threads for parallel regions launched from the calling thread (numba's count is
    per calling thread: the server's engine thread does not inherit the main thread's)."""
    import numba

    numba.set_num_threads(n)


def tune_allocator() -> bool:
    """Make glibc keep large freed blocks in the heap (no mmap/munmap per tensor).

    By default every allocation over ~128 KB-32 MB is a fresh mmap, so each decode step's gathered
    K/V and intermediate tensors page-fault in anew: at a 2,000-token context that was ~15-20% of a
    decode step here (docs/performance.md). Returns whether the setting was applied (glibc only).
    """
    import ctypes

    from freetoken_py.envs import malloc_tuning

    if not malloc_tuning():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 512 << 20)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):  # not glibc (macOS, musl): leave the allocator alone
        return False
