"""AVX-512 VNNI forms of the int4 x int8 and int8 x int8 row dots (kernels/_simd "AVX-512 VNNI",
picked by _dots.q4q8_dot / i8q8_dot), both ISA paths in one process.

References: integer-valued inputs whose every fp32 sum is exact (so any order of summation gives
the same bits): both ISAs must return exactly the integer reference; random inputs: both against
float64 torch on dequant(w) and dequant(quant8(x)) (1e-5), and the two ISAs against each other.
Shapes: K with 1-3 blocks after the last whole 128-quad, group sizes 32 / 64 / 128 / 256 and
192 (which the dispatcher leaves to AVX2), 1 and 4 activation rows; the dispatch itself (the quad
activation layout exactly when the VNNI dot runs), FREETOKEN_SIMD, the emitted vpdpbusd, and
dense / expert kernels at M = 1..9 rows through whatever path this process picked.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from numba import njit

from freetoken_py.kernels import DenseWeight, ExpertBank, dense_linear, moe_experts
from freetoken_py.kernels._buffers import decode_rows
from freetoken_py.kernels._dots import INT_ACT, prep_q8_rows, prep_q8_rows_as, prep_q8n_rows, quad_layout
from freetoken_py.kernels._simd import HAS_AVX2, HAS_AVX512, TARGET_AVX512
from freetoken_py.quant import dequantize_act_q8, quantize_act_q8, roundtrip_act_q8

if HAS_AVX2:
    from freetoken_py.kernels._simd import q4q8_row_dot, q4q8_row_dot4, i8q8_row_dot, i8q8_row_dot4
if TARGET_AVX512:
    from freetoken_py.kernels._simd import q4q8v_row_dot, q4q8v_row_dot4, i8q8v_row_dot, i8q8v_row_dot4

needs_vnni = pytest.mark.skipif(not (TARGET_AVX512 and HAS_AVX2), reason="no AVX-512 VNNI on this compile target")
needs_int8_path = pytest.mark.skipif(INT_ACT != "int8", reason="int8-activation path inactive (no AVX2 or forced off)")

if TARGET_AVX512 and HAS_AVX2:
    @njit(fastmath=True)
    def q4_mv(w, s, xq, xg, hb, vnni):
        """[N, R] = every row of w dotted with every activation row of xq / xg (R = 1 or 4)."""
        r = xq.shape[0]
        out = np.empty((w.shape[0], r), np.float32)
        for n in range(w.shape[0]):
            if r == 4:
                if vnni:
                    a = q4q8v_row_dot4(w[n], s[n], xq[0], xq[1], xq[2], xq[3], xg[0], xg[1], xg[2], xg[3], hb)
                else:
                    a = q4q8_row_dot4(w[n], s[n], xq[0], xq[1], xq[2], xq[3], xg[0], xg[1], xg[2], xg[3], hb)
                out[n, 0], out[n, 1], out[n, 2], out[n, 3] = a
            elif vnni:
                out[n, 0] = q4q8v_row_dot(w[n], s[n], xq[0], xg[0], hb)
            else:
                out[n, 0] = q4q8_row_dot(w[n], s[n], xq[0], xg[0], hb)
        return out

    @njit(fastmath=True)
    def i8_mv(w, xq, xs, vnni):
        r = xq.shape[0]
        out = np.empty((w.shape[0], r), np.float32)
        for n in range(w.shape[0]):
            if r == 4:
                if vnni:
                    a = i8q8v_row_dot4(w[n], xq[0], xq[1], xq[2], xq[3], xs[0], xs[1], xs[2], xs[3])
                else:
                    a = i8q8_row_dot4(w[n], xq[0], xq[1], xq[2], xq[3], xs[0], xs[1], xs[2], xs[3])
                out[n, 0], out[n, 1], out[n, 2], out[n, 3] = a
            elif vnni:
                out[n, 0] = i8q8v_row_dot(w[n], xq[0], xs[0])
            else:
                out[n, 0] = i8q8_row_dot(w[n], xq[0], xs[0])
        return out


def int_activations(rows: int, k: int, rng) -> np.ndarray:
    """Integers in [-127, 127] with a +-127 in every 32-block: s_x = 1 exactly, q_x = x."""
    x = rng.integers(-127, 128, (rows, k)).astype(np.float32)
    x[:, ::32] = 127.0 * rng.choice([-1.0, 1.0], (rows, (k + 31) // 32))
    return x


def int4_codes(n: int, k: int, gs: int, rng):
    """Packed nibbles in [1, 15] (q_w in [-7, 7]) and power-of-two fp16 group scales."""
    nib = rng.integers(1, 16, (n, k)).astype(np.uint8)
    w = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    s = (2.0 ** rng.integers(-2, 2, (n, k // gs))).astype(np.float16).view(np.uint16)
    return w, s, nib.astype(np.float64) - 8.0


# 32-blocks: 1, 3 (no quad), 4, 5, 6, 7 (a quad + 1 / pair / pair + 1), 24 (768), 64 (2048)
KS_G32 = [32, 96, 128, 160, 192, 224, 768, 2048]


@needs_vnni
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("gs,k", [(32, k) for k in KS_G32] + [(64, 128), (64, 192), (64, 320), (64, 768),
                                                           (128, 256), (128, 768), (256, 512), (256, 2048),
                                                           (192, 576)])
def test_int4_both_isas_exact_on_integer_inputs(gs, k, rows):
    rng = np.random.default_rng(gs * 1000 + k + rows)
    w, s, q_w = int4_codes(37, k, gs, rng)
    x = int_activations(rows, k, rng)
    sw = np.repeat(s.view(np.float16).astype(np.float64), gs, axis=1)
    ref = (q_w * sw) @ x.astype(np.float64).T                     # exact in fp32: every partial is an integer / 4
    assert np.abs(ref).max() < 2 ** 22
    vnni_ok = gs <= 64 or gs % 128 == 0              # g = 192: q4q8v_row_dot runs the AVX2 form on the pair layout
    for vnni in (False, True):
        xq, xg = prep_q8_rows_as(x, gs, vnni and vnni_ok)
        got = q4_mv(w, s, xq, xg, gs // 2, vnni)
        assert np.array_equal(got.astype(np.float64), ref), f"vnni={vnni}"


@needs_vnni
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("gs,k", [(32, 160), (32, 224), (32, 2048), (64, 320), (128, 768), (256, 512)])
def test_int4_vnni_against_quantised_activation_reference(gs, k, rows):
    g = torch.Generator().manual_seed(gs + k + rows)
    dw = DenseWeight.from_tensor(torch.randn(45, k, generator=g) * 0.1, "int4", gs)
    x = torch.randn(rows, k, generator=g) * 3.0
    xq, xg = prep_q8_rows_as(x.numpy(), gs, True)
    out = torch.from_numpy(q4_mv(dw.w, dw.s, xq, xg, gs // 2, True)).double()
    ref = dw.dequantized().double() @ dequantize_act_q8(*quantize_act_q8(x)).double().T
    assert float((out - ref).norm() / ref.norm()) <= 1e-5
    xq2, xg2 = prep_q8_rows_as(x.numpy(), gs, False)
    avx2 = torch.from_numpy(q4_mv(dw.w, dw.s, xq2, xg2, gs // 2, False)).double()
    assert float((out - avx2).norm() / ref.norm()) <= 2e-6


@needs_vnni
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("k", [31, 32, 33, 64, 96, 100, 160, 224, 256, 288, 768, 2048])
def test_int8_both_isas_exact_on_integer_inputs(k, rows):
    """K = 31 / 33 / 100: a partial block (scalar tail); 96 / 160 / 224: an odd last whole block;
    |w| = 127 and w = 0 included (vpabsb and the masked negation)."""
    rng = np.random.default_rng(k * 10 + rows)
    w = rng.integers(-127, 128, (37, k)).astype(np.int8)
    w[0] = 127
    w[1] = -127
    w[2, ::3] = 0
    x = int_activations(rows, k, rng)
    xq, xs = prep_q8n_rows(x)
    ref = w.astype(np.float64) @ x.astype(np.float64).T
    got = {v: i8_mv(w, xq, xs, v) for v in (False, True)}
    for v in (False, True):
        assert np.array_equal(got[v].astype(np.float64), ref), f"vnni={v}"


@needs_vnni
@pytest.mark.parametrize("k", [100, 160, 2048])
def test_int8_vnni_against_quantised_activation_reference(k):
    g = torch.Generator().manual_seed(k)
    dw = DenseWeight.from_tensor(torch.randn(45, k, generator=g) * 0.1, "int8")
    x = torch.randn(4, k, generator=g) * 3.0
    xq, xs = prep_q8n_rows(x.numpy())
    ref = dw.dequantized().double() @ roundtrip_act_q8(x).double().T
    row_scale = torch.from_numpy(dw.s[:, :1].astype(np.float64))
    for rows in (1, 4):
        out = torch.from_numpy(i8_mv(dw.w, xq[:rows], xs[:rows], True)).double() * row_scale
        assert float((out - ref[:, :rows]).norm() / ref[:, :rows].norm()) <= 1e-5


def test_quad_layout_follows_the_dispatch():
    """prep_q8_rows writes the quad layout exactly when the process's int4 dot is the VNNI one."""
    assert quad_layout(32) == HAS_AVX512 and quad_layout(128) == HAS_AVX512 and not quad_layout(192)
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    for gs in (32, 64, 128, 256):
        a = prep_q8_rows(x, gs)
        b = prep_q8_rows_as(x, gs, quad_layout(gs))
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@pytest.mark.skipif(not HAS_AVX512, reason="the VNNI dots are not the process's choice here")
def test_row_dot_compiles_to_vpdpbusd():
    from freetoken_py.kernels._dots import row_dot

    @njit(fastmath=True)
    def dot(w, s, xq, xg, hb):
        return row_dot(w, s, xq, xg, hb)

    rng = np.random.default_rng(1)
    w, s, _ = int4_codes(1, 256, 32, rng)
    xq, xg = prep_q8_rows(int_activations(1, 256, rng), 32)
    dot(w[0], s[0], xq[0], xg[0], 16)
    assert "vpdpbusd" in dot.inspect_asm(dot.signatures[0])
    w8 = rng.integers(-127, 128, 256).astype(np.int8)
    x8, s8 = prep_q8n_rows(int_activations(1, 256, rng))
    dot(w8, np.ones(1, np.float32), x8[0], s8[0], 16)
    assert "vpdpbusd" in dot.inspect_asm(dot.signatures[1])


