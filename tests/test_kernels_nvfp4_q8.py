"""nvfp4 weights x int8 activations (kernels/_simd "nvfp4 (e2m1) weights x int8 activations",
_dots.prep_nv8_row / nvfp4q8_dot): what the CPU runs for nvfp4 on x86 with AVX2 (INT_ACT "int8").

References: quant.q8act's torch quantiser (byte for byte against the kernel's quantiser), and
float64 torch on the format's own decoder (kernels._buffers.decode_rows = quant.nvfp4.dequantize_nvfp4)
times the dequantised int8 activations (roundtrip_act_q8): the kernels' only rounding is fp32's.
Each ISA form runs: the one this process picked in-process, the AVX2 form in a subprocess with
FREETOKEN_SIMD=avx2 where this process took AVX-512, and the exact fp32-activation dot
(FREETOKEN_INT_ACT=fp32) in a subprocess against unrounded activations. Shapes cover whole
128-column units (even and odd counts), a 64-column tail unit, and the plain loop (K % 64 != 0,
group 32) that reads the same prepared activations."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch
from numba import njit

from freetoken_py.kernels import DenseWeight, dense_linear
from freetoken_py.kernels._buffers import decode_rows, empty_rows, encode_rows
from freetoken_py.kernels._dots import INT_ACT, NV_WIDE, nv8_index, prep_nv8_rows, prepare, row_dot, row_dot4
from freetoken_py.quant import quantize_act_q8, roundtrip_act_q8

needs_int8_path = pytest.mark.skipif(INT_ACT != "int8", reason="int8-activation path inactive (no AVX2 or forced off)")

# (K, group): 16 whole units, 9 (odd count), 8 + a 64-column tail, the tail alone, and the plain
# loop: K = 96 / 48 (K % 64 != 0, partial last 32-block at 48), group 32
SHAPES = [(2048, 16), (1152, 16), (1088, 16), (64, 16), (96, 16), (48, 16), (256, 32)]


@njit(fastmath=True)
def _rows(w, s, x, gs, out, out4):
    xv, xg = prepare(w, s, x, gs)
    for n in range(w.shape[0]):
        out[n] = row_dot(w[n], s[n], xv[0], xg[0], gs // 2)
        a0, a1, a2, a3 = row_dot4(w[n], s[n], xv[0], xv[1], xv[2], xv[3], xg[0], xg[1], xg[2], xg[3], gs // 2)
        out4[0, n], out4[1, n], out4[2, n], out4[3, n] = a0, a1, a2, a3


def awkward_x(k: int, seed: int) -> np.ndarray:
    """4 rows: an all-zero 32-block, a huge and a tiny block, values of a few thousand, 1e-6 entries."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, k, generator=g)
    x[0, :32] = 0.0
    x[1, 32 % k:64 % k or k] *= 1e4
    x[2] *= 3000.0
    x[3, ::5] *= 1e-6
    return x.numpy().astype(np.float32)


