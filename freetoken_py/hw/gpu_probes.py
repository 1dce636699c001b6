"""The CUDA probes (registered only when torch sees a GPU). Measures device 0 as torch numbers it.

Sizes: 256 MiB copies (64 MiB for a quick check) — far past the point where PCIe reaches its
plateau; expert banks several times larger than the GPU's L2 (VRAM side) or the CPU's L3 (host
side), so neither cache can serve a rotated expert.
"""
from __future__ import annotations

import math
import time
from typing import Callable

from freetoken_py.hw import measure_expert as me
from freetoken_py.hw import measure_gpu as mg
from freetoken_py.hw.measure_dram import numba_threads
from freetoken_py.hw.profile import Figure
from freetoken_py.hw.registry import ProbeContext, expert_workload
from freetoken_py.hw.runner import Probe

COPY_BYTES = 256 * 2**20
QUICK_COPY_BYTES = 64 * 2**20
CONCURRENT_SECONDS = 1.0       # how long the queued H2D copies should keep the DMA engine busy
DEVICE = 0


def _reps(quick: bool) -> int:
    return 3 if quick else 10


def _expert_bytes() -> int:
    return 3 * me.INTER * me.HIDDEN * 2            # gate + up + down, bf16


def _pcie(direction: str, pinned: bool) -> Probe:
    name = f"pcie_{direction}_{'pinned' if pinned else 'pageable'}"

    def run(quick: bool) -> list[Figure]:
        t0, nbytes = time.perf_counter(), QUICK_COPY_BYTES if quick else COPY_BYTES
        samples = mg.pcie_copy(direction, pinned, nbytes, _reps(quick), DEVICE)
        method = (f"torch copy_ {direction.upper()} of {nbytes >> 20} MiB from "
                  f"{'pinned' if pinned else 'pageable'} host memory, CUDA events; median")
        return [mg.figure(name, samples, method, {"bytes": nbytes, "device": DEVICE}, t0)]

    return Probe((name,), f"PCIe {direction.upper()} {'pinned' if pinned else 'pageable'}", run)


