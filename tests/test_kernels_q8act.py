"""int4 and int8 weights x int8 activations (kernels/_simd.q4q8_row_dot / i8q8_row_dot,
_dots.prep_q8_row / prep_q8n_row, quant/q8act).

References: the torch quantiser `quantize_act_q8` (itself checked here against its round-trip
bound), compared byte for byte with the kernels' quantisers; the kernels against float64 torch on
dequant(w) and dequant(quant8(x)) (1e-4), and loosely against fp32 activations; the
fp32-activation fallback (FREETOKEN_INT_ACT=fp32, what non-AVX2 CPUs run) in a subprocess
against the exact fp32 reference; the emitted assembly for the integer multiply-adds.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken_py.kernels import DenseWeight, ExpertBank, dense_linear, moe_experts
from freetoken_py.kernels._dots import INT_ACT, prep_q8_rows, prep_q8_rows_as, prep_q8n_rows, quad_layout
from freetoken_py.kernels._simd import HAS_AVX2
from freetoken_py.quant import dequantize_act_q8, quantize_act_q8, roundtrip_act_q8

needs_int8_path = pytest.mark.skipif(INT_ACT != "int8", reason="int8-activation path inactive (no AVX2 or forced off)")


def rel_err(out, ref):
    return float((torch.as_tensor(out).double() - ref).norm() / ref.norm())


def kernel_layout(q: torch.Tensor, quad: bool = False) -> np.ndarray:
    """Reference q [R, K] -> the kernel's layout: per pair of 32-blocks [even of the first x16 |
    even of the second x16 | odd of the first x16 | odd of the second x16]; a last unpaired
    block [even x16 | odd x16]. quad (the AVX-512 dot's layout): the first 4 * (K // 128) blocks
    per four as [even of each x16 | odd of each x16], the rest as above."""
    r, k = q.shape
    nb = k // 32
    out = []
    if quad and nb >= 4:
        n4 = 128 * (nb // 4)
        quads = q[:, :n4].reshape(r, nb // 4, 4, 16, 2)              # [R, quad, block, 16, (even, odd)]
        out.append(quads.permute(0, 1, 4, 2, 3).reshape(r, n4))
        q, nb = q[:, n4:], nb % 4
    paired = 64 * (nb // 2)
    pairs = q[:, :paired].reshape(r, nb // 2, 2, 16, 2)            # [R, pair, block, 16, (even, odd)]
    out.append(pairs.permute(0, 1, 4, 2, 3).reshape(r, paired))    # [R, pair, (even, odd), block, 16]
    if nb % 2:
        out.append(q[:, paired:].reshape(r, 16, 2).transpose(-1, -2).reshape(r, 32))
    return torch.cat(out, dim=1).numpy()


def awkward_rows(k: int, seed: int) -> torch.Tensor:
    """Rows with an all-zero block, a huge and a tiny block, and exact rounding ties (x/s = n + 1/2)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, k, generator=g)
    x[0, :32] = 0.0
    x[1, 32:64] *= 1e4
    x[2] *= 1e-30
    x[3, :32] = torch.arange(32) - 16 + 0.5                      # exact ties n + 1/2 (half to even) ...
    x[3, 0] = 127.0                                               # ... at scale 127 / 127 = 1
    return x


