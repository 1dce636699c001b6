"""kernels/_simd.exp_shift_sum, the vector exp of the decode softmax, and _simd.swiglu, the experts'
vector SwiGLU on the same exp, against float64 numpy."""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from freetoken_py.kernels._simd import exp_shift_sum, swiglu


@njit(fastmath=True)
def _call(x, m):
    return exp_shift_sum(x, m)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 1000])   # 8-lane body and 1-lane tail
def test_exp_shift_sum_matches_float64(n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 25).astype(np.float32)
    m = np.float32(x.max() if n else 0.0)
    got = x.copy()
    total = _call(got, m)
    shifted = (x - m).astype(np.float64)             # the kernel subtracts in fp32, as this does
    ref = np.exp(shifted)
    normal = shifted >= -87.0
    assert np.all(np.abs(got[normal] - ref[normal]) <= 4e-7 * ref[normal])        # ~3 ulp
    assert np.all(got[~normal] <= 2e-38) and np.all(got >= 0)                       # flushed to e^-87 at most
    assert abs(total - ref.sum()) <= 1e-6 * max(ref.sum(), 1e-30)


def test_exp_without_shift_and_at_the_clamps():
    x = np.array([0.0, 1.0, -1.0, 88.0, 100.0, -87.0, -200.0, 0.5, 1e-8], np.float32)
    got = x.copy()
    _call(got, np.float32(0.0))
    ref = np.exp(np.minimum(x.astype(np.float64), 88.0))
    assert np.all(np.isfinite(got))
    ok = x >= -87
    assert np.all(np.abs(got[ok] - ref[ok]) <= 4e-7 * ref[ok])
    assert got[6] <= 2e-38


@njit(fastmath=True)
def _swiglu(g, u, out):
    swiglu(g, u, out)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 17, 768])
def test_swiglu_matches_float64(n):
    rng = np.random.default_rng(n + 100)
    g = (rng.standard_normal(n) * 8).astype(np.float32)
    g[: min(n, 3)] = np.array([-120.0, 95.0, 0.0], np.float32)[: min(n, 3)]    # past both clamps, and 0
    u = rng.standard_normal(n).astype(np.float32)
    gd = g.astype(np.float64)
    ref = gd / (1.0 + np.exp(-gd)) * u
    out = np.full(n + 2, 7.0, np.float32)                    # written up to len(out[:n]) only
    _swiglu(g, u, out[:n])
    assert np.all(out[n:] == 7.0)
    assert np.all(np.abs(out[:n] - ref) <= 4e-7 * np.abs(ref) + 1e-30)
    inplace = g.copy()
    _swiglu(inplace, u, inplace)                              # out may be g (the kernels' use)
    np.testing.assert_array_equal(inplace, out[:n])
