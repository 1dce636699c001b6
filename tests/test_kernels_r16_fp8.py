"""fp8 (e4m3, fp32 block scales) in 16-row slabs (layout "r16", scales held as int32; _simd "fp8 ...
in the same slabs"): the byte and scale placement and its inverse (any CPU), the slab dot against
float64 on the e4m3 values with bf16-rounded activations (AVX512-BF16 + VBMI), expert calls
against the row layout and float64 in every stage form (whole-expert decode, few pairs, prefill
row blocks, a partial last scale block), dense weights, and the processes that must not build it."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from numba import njit
from r16_util import assert_dense_slabs_equal_rows, assert_slabs_match

from freetoken_py.kernels import ExpertBank, moe_experts
from freetoken_py.kernels._buffers import _FP8_SLOT, r16_fits, r16_pack, r16_unpack
from freetoken_py.kernels._dots import R16_FP8_OK, prep_bf16_rows
from freetoken_py.kernels._simd import HAS_AVX512BF16, HAS_AVX512VBMI
from freetoken_py.kernels.cpu_moe import preferred_layout

needs_fp8_slabs = pytest.mark.skipif(not R16_FP8_OK, reason="fp8 slabs run on AVX512-BF16 + VBMI with bf16 activations "
                                     "(the suite's processes: FREETOKEN_BF16_ACT=fp32, test_in_a_bf16_process runs them)")

if R16_FP8_OK:
    from freetoken_py.kernels._simd import r16_dot, r16_dot4

    @njit(fastmath=True)
    def slab_mv(w, s, xb, bpg, step):
        """[R, N]: w's rows against each bf16 activation row (R = 1 or 4), `step` rows a call."""
        r = xb.shape[0]
        g = np.zeros(1, np.float32)
        out = np.zeros((r, w.shape[0]), np.float32)
        for n in range(0, w.shape[0], step):
            if r == 4:
                r16_dot4(w[n:n + step], s[n:n + step], xb[0], xb[1], xb[2], xb[3], g, g, g, g, bpg,
                         out[0, n:n + step], out[1, n:n + step], out[2, n:n + step], out[3, n:n + step])
            else:
                r16_dot(w[n:n + step], s[n:n + step], xb[0], g, bpg, out[0, n:n + step])
        return out


