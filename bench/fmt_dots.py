"""Matrix-vector row dots per weight format on one core (issue 22): int8, int4, fp8, nvfp4.

One [N, K] matrix per format, encoded by kernels._buffers.encode_rows from the same random
weights, one fp32 activation row; each timed call prepares the activation (as the kernels do)
and runs row_dot over every row, single-threaded ("fp8_loop" / "nvfp4_loop": the plain numba
loops, the fallback where the vector dots do not apply). numba compile is excluded (one warm-up call),
formats are interleaved round by round (each timed call right after an untimed one of the same
kernel) and each reports its median; on a shared box only the ratios mean anything. "_x4": four activation rows per pass (the prefill / grouped form). Where
the process runs the AVX-512 VNNI int4 / int8 dots, "_avx2" rows time the AVX2 forms in the same
loop (avx512_speedup = their time / the VNNI one's; for nvfp4 that row is "nvfp4_avx2").
"fp8_unfolded": the 64-lane fp8 dot that scales each block's partial sum (before the scale was
folded into the decode); "nvfp4_fp32": nvfp4's exact fp32-activation vector dot
(FREETOKEN_INT_ACT=fp32), against "nvfp4", which multiplies int8-quantised activations. Nothing is
cached on disk (numba's cache of a function outside the kernels package does not see kernel
edits). Prints one JSON line: ms per call (median; ms_min: the fastest) and Gweights/s (weights x
activation rows) per format, and each format's time relative to int8 and int4.

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
from freetoken_py.kernels._dots import (INT_ACT, fp8_row_dot, nvfp4_dot, nvfp4_multiplier, nvfp4_factor, nvfp4_row_dot,
                                        prep_nv8_rows, prep_q8_rows_as, prep_q8n_rows, prepare, row_dot, row_dot4)
from freetoken_py.kernels._simd import (HAS_AVX2, HAS_AVX512, fp8_row_dot_v64, i8q8_row_dot, i8q8_row_dot4, nvfp4q8_row_dot,
                                        q4q8_row_dot, q4q8_row_dot4)

GROUPS = {"int8": 32, "int4": 32, "fp8": 128, "nvfp4": 16}


@njit(fastmath=True, cache=False)
def matvec4(w, s, x, gs, out):
    """Four activation rows per pass over the weight rows (the prefill / grouped form); out [N, 4]."""
    xv, xg = prepare(w, s, x, gs)
    hb = gs // 2
    for n in range(w.shape[0]):
        out[n, 0], out[n, 1], out[n, 2], out[n, 3] = row_dot4(w[n], s[n], xv[0], xv[1], xv[2], xv[3],
                                                             xg[0], xg[1], xg[2], xg[3], hb)
    return out


@njit(fastmath=True, cache=False)
def int4_avx2(w, s, x, gs, out):
    """The AVX2 int4 x int8 dot (pair layout) where the process runs the AVX-512 one: same-process A/B."""
    xq, xg = prep_q8_rows_as(x, gs, False)
    for n in range(w.shape[0]):
        out[n] = q4q8_row_dot(w[n], s[n], xq[0], xg[0], gs // 2)
    return out


@njit(fastmath=True, cache=False)
def int4_avx2_x4(w, s, x, gs, out):
    xq, xg = prep_q8_rows_as(x, gs, False)
    for n in range(w.shape[0]):
        out[n, 0], out[n, 1], out[n, 2], out[n, 3] = q4q8_row_dot4(w[n], s[n], xq[0], xq[1], xq[2], xq[3],
                                                                  xg[0], xg[1], xg[2], xg[3], gs // 2)
    return out


@njit(fastmath=True, cache=False)
def int8_avx2(w, s, x, gs, out):
    xq, xs = prep_q8n_rows(x)
    for n in range(w.shape[0]):
        out[n] = s[n, 0] * i8q8_row_dot(w[n], xq[0], xs[0])
    return out


@njit(fastmath=True, cache=False)
def int8_avx2_x4(w, s, x, gs, out):
    xq, xs = prep_q8n_rows(x)
    for n in range(w.shape[0]):
        a0, a1, a2, a3 = i8q8_row_dot4(w[n], xq[0], xq[1], xq[2], xq[3], xs[0], xs[1], xs[2], xs[3])
        out[n, 0], out[n, 1], out[n, 2], out[n, 3] = s[n, 0] * a0, s[n, 0] * a1, s[n, 0] * a2, s[n, 0] * a3
    return out


@njit(fastmath=True, cache=False)
def fp8_unfolded(w, s, x, gs, out):
    for n in range(w.shape[0]):
        out[n] = fp8_row_dot_v64(w[n], s[n], x[0], gs)
    return out


@njit(fastmath=True, cache=False)
def nvfp4_fp32(w, s, x, gs, out):
    for n in range(w.shape[0]):
        out[n] = nvfp4_dot(w[n], s[n], x[0], gs)
    return out


@njit(fastmath=True, cache=False)
def nvfp4_avx2(w, s, x, gs, out):
    """The AVX2 nvfp4 x int8 dot where the process runs the AVX-512 one (same activation layout)."""
    xq, xg = prep_nv8_rows(x)
    k = x.shape[1]
    for n in range(w.shape[0]):
        out[n] = nvfp4q8_row_dot(w[n], s[n], xq[0], xg[0]) * (nvfp4_multiplier(nvfp4_factor(s[n], k // 16)) * np.float32(128.0))
    return out


@njit(fastmath=True, cache=False)
def matvec(w, s, x, gs, out):
    xv, xg = prepare(w, s, x, gs)
    hb = gs // 2
    for n in range(w.shape[0]):
        out[n] = row_dot(w[n], s[n], xv[0], xg[0], hb)
    return out


@njit(fastmath=True, cache=False)
def fp8_loop(w, s, x, gs, out):
    """The plain numba loops (the fallback where the vector dots do not apply), for comparison."""
    for n in range(w.shape[0]):
        out[n] = fp8_row_dot(w[n], s[n], x[0], gs)
    return out


@njit(fastmath=True, cache=False)
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
    x4 = np.random.default_rng(0).standard_normal((4, a.k)).astype(np.float32)
    x = x4[:1]
    mats = {}
    for fmt, gs in GROUPS.items():
        w, s = empty_rows(fmt, (a.n,), a.k, gs)
        encode_rows(wt, fmt, gs, w, s)
        out, out4 = np.empty(a.n, np.float32), np.empty((a.n, 4), np.float32)
        mats[fmt] = (w, s, gs, x, out, matvec)
        if fmt in ("fp8", "nvfp4"):
            mats[fmt + "_x4"] = (w, s, gs, x4, out4, matvec4)
            mats[fmt + ("_unfolded" if fmt == "fp8" else "_fp32")] = (w, s, gs, x, out, fp8_unfolded if fmt == "fp8" else nvfp4_fp32)
            if fmt == "nvfp4" and HAS_AVX512 and INT_ACT == "int8":
                mats["nvfp4_avx2"] = (w, s, gs, x, out, nvfp4_avx2)
            mats[fmt + "_loop"] = (w, s, gs, x, out, fp8_loop if fmt == "fp8" else nvfp4_loop)
        if fmt in ("int8", "int4"):
            mats[fmt + "_x4"] = (w, s, gs, x4, out4, matvec4)
            if HAS_AVX512 and HAS_AVX2 and INT_ACT == "int8":     # the AVX2 forms, same process
                mats[fmt + "_avx2"] = (w, s, gs, x, out, int4_avx2 if fmt == "int4" else int8_avx2)
                mats[fmt + "_x4_avx2"] = (w, s, gs, x4, out4, int4_avx2_x4 if fmt == "int4" else int8_avx2_x4)
    for w, s, gs, xx, out, fn in mats.values():
        fn(w, s, xx, gs, out)               # compile / warm
    times = {f: [] for f in mats}
    for _ in range(a.rounds):
        for fmt, (w, s, gs, xx, out, fn) in mats.items():
            fn(w, s, xx, gs, out)           # untimed: the vector units warm (after ~2 ms of scalar code,
            t0 = time.perf_counter()        # e.g. the *_loop rows, the next call ran 2-3x slower, AVX2 and VNNI alike)
            fn(w, s, xx, gs, out)
            times[fmt].append(time.perf_counter() - t0)
    ms = {f: 1e3 * float(np.median(t)) for f, t in times.items()}
    res = {"bench": "fmt_dots", "n": a.n, "k": a.k, "rounds": a.rounds, "int_act": INT_ACT, "threads": 1,
           "simd": "avx512" if HAS_AVX512 else "avx2" if HAS_AVX2 else "generic",
           "ms": {f: round(v, 4) for f, v in ms.items()},
           "ms_min": {f: round(1e3 * float(np.min(t)), 4) for f, t in times.items()},
           "gweights_per_s": {f: round(a.n * a.k * (4 if "_x4" in f else 1) / (v * 1e-3) / 1e9, 2) for f, v in ms.items()},
           "avx512_speedup": {f: round(ms[f + "_avx2"] / ms[f], 2) for f in ms if f + "_avx2" in ms},
           "vs_int8": {f: round(v / ms["int8"], 2) for f, v in ms.items()},
           "vs_int4": {f: round(v / ms["int4"], 2) for f, v in ms.items()}}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
