"""CPU kernels: numba expert MLPs and dense GEMV over page-aligned bf16 / fp32 / int8 / int4 weights
(and `gpu_moe`: the accelerator tier's Triton experts for decode-sized steps, optional).

Importing this package compiles nothing and does not import numba or torch; the names below load
their module on first access, and numba compiles each kernel on first call (or in `warmup()`),
caching the machine code on disk (`cache=True`).
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "ExpertBank": "cpu_moe",
    "moe_experts": "cpu_moe",
    "DenseWeight": "cpu_linear",
    "dense_linear": "cpu_linear",
    "configure_threads": "threads",
    "warmup": "warmup",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
