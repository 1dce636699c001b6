"""The machine profile the scheduler trusts: what the machine is, and what it measured.

`HardwareProfile` is a versioned, frozen dataclass that round-trips through JSON. It is cached in
the user cache directory under a key made of what identifies the machine (CPU model and cores,
RAM size, GPU UUIDs, driver), so moving the cache to another machine, or swapping a GPU, never
feeds stale numbers to the planner.

Every measured number is a `Figure`: the median of its samples (what the planner uses — DRAM
bandwidth here is bimodal, a best-of would promise bursts), the best sample, all samples, and one
line saying how it was measured.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

PROFILE_VERSION = 3   # 2: nvfp4 measured at its group of 16 (v1 measured g32, the fallback loop); 3: fp8 at its block of 128 (v2: 32)


class ProfileVersionError(ValueError):
    """The cached profile was written by another profile version; measure again."""


@dataclass(frozen=True)
class Figure:
    """One measured bandwidth. `gbps` (10^9 bytes/s) is the median of `samples`."""

    name: str
    gbps: float
    best_gbps: float
    samples: tuple[float, ...]
    method: str
    params: Mapping[str, Any] = field(default_factory=dict)
    measured_at: float = 0.0
    seconds: float = 0.0

    @classmethod
    def from_samples(cls, name: str, samples: list[float], method: str, params: Mapping[str, Any],
                     seconds: float) -> "Figure":
        if not samples:
            raise ValueError(f"figure {name}: no samples")
        return cls(name=name, gbps=float(statistics.median(samples)), best_gbps=float(max(samples)),
                   samples=tuple(round(float(s), 3) for s in samples), method=method,
                   params=dict(params), measured_at=time.time(), seconds=round(seconds, 3))

    def drift(self, other: "Figure") -> float:
        """Relative change of `other`'s median against this figure's median."""
        return other.gbps / self.gbps - 1.0 if self.gbps > 0 else float("inf")

    def drifted(self, other: "Figure", tolerance: float) -> bool:
        """True if `other` lies outside both this figure's sample range and ±tolerance of its median.

        A value inside the range this figure already recorded is its known spread (DRAM here
        alternates between ~34 and ~50+ GB/s), not a change of the machine.
        """
        lo = min(min(self.samples), self.gbps * (1.0 - tolerance))
        hi = max(max(self.samples), self.gbps * (1.0 + tolerance))
        return not (lo <= other.gbps <= hi)


@dataclass(frozen=True)
class CpuInfo:
    model: str
    vendor: str
    family: str
    model_id: str
    stepping: str
    physical_cores: int
    logical_cores: int
    usable_cores: int               # what this process may run on (cgroup / affinity)
    topology_source: str            # how physical_cores was found
    isa: Mapping[str, bool]         # avx2, avx512f, avx512_bf16, avx512_vnni, amx, ...
    isa_source: str
    l3_bytes: Optional[int]


@dataclass(frozen=True)
class MemoryInfo:
    total_bytes: int
    available_bytes: int
    numa_nodes: int
    numa_source: str


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    uuid: str
    vram_total_bytes: Optional[int]
    vram_free_bytes: Optional[int]
    pcie_gen_current: Optional[int]
    pcie_gen_max: Optional[int]
    pcie_width_current: Optional[int]
    pcie_width_max: Optional[int]
    compute_capability: Optional[str]


@dataclass(frozen=True)
class GpuSystem:
    gpus: tuple[GpuInfo, ...]
    driver_version: Optional[str]
    cuda_driver_version: Optional[str]
    cuda_runtime_version: Optional[str]   # torch.version.cuda; None for a CPU build of torch
    torch_cuda_available: bool
    status: str                           # one line: what was found, or why nothing was


@dataclass(frozen=True)
class HardwareProfile:
    version: int
    cpu: CpuInfo
    memory: MemoryInfo
    gpu: GpuSystem
    figures: Mapping[str, Figure]
    unavailable: Mapping[str, str] = field(default_factory=dict)   # figure -> why not measured
    created_at: float = 0.0
    revalidation: Mapping[str, Any] = field(default_factory=dict)  # last start-up check

    def figure(self, name: str) -> Figure:
        try:
            return self.figures[name]
        except KeyError:
            why = self.unavailable.get(name, "not measured")
            raise KeyError(f"no figure {name!r} in the hardware profile ({why})") from None

    def gbps(self, name: str, default: Optional[float] = None) -> Optional[float]:
        fig = self.figures.get(name)
        return fig.gbps if fig is not None else default

    @property
    def key(self) -> str:
        return machine_key(self.cpu, self.memory, self.gpu)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "HardwareProfile":
        if data.get("version") != PROFILE_VERSION:
            raise ProfileVersionError(f"profile version {data.get('version')!r} != {PROFILE_VERSION}")
        gpu = dict(data["gpu"])
        gpu["gpus"] = tuple(GpuInfo(**g) for g in gpu["gpus"])
        figures = {k: _figure_from_dict(v) for k, v in data["figures"].items()}
        return cls(version=data["version"], cpu=CpuInfo(**data["cpu"]),
                   memory=MemoryInfo(**data["memory"]), gpu=GpuSystem(**gpu), figures=figures,
                   unavailable=dict(data.get("unavailable", {})),
                   created_at=data.get("created_at", 0.0),
                   revalidation=dict(data.get("revalidation", {})))

    @classmethod
    def from_json(cls, text: str) -> "HardwareProfile":
        return cls.from_dict(json.loads(text))


def _figure_from_dict(d: Mapping[str, Any]) -> Figure:
    d = dict(d)
    d["samples"] = tuple(d["samples"])
    return Figure(**d)


def machine_key(cpu: CpuInfo, memory: MemoryInfo, gpu: GpuSystem) -> str:
    """What identifies the machine: a change to any of these invalidates the cached figures.

    RAM is rounded to GiB so a few MB of firmware/balloon jitter does not look like a new machine;
    free RAM, free VRAM and current PCIe link state are deliberately not part of the key.
    """
    ident = {
        "cpu": [cpu.model, cpu.vendor, cpu.family, cpu.model_id, cpu.stepping],
        "cores": [cpu.physical_cores, cpu.usable_cores],
        "ram_gib": round(memory.total_bytes / 2**30),
        "gpus": sorted(g.uuid for g in gpu.gpus),
        "driver": gpu.driver_version,
        "profile_version": PROFILE_VERSION,
    }
    blob = json.dumps(ident, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def profile_path(key: str, cache_root: Optional[Path] = None) -> Path:
    from freetoken_py.envs import cache_dir

    return (cache_root or cache_dir()) / "hw" / f"profile-{key}.json"


def save_profile(profile: HardwareProfile, path: Path) -> None:
    """Atomic write: a crash mid-write never leaves a half profile for the next start-up."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(profile.to_json())
    os.replace(tmp, path)


def load_profile(path: Path) -> Optional[HardwareProfile]:
    """The cached profile, or None if it is missing, unreadable or from another version."""
    try:
        return HardwareProfile.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None