@pytest.mark.parametrize("gs", [32, 64, 128])
def test_kernel_quantiser_is_the_reference_byte_for_byte(gs):
    x = awkward_rows(256, seed=gs)
    xq, xg = prep_q8_rows(x.numpy(), gs)
    q, s = quantize_act_q8(x)
    nb = 256 // 32
    assert xq.dtype == np.int8 and xg.shape == (5, nb + 256 // gs)
    assert np.array_equal(xq, kernel_layout(q, quad_layout(gs))), "int8 values or their even/odd layout differ"
    assert np.array_equal(xg[:, :nb], s.numpy())
    corr = 8 * (s.double() * q.double().reshape(5, nb, 32).sum(-1)).reshape(5, 256 // gs, -1).sum(-1)
    assert np.allclose(xg[:, nb:], corr.numpy(), rtol=1e-6, atol=0)
    assert s[0, 0] == 0 and (q[0, :32] == 0).all()                 # all-zero block


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), blocks=st.integers(1, 6), log_scale=st.floats(-20, 20), seed=st.integers(0, 10**6))
def test_round_trip_within_half_a_step(rows, blocks, log_scale, seed):
    x = torch.randn(rows, 32 * blocks, generator=torch.Generator().manual_seed(seed)) * 10.0 ** log_scale
    q, s = quantize_act_q8(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and (q.abs() <= 127).all()
    err = (dequantize_act_q8(q, s) - x).abs().reshape(rows, blocks, 32)
    amax = x.abs().reshape(rows, blocks, 32).amax(-1, keepdim=True)
    assert bool((err <= s.unsqueeze(-1) / 2 + 2.0 ** -20 * amax + 1e-37).all())
    for quad in (False, True):
        xq, xg = prep_q8_rows_as(x.numpy(), 32, quad)
        assert np.array_equal(xq, kernel_layout(q, quad)) and np.array_equal(xg[:, :blocks], s.numpy())


@pytest.mark.parametrize("gs", [96, 160, 48])
def test_int4_kernels_reject_group_sizes_they_cannot_walk(gs):
    """The AVX2 dot walks pairs of 32-blocks inside a group: 32 or a multiple of 64 only (96 used
    to be accepted and gave wrong sums)."""
    with pytest.raises(ValueError, match="32 or a multiple of 64"):
        DenseWeight.from_tensor(torch.zeros(4, 2 * gs), "int4", gs)


def test_quantiser_rejects_ragged_rows():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_act_q8(torch.zeros(2, 40))


@needs_int8_path
@pytest.mark.parametrize("num_t", [1, 3, 5, 7])
# 32-blocks per row: 384 = 6 pairs, 416 = 6 pairs + 1, 448 = 7 pairs (gs 64: one pair per group), 480 = 7 + 1;
# gs 192: three pairs per group (the odd-pairs branch of a multi-pair group). gs 32 walks quads of pairs
# first (_simd._q8_quad): 256 = one quad, 320 = a quad + 1 pair, 384 = + 2, 448 = + 3, 1056 = 4 quads + 1 block
@pytest.mark.parametrize("gs,k", [(32, 384), (64, 384), (128, 384), (32, 416), (32, 448), (64, 448), (32, 480),
                                  (192, 576), (32, 256), (32, 320), (32, 1056)])
def test_dense_int4_against_quantised_and_fp32_activations(gs, k, num_t):
    g = torch.Generator().manual_seed(gs + num_t + k)
    dw = DenseWeight.from_tensor(torch.randn(45, k, generator=g) * 0.1, "int4", gs)   # 45 rows
    x = torch.randn(num_t, k, generator=g)
    out = dense_linear(dw, x)
    w = dw.dequantized().double()
    assert rel_err(out, dequantize_act_q8(*quantize_act_q8(x)).double() @ w.T) <= 1e-4
    assert rel_err(out, x.double() @ w.T) <= 2e-2                 # the int8 activations' own error: ~6e-3


@needs_int8_path
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_moe_int4_top1_against_quantised_activations(gs):
    """top-k = 1, T = 1 (decode) and T = 7 (grouped, 4 + tail): stage 1 sees quant8(x), stage 2
    quant8(h) (fixed seeds without a rounding tie of h; test_kernels_moe handles ties)."""
    _check_top1("int4", gs, inter=128, hidden=256, seed=gs)


def _check_top1(fmt: str, gs: int, inter: int, hidden: int, seed: int) -> None:
    """3 experts, top-1 routing, T = 1 and 7: the kernel against top1_ref with quantised
    activations (1e-4) and with fp32 ones (3e-2)."""
    g = torch.Generator().manual_seed(seed)
    gate, up, down = (torch.randn(*shape, generator=g) * 0.1
                      for shape in ((3, inter, hidden),) * 2 + ((3, hidden, inter),))
    bank = ExpertBank.from_weights(gate, up, down, fmt=fmt, group_size=gs)
    w13, w2 = (t.double() for t in bank.dequantized())
    for num_t in (1, 7):
        x = torch.randn(num_t, hidden, generator=g)
        ids = torch.randint(0, 3, (num_t, 1), generator=g)
        out = moe_experts(bank, x, ids, torch.ones(num_t, 1))
        assert rel_err(out, top1_ref(w13, w2, ids[:, 0], x, q8=True)) <= 1e-4
        assert rel_err(out, top1_ref(w13, w2, ids[:, 0], x, q8=False)) <= 3e-2


def top1_ref(w13, w2, e, x, q8):
    """SwiGLU expert e[t] on x[t] in float64; q8: x and h pass through the int8 quantiser first."""
    seen = (lambda v: roundtrip_act_q8(v.float()).double()) if q8 else (lambda v: v.double())
    gu = torch.einsum("tod,td->to", w13[e], seen(x))
    inter = gu.shape[1] // 2
    return torch.einsum("tdi,ti->td", w2[e], seen(torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]))


