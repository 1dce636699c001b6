"""Effective bandwidth of the production CPU expert kernel at batch 1.

Calls `freetoken_py.kernels.cpu_moe.moe_experts` — the kernel decode runs, not a copy of it — on a
bank of random experts several times larger than L3, routing each call to the next `top_k`
experts in turn, so an expert is read again only after the whole bank has streamed through the
cache and no call is served from it. GB/s = top_k x bytes per expert x calls / seconds.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Optional

from freetoken_py.hw.profile import Figure

FORMATS = ("bf16", "fp32", "int8", "int4")
HIDDEN = 1024          # D
INTER = 256            # I, the expert width
TOP_K = 8
GROUP_SIZE = 32
# a format whose group is part of its definition runs at that group: NVFP4's is 16 (at 32 the
# kernel takes its any-shape fallback loop, ~40x slower: the figure once said 0.4 GB/s)
FORMAT_GROUP = {"nvfp4": 16, "fp8": 128}   # fp8: the 128-column block FP8 checkpoints ship with


def group_size(fmt: str) -> int:
    return FORMAT_GROUP.get(fmt, GROUP_SIZE)
BANK_L3_MULTIPLE = 4   # bank >= 4x L3 (2x for a quick check)
MAX_BANK_BYTES = 2**30  # but <= 1 GiB: a VM may report its host's whole L3 (480 MiB), see docs/probe.md
_BASE_EXPERTS = 2      # experts converted by from_weights; the bank repeats them (tiled_bank)


@dataclass
class ExpertWorkload:
    """A bank plus the fixed inputs of one batch-1 decode step."""

    fmt: str
    bank: Any
    num_experts: int
    x: Any              # [1, D] float32
    weights: Any        # [1, K] float32
    routes: list        # per call: [1, K] int64 expert ids; together they cover every expert
    next_route: int = 0

    @property
    def bank_bytes(self) -> int:
        return int(self.bank.bytes_per_expert) * self.num_experts


def kernel_module():
    """The production CPU kernel module (ImportError if this build does not have it yet)."""
    from freetoken_py.kernels import cpu_moe

    return cpu_moe



def _random_weights(num_experts: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    reps = math.ceil(num_experts / _BASE_EXPERTS)

    def make(*shape):   # [E, *shape]: small random base, tiled to E (a memcpy, fast)
        base = (torch.rand((_BASE_EXPERTS, *shape), generator=g) - 0.5) * 0.1
        return base.repeat(reps, 1, 1)[:num_experts].contiguous()

    return make(INTER, HIDDEN), make(INTER, HIDDEN), make(HIDDEN, INTER)   # gate, up, down


def tiled_bank(bank: Any, num_experts: int) -> Optional[Any]:
    """`bank` grown to `num_experts` by repeating its encoded experts at new (page-aligned)
    addresses: the production layout read by the production kernel, without paying the format
    conversion for every expert. None if the bank is not a dataclass of per-expert arrays."""
    import numpy as np

    try:
        from freetoken_py.kernels._buffers import aligned_empty
    except ImportError:
        return None
    if not dataclasses.is_dataclass(bank):
        return None
    base = bank.nbytes // bank.bytes_per_expert
    changes = {}
    for f in dataclasses.fields(bank):
        arr = getattr(bank, f.name)
        if isinstance(arr, np.ndarray) and arr.ndim >= 1 and arr.shape[0] == base:
            out = aligned_empty((num_experts, *arr.shape[1:]), arr.dtype)
            for start in range(0, num_experts, base):
                n = min(base, num_experts - start)
                out[start:start + n] = arr[:n]
            changes[f.name] = out
    grown = dataclasses.replace(bank, **changes) if changes else None
    if grown is None or grown.bytes_per_expert != bank.bytes_per_expert:
        return None
    return grown


def base_bank(fmt: str, seed: int = 0) -> Any:
    """A few random experts converted to `fmt` by the production `ExpertBank.from_weights`."""
    # the row layout: this figure prices the residency tiers' CPU experts (residency/profiles.py),
    # whose banks stay in rows; the cpu backend's r16 slabs are bench/expert_roofline.py's
    return kernel_module().ExpertBank.from_weights(*_random_weights(_BASE_EXPERTS, seed), fmt=fmt,
                                                   group_size=group_size(fmt))


def build_workload(fmt: str, l3_bytes: Optional[int], quick: bool = False, seed: int = 0,
                   base: Any = None) -> ExpertWorkload:
    import torch

    mod = kernel_module()
    base = base if base is not None else base_bank(fmt, seed)
    target = min((l3_bytes or 32 * 2**20) * (BANK_L3_MULTIPLE // 2 if quick else BANK_L3_MULTIPLE), MAX_BANK_BYTES)
    num = max(math.ceil(target / base.bytes_per_expert), 2 * TOP_K)
    num = math.ceil(num / TOP_K) * TOP_K
    bank = tiled_bank(base, num) or mod.ExpertBank.from_weights(
        *_random_weights(num, seed), fmt=fmt, group_size=group_size(fmt))
    routes = [torch.arange(i, i + TOP_K, dtype=torch.int64).view(1, TOP_K)
              for i in range(0, num, TOP_K)]
    x = torch.randn((1, HIDDEN), generator=torch.Generator().manual_seed(seed + 1))
    w = torch.full((1, TOP_K), 1.0 / TOP_K, dtype=torch.float32)
    return ExpertWorkload(fmt, bank, num, x, w, routes)


def sample(work: ExpertWorkload, sample_s: float = 0.1) -> float:
    """GB/s over consecutive calls, continuing the rotation, until `sample_s` has passed or
    every expert has been read once (a slow format costs time, not the whole cycle)."""
    moe = kernel_module().moe_experts
    calls, t0 = 0, time.perf_counter()
    while True:
        ids = work.routes[work.next_route]
        work.next_route = (work.next_route + 1) % len(work.routes)
        moe(work.bank, work.x, ids, work.weights, activation="silu")
        calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= sample_s or calls == len(work.routes):
            return calls * TOP_K * int(work.bank.bytes_per_expert) / elapsed / 1e9


def samples(work: ExpertWorkload, count: int, budget_s: float,
            threads: int) -> tuple[list[float], float, float, int]:
    """(GB/s samples, seconds of the untimed first call — numba compiles the kernel or loads it
    from its disk cache —, CPU share of the timed calls: CPU seconds / (wall x threads), numba
    compiles during the first call)."""
    from freetoken_py.hw.measure_dram import compiles_during

    start = time.perf_counter()
    compiled = compiles_during(lambda: sample(work, sample_s=0.0))
    first_call_s = time.perf_counter() - start
    out, start, cpu0 = [], time.perf_counter(), time.process_time()
    for i in range(count):
        out.append(sample(work))
        if i >= 1 and time.perf_counter() - start > budget_s:
            break
    share = (time.process_time() - cpu0) / ((time.perf_counter() - start) * threads)
    return out, first_call_s, share, compiled


def measure_expert_kernel(work: ExpertWorkload, name: str, threads: int, count: int = 5,
                          budget_s: float = 1.5, setup_s: float = 0.0) -> Figure:
    from freetoken_py.hw.measure_dram import numba_threads

    with numba_threads(threads) as threads:
        t0 = time.perf_counter()
        got, first_call_s, share, compiled = samples(work, count, budget_s, threads)
    method = (f"cpu_moe.moe_experts, {work.fmt}, batch 1, top-{TOP_K} of {work.num_experts} "
              f"experts ({work.bank_bytes >> 20} MiB, D={HIDDEN}, I={INTER}) rotated so no "
              f"call hits the cache; median of {len(got)} samples of <= 0.1 s")
    params = {"format": work.fmt, "hidden": HIDDEN, "inter": INTER, "top_k": TOP_K,
              "num_experts": work.num_experts, "bytes_per_expert": int(work.bank.bytes_per_expert),
              "bank_bytes": work.bank_bytes, "group_size": group_size(work.fmt), "threads": threads,
              "cpu_share": round(share, 2), "first_call_s": round(first_call_s, 2),
              "kernels_compiled": compiled, "setup_s": round(setup_s, 2)}
    return Figure.from_samples(name, got, method, params, time.perf_counter() - t0)