def _vram(ctx: ProbeContext) -> Probe:
    def run(quick: bool) -> list[Figure]:
        t0 = time.perf_counter()
        free = ctx.gpu.gpus[0].vram_free_bytes or 8 * 2**30
        nbytes = min(256 * 2**20 if quick else 2**30, free // 8)
        samples = mg.vram_copy(nbytes, _reps(quick), DEVICE)
        method = f"torch copy_ of {nbytes >> 20} MiB in VRAM; (read + write bytes) / time; median"
        return [mg.figure("vram_d2d", samples, method, {"bytes": nbytes}, t0)]

    return Probe(("vram_d2d",), "VRAM device-to-device copy", run)


def _gather(ctx: ProbeContext) -> Probe:
    def run(quick: bool) -> list[Figure]:
        import torch

        t0, per = time.perf_counter(), _expert_bytes()
        num = max(math.ceil(4 * (ctx.cpu.l3_bytes or 32 * 2**20) / per), 4 * me.TOP_K)
        host = ctx.resource("pinned_bank", lambda: torch.ones((num, per), dtype=torch.uint8,
                                                               pin_memory=True))
        samples = mg.expert_gather(host, 2 * me.TOP_K, me.TOP_K, 5 if quick else 20, DEVICE)
        method = (f"top-{me.TOP_K} bf16 experts ({per >> 10} KiB each) per step copied from a "
                  f"{num}-expert pinned host bank into VRAM slots, one async copy each; median")
        return [mg.figure("gpu_expert_gather", samples, method,
                          {"bytes_per_expert": per, "num_experts": num}, t0)]

    return Probe(("gpu_expert_gather",), "expert copy path (host -> VRAM slots)", run)


def _gpu_kernel(ctx: ProbeContext) -> Probe:
    def run(quick: bool) -> list[Figure]:
        import torch

        t0, per = time.perf_counter(), _expert_bytes()
        l2 = getattr(torch.cuda.get_device_properties(DEVICE), "L2_cache_size", 0) or 64 * 2**20
        num = max(math.ceil(4 * l2 / per), 4 * me.TOP_K)

        def bank():
            kw = {"device": f"cuda:{DEVICE}", "dtype": torch.bfloat16}
            return (torch.randn((num, me.INTER, me.HIDDEN), **kw),
                    torch.randn((num, me.INTER, me.HIDDEN), **kw),
                    torch.randn((num, me.HIDDEN, me.INTER), **kw))

        gate, up, down = ctx.resource("vram_bank", bank)
        reps, path, why = 5 if quick else 20, "torch", ""
        # the path the residency executor takes at decode: the Triton experts where they run
        # here (kernels/gpu_moe.py), else torch one expert at a time
        from freetoken_py.kernels import gpu_moe

        samples = None
        if gpu_moe.available(f"cuda:{DEVICE}"):
            # the executor's own gate: Triton there and its one-time check against torch passing
            problem = gpu_moe.self_check(f"cuda:{DEVICE}", torch.bfloat16)
            if problem is not None:
                why = f" (Triton not used: {problem[:160]})"
            else:
                try:
                    samples, path = mg.gpu_expert_step_triton(gate, up, down, me.TOP_K, reps), "triton"
                except Exception as exc:      # a Triton failure here: measure the torch path, say why
                    why = f" (Triton failed: {type(exc).__name__}: {str(exc)[:160]})"
        if samples is None:
            samples = mg.gpu_expert_step(gate, up, down, me.TOP_K, reps)
        kind = "Triton SwiGLU experts (kernels/gpu_moe.py)" if path == "triton" else "torch SwiGLU experts"
        method = (f"{kind}{why}, bf16, batch 1, top-{me.TOP_K} of {num} VRAM-resident "
                  f"experts (> 4x L2), rotated; expert bytes / step time; median")
        return [mg.figure("gpu_expert_kernel", samples, method,
                          {"bytes_per_expert": per, "num_experts": num, "path": path}, t0)]

    return Probe(("gpu_expert_kernel",), "GPU expert kernel", run)


def _gpu_kernel_int4(ctx: ProbeContext) -> Probe:
    """`gpu_expert_kernel` for int4 experts (`--expert-dtype int4` in the residency tiers) on the
    same geometry, random packed weights and small fp16 scales, through the path the executor
    takes at decode: the quantised Triton kernels where they run and pass their self-check, else
    torch dequantising each expert (`params.path` says which; the method says why)."""
    def run(quick: bool) -> list[Figure]:
        import torch

        from freetoken_py.kernels import gpu_moe

        t0, dev = time.perf_counter(), f"cuda:{DEVICE}"
        i, d, g = me.INTER, me.HIDDEN, me.GROUP_SIZE
        per = 3 * i * d // 2 + 2 * (2 * i * d // g + d * i // g)
        l2 = getattr(torch.cuda.get_device_properties(DEVICE), "L2_cache_size", 0) or 64 * 2**20
        num = max(math.ceil(4 * l2 / per), 4 * me.TOP_K)
        parts = (torch.randint(0, 256, (num, 2 * i, d // 2), dtype=torch.uint8, device=dev),
                 torch.full((num, 2 * i, d // g), 0.01, dtype=torch.float16, device=dev).view(torch.int16),
                 torch.randint(0, 256, (num, d, i // 2), dtype=torch.uint8, device=dev),
                 torch.full((num, d, i // g), 0.01, dtype=torch.float16, device=dev).view(torch.int16))
        reps, path, why = 5 if quick else 20, "torch", ""
        samples = None
        if gpu_moe.available(dev):
            problem = gpu_moe.self_check_quant(dev, "int4", g)
            if problem is not None:
                why = f" (Triton not used: {problem[:160]})"
            else:
                try:
                    samples, path = mg.gpu_expert_step_int4(parts, me.TOP_K, reps, g), "triton"
                except Exception as exc:      # a Triton failure here: measure the torch path, say why
                    why = f" (Triton failed: {type(exc).__name__}: {str(exc)[:160]})"
        if samples is None:
            samples = mg.gpu_expert_step_int4(parts, me.TOP_K, reps, g, triton=False)
        kind = ("Triton int4 experts (kernels/gpu_moe.py moe_pairs_quant)" if path == "triton"
                else "torch int4 experts (dequantised per expert)")
        method = (f"{kind}{why}, g = {g}, batch 1, top-{me.TOP_K} of {num} VRAM-resident experts "
                  f"(>= 4x L2), rotated; int4 expert bytes (weights and scales) / step time; median")
        return [mg.figure("gpu_expert_kernel_int4", samples, method,
                          {"bytes_per_expert": per, "num_experts": num, "path": path}, t0)]

    return Probe(("gpu_expert_kernel_int4",), "GPU expert kernel, int4", run)


def _concurrent(ctx: ProbeContext) -> Probe:
    names = ("pcie_h2d_pinned_concurrent", "cpu_expert_bf16_concurrent")

    def run(quick: bool) -> list[Figure]:
        t0, nbytes = time.perf_counter(), QUICK_COPY_BYTES if quick else COPY_BYTES
        work = expert_workload(ctx, "bf16", quick)
        alone = mg.pcie_copy("h2d", True, nbytes, 2, DEVICE)
        seconds = CONCURRENT_SECONDS / (4 if quick else 1)
        copies = max(4, math.ceil(seconds * max(alone) * 1e9 / nbytes))
        cpu_sample: Callable[[], float] = lambda: me.sample(work, sample_s=0.05)   # noqa: E731
        with numba_threads(ctx.threads):
            me.sample(work, sample_s=0.0)                              # warm the kernel
            pcie, cpu = mg.concurrent_h2d_and_cpu(nbytes, copies, cpu_sample, DEVICE)
        method = (f"{copies} queued pinned H2D copies of {nbytes >> 20} MiB on a side stream while "
                  f"cpu_moe.moe_experts (bf16, batch 1, top-{me.TOP_K}) rotates over "
                  f"{work.bank_bytes >> 20} MiB of experts; medians over the shared window")
        params = {"bytes": nbytes, "copies": copies, "bank_bytes": work.bank_bytes}
        return [mg.figure(names[0], pcie, method, params, t0),
                mg.figure(names[1], cpu, method, params, t0)]

    return Probe(names, "PCIe H2D + CPU expert kernel together", run)


def gpu_probes(ctx: ProbeContext, with_cpu_kernel: bool = True) -> list[Probe]:
    probes = [_pcie(d, p) for d in ("h2d", "d2h") for p in (True, False)]
    probes += [_vram(ctx), _gather(ctx), _gpu_kernel(ctx), _gpu_kernel_int4(ctx)]
    if with_cpu_kernel:
        probes.append(_concurrent(ctx))
    return probes