def fp8_rows(n: int, k: int, bk: int, seed: int):
    """Random e4m3 rows (every byte but NaN, subnormals and zeros included) with fp32 block scales
    and their float64 values."""
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 256, (n, k), dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] = 0x01                                   # e4m3fn's NaN -> a subnormal
    s = (rng.random((n, -(-k // bk))) + 0.25).astype(np.float32) * 0.01
    vals = torch.from_numpy(w).view(torch.float8_e4m3fn).double().numpy()
    return w, s, vals * np.repeat(s.astype(np.float64), bk, axis=1)[:, :k]


def test_pack_places_each_byte_and_scale_and_unpack_inverts_it():
    n, k, bk = 32, 96, 32
    w, s, _ = fp8_rows(n, k, bk, 0)
    wr, sr = r16_pack(w, s)
    assert wr.shape == w.shape and sr.shape == s.shape and sr.dtype == np.int32   # int32: the fp8 slab layout
    flat, sflat = wr.reshape(n // 16, -1), sr.view(np.float32).reshape(n // 16, -1)
    for slab in range(n // 16):
        for r in range(16):
            for col in range(k):
                assert flat[slab, 64 * (col // 4) + _FP8_SLOT[r, col % 4]] == w[16 * slab + r, col]
            for g in range(s.shape[1]):
                assert sflat[slab, 16 * g + r] == s[16 * slab + r, g]
    assert sorted(_FP8_SLOT.reshape(-1)) == list(range(64))        # a permutation of the chunk
    back_w, back_s = r16_unpack(wr, sr)
    assert np.array_equal(back_w, w) and np.array_equal(back_s, s) and back_s.dtype == np.float32
    e3, s3 = np.stack([w, w ^ 0x05, w]), np.stack([s, s, s * 2])
    wr3, sr3 = r16_pack(e3, s3)
    assert np.array_equal(wr3[1], r16_pack(e3[1], s3[1])[0]) and np.array_equal(sr3[2], r16_pack(e3[2], s3[2])[1])
    assert all(np.array_equal(a, b) for a, b in zip(r16_unpack(wr3, sr3), (e3, s3)))


def test_which_widths_take_the_layout():
    assert r16_fits("fp8", 32, 2048, 128) and r16_fits("fp8", 16, 96, 64)
    assert not r16_fits("fp8", 24, 128, 128) and not r16_fits("fp8", 32, 80, 128) and not r16_fits("fp8", 32, 128, 16)
    assert preferred_layout("fp8", 768, 2048, 128) == ("r16" if R16_FP8_OK else "rows")
    assert preferred_layout("fp8", 40, 2048, 128) == "rows"


@needs_fp8_slabs
@pytest.mark.parametrize("k,bk", [(32, 32), (96, 32), (128, 128), (320, 128), (2048, 128), (256, 64), (7168, 128)])
@pytest.mark.parametrize("rows", [1, 4])
def test_slab_dot_equals_float64(k, bk, rows):
    n = 48
    w, s, ref = fp8_rows(n, k, bk, k + bk + rows)
    wr, sr = r16_pack(w, s)
    x = np.random.default_rng(k).standard_normal((rows, k)).astype(np.float32) * 3
    xb = prep_bf16_rows(x)
    xr = (xb.astype(np.uint32) << 16).view(np.float32).astype(np.float64)     # the bf16 activations' values
    assert_slabs_match(xr @ ref.T, lambda step, ok: slab_mv(wr if ok else w, sr if ok else s.view(np.int32), xb,
                                                            bk // 32, step), n)


def reference(bank: ExpertBank, x, ids, wts):
    """float64 on the bank's dequantised weights with bf16-rounded activations at each stage."""
    w13, w2 = (t.double() for t in bank.dequantized())
    inter = bank.inter
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e] @ x[t].bfloat16().double()
            h = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            out[t] += float(wts[t, j]) * (w2[e] @ h.float().bfloat16().double())
    return out


@needs_fp8_slabs
@pytest.mark.parametrize("tokens,e,i,d,bk,topk,vs_rows", [
    (1, 8, 768, 2048, 128, 8, True),     # decode at Qwen3-30B-A3B widths (whole experts or staged by the threads)
    (1, 9, 128, 576, 128, 8, True),      # decode, a short last down block
    (3, 8, 128, 256, 128, 2, True),      # a few tokens: 1-4 pairs per expert
    (40, 4, 128, 256, 128, 2, True),     # prefill: row blocks, 4 pairs per slab pass
    (5, 6, 96, 320, 128, 3, False),      # partial last block in both stages (the rows' dot takes fp32 here)
])
def test_expert_call_equals_rows_and_float64(tokens, e, i, d, bk, topk, vs_rows):
    g = torch.Generator().manual_seed(tokens + i)
    gate, up, down = torch.randn(e, i, d, generator=g) * 0.1, torch.randn(e, i, d, generator=g) * 0.1, \
        torch.randn(e, d, i, generator=g) * 0.1
    rows = ExpertBank.from_weights(gate, up, down, "fp8", bk)
    slabs = ExpertBank.from_weights(gate, up, down, "fp8", bk, layout="r16")
    assert rows.layout == "rows" and slabs.layout == "r16" and slabs.s13.dtype == np.int32
    assert all(torch.equal(a, b) for a, b in zip(rows.dequantized(), slabs.dequantized()))
    x = torch.randn(tokens, d, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(tokens)])
    wts = torch.rand(tokens, topk, generator=g)
    b = moe_experts(slabs, x, ids, wts)
    if vs_rows:                          # both take bf16 activations: the same products
        a = moe_experts(rows, x, ids, wts)
        assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max())
    ref = reference(slabs, x, ids, wts)
    assert float((b.double() - ref).abs().max()) <= 2e-3 * float(ref.abs().max())


@needs_fp8_slabs
def test_dense_weights_take_the_slabs_and_equal_rows():
    assert_dense_slabs_equal_rows("fp8", 128)


@pytest.mark.parametrize("env", [{"FREETOKEN_SIMD": "avx2"}, {"FREETOKEN_BF16_ACT": "fp32"}])
def test_processes_without_bf16_activations_never_build_fp8_slabs(env):
    """FREETOKEN_SIMD=avx2 or FREETOKEN_BF16_ACT=fp32 (the exact fp32 fp8 dots): fp8 banks stay in
    rows and a bank claiming the slabs is refused with the reason."""
    code = """
import torch, numpy as np
from freetoken_py.kernels import ExpertBank
from freetoken_py.kernels._dots import R16_FP8_OK
from freetoken_py.kernels.cpu_moe import preferred_layout
assert not R16_FP8_OK and preferred_layout("fp8", 64, 128, 128) == "rows"
g = torch.Generator().manual_seed(0)
bank = ExpertBank.from_weights(torch.randn(2, 64, 128, generator=g), torch.randn(2, 64, 128, generator=g),
                               torch.randn(2, 128, 64, generator=g), "fp8", 128)
assert bank.layout == "rows"
try:
    ExpertBank(bank.fmt, bank.group_size, bank.w13, bank.s13.view(np.int32), bank.w2, bank.s2.view(np.int32))
    raise SystemExit("an fp8 r16 bank was accepted without the slab kernels")
except ValueError as e:
    assert "AVX512-BF16" in str(e)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


@pytest.mark.skipif(R16_FP8_OK or not (HAS_AVX512BF16 and HAS_AVX512VBMI) or os.environ.get("FREETOKEN_SIMD") == "avx2",
                    reason="this process runs the fp8 slab tests itself, or the CPU has no fp8 slabs")
def test_in_a_bf16_process():
    """The suite's processes take fp32 activations (tests/conftest.py), where fp8 never takes the
    slabs: this module's kernel tests again in a process with bf16 activations (the default on
    CPUs with AVX512-BF16 + VBMI, where production takes the slabs)."""
    # FREETOKEN_INT_ACT=fp32 too: fp8 slabs do not depend on the int8-activation kernels (a process
    # with fp32 activations for int4 / int8 still runs fp8 in slabs); the default mode's fp8 slabs
    # run in tests/test_kernels_fp8_bf16act.py's checkpoint test
    env = dict(os.environ, FREETOKEN_BF16_ACT="bf16", FREETOKEN_INT_ACT="fp32")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", __file__],
                       env=env, capture_output=True, text=True, timeout=1200)
    tail = r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    import re
    passed = re.search(r"(\d+) passed", tail)
    assert passed and int(passed.group(1)) >= 20, tail       # the kernel tests ran there, not skipped