AVX2_DOT_ASM = """
import numpy as np
from numba import njit
from freetoken_py.kernels._dots import prep_q8_rows, row_dot
from freetoken_py.kernels._simd import HAS_AVX512
assert not HAS_AVX512                                          # FREETOKEN_SIMD=avx2 took effect

@njit(fastmath=True)
def dot(w, s, xq, xg, hb):
    return row_dot(w, s, xq, xg, hb)

w = np.full(16, 0x98, np.uint8)                                # nibbles 8 and 9: q_w = 0 and 1
xq, xg = prep_q8_rows(np.arange(32, dtype=np.float32).reshape(1, 32), 32)
one = np.ones(1, np.float16).view(np.uint16)                   # scales: fp16 bits
print(dot(w, one, xq[0], xg[0], 16))
print(" ".join(sorted({op for op in ("vpmaddubsw", "vpmaddwd", "vphaddd", "vpdpbusd")
                       if op in dot.inspect_asm(dot.signatures[0])})))
"""


@pytest.mark.skipif(not HAS_AVX2, reason="AVX2 intrinsics only compile for an AVX2 target")
def test_avx2_dot_compiles_to_integer_multiply_adds():
    """The AVX2 form of the int4 x int8 dot (the process's form on AVX2-only CPUs; forced with
    FREETOKEN_SIMD=avx2 on AVX-512 ones, whose own VNNI form test_kernels_vnni.py checks): pmaddubsw /
    pmaddwd products and the quad step's vphaddd merge of eight block sums (g = 32), no VNNI."""
    env = dict(os.environ, FREETOKEN_SIMD="avx2")
    res = subprocess.run([sys.executable, "-c", AVX2_DOT_ASM], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    value, ops = res.stdout.strip().splitlines()[-2:]
    assert float(value) == pytest.approx(np.arange(1, 32, 2).sum(), rel=1e-2)
    assert ops.split() == ["vphaddd", "vpmaddubsw", "vpmaddwd"]


FALLBACK = """
import torch
from freetoken_py.kernels import DenseWeight, ExpertBank, dense_linear, moe_experts
from freetoken_py.kernels._dots import INT_ACT
assert INT_ACT == "fp32", INT_ACT
g = torch.Generator().manual_seed(0)
dw = DenseWeight.from_tensor(torch.randn(40, 128, generator=g) * 0.1, "int4", 64)
x = torch.randn(5, 128, generator=g)
ref = x.double() @ dw.dequantized().double().T
assert float((dense_linear(dw, x).double() - ref).norm() / ref.norm()) <= 1e-4
gate, up, down = (torch.randn(*s, generator=g) * 0.1 for s in ((2, 64, 128),) * 2 + ((2, 128, 64),))
bank = ExpertBank.from_weights(gate, up, down, fmt="int4", group_size=32)
w13, w2 = (t.double() for t in bank.dequantized())
ids = torch.tensor([[1], [0], [1]])
gu = torch.einsum("tod,td->to", w13[ids[:, 0]], x[:3].double())
ref = torch.einsum("tdi,ti->td", w2[ids[:, 0]], torch.nn.functional.silu(gu[:, :64]) * gu[:, 64:])
out = moe_experts(bank, x[:3], ids, torch.ones(3, 1))
assert float((out.double() - ref).norm() / ref.norm()) <= 1e-4
bank8 = ExpertBank.from_weights(gate, up, down, fmt="int8")     # int8 weights: fp32 activations too
w13, w2 = (t.double() for t in bank8.dequantized())
gu = torch.einsum("tod,td->to", w13[ids[:, 0]], x[:3].double())
ref = torch.einsum("tdi,ti->td", w2[ids[:, 0]], torch.nn.functional.silu(gu[:, :64]) * gu[:, 64:])
out = moe_experts(bank8, x[:3], ids, torch.ones(3, 1))
assert float((out.double() - ref).norm() / ref.norm()) <= 1e-5
dw8 = DenseWeight.from_tensor(torch.randn(40, 100, generator=g) * 0.1, "int8")
x8 = torch.randn(5, 100, generator=g)
ref = x8.double() @ dw8.dequantized().double().T
assert float((dense_linear(dw8, x8).double() - ref).norm() / ref.norm()) <= 1e-5
import numpy as np
from numba import njit
from freetoken_py.kernels._simd import exp_shift_sum
e = np.linspace(-80, 0, 37).astype(np.float32)
got = e.copy()
njit(lambda a: exp_shift_sum(a, np.float32(0.0)))(got)
assert np.allclose(got, np.exp(e.astype(np.float64)), rtol=2e-6, atol=0)   # no FMA on generic: ~11 ulp
print("ok")
"""


@pytest.mark.parametrize("target", ["host", "generic"])
def test_fp32_activation_fallback_still_exact(target):
    """The path non-AVX2 CPUs take, forced here: exact against fp32 activations (1e-4). "generic":
    numba compiles for a baseline x86-64 (no AVX2, F16C, FMA, SSE4.1), where fp16 scales must not
    go through compiler-rt's __extendhfsf2 (not resolvable in numba's JIT: a crash) and exp must not
    call libm per lane. Own numba cache dirs (keeps the main cache warm)."""
    env = dict(os.environ, FREETOKEN_INT_ACT="fp32",
               NUMBA_CACHE_DIR=os.path.join(tempfile.gettempdir(), f"freetoken-test-int4-fp32act-{target}"))
    if target == "generic":
        env.update(NUMBA_CPU_NAME="generic")
        env.pop("NUMBA_CPU_FEATURES", None)
    res = subprocess.run([sys.executable, "-c", FALLBACK], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def _mode_in_subprocess(**env_vars):
    env = {k: v for k, v in os.environ.items() if k not in ("FREETOKEN_INT_ACT", "FREETOKEN_INT4_ACT")}
    return subprocess.run([sys.executable, "-c", "from freetoken_py.kernels._dots import INT_ACT; print(INT_ACT)"],
                          capture_output=True, text=True, env=dict(env, **env_vars), timeout=120)


def test_bad_mode_is_a_clear_error():
    res = _mode_in_subprocess(FREETOKEN_INT_ACT="int3")
    assert res.returncode != 0 and "FREETOKEN_INT_ACT (or its old name FREETOKEN_INT4_ACT) must be 'int8' or 'fp32', got 'int3'" in res.stderr


def test_old_variable_name_is_an_alias_and_the_new_one_wins():
    assert _mode_in_subprocess(FREETOKEN_INT4_ACT="FP32").stdout.strip() == "fp32"
    assert _mode_in_subprocess(FREETOKEN_INT4_ACT="fp32", FREETOKEN_INT_ACT="int8").stdout.strip() == ("int8" if HAS_AVX2 else "fp32")


# --- int8 weights x int8 activations ----------------------------------------------------------------


@pytest.mark.parametrize("k", [256, 100])
def test_int8_quantiser_is_the_reference_byte_for_byte(k):
    """Natural order; K = 100 ends in a 4-element block, quantised as the zero-padded reference."""
    x = awkward_rows(k, seed=k)
    xq, xs = prep_q8n_rows(x.numpy())
    q, s = quantize_act_q8(torch.nn.functional.pad(x, (0, -k % 32)))
    assert xq.dtype == np.int8 and xs.shape == (5, -(-k // 32))
    assert np.array_equal(xq, q[:, :k].numpy()) and np.array_equal(xs, s.numpy())


@needs_int8_path
@pytest.mark.parametrize("k", [96, 160, 100])
@pytest.mark.parametrize("num_t", [1, 3, 5, 7])
def test_dense_int8_against_quantised_and_fp32_activations(k, num_t):
    """T = 1 (row_dot), 3 (a padded 4-pass), 5 / 7 (4 + tail); K = 100: a partial last block."""
    g = torch.Generator().manual_seed(k + num_t)
    dw = DenseWeight.from_tensor(torch.randn(45, k, generator=g) * 0.1, "int8")
    x = torch.randn(num_t, k, generator=g)
    out = dense_linear(dw, x)
    w = dw.dequantized().double()
    assert rel_err(out, roundtrip_act_q8(x).double() @ w.T) <= 1e-4
    assert rel_err(out, x.double() @ w.T) <= 2e-2                 # the int8 activations' own error: ~5e-3


@needs_int8_path
@pytest.mark.parametrize("num_t", [1, 7])
def test_dense_int8_extremes_are_exact(num_t):
    """|w| = |q_x| = 127 everywhere: every vpmaddubsw pair sum is 2 * 127^2 = 32258, just under i16
    saturation (32767); signs mixed so a lost sign shows. Small integers: the result is exact."""
    sign = torch.tensor([1.0, -1.0, -1.0, 1.0]).repeat(24)                 # [96]
    w = torch.stack([sign, -sign, torch.ones(96), -torch.ones(96)])        # [4, 96]: scale 1/127
    dw = DenseWeight.from_tensor(w, "int8")
    assert np.abs(dw.w).min() == 127
    x = torch.ones(num_t, 96) * torch.arange(1, num_t + 1)[:, None].float()   # q_x = 127, s_x = t / 127
    ref = x.double() @ w.double().T
    assert torch.equal(dense_linear(dw, x).double(), ref), (dense_linear(dw, x), ref)


@needs_int8_path
def test_moe_int8_top1_against_quantised_activations():
    """top-k = 1, T = 1 (decode) and T = 7 (grouped, 4 + tail), D = 160 and I = 100 (a partial
    block in stage 2): stage 1 sees quant8(x), stage 2 quant8(h)."""
    _check_top1("int8", 32, inter=100, hidden=160, seed=8)


@pytest.mark.skipif(not HAS_AVX2, reason="AVX2 intrinsics only compile for an AVX2 target")
def test_int8_dot_compiles_to_sign_and_integer_multiply_adds():
    from numba import njit

    from freetoken_py.kernels._dots import row_dot

    @njit(fastmath=True)
    def dot(w, s, xq, xg, hb):
        return row_dot(w, s, xq, xg, hb)

    w = np.tile(np.array([3, -2], np.int8), 48)                            # K = 96, row scale 1
    x = np.arange(96, dtype=np.float32).reshape(1, 96) - 40.0
    xq, xs = prep_q8n_rows(x)
    expect = float(w.astype(np.float64) @ roundtrip_act_q8(x)[0].astype(np.float64))
    assert dot(w, np.ones(1, np.float32), xq[0], xs[0], 16) == pytest.approx(expect, rel=1e-5)
    asm = dot.inspect_asm(dot.signatures[0])
    assert all(op in asm for op in ("vpsignb", "vpabsb", "vpmaddubsw", "vpmaddwd")), "not the integer dot"
