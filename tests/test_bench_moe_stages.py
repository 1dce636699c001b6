"""bench/moe_stages.py times the decode MoE call's stages one by one: its stage functions must
compute what the production call computes, or the figures would be of some other work."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import moe_stages  # noqa: E402
from freetoken_py.kernels import ExpertBank, moe_experts  # noqa: E402
from freetoken_py.kernels._moe_kernels import RB_FEW  # noqa: E402
from freetoken_py.kernels.cpu_moe import preferred_layout  # noqa: E402


@pytest.mark.parametrize("fmt,layout", [("int4", "rows"), ("int4", "auto"), ("int8", "rows")])
def test_the_stages_sum_to_the_production_call(fmt, layout):
    g = torch.Generator().manual_seed(1)
    hidden, inter, num, k = 256, 160, 12, 8      # I not a multiple of RB_FEW: a short last block
    layout = preferred_layout(fmt, inter, hidden, 32) if layout == "auto" else layout   # r16 slabs on AVX-512 VNNI
    bank = ExpertBank.from_weights(*(torch.randn(num, inter, hidden, generator=g) * 0.05 for _ in range(2)),
                                   torch.randn(num, hidden, inter, generator=g) * 0.05, fmt=fmt, group_size=32,
                                   layout=layout)
    assert bank.layout == layout
    x = torch.randn(1, hidden, generator=g).numpy()
    ids = torch.randperm(num, generator=g)[:k].view(1, k).numpy()
    wts = torch.rand(1, k, generator=g).numpy()
    h = np.empty((k, inter), np.float32)
    ub = np.empty((k * -(-inter // RB_FEW), 4, RB_FEW), np.float32)
    moe_stages._stage1(bank.w13, bank.s13, x, ids, 32, h, ub)
    y = np.empty((k, hidden), np.float32)
    moe_stages._stage2(bank.w2, bank.s2, h, ids, 32, y)
    want = moe_experts(bank, x, ids, wts)
    got = (wts.reshape(k, 1) * y).sum(0, keepdims=True)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max() + 1e-7


@pytest.mark.parametrize("fmt,layout", [("int4", "rows"), ("int4", "auto"), ("nvfp4", "auto"), ("int8", "rows")])
def test_the_dense_gemv_line_reads_the_same_rows(fmt, layout):
    """gemv_gate_up: the call's 8 experts' gate/up rows as one matrix, against x @ their dequantised rows."""
    g = torch.Generator().manual_seed(2)
    hidden, inter, num, k = 256, 64, 16, 8
    gs = 16 if fmt == "nvfp4" else 32
    layout = preferred_layout(fmt, inter, hidden, gs) if layout == "auto" else layout
    bank = ExpertBank.from_weights(*(torch.randn(num, inter, hidden, generator=g) * 0.05 for _ in range(2)),
                                   torch.randn(num, hidden, inter, generator=g) * 0.05, fmt=fmt, group_size=gs,
                                   layout=layout)
    x = torch.randn(1, hidden, generator=g).numpy()
    got = moe_stages.gate_up_gemv(bank, x, k)(np.arange(8, 16).reshape(1, k))
    from freetoken_py.quant import roundtrip_act_q8
    want = roundtrip_act_q8(torch.from_numpy(x)) @ bank.dequantized()[0][8:16].reshape(-1, hidden).T
    assert np.abs(got - want.numpy()).max() <= 1e-4 * np.abs(want.numpy()).max()
