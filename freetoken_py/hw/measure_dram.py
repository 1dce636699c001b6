"""Host DRAM read bandwidth: a numba sum over a buffer much larger than L3.

All-cores: a `prange` reduction (a reduction variable vectorises; a plain loop body in `prange`
did not, see PERF.md) with one numba thread per physical core. Single core: the same sum, serial.
Each repetition streams the whole buffer once; bytes / seconds is one sample.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Optional

import numpy as np

from freetoken_py.hw.profile import Figure

MIN_BUFFER_BYTES = 256 * 2**20
MAX_BUFFER_BYTES = 1 * 2**30
L3_MULTIPLE = 16          # buffer >= 16 x L3: the cache holds < 7% of it


def buffer_bytes(l3: Optional[int], available: int, quick: bool = False) -> int:
    """Buffer size: >= 16x L3 (8x for a quick check), 256 MiB .. 1 GiB, at most 1/8 of free RAM."""
    want = max((l3 or 32 * 2**20) * (L3_MULTIPLE // 2 if quick else L3_MULTIPLE), MIN_BUFFER_BYTES)
    return int(min(want, MAX_BUFFER_BYTES, max(available // 8, 64 * 2**20)))


def make_buffer(nbytes: int) -> np.ndarray:
    buf = np.empty(nbytes // 4, dtype=np.float32)
    buf.fill(1.0)    # touch every page now, so page faults are not timed
    return buf


def compiles_during(fn) -> int:
    """Run fn(); how many functions numba compiled meanwhile (a disk-cache load is not a
    compile: numba fires its "numba:compile" event only after a cache miss)."""
    from numba.core import event

    with event.install_recorder("numba:compile") as rec:
        fn()
    return sum(1 for _, e in rec.buffer if e.is_start)


_KERNELS: dict[str, object] = {}


def _kernels() -> tuple:
    """Compile (or load from numba's on-disk cache) the two sums once per process."""
    if not _KERNELS:
        from numba import njit, prange

        @njit(parallel=True, fastmath=True, cache=True)
        def sum_parallel(a):  # pragma: no cover - numba compiled
            s = np.float32(0.0)
            for i in prange(a.shape[0]):
                s += a[i]
            return s

        @njit(fastmath=True, cache=True)
        def sum_serial(a):  # pragma: no cover - numba compiled
            s = np.float32(0.0)
            for i in range(a.shape[0]):
                s += a[i]
            return s

        small = np.ones(4096, dtype=np.float32)
        sum_parallel(small)
        sum_serial(small)
        _KERNELS.update(parallel=sum_parallel, serial=sum_serial)
    return _KERNELS["parallel"], _KERNELS["serial"]


@contextmanager
def numba_threads(n: int) -> Iterator[int]:
    """Run numba parallel regions (from this thread) on n threads; restores the old count."""
    import numba

    old = numba.get_num_threads()
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    try:
        yield numba.get_num_threads()
    finally:
        numba.set_num_threads(old)


def read_samples(buf: np.ndarray, threads: int, reps: int, budget_s: float) -> list[float]:
    """GB/s of `reps` full passes over `buf` (fewer if `budget_s` runs out; at least 2)."""
    par, ser = _kernels()
    kernel = ser if threads == 1 else par
    with numba_threads(threads):
        kernel(buf[: 1 << 16])            # wake the thread pool
        samples, start = [], time.perf_counter()
        for i in range(reps):
            t0 = time.perf_counter()
            kernel(buf)
            samples.append(buf.nbytes / (time.perf_counter() - t0) / 1e9)
            if i >= 1 and time.perf_counter() - start > budget_s:
                break
        return samples


def measure_dram_read(buf: np.ndarray, threads: int, name: str, reps: int = 7,
                      budget_s: float = 2.0, setup_s: float = 0.0) -> Figure:
    compiled = compiles_during(_kernels)     # numba compiles, or loads from its disk cache
    t0, cpu0 = time.perf_counter(), time.process_time()
    samples = read_samples(buf, threads, reps, budget_s)
    # CPU seconds / (wall x threads): well below 1 means other processes held the cores
    share = (time.process_time() - cpu0) / ((time.perf_counter() - t0) * threads)
    how = "numba prange sum" if threads > 1 else "numba serial sum"
    method = (f"{how} over a {buf.nbytes >> 20} MiB float32 buffer, {threads} thread(s); "
              f"median of {len(samples)} passes")
    params = {"buffer_bytes": int(buf.nbytes), "threads": threads, "cpu_share": round(share, 2),
              "kernels_compiled": compiled, "setup_s": round(setup_s, 2)}
    return Figure.from_samples(name, samples, method, params, time.perf_counter() - t0)
