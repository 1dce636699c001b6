"""Dense GEMV kernel (freetoken_py.kernels.cpu_linear), thread configuration, lazy import.

Reference: float64 torch matmul on the weight's own dequantized values (`dw.dequantized()`,
checked here against torch's bf16 rounding and the int8 quant reference). int4 and int8 on the
int8-activation path (`_dots.INT_ACT`): the reference multiplies the per-32-block int8 activations
(`quant.q8act.roundtrip_act_q8`; int8's K = 37 exercises the partial last block).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from freetoken_py.kernels import DenseWeight, configure_threads, dense_linear
from freetoken_py.kernels._dots import INT_ACT
from freetoken_py.kernels.cpu_linear import TORCH_MIN_TOKENS
from freetoken_py.quant import quantize_int8, roundtrip_act_q8

TOL = {"fp32": 1e-5, "bf16": 1e-5, "int8": 1e-4, "int4": 1e-4}


def rel_err(out, ref):
    return float((torch.as_tensor(out).double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("fmt, n, k", [("fp32", 19, 37), ("bf16", 19, 37), ("int8", 19, 37), ("int4", 70, 96),
                                       ("bf16", 300, 256)])
@pytest.mark.parametrize("num_t", [1, 2, 3, 5, TORCH_MIN_TOKENS + 3])
def test_matches_torch_reference(fmt, n, k, num_t):
    g = torch.Generator().manual_seed(n + num_t)
    w = torch.randn(n, k, generator=g) * 0.1
    dw = DenseWeight.from_tensor(w, fmt=fmt)
    x = torch.randn(num_t, k, generator=g)
    out = dense_linear(dw, x)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and tuple(out.shape) == (num_t, n)
    xs = roundtrip_act_q8(x) if fmt in ("int4", "int8") and INT_ACT == "int8" else x
    assert rel_err(out, xs.double() @ dw.dequantized().double().T) <= TOL[fmt]


def test_stored_weights_are_the_format_encodings():
    w = torch.randn(33, 40, generator=torch.Generator().manual_seed(0))
    bf16 = DenseWeight.from_tensor(w, "bf16")
    assert bf16.w.dtype == np.uint16 and torch.equal(bf16.dequantized(), w.bfloat16().float())
    int8 = DenseWeight.from_tensor(w, "int8")
    q, s = quantize_int8(w)
    assert np.array_equal(int8.w, q.numpy()) and np.array_equal(int8.s[:, 0], s.numpy())
    fp32 = DenseWeight.from_tensor(w.double(), "fp32")
    assert torch.equal(fp32.dequantized(), w) and fp32.w.ctypes.data % 4096 == 0
    assert (bf16.nbytes, int8.nbytes, fp32.nbytes) == (33 * 40 * 2, 33 * 40 + 33 * 4, 33 * 40 * 4)


def test_numpy_in_numpy_out_and_bad_shapes():
    dw = DenseWeight.from_tensor(torch.randn(8, 16), "fp32")
    x = np.ones((2, 16), np.float32)
    out = dense_linear(dw, x)
    assert isinstance(out, np.ndarray) and np.allclose(out, x @ dw.w.T, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"\[T, 16\]"):
        dense_linear(dw, np.ones((2, 15), np.float32))
    with pytest.raises(ValueError, match="format"):
        DenseWeight.from_tensor(torch.randn(8, 16), "fp16")
    with pytest.raises(ValueError, match="2-D"):
        DenseWeight.from_tensor(torch.randn(2, 8, 16), "bf16")


def test_configure_threads_sets_numba_and_torch():
    import numba

    old_numba, old_torch = numba.get_num_threads(), torch.get_num_threads()
    try:
        assert configure_threads(1) == 1
        assert numba.get_num_threads() == 1 and torch.get_num_threads() == 1
        n = configure_threads()
        assert n >= 1 and numba.get_num_threads() == n and torch.get_num_threads() == n
        with pytest.raises(ValueError):
            configure_threads(0)
    finally:
        numba.set_num_threads(old_numba)
        torch.set_num_threads(old_torch)


def test_import_is_lazy():
    """Importing the package pulls in neither numba nor torch (so nothing can compile)."""
    code = ("import sys, freetoken_py.kernels as k; "
            "print(','.join(m for m in ('numba', 'torch') if m in sys.modules)); "
            "print(sorted(k.__all__))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded, names = res.stdout.splitlines()
    assert loaded == ""
    assert names == str(sorted(["DenseWeight", "ExpertBank", "configure_threads", "dense_linear",
                                "moe_experts", "warmup"]))


WARM_THEN_RUN = """
import json
import torch
from freetoken_py.kernels import DenseWeight, ExpertBank, dense_linear, moe_experts, warmup
from freetoken_py.kernels._moe_kernels import moe_rows
from freetoken_py.kernels.cpu_linear import dense_rows, dense_rows_prepared
count = lambda: [len(f.signatures) for f in (moe_rows, dense_rows, dense_rows_prepared)]
warmup(("int8",))
before = count()
g = torch.Generator().manual_seed(1)
bank = ExpertBank.from_weights(torch.randn(4, 64, 96, generator=g), torch.randn(4, 64, 96, generator=g),
                               torch.randn(4, 96, 64, generator=g), fmt="int8", group_size=32)
moe_experts(bank, torch.randn(1, 96, generator=g), torch.tensor([[0, 3]]), torch.full((1, 2), 0.5))
dense_linear(DenseWeight.from_tensor(torch.randn(48, 96, generator=g), fmt="int8", group_size=32),
             torch.randn(3, 96, generator=g).numpy())
print(json.dumps([before, count()]))
"""


def test_warmup_compiles_the_signatures_production_uses():
    """After warmup of a format, a real-sized expert call and dense call of that format compile nothing
    new: warmup hit exactly the argument types production passes (counted from numba's dispatchers, in a
    fresh process so no other test has compiled them first)."""
    res = subprocess.run([sys.executable, "-c", WARM_THEN_RUN], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    before, after = json.loads(res.stdout.strip().splitlines()[-1])
    assert before[0] >= 1 and before[1] + before[2] >= 1    # warmup compiled the expert and dense kernels
    assert after == before                                  # and production's calls needed nothing more
