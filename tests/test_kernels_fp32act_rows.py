"""fp8 and bf16 rows with fp32 activations (the default on CPUs without AVX512-BF16) against
float64 references of the same weights:

- the prefill tiles (kernels/_simd "Prefill tiles", _moe_kernels._gate_up_tiled / _down_tiled):
  rows widened into an fp32 tile and multiplied in 4 x 4 register blocks. The tile functions are
  called directly with fp32 activations (on every CPU), and end to end through moe_experts where
  the process's activation path for the format is fp32 (tests/conftest.py sets FREETOKEN_BF16_ACT=fp32,
  so on every CPU unless overridden; with bf16 activations the tiles do not run). Shapes: rows in and not in whole 4s (the rest goes to
  the row dots), experts above and below TILE_MIN_PAIRS in one call, padded 4-pair tails, fp8
  blocks of 128 and of 16.
- the bf16 x fp32 row dots (_simd.bf16f_row_dot / bf16f_row_dot4) at lengths with and without a
  scalar tail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import njit

from freetoken_py.kernels import ExpertBank, moe_experts
from freetoken_py.kernels import _dots
from freetoken_py.kernels._dots import ACT_GPTOSS, ACT_SILU, tile_rows
from freetoken_py.kernels._moe_kernels import TILE_MIN_PAIRS, _down_tiled, _gate_up_tiled, group_pairs
from freetoken_py.kernels._simd import bf16f_row_dot, bf16f_row_dot4, tile_dot44
from tests.test_kernels_moe import act_ref, close_to_ref, moe_ref_slack, random_experts

FORMATS = [("fp8", 128), ("fp8", 16), ("bf16", 32)]


def bank_of(fmt, gs, num_e, inter, hidden, seed=0):
    return ExpertBank.from_weights(*random_experts(num_e, inter, hidden, seed=seed), fmt=fmt, group_size=gs)


@njit(cache=False)
def _tiles_taken(w, s, x, hb):
    return tile_rows(w, s, x, hb)


@pytest.mark.parametrize("k", [16, 48, 2048])
def test_tile_dot44_matches_float64(k):
    g = torch.Generator().manual_seed(k)
    w = torch.randn(4, k, generator=g).numpy()
    x = torch.randn(4, k, generator=g).numpy()
    got = np.array(njit(lambda w, x: tile_dot44(w[0], w[1], w[2], w[3], x[0], x[1], x[2], x[3]))(w, x))
    ref = (w.astype(np.float64) @ x.astype(np.float64).T).reshape(-1)      # index 4 r + c
    assert np.allclose(got, ref, rtol=0, atol=1e-5 * np.abs(w).sum(1).max() * np.abs(x).max())


@pytest.mark.parametrize("fmt, gs", FORMATS)
@pytest.mark.parametrize("inter, i0, i1", [(48, 0, 16), (48, 32, 48), (38, 32, 38), (38, 16, 22), (38, 32, 35)])
@pytest.mark.parametrize("kind", [ACT_SILU, ACT_GPTOSS])
def test_gate_up_tiled_matches_float64(fmt, gs, inter, i0, i1, kind):
    hidden, num_t, k = 128, 11, 2
    bank = bank_of(fmt, gs, 2, inter, hidden)
    x = torch.randn(num_t, hidden, generator=torch.Generator().manual_seed(1)) * (8.0 if kind == ACT_GPTOSS else 1.0)
    xv = x.numpy().astype(np.float32)
    hb = gs // 2
    assert _tiles_taken(bank.w13[0], bank.s13[0], xv, hb)
    pairs = np.array([p for p in range(num_t * k) if p % 2 == 0], np.int64)[:9]   # 9 pairs: a padded tail
    h = np.full((num_t * k, inter), np.nan, np.float32)
    done = _gate_up_tiled(bank.w13[0], bank.s13[0], xv, pairs, k, i0, i1, kind, hb, h)
    assert done == i0 + (i1 - i0) // 4 * 4
    w13 = bank.dequantized()[0][0].double()
    gu = (w13 @ x.double().T).T                                       # [T, 2I]
    ref = act_ref(gu[:, :inter], gu[:, inter:], "silu" if kind == ACT_SILU else "gptoss")
    for p in pairs:
        got = torch.from_numpy(h[p, i0:done]).double()
        want = ref[p // k, i0:done]
        assert torch.allclose(got, want, rtol=0, atol=1e-5 * float(ref.abs().max()) + 1e-6)   # (no rows: i1 - i0 < 4)
    untouched = np.ones(num_t * k, bool)
    untouched[pairs] = False
    assert np.isnan(h[untouched]).all()                               # other pairs' rows
    assert np.isnan(h[pairs][:, :i0]).all() and np.isnan(h[pairs][:, done:]).all()   # rows outside the tiles


@pytest.mark.parametrize("fmt, gs", FORMATS)
@pytest.mark.parametrize("d0, d1", [(0, 64), (8, 30)])
def test_down_tiled_matches_float64(fmt, gs, d0, d1):
    hidden, inter, num_t, k = 64, 48, 10, 3
    bank = bank_of(fmt, gs, 3, inter, hidden, seed=2)
    hv = torch.randn(num_t * k, inter, generator=torch.Generator().manual_seed(3)).numpy()
    wts = torch.rand(num_t * k, generator=torch.Generator().manual_seed(4)).numpy()
    pairs = np.arange(1, num_t * k, 3, dtype=np.int64)                 # 10 pairs (t = 0..9), one per token
    out = np.zeros((num_t, hidden), np.float32)
    tile = np.empty((d1 - d0, inter), np.float32)
    dend = _down_tiled(bank.w2[1], bank.s2[1], hv, pairs, wts, k, d0, d1, gs // 2, tile, out)
    assert dend == d0 + (d1 - d0) // 4 * 4
    w2 = bank.dequantized()[1][1].double()
    ref = np.zeros((num_t, hidden))
    for p in pairs:
        ref[p // k, d0:dend] += wts[p] * (w2[d0:dend].numpy() @ hv[p].astype(np.float64))
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()
    assert not out[:, :d0].any() and not out[:, dend:].any()


def default_act_is_fp32(fmt):
    return (_dots.FP8_ACT if fmt == "fp8" else _dots.BF16_ACT) == "fp32"


@pytest.mark.parametrize("fmt, gs", FORMATS)
@pytest.mark.parametrize("inter, hidden", [(48, 64), (38, 128), (64, 37), (35, 64)])
@pytest.mark.parametrize("activation", ["silu", "gptoss"])
def test_moe_experts_with_tiles_matches_reference(fmt, gs, inter, hidden, activation):
    """A prefill-sized call: 5 experts, 41 tokens, top-2, one expert hit by few pairs (row dots)
    and the others by many (tiles where the shape allows: D 37 and I 38 take the row dots, I 35
    leaves a 3-row block to them; fp8 at block 128 has partial blocks here)."""
    num_e, num_t, k = 5, 41, 2
    bank = bank_of(fmt, gs, num_e, inter, hidden, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(num_t, hidden, generator=g) * (8.0 if activation == "gptoss" else 1.0)
    ids = torch.stack([torch.randperm(num_e - 1, generator=g)[:k] for _ in range(num_t)])
    ids[0, 0] = num_e - 1                                              # expert 4: one pair
    w = torch.rand(num_t, k, generator=g)
    _, _, off = group_pairs(ids.numpy().reshape(-1), num_e)
    counts = np.diff(off)
    assert counts.min() < TILE_MIN_PAIRS <= counts.max()
    out = moe_experts(bank, x, ids, w, activation=activation)
    assert close_to_ref(out, moe_ref_slack(bank, x, ids, w, activation), 1e-5)
    if default_act_is_fp32(fmt) and hidden % 16 == 0:
        assert _tiles_taken(bank.w13[0], bank.s13[0], x.numpy(), gs // 2)


@njit(cache=False)
def _bf16f_rows(w, x, out1, out4):
    for i in range(w.shape[0]):
        out1[i] = bf16f_row_dot(w[i], x[0])
        out4[i, 0], out4[i, 1], out4[i, 2], out4[i, 3] = bf16f_row_dot4(w[i], x[0], x[1], x[2], x[3])


@pytest.mark.parametrize("k", [1, 15, 16, 37, 64, 100, 2048, 2051])
def test_bf16f_row_dots_match_float64(k):
    g = torch.Generator().manual_seed(k)
    wb = torch.randn(9, k, generator=g).bfloat16()
    w = wb.view(torch.int16).numpy().view(np.uint16)
    x = torch.randn(4, k, generator=g).numpy()
    out1, out4 = np.zeros(9, np.float32), np.zeros((9, 4), np.float32)
    _bf16f_rows(w, x, out1, out4)
    ref = wb.double().numpy() @ x.astype(np.float64).T                  # [9, 4]
    tol = 1e-6 * (np.abs(wb.float().numpy()) @ np.abs(x).T) + 1e-30       # fp32 sums of exact products
    assert (np.abs(out1 - ref[:, 0]) <= tol[:, 0]).all()
    assert (np.abs(out4 - ref) <= tol).all()