def _simd_in_subprocess(value: str):
    env = dict(os.environ, FREETOKEN_SIMD=value)
    code = "from freetoken_py.kernels._simd import HAS_AVX512; print(HAS_AVX512)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_simd_env_forces_avx2_and_rejects_bad_values():
    assert _simd_in_subprocess("AVX2").stdout.strip() == "False"
    assert _simd_in_subprocess("avx512").stdout.strip() == str(TARGET_AVX512)
    res = _simd_in_subprocess("sse9")
    assert res.returncode != 0 and "FREETOKEN_SIMD must be 'avx2' or 'avx512' (or unset), got 'sse9'" in res.stderr


@needs_int8_path
@pytest.mark.parametrize("fmt,gs,k", [("int4", 32, 224), ("int4", 64, 320), ("int4", 128, 384), ("int8", 32, 100),
                                      ("int8", 32, 224)])
def test_dense_rows_m1_to_9_against_reference(fmt, gs, k):
    """Through the process's dispatch (VNNI here when available): every row count 1..9 (the 4-row
    passes, their padded 2-3 row tails and the 1-row tail)."""
    g = torch.Generator().manual_seed(k)
    dw = DenseWeight.from_tensor(torch.randn(70, k, generator=g) * 0.1, fmt, gs)
    w = dw.dequantized().double()
    for m in range(1, 10):
        x = torch.randn(m, k, generator=g)
        out = dense_linear(dw, x).double()
        ref = roundtrip_act_q8(x).double() @ w.T
        assert float((out - ref).norm() / ref.norm()) <= 1e-5, m


