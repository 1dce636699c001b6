"""Quantization references (freetoken_py.quant): round-trip bounds and exact packing layouts.

References: the error bound each format promises (|dequant(quant(w)) - w| <= scale / 2 per
element) and small examples whose bytes are worked out by hand below.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken_py.quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8


def within_half_step(err, step, w):
    """|err| <= step / 2, plus fp32 rounding of the division and of q * step (a few ulps of |w|)."""
    return bool((err <= step / 2 + 2.0 ** -21 * w.abs() + 1e-30).all())


def test_int8_hand_example():
    w = torch.tensor([[1.0, -2.0, 3.0, 127.0],     # max 127 -> scale 1, q = w
                      [2.54, -1.0, 0.0, 0.02]])    # max 2.54 -> scale 0.02, q = w / 0.02
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert s.tolist() == pytest.approx([1.0, 0.02])
    assert q.tolist() == [[1, -2, 3, 127], [127, -50, 0, 1]]
    assert torch.equal(dequantize_int8(q, s), q.float() * s[:, None])


def test_int4_hand_example_nibbles():
    # one group of 32 with max |w| = 7 -> scale 1, so q = w; stored value q + 8, even column low
    row = [0.0, 1.0, -1.0, 7.0, -7.0, 3.0] + [0.0] * 26
    packed, scales = quantize_int4(torch.tensor([row]), group_size=32)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (1, 16)
    assert scales.tolist() == [[1.0]]
    # byte 0: 0+8=0x8 | (1+8)=0x9 << 4 -> 0x98; byte 1: -1+8=0x7 | (7+8)=0xF << 4 -> 0xF7;
    # byte 2: -7+8=0x1 | (3+8)=0xB << 4 -> 0xB1; zeros pack to 0x88
    assert packed[0].tolist() == [0x98, 0xF7, 0xB1] + [0x88] * 13
    assert dequantize_int4(packed, scales, 32)[0].tolist() == row


def test_int4_group_scales_are_per_group():
    w = torch.zeros(1, 64)
    w[0, 5] = 7.0             # group 0: scale 1
    w[0, 40] = -14.0          # group 1: scale 2, -14 -> q = -7 -> nibble 1 in the low half of byte 20
    packed, scales = quantize_int4(w, group_size=32)
    assert scales.tolist() == [[1.0, 2.0]]
    assert packed[0, 2].item() == (0 + 8) | ((7 + 8) << 4)
    assert packed[0, 20].item() == (-7 + 8) | ((0 + 8) << 4)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int4_round_trip_bound(group_size, dtype):
    g = torch.Generator().manual_seed(group_size)
    w = (torch.randn(3, 5, 2 * group_size, generator=g) * 0.1).to(dtype)
    packed, scales = quantize_int4(w, group_size)
    assert tuple(packed.shape) == (3, 5, group_size) and tuple(scales.shape) == (3, 5, 2)
    back = dequantize_int4(packed, scales, group_size)
    err = (back - w.float()).abs().reshape(3, 5, 2, group_size)
    assert within_half_step(err, scales[..., None], w.float().reshape(3, 5, 2, group_size))
    q = torch.stack([packed & 15, packed >> 4], -1).int() - 8
    assert q.min() >= -8 and q.max() <= 7


def test_int4_fp16_scales_round_trip_against_the_rounded_scale():
    """scale_dtype=float16 (what the kernels store): scales are fp16, q is computed against the
    rounded scale, so the half-step bound holds with the stored scale; huge groups cap at fp16's
    max instead of overflowing to inf; an all-zero group stays zero."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 6, 64, generator=g) * torch.logspace(-6, 2, 6)[None, :, None]   # rows across 8 decades
    w[0, 0, :32] = 0.0
    packed, scales = quantize_int4(w, 32, scale_dtype=torch.float16)
    assert scales.dtype == torch.float16 and torch.isfinite(scales).all()
    back = dequantize_int4(packed, scales, 32)
    err = (back - w).abs().reshape(4, 6, 2, 32)
    assert within_half_step(err, scales.float()[..., None], w.reshape(4, 6, 2, 32))
    assert (back[0, 0, :32] == 0).all()
    big = torch.full((1, 32), 1e6)
    _, s_big = quantize_int4(big, 32, scale_dtype=torch.float16)
    assert s_big.item() == torch.finfo(torch.float16).max                # capped, q clamped to 7
    with pytest.raises(ValueError, match="float32 or float16"):
        quantize_int4(w, 32, scale_dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_round_trip_bound(dtype):
    w = (torch.randn(2, 7, 33, generator=torch.Generator().manual_seed(1))).to(dtype)
    q, s = quantize_int8(w)
    assert tuple(q.shape) == (2, 7, 33) and tuple(s.shape) == (2, 7)
    err = (dequantize_int8(q, s) - w.float()).abs()
    assert within_half_step(err, s[..., None], w.float())
    assert q.abs().max() == 127                     # the largest element uses the full range


def test_zero_rows_and_groups_quantize_to_zero():
    q, s = quantize_int8(torch.zeros(2, 8))
    assert s.tolist() == [0.0, 0.0] and not q.any()
    packed, scales = quantize_int4(torch.zeros(1, 32), 32)
    assert scales.tolist() == [[0.0]] and (packed == 0x88).all()
    assert not dequantize_int4(packed, scales, 32).any()


def test_numpy_in_numpy_out():
    w = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    q, s = quantize_int8(w)
    assert isinstance(q, np.ndarray) and isinstance(dequantize_int8(q, s), np.ndarray)
    p, sc = quantize_int4(w, 32)
    assert isinstance(p, np.ndarray) and p.dtype == np.uint8
    back = dequantize_int4(p, sc, 32)
    assert isinstance(back, np.ndarray)
    assert within_half_step(torch.from_numpy(np.abs(back - w)), torch.from_numpy(np.repeat(sc, 32, 1)), torch.from_numpy(w))


@pytest.mark.parametrize("k, group_size", [(48, 32), (100, 64), (64, 0), (64, 7)])
def test_int4_rejects_bad_group(k, group_size):
    with pytest.raises(ValueError, match="group_size"):
        quantize_int4(torch.zeros(2, k), group_size)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 6), groups=st.integers(1, 4), group_size=st.sampled_from([32, 64, 128]),
       scale=st.floats(1e-4, 1e3), seed=st.integers(0, 2**16))
def test_round_trip_bounds_hold_for_any_scale(n, groups, group_size, scale, seed):
    w = torch.randn(n, groups * group_size, generator=torch.Generator().manual_seed(seed)) * scale
    packed, scales = quantize_int4(w, group_size)
    err4 = (dequantize_int4(packed, scales, group_size) - w).abs()
    assert within_half_step(err4, scales.repeat_interleave(group_size, 1), w)
    q, s = quantize_int8(w)
    assert within_half_step((dequantize_int8(q, s) - w).abs(), s[:, None], w)
