"""CUDA figures: PCIe both ways (pinned / pageable), VRAM copy, the expert copy path, the GPU
expert kernel, and PCIe streaming while the CPU expert kernel runs.

Everything here needs `torch.cuda.is_available()`; callers check it first. Times come from CUDA
events on the stream that does the work, so Python overhead is not counted as transfer time.
The concurrent figure queues all its copies on a side stream up front: the DMA engine keeps
streaming while the CPU kernel holds the GIL, which is how a real decode step overlaps them.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from freetoken_py.hw.profile import Figure

GB = 1e9


def _torch():
    import torch

    return torch


def timed_gpu(fn: Callable[[], None], nbytes: int, reps: int, stream: Any = None) -> list[float]:
    """GB/s of `reps` calls of fn, each timed by CUDA events on `stream`."""
    torch = _torch()
    stream = stream or torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        fn()                                   # warm-up: allocator, first-touch of pages
        stream.synchronize()
        samples = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            samples.append(nbytes / (start.elapsed_time(end) / 1e3) / GB)
    return samples


def pcie_copy(direction: str, pinned: bool, nbytes: int, reps: int, device: int = 0) -> list[float]:
    """H2D ("h2d") or D2H ("d2h") copies of `nbytes`, from pinned or pageable host memory."""
    torch = _torch()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    if direction == "h2d":
        fn = lambda: dev.copy_(host, non_blocking=pinned)   # noqa: E731
    else:
        fn = lambda: host.copy_(dev, non_blocking=pinned)   # noqa: E731
    with torch.cuda.device(device):
        return timed_gpu(fn, nbytes, reps)


def vram_copy(nbytes: int, reps: int, device: int = 0) -> list[float]:
    """Device-to-device copy; counts bytes read + bytes written (as CUDA's bandwidthTest does)."""
    torch = _torch()
    a = torch.ones(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    b = torch.empty_like(a)
    with torch.cuda.device(device):
        return timed_gpu(lambda: b.copy_(a), 2 * nbytes, reps)


def expert_gather(host_bank: Any, num_slots: int, top_k: int, reps: int, device: int = 0) -> list[float]:
    """The expert streaming path: copy `top_k` routed experts per step from a pinned host bank
    `[E, bytes_per_expert]` (uint8) into VRAM slots, one async copy per expert, rotating experts."""
    torch = _torch()
    num_experts, per_expert = host_bank.shape
    slots = torch.empty((num_slots, per_expert), dtype=torch.uint8, device=f"cuda:{device}")
    state = {"next": 0}

    def step():
        for k in range(top_k):
            e = (state["next"] + k) % num_experts
            slots[k % num_slots].copy_(host_bank[e], non_blocking=True)
        state["next"] = (state["next"] + top_k) % num_experts

    with torch.cuda.device(device):
        return timed_gpu(step, top_k * per_expert, reps)


def _rotating(num_experts: int, top_k: int, x: Any, add: Callable[[Any, list[int]], None]) -> Callable[[], Any]:
    """A step function: `add(out, chosen)` for the next top_k experts of the bank (rotating) into a
    fresh zero output like x, which it returns."""
    torch = _torch()
    state = {"next": 0}

    def step():
        out = torch.zeros_like(x)
        add(out, [(state["next"] + k) % num_experts for k in range(top_k)])
        state["next"] = (state["next"] + top_k) % num_experts
        return out

    return step


def triton_expert_step(gate: Any, up: Any, down: Any, x: Any, top_k: int) -> Callable[[], Any]:
    """One batch-1 step's function for `gpu_expert_step_triton`: the next top_k experts of the
    bank (rotating) through kernels/gpu_moe.py, returning their routing-weighted sum for x [1, D]
    (weights 1/top_k). Any device Triton runs on (its CPU interpreter included)."""
    torch = _torch()
    from freetoken_py.kernels.gpu_moe import moe_pairs

    w13 = torch.cat([gate, up], dim=1)                                    # [E, 2I, D], as the slots hold them
    rows = torch.zeros(top_k, dtype=torch.long, device=gate.device)
    wts = torch.full((top_k,), 1.0 / top_k, device=gate.device)
    return _rotating(gate.shape[0], top_k, x, lambda out, chosen: moe_pairs(
        out, x, rows, wts, [w13[e] for e in chosen], [down[e] for e in chosen]))


def triton_expert_step_int4(parts: tuple, x: Any, top_k: int, group_size: int = 32,
                            triton: bool = True) -> Callable[[], Any]:
    """`triton_expert_step` for int4 experts: `parts` = (q13 [E, 2I, D/2] uint8, s13 [E, 2I, D/g]
    int16 fp16 bits, q2 [E, D, I/2], s2 [E, D, I/g]), the slots' layout; the next top_k experts
    through `gpu_moe.moe_pairs_quant` (weights 1/top_k), or with `triton=False` through torch,
    each expert dequantised (`gpu_moe.quant_swiglu`)."""
    torch = _torch()
    from freetoken_py.kernels.gpu_moe import moe_pairs_quant, quant_swiglu

    rows = torch.zeros(top_k, dtype=torch.long, device=x.device)
    wts = torch.full((top_k,), 1.0 / top_k, device=x.device)

    def add(out, chosen):
        experts = [tuple(p[e] for p in parts) for e in chosen]
        if triton:
            moe_pairs_quant(out, x, rows, wts, experts, "int4", group_size)
        else:
            for expert in experts:
                out += quant_swiglu(x, expert, "int4", group_size) / top_k

    return _rotating(parts[0].shape[0], top_k, x, add)


def gpu_expert_step_int4(parts: tuple, top_k: int, reps: int, group_size: int = 32, triton: bool = True) -> list[float]:
    """Batch-1 int4 experts from VRAM-resident slots through the path the residency executor takes
    at decode with `--expert-dtype int4` (Triton, or torch with `triton=False`); GB/s of int4
    bytes (weights and scales)."""
    torch = _torch()
    device = parts[0].device
    x = torch.randn((1, parts[2].shape[1]), device=device)
    per_expert = sum(p[0].numel() * p.element_size() for p in parts)
    with torch.cuda.device(device):
        return timed_gpu(triton_expert_step_int4(parts, x, top_k, group_size, triton), top_k * per_expert, reps)


def gpu_expert_step_triton(gate: Any, up: Any, down: Any, top_k: int, reps: int) -> list[float]:
    """`gpu_expert_step` through the Triton experts the residency executor uses at decode
    (kernels/gpu_moe.py: top_k pairs of one token in two launches)."""
    torch = _torch()
    x = torch.randn((1, gate.shape[2]), device=gate.device, dtype=gate.dtype)
    per_expert = (gate[0].numel() + up[0].numel() + down[0].numel()) * gate.element_size()
    with torch.cuda.device(gate.device):
        return timed_gpu(triton_expert_step(gate, up, down, x, top_k), top_k * per_expert, reps)


def gpu_expert_step(gate: Any, up: Any, down: Any, top_k: int, reps: int) -> list[float]:
    """Batch-1 SwiGLU experts from VRAM-resident bf16 weights (gate/up [E,I,D], down [E,D,I]),
    top_k experts per step, rotated, through torch one expert at a time (the executor's path
    where Triton is not available)."""
    torch = _torch()
    x = torch.randn((1, gate.shape[2]), device=gate.device, dtype=gate.dtype)
    per_expert = (gate[0].numel() + up[0].numel() + down[0].numel()) * gate.element_size()

    def add(out, chosen):
        for e in chosen:
            h = torch.nn.functional.silu(x @ gate[e].T) * (x @ up[e].T)     # [1, I]
            out += (h @ down[e].T) / top_k                                 # [1, D]

    with torch.cuda.device(gate.device):
        return timed_gpu(_rotating(gate.shape[0], top_k, x, add), top_k * per_expert, reps)


def concurrent_h2d_and_cpu(nbytes: int, copies: int, cpu_sample: Callable[[], float],
                           device: int = 0) -> tuple[list[float], list[float]]:
    """PCIe H2D (pinned) streaming while the CPU expert kernel runs, both contending for DRAM.

    Queues `copies` async copies on a side stream, then takes CPU kernel samples (each returns
    GB/s) until the stream drains. Returns (per-copy H2D GB/s, CPU kernel GB/s samples), both
    measured over the same window.
    """
    torch = _torch()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    stream = torch.cuda.Stream(device=device)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(copies + 1)]
    with torch.cuda.stream(stream):
        dev.copy_(host, non_blocking=True)
        stream.synchronize()
        events[0].record(stream)
        for i in range(copies):
            dev.copy_(host, non_blocking=True)
            events[i + 1].record(stream)
    cpu: list[float] = []
    while True:
        gbps = cpu_sample()
        busy = not stream.query()
        if busy or not cpu:      # a sample that outlived the copies was only partly contended
            cpu.append(gbps)
        if not busy:
            break
    stream.synchronize()
    pcie = [nbytes / (events[i].elapsed_time(events[i + 1]) / 1e3) / GB for i in range(copies)]
    return pcie, cpu


def figure(name: str, samples: list[float], method: str, params: dict, t0: float) -> Figure:
    return Figure.from_samples(name, samples, method, params, time.perf_counter() - t0)