@needs_int8_path
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_experts_m1_to_9_against_reference(fmt):
    """moe_experts at T = 1..9, top-2 of 4 experts, D = 256 / I = 96 (int8: 3 blocks, an odd one)."""
    g = torch.Generator().manual_seed(9)
    gate, up = (torch.randn(4, 96, 256, generator=g) * 0.1 for _ in range(2))
    down = torch.randn(4, 256, 96, generator=g) * 0.1
    bank = ExpertBank.from_weights(gate, up, down, fmt=fmt, group_size=32)
    w13, w2 = (decode_rows(a, b, fmt, 32).double() for a, b in ((bank.w13, bank.s13), (bank.w2, bank.s2)))
    for m in range(1, 10):
        x = torch.randn(m, 256, generator=g)
        ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(m)])
        wts = torch.rand(m, 2, generator=g)
        out = moe_experts(bank, x, ids, wts).double()
        xq = roundtrip_act_q8(x).double()
        ref = torch.zeros(m, 256, dtype=torch.float64)
        for t in range(m):
            for j in range(2):
                e = int(ids[t, j])
                gu = w13[e] @ xq[t]
                h = torch.nn.functional.silu(gu[:96]) * gu[96:]
                ref[t] += float(wts[t, j]) * (w2[e] @ roundtrip_act_q8(h[None].float())[0].double())
        assert float((out - ref).norm() / ref.norm()) <= 1e-4, m