def random_rows(n: int, k: int, gs: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes: every nibble value at random; e4m3 group scales at random over 0x00..0x7e (subnormal
    scales included); row factors of both kinds (a multiplier, a reciprocal)."""
    rng = np.random.default_rng(seed)
    w, s = empty_rows("nvfp4", (n,), k, gs)
    w[:] = rng.integers(0, 256, w.shape, dtype=np.uint8)
    ng = k // gs
    s[:, :ng] = rng.integers(0, 0x7F, (n, ng), dtype=np.uint8)
    s[:, :ng][:, ::7] = rng.integers(1, 8, s[:, :ng][:, ::7].shape, dtype=np.uint8)     # subnormal e4m3 scales
    f = np.where(np.arange(n) % 2 == 0, 1.0 / 3.0, -3000.0).astype(np.float32)
    s[:, ng:] = f.view(np.uint8).reshape(n, 4)
    return w, s


def max_error(k: int, gs: int, exact_x: bool) -> float:
    """max |kernel - reference| / (|x| . |w|) over row_dot and row_dot4, for random and encoded rows."""
    worst = 0.0
    for seed, kind in ((1, "random"), (2, "encoded")):
        n = 24
        if kind == "random":
            w, s = random_rows(n, k, gs, seed + k)
        else:
            g = torch.Generator().manual_seed(k + gs)
            wt = torch.randn(n, k, generator=g) * torch.logspace(-4, 1, k)[torch.randperm(k, generator=g)]
            w, s = empty_rows("nvfp4", (n,), k, gs)
            encode_rows(wt, "nvfp4", gs, w, s)
        ref_w = decode_rows(w, s, "nvfp4", gs).double().numpy()
        x = awkward_x(k, seed)
        xr = x.astype(np.float64) if exact_x else roundtrip_act_q8(torch.from_numpy(x)).double().numpy()
        out, out4 = np.empty(n, np.float32), np.empty((4, n), np.float32)
        _rows(w, s, x, gs, out, out4)
        assert np.all(np.isfinite(out)) and np.all(np.isfinite(out4))
        ref = xr @ ref_w.T
        bound = np.abs(xr) @ np.abs(ref_w).T + 1e-30
        worst = max(worst, float(np.max(np.abs(out - ref[0]) / bound[0])), float(np.max(np.abs(out4 - ref) / bound)))
    return worst


def run_all(exact_x: bool) -> float:
    return max(max_error(k, gs, exact_x) for k, gs in SHAPES)


@needs_int8_path
@pytest.mark.parametrize("k", [2048, 1088, 100, 48])
def test_quantiser_is_the_reference_byte_for_byte(k):
    """Values and scales as quantize_act_q8 of the zero-padded row; layout nv8_index; lane data."""
    x = torch.from_numpy(awkward_x(k, seed=k))
    x[2, :32] = 0.0
    x[2, 0], x[2, 7], x[2, 9] = 127.0, 2.5, -3.5        # scale 1: exact ties x / s = n + 1/2 (half to even)
    xq, xg = prep_nv8_rows(x.numpy())
    q, sc = quantize_act_q8(torch.nn.functional.pad(x, (0, -k % 32)))
    nl = (k + 7) // 8
    idx = np.array([nv8_index(c, k) for c in range(k)])
    assert sorted(idx) == list(range(k))                                  # a permutation
    assert np.array_equal(xq[:, idx], q[:, :k].numpy())
    lanes_scale = xg[:, :nl].view(np.float32)
    assert np.array_equal(lanes_scale, sc.numpy()[:, np.arange(nl) * 8 // 32])
    qpad = torch.nn.functional.pad(q[:, :k].to(torch.int64), (0, 8 * nl - k))
    assert np.array_equal(xg[:, nl:], (-12 * qpad.reshape(4, nl, 8).sum(-1)).numpy())


@needs_int8_path
@pytest.mark.parametrize("k,gs", SHAPES)
def test_dots_match_the_decoded_weights_times_the_int8_activations(k, gs):
    assert max_error(k, gs, exact_x=False) <= 2e-6


@needs_int8_path
def test_extremes_do_not_saturate():
    """Every nibble 6.0 (u8 24, the table's largest) or -6.0 (u8 0) against q_x = +-127: each
    vpmaddubsw pair and the lo + hi sum at their maxima; integer-valued, so exact."""
    k, n = 2048 + 64, 4
    w, s = empty_rows("nvfp4", (n,), k, 16)
    w[0], w[1], w[2], w[3] = 0x77, 0xFF, 0x7F, 0xF7                      # +6 / -6 in both nibbles, mixed
    s[:, :k // 16] = 0x38                                                 # e4m3 1.0
    s[:, k // 16:] = np.array([1.0], np.float32).view(np.uint8)[None]
    x = np.ones((4, k), np.float32) * np.array([1, -1, 2, -3], np.float32)[:, None]
    out, out4 = np.empty(n, np.float32), np.empty((4, n), np.float32)
    _rows(w, s, x, 16, out, out4)
    ref = x.astype(np.float64) @ decode_rows(w, s, "nvfp4", 16).double().numpy().T
    assert np.array_equal(out, ref[0].astype(np.float32)) and np.array_equal(out4, ref.astype(np.float32))


@needs_int8_path
@pytest.mark.parametrize("num_t", [1, 3, 6])
def test_dense_linear_runs_the_int8_path(num_t):
    """Through the public API (T = 1: row_dot; 3: a padded 4-row pass; 6: 4 + 2)."""
    g = torch.Generator().manual_seed(num_t)
    dw = DenseWeight.from_tensor(torch.randn(40, 1088, generator=g) * 0.05, "nvfp4")
    x = torch.randn(num_t, 1088, generator=g)
    out = dense_linear(dw, x).double()
    w = dw.dequantized().double()
    ref = roundtrip_act_q8(x).double() @ w.T
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-5
    exact = x.double() @ w.T
    assert 1e-5 < ((out - exact).norm() / exact.norm()).item() <= 2e-2      # the int8 activations are in effect


def _subprocess(**env_vars) -> str:
    tag = "-".join(f"{k}={v}" for k, v in sorted(env_vars.items()))
    env = dict(os.environ, **env_vars, NUMBA_CACHE_DIR=os.path.join(tempfile.gettempdir(), f"freetoken-test-nvq8-{tag}"))
    code = ("import sys; sys.path.insert(0, %r); import test_kernels_nvfp4_q8 as t; from freetoken_py.kernels._dots import "
            "INT_ACT, NV_WIDE; print(INT_ACT, NV_WIDE, t.run_all(INT_ACT != 'int8'))" % os.path.dirname(__file__))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.split()


@needs_int8_path
@pytest.mark.skipif(not NV_WIDE, reason="this process already runs the AVX2 form")
def test_the_avx2_form_in_a_subprocess():
    mode, wide, err = _subprocess(FREETOKEN_SIMD="avx2")
    assert (mode, wide) == ("int8", "False") and float(err) <= 2e-6


def test_the_exact_fp32_activation_dot_in_a_subprocess():
    """FREETOKEN_INT_ACT=fp32 (what CPUs without AVX2 run): the activations as they are."""
    mode, _, err = _subprocess(FREETOKEN_INT_ACT="fp32")
    assert mode == "fp32" and float(err) <= 1e-5
