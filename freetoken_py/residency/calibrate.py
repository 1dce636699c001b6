"""This machine's fixed host costs of a decode layer-step, measured on the executor itself.

The cost model's bandwidths say how long the experts' bytes take; a decode layer-step also pays
fixed host work that no bandwidth figure contains: reading the routing, planning, the policy's
bookkeeping and the counters (`host_layer_s`, every layer-step, whatever the placement), and the
CPU tier's own fixed cost per call (activations and routing weights converted for the kernel,
the kernel's launch, the result converted back: `cpu_call_s`). On the 2-vCPU development
machine they were 0.13-0.29 ms and 0.11-0.22 ms, against ~1 ms of expert bytes per layer-step
of the bench model (docs/residency.md).

`measure_host_costs` runs the real `ResidencyExecutor` and `AdaptivePolicy` over random experts
with the model's expert count and top-k, a narrow hidden size (at most 256) and a tiny
intermediate size, four MoE layers, one token per call and no slots: every expert runs on the
CPU tier, so the policy's admissions, victim scans and shadow caches, which a run with slots
also pays, are not in the figure. Between calls it reads a buffer the size of a layer's routed
expert bytes (capped), as the CPU tier's weight traffic evicts the caches in a real decode
step: the same Python and torch operations run 2-3x slower after that than in a warm loop.
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import torch

MAX_FLUSH_BYTES = 64 << 20
_INTER = 32          # the tiny experts' intermediate size (one 32-column block)
_LAYERS = 4         # MoE layers of the synthetic model
_MAX_HIDDEN = 256    # the tiny experts' width (the conversions of wider activations cost microseconds more)


def _bench_experts(num_experts: int, d: int, inter: int, dtype: torch.dtype, g: torch.Generator,
                   cpu_kernels: bool, expert_format: str, group_size: int):
    """(host experts per layer, their ExpertFormat, the CPU tier's banks or None) of _LAYERS
    random layers, as the store would hold them."""
    from freetoken_py.kernels.cpu_moe import ExpertBank
    from freetoken_py.residency.formats import QUANTISED, ExpertFormat, bank_parts

    w13 = [(torch.rand(num_experts, 2 * inter, d, generator=g) - 0.5).to(dtype) for _ in range(_LAYERS)]
    w2 = [(torch.rand(num_experts, d, inter, generator=g) - 0.5).to(dtype) for _ in range(_LAYERS)]
    if expert_format in QUANTISED:   # the store's banks: the host banks and the CPU tier's
        banks = [ExpertBank.from_weights(a[:, :inter], a[:, inter:], b, fmt=expert_format, group_size=group_size)
                 for a, b in zip(w13, w2)]
        return [bank_parts(b) for b in banks], ExpertFormat.of_bank(banks[0]), banks
    banks = None
    if cpu_kernels:   # the numba CPU tier for bf16 / fp32 experts; torch on the host weights otherwise
        try:
            banks = [ExpertBank.view_of(a, b) for a, b in zip(w13, w2)]
        except ValueError:
            banks = None
    return list(zip(w13, w2)), ExpertFormat.of_float(w13[0], w2[0]), banks


def measure_host_costs(num_experts: int, top_k: int, hidden: int, cpu_expert_gbps: float,
                       layer_bytes: int, dtype: torch.dtype = torch.bfloat16, calls: int = 48,
                       warmup: int = 8, seed: int = 0, cpu_kernels: bool = True,
                       expert_format: str = "float", group_size: int = 32) -> tuple[float, float]:
    """(host_layer_s, cpu_call_s): medians per call. `cpu_expert_gbps` is the rate the cost model
    charges the CPU tier's bytes at (the tiny experts' bytes at that rate are taken off the
    tier's time, so `cpu_call_s` is the fixed part); `layer_bytes`: the routed expert bytes of one
    real layer-step, read between calls to evict the caches (capped at 64 MiB); `cpu_kernels`:
    the CPU tier runs the numba kernels (as the executor does for bf16 / fp32 SiLU experts when
    attached with them), else torch on the host weights; `expert_format` "int8" / "int4" / "fp8" /
    "nvfp4": the experts quantised in banks, as `--expert-dtype` or a quantised checkpoint holds
    them (the numba kernels then always; int4 and fp8 with `group_size`, the experts one group
    wide if that is more than 32 columns; nvfp4 in its groups of 16)."""
    from freetoken_py.residency.adaptive import AdaptivePolicy
    from freetoken_py.residency.executor import ResidencyExecutor
    from freetoken_py.residency.planner import CostModel
    from freetoken_py.residency.profiles import GB, PROFILES, emulated
    from freetoken_py.residency.slots import SlotCache

    if top_k < 1 or num_experts < top_k:
        raise ValueError(f"need 1 <= top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")
    d = min(hidden, _MAX_HIDDEN)
    g = torch.Generator().manual_seed(seed)
    if expert_format == "nvfp4":
        group_size, d = 16, max(16, d // 16 * 16)        # nvfp4 banks: whole groups of 16 on both axes
    inter = max(_INTER, group_size) if expert_format in ("int4", "fp8") else _INTER
    host, fmt, banks = _bench_experts(num_experts, d, inter, dtype, g, cpu_kernels, expert_format, group_size)
    expert_bytes = fmt.expert_bytes
    profile = replace(emulated(PROFILES["rtx4090"]), cpu_expert_gbps=cpu_expert_gbps)   # (no slot: GPU unused)
    cost = CostModel(profile, expert_bytes, 6.0 * inter * d)
    ex = ResidencyExecutor(host, fmt, AdaptivePolicy(list(range(_LAYERS)), num_experts, 0), cost,
                           SlotCache(0, fmt.specs, "cpu"), cpu_banks=banks)
    flush = np.ones(max(1, min(layer_bytes, MAX_FLUSH_BYTES) // 8))
    host, tier = [], []
    rng = np.random.default_rng(seed)
    for i in range(warmup + calls):
        layer = i % _LAYERS               # (a new step every _LAYERS calls, as in a forward pass)
        ids = torch.from_numpy(rng.choice(num_experts, top_k, replace=False)).view(1, top_k)
        wts = torch.from_numpy(rng.random((1, top_k), np.float32)).to(dtype)
        x = torch.randn(1, d, generator=g).to(dtype)
        flush.sum()                       # a layer's expert traffic: the caches are cold, as in decode
        c = ex.telemetry.layers[layer]
        t0 = c.cpu_tier_s
        start = time.perf_counter()
        ex(layer, x, ids, wts)
        wall = time.perf_counter() - start
        if i >= warmup:
            tier_s = c.cpu_tier_s - t0
            host.append(wall - tier_s)
            tier.append(tier_s)
    fixed = top_k * expert_bytes / (cpu_expert_gbps * GB)
    return float(np.median(host)), max(0.0, float(np.median(tier)) - fixed)


def with_host_costs(profile, num_experts: int, fmt, top_k: int, cpu_kernels: bool = True, calls: int = 48):
    """`profile` with this machine's measured `host_layer_s` and `cpu_call_s` (`measure_host_costs`)
    for a model whose MoE layers hold `num_experts` experts of format `fmt` (formats.ExpertFormat:
    width, bytes, dtype), routing `top_k` of them; `cpu_kernels`: the CPU tier runs the numba
    kernels. The tiny experts are in `fmt`'s format (a quantised one's quantised from bf16)."""
    dtype = fmt.dtype if fmt.name == "float" else torch.bfloat16
    host_s, call_s = measure_host_costs(num_experts, top_k, fmt.hidden, profile.cpu_expert_gbps,
                                        top_k * fmt.expert_bytes, dtype, calls, cpu_kernels=cpu_kernels,
                                        expert_format=fmt.name, group_size=fmt.group_size)
    return replace(profile, host_layer_s=host_s, cpu_call_s=call_s)
