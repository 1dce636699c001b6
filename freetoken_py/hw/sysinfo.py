"""What the machine is (not how fast): CPU, ISA, cores, RAM, NUMA, GPUs.

Every source may be missing — a container hides /sys topology, a machine has no NVIDIA driver,
pynvml is not installed — so each reader falls back and records where its answer came from.
Parsers take text so tests can feed them a container's or another CPU's /proc/cpuinfo.
"""
from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

from freetoken_py.hw.profile import CpuInfo, GpuInfo, GpuSystem, MemoryInfo

# cpuinfo flag -> profile ISA name; "amx" is the tile unit every AMX variant needs.
ISA_FLAGS = {
    "avx2": "avx2", "fma": "fma", "f16c": "f16c",
    "avx512f": "avx512f", "avx512bw": "avx512bw", "avx512_bf16": "avx512_bf16",
    "avx512_vnni": "avx512_vnni", "avx512_fp16": "avx512_fp16",
    "amx_tile": "amx", "amx_bf16": "amx_bf16", "amx_int8": "amx_int8",
}


def parse_cpuinfo(text: str) -> dict[str, Any]:
    """Model, vendor, family/model/stepping, flags and the (physical id, core id) pairs."""
    info: dict[str, Any] = {"flags": set(), "cores": set(), "processors": 0}
    phys = None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "processor":
            info["processors"] += 1
            phys = None
        elif key in ("model name", "vendor_id", "cpu family", "model", "stepping"):
            info.setdefault(key, value)
        elif key in ("flags", "Features") and not info["flags"]:
            info["flags"] = set(value.split())
        elif key == "physical id":
            phys = value
        elif key == "core id":
            info["cores"].add((phys, value))
    return info


def isa_from_flags(flags: set[str]) -> dict[str, bool]:
    return {name: flag in flags for flag, name in ISA_FLAGS.items()}


def physical_cores(cpuinfo: dict[str, Any], logical: int) -> tuple[int, str]:
    """(count, source): psutil, then /proc/cpuinfo core ids, then the logical count."""
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
        if n:
            return int(n), "psutil"
    except Exception:   # psutil missing or unable to read topology in a sandbox
        pass
    if cpuinfo["cores"]:
        return len(cpuinfo["cores"]), "/proc/cpuinfo core ids"
    return logical, "topology hidden: assumed one thread per core"


def l3_bytes() -> Optional[int]:
    """Largest cache size in /sys for cpu0, else None (containers may hide it)."""
    best = None
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        m = re.fullmatch(r"(\d+)([KMG]?)", size)
        if m:
            n = int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)]
            best = max(best or 0, n)
    return best


def collect_cpu(cpuinfo_text: Optional[str] = None) -> CpuInfo:
    if cpuinfo_text is None:
        try:
            cpuinfo_text = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo_text = ""
    info = parse_cpuinfo(cpuinfo_text)
    logical = os.cpu_count() or max(info["processors"], 1)
    phys, source = physical_cores(info, logical)
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = logical
    import platform

    return CpuInfo(
        model=info.get("model name") or platform.processor() or "unknown",
        vendor=info.get("vendor_id", ""), family=info.get("cpu family", ""),
        model_id=info.get("model", ""), stepping=info.get("stepping", ""),
        physical_cores=phys, logical_cores=logical, usable_cores=min(usable, logical),
        topology_source=source, isa=isa_from_flags(info["flags"]),
        isa_source="/proc/cpuinfo flags" if info["flags"] else "unavailable (no cpuinfo flags)",
        l3_bytes=l3_bytes())


def collect_memory() -> MemoryInfo:
    import psutil

    vm = psutil.virtual_memory()
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    source = "/sys/devices/system/node" if nodes else "hidden: assumed 1"
    return MemoryInfo(total_bytes=int(vm.total), available_bytes=int(vm.available),
                      numa_nodes=max(len(nodes), 1), numa_source=source)


def _guard(fn: Callable, *args: Any) -> Any:
    """One NVML call; any NVML error (not supported, no permission, ...) becomes None."""
    try:
        return fn(*args)
    except Exception:
        return None


