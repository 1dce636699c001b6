"""Issue 45's kernel changes against each format's own float64 dequantisation, on odd shapes, in
both instruction-set paths:

- fp8 x bf16 activations (`_simd.fp8bf_row_dot*`, AVX512-BF16 + VBMI): the flat loop (blocks of
  128 and K % 128 == 0: one trip per block) and the general one (other blocks, a partial last
  block, an odd unit count), rows holding every e4m3 byte (zeros and subnormals included), against
  quant.fp8's table in float64 times the block scales and torch's bf16 rounding of the activations;
- nvfp4 x int8 activations, the AVX-512 VNNI unit (low nibbles by one vpermb, the e4m3 group scales
  by bit placement instead of vcvtph2ps): zero, subnormal and the largest scales, odd unit counts
  and a 64-column tail, against quant.nvfp4's decoder (decode_rows) in float64 times the
  dequantised int8 activations (roundtrip_act_q8).
Both are AVX-512 forms (the AVX2 paths did not change: fp8 keeps its exact fp32 dots there, nvfp4
its AVX2 unit); the AVX2 runs of these formats are tests/test_kernels_fp8_bf16act.py's and
tests/test_kernels_nvfp4_q8.py's FREETOKEN_SIMD=avx2 subprocesses.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import njit

from freetoken_py.kernels import _dots
from freetoken_py.kernels._buffers import decode_rows, empty_rows
from freetoken_py.kernels._simd import HAS_AVX512, HAS_AVX512BF16, HAS_AVX512VBMI
from freetoken_py.quant import roundtrip_act_q8
from freetoken_py.quant.fp8 import e4m3_table

needs_bf16 = pytest.mark.skipif(not (HAS_AVX512BF16 and HAS_AVX512VBMI), reason="no AVX512-BF16 + VBMI on this CPU")
needs_vnni = pytest.mark.skipif(not HAS_AVX512 or _dots.INT_ACT != "int8", reason="AVX-512 VNNI int8 path inactive")


def torch_bf16(x: torch.Tensor) -> torch.Tensor:
    r = x.float().bfloat16().float()
    return torch.where(r.abs() < 2.0 ** -126, r * 0.0, r)


@njit(fastmath=True)
def _fp8_rows(w, s, xb, bk, out, out4):
    for n in range(w.shape[0]):
        out[n] = _dots.fp8bf_row_dot(w[n], s[n], xb[0], bk)
        out4[n, 0], out4[n, 1], out4[n, 2], out4[n, 3] = _dots.fp8bf_row_dot4(w[n], s[n], xb[0], xb[1], xb[2],
                                                                              xb[3], bk)


@needs_bf16
@pytest.mark.parametrize("n,k,bk", [(5, 384, 128), (3, 1152, 128), (4, 128, 128),       # flat: odd block counts
                                    (3, 320, 128), (6, 768, 256), (5, 448, 64), (2, 192, 192)])   # general
def test_fp8_bf16_dot_matches_the_table_in_float64(n, k, bk):
    g = np.random.default_rng(n * k + bk)
    w = g.integers(0, 256, (n, k)).astype(np.uint8)
    w[np.isin(w, (0x7F, 0xFF))] = 0x7E                       # no NaN bytes
    w[0, :64] = np.arange(64, dtype=np.uint8) % 16           # zeros and subnormals in one unit
    s = (g.random((n, -(-k // bk))) * 2e-3 + 1e-4).astype(np.float32)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(k)) * 3
    xb = _dots.prep_fp8bf_rows(x.numpy())
    vals = torch.from_numpy(e4m3_table().astype(np.float64))[torch.from_numpy(w.astype(np.int64))]
    ref = (vals * torch.from_numpy(s.astype(np.float64)).repeat_interleave(bk, 1)[:, :k]) @ torch_bf16(x).double().T
    out, out4 = np.zeros(n, np.float32), np.zeros((n, 4), np.float32)
    _fp8_rows(w, s, xb, bk, out, out4)
    for got, want in ((out, ref[:, 0]), (out4, ref)):
        err = (torch.as_tensor(got).double() - want).norm() / want.norm()
        assert err <= 1e-5, (n, k, bk, float(err))


@njit(fastmath=True)
def _nv_rows(w, s, xq, xg, out, out4):
    for n in range(w.shape[0]):
        out[n] = _dots.nvfp4q8_dot(w[n], s[n], xq[0], xg[0], 16)
        out4[n, 0], out4[n, 1], out4[n, 2], out4[n, 3] = _dots.nvfp4q8_dot4(w[n], s[n], xq[0], xq[1], xq[2], xq[3],
                                                                            xg[0], xg[1], xg[2], xg[3], 16)


@needs_vnni
@pytest.mark.parametrize("k", [128, 384, 1152, 192, 1088])
def test_nvfp4_vnni_unit_matches_the_decoder_in_float64(k):
    n = 9
    rng = np.random.default_rng(k)
    w, s = empty_rows("nvfp4", (n,), k, 16)
    w[:] = rng.integers(0, 256, w.shape, dtype=np.uint8)
    ng = k // 16
    s[:, :ng] = rng.integers(0, 0x7F, (n, ng), dtype=np.uint8)
    s[0, :ng] = np.arange(ng) % 8                             # zero and subnormal scales
    s[1, :ng] = 0x7E                                          # the largest finite e4m3 (448)
    s[2, :ng:3] = 0x80                                        # a negative zero
    s[:, ng:] = np.array([0.25, -3.0] * 5, np.float32)[:n].view(np.uint8).reshape(n, 4)
    x = np.random.default_rng(k + 1).standard_normal((4, k)).astype(np.float32) * 3
    xq, xg = _dots.prep_nv8_rows(x)
    wf = decode_rows(w, s, "nvfp4", 16).double()
    ref = wf @ torch.as_tensor(roundtrip_act_q8(x)).double().T
    scale = wf.abs() @ torch.as_tensor(np.abs(x)).double().T + 1e-30
    out, out4 = np.zeros(n, np.float32), np.zeros((n, 4), np.float32)
    _nv_rows(w, s, xq, xg, out, out4)
    assert float(((torch.as_tensor(out).double() - ref[:, 0]).abs() / scale[:, 0]).max()) <= 1e-6
    assert float(((torch.as_tensor(out4).double() - ref).abs() / scale).max()) <= 1e-6
