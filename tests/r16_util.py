"""Shared check of the r16 slab-dot tests (tests/test_kernels_r16.py, test_kernels_r16_fp8.py)."""
from __future__ import annotations

import numpy as np


def assert_slabs_match(want: np.ndarray, run, n: int) -> None:
    """run(step, slabs) -> [R, N] outputs of the slab dot, `step` rows (whole slabs) a call, on the
    packed bytes (slabs=True) or the row bytes read as slabs (False): the former within 2e-6 of
    want at a call per slab and all n rows in one call, the latter off by > 5 %."""
    scale = np.abs(want).max()
    for step in (16, n):
        got = run(step, True)
        assert np.abs(got - want).max() <= 2e-6 * scale, (step, np.abs(got - want).max() / scale)
    assert np.abs(run(n, False) - want).max() > 0.05 * scale


def assert_dense_slabs_equal_rows(fmt: str, group_size: int) -> None:
    """DenseWeight in `fmt` takes the slabs by default (80 rows: a last task of one slab), holds
    the same values as the row layout and computes the same products for 1, 3 and 6 tokens; 40
    rows (not whole slabs) stay rows."""
    import torch

    from freetoken_py.kernels import DenseWeight, dense_linear

    w = torch.randn(80, 256, generator=torch.Generator().manual_seed(5))
    rows = DenseWeight.from_tensor(w, fmt, group_size, layout="rows")
    slabs = DenseWeight.from_tensor(w, fmt, group_size)
    assert rows.layout == "rows" and slabs.layout == "r16"
    assert torch.equal(rows.dequantized(), slabs.dequantized())
    for t in (1, 3, 6):
        x = torch.randn(t, 256, generator=torch.Generator().manual_seed(t))
        a, b = dense_linear(rows, x), dense_linear(slabs, x)
        assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max())
    assert DenseWeight.from_tensor(torch.randn(40, 256), fmt, group_size).layout == "rows"
