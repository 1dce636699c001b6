"""The kernels' path tags (_dots "Path tags"): the row loops test the vector dot's shape once per
block (`vec_rows`) and run on VEC (the vector dot alone) or ANY (row_dot's own per-row dispatch).

Checks, per format and activation path of this process: `vec_rows` holds for the shapes real
checkpoints have (fp8 block 128, nvfp4 group 16, K % 64 == 0 (fp8: a partial last block included): a regression to ANY would only cost
speed, so it is asserted) and not where the vector forms do not apply (a 32-column fp8 block, K % 64 != 0:
352 fp8 or 96 nvfp4 columns: VEC there would read a wrong layout); where it holds, pdot / pdot4 on VEC
equal row_dot / row_dot4 bit for bit (they run the same vector dot), and on ANY always; and the
dense GEMV block (`cpu_linear.gemv_block`, which picks the tag) equals row_dot per row (to fp32
rounding) for 1, 3 and 4 tokens on both kinds of shape.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import njit

from freetoken_py.kernels._dots import ANY, VEC, pdot, pdot4, prepare, row_dot, row_dot4, vec_rows
from freetoken_py.kernels.cpu_linear import DenseWeight, gemv_block

# (format, group / block size, columns, whether the vector dot alone applies)
CASES = [("fp8", 128, 256, True), ("fp8", 128, 384, True), ("fp8", 32, 256, False), ("fp8", 128, 352, False),
         ("nvfp4", 16, 128, True), ("nvfp4", 16, 2048, True), ("nvfp4", 16, 96, False),
         ("int4", 32, 256, True), ("int8", 32, 160, True), ("bf16", 32, 96, True)]


@njit(fastmath=True)
def _prepare(w, s, x, gs):
    return prepare(w, s, x, gs)


@njit(fastmath=True)
def _gemv_block(w, s, xv, xg, hb, n0, n1, out):
    gemv_block(w, s, xv, xg, hb, n0, n1, out)      # an overload: callable from jitted code only


@njit(fastmath=True)
def _tagged(w, s, xv, xg, hb, vec, one, four):
    """one [3, N]: row_dot, pdot(ANY), pdot(VEC) of token 0; four [3, N, 4] likewise for tokens 0-3."""
    for n in range(w.shape[0]):
        one[0, n] = row_dot(w[n], s[n], xv[0], xg[0], hb)
        one[1, n] = pdot(ANY, w[n], s[n], xv[0], xg[0], hb)
        four[0, n, 0], four[0, n, 1], four[0, n, 2], four[0, n, 3] = row_dot4(
            w[n], s[n], xv[0], xv[1], xv[2], xv[3], xg[0], xg[1], xg[2], xg[3], hb)
        four[1, n, 0], four[1, n, 1], four[1, n, 2], four[1, n, 3] = pdot4(
            ANY, w[n], s[n], xv[0], xv[1], xv[2], xv[3], xg[0], xg[1], xg[2], xg[3], hb)
        if vec:
            one[2, n] = pdot(VEC, w[n], s[n], xv[0], xg[0], hb)
            four[2, n, 0], four[2, n, 1], four[2, n, 2], four[2, n, 3] = pdot4(
                VEC, w[n], s[n], xv[0], xv[1], xv[2], xv[3], xg[0], xg[1], xg[2], xg[3], hb)


@njit(fastmath=True)
def _vec_rows(w, s, xv, hb):
    return vec_rows(w, s, xv, hb)


def _weight(fmt, gs, k, n=9):
    g = torch.Generator().manual_seed(k * 7 + gs)
    dw = DenseWeight.from_tensor(torch.randn(n, k, generator=g) * 0.05, fmt, group_size=gs)
    x = (torch.randn(4, k, generator=g) * 2).numpy()
    return dw, x


@pytest.mark.parametrize("fmt,gs,k,vec", CASES)
def test_vec_rows_and_the_tagged_dots_equal_row_dot(fmt, gs, k, vec):
    dw, x = _weight(fmt, gs, k)
    xv, xg = _prepare(dw.w, dw.s, x, gs)
    hb = gs // 2
    if fmt in ("fp8", "nvfp4"):   # the formats whose dots have a per-row fallback
        fp32_nvfp4 = fmt == "nvfp4" and xv.dtype == np.float32     # FREETOKEN_INT_ACT=fp32: its vector form takes K % 32
        assert _vec_rows(dw.w, dw.s, xv, hb) == (k % 32 == 0 if fp32_nvfp4 else vec)
    else:
        assert _vec_rows(dw.w, dw.s, xv, hb)
    vec = bool(_vec_rows(dw.w, dw.s, xv, hb))
    n = dw.w.shape[0]
    one, four = np.full((3, n), np.nan, np.float32), np.full((3, n, 4), np.nan, np.float32)
    _tagged(dw.w, dw.s, xv, xg, hb, vec, one, four)
    assert np.isfinite(one[0]).all() and np.abs(one[0]).max() > 0
    np.testing.assert_array_equal(one[1], one[0])
    np.testing.assert_array_equal(four[1], four[0])
    if vec:
        np.testing.assert_array_equal(one[2], one[0])
        np.testing.assert_array_equal(four[2], four[0])


@pytest.mark.parametrize("fmt,gs,k,vec", CASES)
@pytest.mark.parametrize("num_t", [1, 3, 4])
def test_gemv_block_equals_row_dot_per_row(fmt, gs, k, vec, num_t):
    dw, x = _weight(fmt, gs, k)
    xv, xg = _prepare(dw.w, dw.s, np.ascontiguousarray(x[:num_t]), gs)
    n = dw.w.shape[0]
    out = np.full((num_t, n), np.nan, np.float32)
    _gemv_block(dw.w, dw.s, xv, xg, gs // 2, 2, n, out)       # rows 2.. only: a block, as the kernels call it
    one, four = np.full((3, n), np.nan, np.float32), np.full((3, n, 4), np.nan, np.float32)
    xv4, xg4 = _prepare(dw.w, dw.s, np.ascontiguousarray(x[[min(i, num_t - 1) for i in range(4)]]), gs)
    _tagged(dw.w, dw.s, xv4, xg4, gs // 2, False, one, four)
    assert np.isnan(out[:, :2]).all()
    want = one[0][None, 2:] if num_t == 1 else four[0, 2:, :num_t].T
    # equal to fp32 rounding: the same dots, compiled into another function (fast-math may contract
    # the row multiplier differently; a wrong path is wrong in every digit)
    np.testing.assert_allclose(out[:, 2:], want, rtol=2e-5, atol=2e-6 * np.abs(want).max())