def _text(value: Any) -> Optional[str]:
    return value.decode() if isinstance(value, bytes) else (None if value is None else str(value))


def _nvml_gpus(nv: Any) -> tuple[list[GpuInfo], Optional[str], Optional[str]]:
    gpus = []
    for i in range(_guard(nv.nvmlDeviceGetCount) or 0):
        h = _guard(nv.nvmlDeviceGetHandleByIndex, i)
        if h is None:
            continue
        mem = _guard(nv.nvmlDeviceGetMemoryInfo, h)
        cc = _guard(nv.nvmlDeviceGetCudaComputeCapability, h)
        gpus.append(GpuInfo(
            index=i, name=_text(_guard(nv.nvmlDeviceGetName, h)) or "unknown",
            uuid=_text(_guard(nv.nvmlDeviceGetUUID, h)) or f"index-{i}",
            vram_total_bytes=int(mem.total) if mem else None,
            vram_free_bytes=int(mem.free) if mem else None,
            pcie_gen_current=_guard(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
            pcie_gen_max=_guard(nv.nvmlDeviceGetMaxPcieLinkGeneration, h),
            pcie_width_current=_guard(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
            pcie_width_max=_guard(nv.nvmlDeviceGetMaxPcieLinkWidth, h),
            compute_capability=f"{cc[0]}.{cc[1]}" if cc else None))
    driver = _text(_guard(nv.nvmlSystemGetDriverVersion))
    cuda = _guard(nv.nvmlSystemGetCudaDriverVersion)
    cuda_s = f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else None
    return gpus, driver, cuda_s


def _torch_gpus(torch: Any) -> list[GpuInfo]:
    """Fallback when NVML is missing but CUDA works (e.g. pynvml not installed)."""
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        free, total = _guard(torch.cuda.mem_get_info, i) or (None, p.total_memory)
        uuid = str(getattr(p, "uuid", "") or f"index-{i}")
        gpus.append(GpuInfo(index=i, name=p.name, uuid=uuid, vram_total_bytes=int(total),
                            vram_free_bytes=None if free is None else int(free),
                            pcie_gen_current=None, pcie_gen_max=None, pcie_width_current=None,
                            pcie_width_max=None, compute_capability=f"{p.major}.{p.minor}"))
    return gpus


def _nvml_failure(exc: Exception) -> str:
    kind = type(exc).__name__
    if "LibraryNotFound" in kind:
        return "no NVIDIA driver (the NVML library is not installed)"
    if "DriverNotLoaded" in kind:
        return "the NVIDIA driver is not loaded"
    return f"NVML failed ({kind}: {exc})"


def collect_gpus() -> GpuSystem:
    notes: list[str] = []
    gpus: list[GpuInfo] = []
    driver = cuda_driver = None
    try:
        with warnings.catch_warnings():   # pynvml warns that it is deprecated on import
            warnings.simplefilter("ignore")
            import pynvml as nv
    except ImportError:
        nv = None
        notes.append("pynvml is not installed")
    if nv is not None:
        try:
            nv.nvmlInit()
        except Exception as exc:
            notes.append(_nvml_failure(exc))
        else:
            try:
                gpus, driver, cuda_driver = _nvml_gpus(nv)
            finally:
                _guard(nv.nvmlShutdown)
    try:
        import torch

        runtime = torch.version.cuda
        torch_ok = bool(torch.cuda.is_available())
    except Exception as exc:   # a broken CUDA install must not stop a CPU-only probe
        runtime, torch_ok = None, False
        notes.append(f"torch.cuda failed ({type(exc).__name__})")
    if runtime is None:
        notes.append("torch is a CPU-only build")
    elif not torch_ok:
        notes.append(f"torch (CUDA {runtime}) sees no usable GPU")
    if torch_ok and not gpus:
        gpus = _torch_gpus(torch)
    status = f"{len(gpus)} GPU(s)" if gpus else "no GPU"
    if notes:
        status += ": " + "; ".join(notes)
    return GpuSystem(gpus=tuple(gpus), driver_version=driver, cuda_driver_version=cuda_driver,
                     cuda_runtime_version=runtime, torch_cuda_available=torch_ok, status=status)
