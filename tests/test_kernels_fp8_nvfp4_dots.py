"""fp8 / nvfp4 row dots (the _simd vector forms and the plain fallback loops) against the
format's own decoder (kernels._buffers.decode_rows) times the activations in float64, including
activations of a few thousand (a fast-math rewrite of (v * 2^120) * x into v * (2^120 * x) made
the old loop return NaN there) and shapes that take each path. nvfp4 on x86 with AVX2 multiplies
int8-quantised activations (INT_ACT "int8", tests/test_kernels_nvfp4_q8.py): its reference takes
the activations as the kernel rounds them (quant.roundtrip_act_q8)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import njit

from freetoken_py.kernels._buffers import decode_rows, empty_rows, encode_rows
from freetoken_py.kernels._dots import INT_ACT, prepare, row_dot, row_dot4
from freetoken_py.quant import roundtrip_act_q8


@njit(fastmath=True)
def _rows(w, s, x, gs, out, out4):
    xv, xg = prepare(w, s, x, gs)
    for n in range(w.shape[0]):
        out[n] = row_dot(w[n], s[n], xv[0], xg[0], gs // 2)
        a0, a1, a2, a3 = row_dot4(w[n], s[n], xv[0], xv[1], xv[2], xv[3], xg[0], xg[1], xg[2], xg[3], gs // 2)
        out4[0, n], out4[1, n], out4[2, n], out4[3, n] = a0, a1, a2, a3


# (fmt, K, group): fp8 64-lane / 16-lane (partial last block) / plain loop (K % 16 != 0);
# nvfp4 vector (group 16) / plain loop (group 32)
# fp8 1024 / 128 and 1088 / 128 (a partial 64-column last block): the folded-scale dot
CASES = [("fp8", 1024, 128), ("fp8", 1088, 128), ("fp8", 400, 128), ("fp8", 200, 128), ("fp8", 96, 32),
         ("nvfp4", 1024, 16), ("nvfp4", 96, 16), ("nvfp4", 256, 32)]


@pytest.mark.parametrize("fmt,k,gs", CASES)
@pytest.mark.parametrize("amp", [1.0, 3000.0])
def test_dot_matches_decoded_weights(fmt, k, gs, amp):
    g = torch.Generator().manual_seed(k + gs)
    n = 24
    wt = torch.randn(n, k, generator=g) * torch.logspace(-4, 1, k)[torch.randperm(k, generator=g)]
    w, s = empty_rows(fmt, (n,), k, gs)
    encode_rows(wt, fmt, gs, w, s)
    ref_w = decode_rows(w, s, fmt, gs).double().numpy()
    x = (torch.randn(4, k, generator=g) * amp).numpy().astype(np.float32)
    x[:, ::5] *= 1e-6
    out, out4 = np.empty(n, np.float32), np.empty((4, n), np.float32)
    _rows(w, s, x, gs, out, out4)
    xr = roundtrip_act_q8(torch.from_numpy(x)).numpy() if fmt == "nvfp4" and INT_ACT == "int8" else x
    ref = xr.astype(np.float64) @ ref_w.T
    bound = 1e-5 * (np.abs(xr).astype(np.float64) @ np.abs(ref_w).T) + 1e-30
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(out4))
    assert np.all(np.abs(out - ref[0]) <= bound[0])
    assert np.all(np.abs(out4 - ref) <= bound)


@pytest.mark.parametrize("big", [100.0, 1000.0, 3e30])
def test_fp8_large_block_scales_stay_finite(big):
    """The folded-scale dot multiplies each block scale by 2^120 (finite below 2^8): a row with a
    block scale from 2^7 up multiplies by 2^120 and then by the scale (a branch per block)."""
    g = torch.Generator().manual_seed(7)
    n, k, gs = 8, 1024, 128
    w, s = empty_rows("fp8", (n,), k, gs)
    encode_rows(torch.randn(n, k, generator=g), "fp8", gs, w, s)
    s[::2, 3] = big                                  # even rows: one big block; odd rows fold throughout
    ref_w = decode_rows(w, s, "fp8", gs).double().numpy()
    x = torch.randn(4, k, generator=g).numpy()
    out, out4 = np.empty(n, np.float32), np.empty((4, n), np.float32)
    _rows(w, s, x, gs, out, out4)
    ref = x.astype(np.float64) @ ref_w.T
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(ref_w).T)
    assert np.all(np.abs(out - ref[0]) <= bound[0]) and np.all(np.abs(out4 - ref) <= bound)


def test_fp8_dot_decodes_every_code_exactly_and_in_place():
    """One-hot activations read single weights back: every e4m3 code (NaN's left out), at every
    column of the 64-byte units the vector dots decode at once, equals its float64 value times its
    block scale bit for bit (the table decode on CPUs with AVX512-VBMI: a wrong table entry, sign or
    column order fails here; elsewhere the bit-placement decode)."""
    n, k, gs = 4, 256, 128
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    rng = np.random.default_rng(5)
    w = np.stack([rng.permutation(np.resize(codes, k)) for _ in range(n)]).astype(np.uint8)
    s = np.array([[0.5, 3.0], [1e-3, 200.0], [1.0, 1.0], [7.0, 0.25]], np.float32)
    want = decode_rows(w, s, "fp8", gs).double().numpy()
    out, out4 = np.empty(n, np.float32), np.empty((4, n), np.float32)
    got = np.empty((n, k))
    for j in range(0, k, 4):
        x = np.zeros((4, k), np.float32)
        x[np.arange(4), j + np.arange(4)] = 1.0
        _rows(w, s, x, gs, out, out4)
        assert out[0] == out4[0][0] or (np.isnan(out[0]) and np.isnan(out4[0][0]))
        got[:, j:j + 4] = out4.T
    assert np.array_equal(got, want.astype(np.float32).astype(np.float64))


def test_numbas_inliner_phi_warnings_are_silenced_and_nothing_else():
    """The nvfp4 kernels' first compile printed numba's pedantic "variable ... is not in scope"
    warning (with its "please report" text) five times; importing _dots silences exactly that form
    (a fresh process: pytest resets warning filters per test)."""
    import subprocess
    import sys

    code = (
        "import warnings\n"
        "from numba.core.errors import NumbaIRAssumptionWarning as W\n"
        "import freetoken_py.kernels._dots\n"
        "warnings.warn(W(\"\\x1b[1m\\x1b[1mvariable '_pdot4_impl__locals___lambda__v849_nvfp4q8_vec4_v850_nvfp4_multiplier\"\n"
        "                \"_v852__vphi102_0_2.1' is not in scope.\\n\\nThis warning came from an internal pedantic check.\"))\n"
        "warnings.warn(W(\"variable 'other.1' is not in scope.\"))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "other.1" in proc.stderr and "__vphi" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("k,bk", [(256, 128), (208, 64), (96, 32)])
def test_fp8_widen_row_is_every_code_times_its_scale_exactly(k, bk):
    """The prefill tiles' widen (`_dots.widen_row` -> `_simd.fp8_widen_row`): every e4m3 code times
    its block scale, bit for bit, through the 64-column table units (AVX512-VBMI) and the 16-column
    remainder (blocks of 32, a last block of 16) alike."""
    from freetoken_py.kernels._dots import widen_row

    @njit
    def widen(w, s, hb, out):
        for r in range(w.shape[0]):
            widen_row(w[r], s[r], hb, out[r])

    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    rng = np.random.default_rng(k)
    w = np.stack([rng.permutation(np.resize(codes, k)) for _ in range(3)]).astype(np.uint8)
    s = rng.choice(np.array([1e-3, 0.5, 3.0, 200.0], np.float32), size=(3, -(-k // bk))).astype(np.float32)
    out = np.empty((3, k), np.float32)
    widen(w, s, bk // 2, out)
    assert np.array_equal(out, decode_rows(w, s, "fp8", bk).numpy())
