"""The default probes and the figure names they produce.

Figure names (GB/s, 10^9 bytes per second):

  dram_read_all_cores            numba parallel sum, one thread per physical core
  dram_read_single_core          numba serial sum
  cpu_expert_<fmt>               production CPU expert kernel, batch 1 (fmt: bf16 fp32 int8 int4)
  pcie_h2d_pinned / _pageable    host -> device copy          (CUDA only, from here down)
  pcie_d2h_pinned / _pageable    device -> host copy
  vram_d2d                       device copy, read + write bytes
  gpu_expert_gather              routed experts copied from a pinned host bank into VRAM slots
  gpu_expert_kernel              batch-1 experts computed from VRAM-resident bf16 weights (the executor's decode path)
  gpu_expert_kernel_int4         the same for int4 experts (the quantised Triton kernels, else torch's dequantise path)
  pcie_h2d_pinned_concurrent     H2D streaming while the CPU expert kernel runs ...
  cpu_expert_bf16_concurrent     ... and that kernel meanwhile: the pair the planner should use

`ProbeContext` holds what several probes share (the DRAM buffer, expert banks, pinned memory)
for the duration of one profiling run; `close()` frees it.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

from freetoken_py.hw.profile import CpuInfo, Figure, GpuSystem, MemoryInfo
from freetoken_py.hw.runner import Probe

GPU_FIGURES = ("pcie_h2d_pinned", "pcie_h2d_pageable", "pcie_d2h_pinned", "pcie_d2h_pageable",
               "vram_d2d", "gpu_expert_gather", "gpu_expert_kernel", "gpu_expert_kernel_int4",
               "pcie_h2d_pinned_concurrent", "cpu_expert_bf16_concurrent")
CONCURRENT_FIGURES = GPU_FIGURES[-2:]


class ProbeContext:
    def __init__(self, cpu: CpuInfo, memory: MemoryInfo, gpu: GpuSystem):
        self.cpu, self.memory, self.gpu = cpu, memory, gpu
        self._resources: dict[Any, Any] = {}

    @property
    def threads(self) -> int:
        """One worker per physical core this process may use."""
        return max(1, min(self.cpu.physical_cores, self.cpu.usable_cores))

    def resource(self, key: Any, factory: Callable[[], Any]) -> Any:
        if key not in self._resources:
            self._resources[key] = factory()
        return self._resources[key]

    def close(self) -> None:
        self._resources.clear()


def dram_probes(ctx: ProbeContext) -> list[Probe]:
    from freetoken_py.hw import measure_dram as m

    def buffer(quick: bool):
        nbytes = m.buffer_bytes(ctx.cpu.l3_bytes, ctx.memory.available_bytes, quick)
        return ctx.resource(("dram", nbytes), lambda: m.make_buffer(nbytes))

    def run(name: str, threads: int) -> Callable[[bool], list[Figure]]:
        def go(quick: bool) -> list[Figure]:
            t0 = time.perf_counter()
            buf = buffer(quick)
            return [m.measure_dram_read(buf, threads, name, reps=3 if quick else 7,
                                        setup_s=time.perf_counter() - t0)]
        return go

    return [Probe(("dram_read_all_cores",), f"DRAM read, {ctx.threads} cores",
                  run("dram_read_all_cores", ctx.threads)),
            Probe(("dram_read_single_core",), "DRAM read, 1 core", run("dram_read_single_core", 1))]


def expert_workload(ctx: ProbeContext, fmt: str, quick: bool):
    from freetoken_py.hw import measure_expert as me

    base = ctx.resource(("expert_base", fmt), lambda: me.base_bank(fmt))
    return ctx.resource(("experts", fmt, quick),
                        lambda: me.build_workload(fmt, ctx.cpu.l3_bytes, quick=quick, base=base))


def cpu_kernel(ctx: ProbeContext) -> tuple[Any, Optional[str]]:
    """(the cpu_moe module, None), or (None, why it cannot be used). Nothing is compiled here:
    each probe's untimed first call compiles (or loads) just the kernel it measures."""
    from freetoken_py.hw import measure_expert as me

    def load() -> tuple[Any, Optional[str]]:
        try:
            return me.kernel_module(), None
        except Exception as exc:   # ImportError before the kernel lands; anything else reported
            return None, f"CPU expert kernel unavailable ({type(exc).__name__}: {exc})"

    return ctx.resource("cpu_moe", load)


def expert_probes(ctx: ProbeContext) -> tuple[list[Probe], dict[str, str]]:
    from freetoken_py.hw import measure_expert as me

    mod, why = cpu_kernel(ctx)
    if mod is None:
        return [], {f"cpu_expert_{f}": why for f in me.FORMATS}
    formats = tuple(getattr(mod, "FORMATS", me.FORMATS))

    def run(fmt: str) -> Callable[[bool], list[Figure]]:
        def go(quick: bool) -> list[Figure]:
            t0 = time.perf_counter()
            work = expert_workload(ctx, fmt, quick)
            return [me.measure_expert_kernel(work, f"cpu_expert_{fmt}", ctx.threads,
                                             count=3 if quick else 5,
                                             setup_s=time.perf_counter() - t0)]
        return go

    return [Probe((f"cpu_expert_{f}",), f"CPU expert kernel, {f}", run(f)) for f in formats], {}


def gpu_selection(ctx: ProbeContext, names: Sequence[str] = GPU_FIGURES
                  ) -> tuple[list[Probe], dict[str, str]]:
    """The CUDA probes that produce any of `names`, and why the others cannot run here."""
    wanted = set(names)
    if not (ctx.gpu.torch_cuda_available and ctx.gpu.gpus):
        return [], {n: "no CUDA GPU (see gpu.status)" for n in names}
    from freetoken_py.hw.gpu_probes import gpu_probes

    why = cpu_kernel(ctx)[1] if wanted & set(CONCURRENT_FIGURES) else None
    probes = [p for p in gpu_probes(ctx, with_cpu_kernel=why is None) if wanted & set(p.names)]
    unavailable = {n: f"needs the CPU expert kernel: {why}"
                   for n in CONCURRENT_FIGURES if why and n in wanted}
    return probes, unavailable


def default_probes(ctx: ProbeContext) -> tuple[list[Probe], dict[str, str]]:
    """(every probe this machine can run, {figure: why it cannot be measured here})."""
    probes = dram_probes(ctx)
    experts, unavailable = expert_probes(ctx)
    gpu, gpu_unavailable = gpu_selection(ctx)
    unavailable.update(gpu_unavailable)
    return probes + experts + gpu, unavailable
