"""Compile (or load from numba's on-disk cache) the expert and dense kernels this package's API
exports (`moe_experts`, `dense_linear`), every format and activation. The fused decode steps
(paged attention, MLA, Gated DeltaNet: kernels/cpu_decode.py, cpu_mla.py, cpu_gdn.py) take
per-model argument types; the engine warms them for the model it loaded (`engine.warmup.warm_kernels`)."""
from __future__ import annotations

import time

import numpy as np
import torch

from freetoken_py.kernels._dots import ACTIVATIONS, FORMATS


def warmup(formats=FORMATS) -> float:
    """Run each kernel once per format on tiny inputs (both code paths of moe_experts and
    dense_linear's numba path) with the exact argument types production uses; returns seconds."""
    from freetoken_py.kernels.cpu_linear import DenseWeight, dense_linear
    from freetoken_py.kernels.cpu_moe import ExpertBank, moe_experts, preferred_layout

    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(shape, generator=g) for shape in ((2, 32, 64), (2, 32, 64), (2, 64, 32)))
    x = torch.randn(5, 64, generator=g)
    ids = torch.tensor([[0, 1]] * 5)
    wts = torch.full((5, 2), 0.5)
    for fmt in formats:
        group = 16 if fmt == "nvfp4" else 32
        layouts = {"rows", preferred_layout(fmt, 32, 64, group)}     # the cpu backend's too (r16 slabs)
        for layout in sorted(layouts):
            bank = ExpertBank.from_weights(gate, up, down, fmt=fmt, group_size=group, layout=layout)
            for activation in ACTIVATIONS:
                moe_experts(bank, x[:1], ids[:1], wts[:1], activation=activation)
            dense_linear(DenseWeight.from_tensor(down[0], fmt=fmt, group_size=group, layout=layout),
                         x[:3, :32].numpy().astype(np.float32))
    return time.perf_counter() - t0
