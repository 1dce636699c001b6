"""Matrix-vector row dots per weight format on one core (issue 22): int8, int4, fp8, nvfp4.

One [N, K] matrix per format, encoded by kernels._buffers.encode_rows from the same random
weights, one fp32 activation row; each timed call prepares the activation (as the kernels do)
and runs row_dot over every row, single-threaded. Extra rows for comparison: "fp8_unfolded"
(the 64-lane dot that scales each block's partial sum, what rows with a block scale >= 2^7 run),
"nvfp4_fp32" (the exact fp32-activation vector dot, FREETOKEN_INT_ACT=fp32), "fp8_loop" /
"nvfp4_loop" (the plain numba loops, the fallback where no vector dot applies). numba compile is
excluded (one warm-up call); nothing here is cached on disk (numba's cache of a function outside
the kernels package does not see kernel edits: stale timings). Formats are interleaved round by
round; each reports its median and its minimum; on a shared box only the ratios mean anything.
Prints one JSON line: ms per call (median, min) and Gweights/s per format, each format's time
relative to int8 and int4, and the ISA forms in use (int_act, simd: "avx512" or "avx2";
FREETOKEN_SIMD=avx2 forces the AVX2 forms).

    python bench/fmt_dots.py [--n 2048 --k 2048 --rounds 200] [--tiny]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from numba import njit

from freetoken_py.kernels._buffers import empty_rows, encode_rows
from freetoken_py.kernels import _dots
from freetoken_py.kernels._dots import INT_ACT, fp8_row_dot, nvfp4_dot, nvfp4_row_dot, prepare, row_dot
from freetoken_py.kernels._simd import fp8_row_dot_v64

GROUPS = {"int8": 32, "int4": 32, "fp8": 128, "nvfp4": 16}


@njit(fastmath=True)
def matvec(w, s, x, gs, out):
    xv, xg = prepare(w, s, x, gs)
    hb = gs // 2
    for n in range(w.shape[0]):
        out[n] = row_dot(w[n], s[n], xv[0], xg[0], hb)
    return out


@njit(fastmath=True)
def fp8_unfolded(w, s, x, gs, out):
    for n in range(w.shape[0]):
        out[n] = fp8_row_dot_v64(w[n], s[n], x[0], gs)
    return out


@njit(fastmath=True)
def nvfp4_fp32(w, s, x, gs, out):
    for n in range(w.shape[0]):
        out[n] = nvfp4_dot(w[n], s[n], x[0], gs)
    return out


@njit(fastmath=True)
def fp8_loop(w, s, x, gs, out):
    """The plain numba loops (the fallback where the vector dots do not apply), for comparison."""
    for n in range(w.shape[0]):
        out[n] = fp8_row_dot(w[n], s[n], x[0], gs)
    return out


@njit(fastmath=True)
def nvfp4_loop(w, s, x, gs, out):
    for n in range(w.shape[0]):
        out[n] = nvfp4_row_dot(w[n], s[n], x[0], gs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--tiny", action="store_true", help="256 x 256, 5 rounds (smoke test)")
    a = ap.parse_args()
    if a.tiny:
        a.n, a.k, a.rounds = 256, 256, 5
    import numba
    numba.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    wt = torch.randn(a.n, a.k, generator=g) * 0.02
    x = np.random.default_rng(0).standard_normal((1, a.k)).astype(np.float32)
    mats = {}
    for fmt, gs in GROUPS.items():
        w, s = empty_rows(fmt, (a.n,), a.k, gs)
        encode_rows(wt, fmt, gs, w, s)
        out = np.empty(a.n, np.float32)
        matvec(w, s, x, gs, out)            # compile / warm
        mats[fmt] = (w, s, gs, out, matvec)
        if fmt in ("fp8", "nvfp4"):
            for name, fn in ((("fp8_unfolded", fp8_unfolded), ("fp8_loop", fp8_loop)) if fmt == "fp8" else
                             (("nvfp4_fp32", nvfp4_fp32), ("nvfp4_loop", nvfp4_loop))):
                fn(w, s, x, gs, out)
                mats[name] = (w, s, gs, out, fn)
    times = {f: [] for f in mats}
    for _ in range(a.rounds):
        for fmt, (w, s, gs, out, fn) in mats.items():
            t0 = time.perf_counter()
            fn(w, s, x, gs, out)
            times[fmt].append(time.perf_counter() - t0)
    ms = {f: 1e3 * float(np.median(t)) for f, t in times.items()}
    res = {"bench": "fmt_dots", "n": a.n, "k": a.k, "rounds": a.rounds, "int_act": INT_ACT,
           "simd": "avx512" if _dots.NV_WIDE else "avx2", "threads": 1,
           "ms": {f: round(v, 4) for f, v in ms.items()},
           "ms_min": {f: round(1e3 * float(np.min(t)), 4) for f, t in times.items()},
           "gweights_per_s": {f: round(a.n * a.k / (v * 1e-3) / 1e9, 2) for f, v in ms.items()},
           "vs_int8": {f: round(v / ms["int8"], 2) for f, v in ms.items()},
           "vs_int4": {f: round(v / ms["int4"], 2) for f, v in ms.items()}}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
