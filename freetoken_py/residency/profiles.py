"""Tier profiles (the cost model's prior) and the byte geometry of real frontier MoEs.

A `TierProfile` is the handful of numbers the planner needs: how fast a byte moves over each path
and how fast each tier computes. The hand-built profiles below are *assumptions* taken from vendor
specifications and typical measured fractions of them (see docs/residency.md for the sources);
they are not measurements of this machine. `from_hardware_profile` turns a measured
`hw.HardwareProfile` into a `TierProfile` (concurrent figures preferred: PCIe DMA and the CPU
kernel share DRAM).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

GB = 1e9


@dataclass(frozen=True)
class TierProfile:
    name: str
    vram_bytes: int            # total accelerator memory
    vram_gbps: float           # accelerator memory bandwidth (weights read by GPU experts)
    pcie_gbps: float           # pinned host -> device, while the CPU kernel also runs
    cpu_expert_gbps: float     # CPU expert kernel, bytes of weights per second, while PCIe also runs
    cpu_tflops: float          # CPU expert kernel compute ceiling (prefill: many tokens per expert)
    gpu_tflops: float          # accelerator compute ceiling for expert GEMMs
    cpu_call_s: float = 30e-6  # activations to the host and back + kernel launch, per layer
    copy_call_s: float = 5e-6  # per streamed expert: copy launch and event sync
    # host work of every layer-step outside the tiers (routing read, plan, bookkeeping): 0 in the
    # hand-built profiles (they describe hardware); measured on this machine by residency.calibrate
    host_layer_s: float = 0.0
    vram_reserve_bytes: int = 2**30   # CUDA context, activations, allocator slack
    emulated: bool = False     # True: numbers injected for an emulated accelerator, not measured
    # the accelerator's expert kernels' rate when it is not `vram_gbps` (a measured profile for
    # int4 experts: their own kernels'); 0: `vram_gbps`. Dense weights are read at `vram_gbps`
    accel_expert_gbps: float = 0.0
    # host memory, which holds every routed expert's host copy (the banks the streamer copies from
    # and the CPU tier reads): an assumption in the hand-built profiles, the machine's total in a
    # measured one; 0: not known. The simulator does not model a model larger than it (its
    # experts would be read from disk): the bench flags such cases (`fits_in_host_ram`)
    host_ram_bytes: int = 0
    # fixed costs per MoE layer-step (planner.CostModel): the accelerator's, in a layer-step it
    # has work in, and the host's outside the executor (the dense part's launches). 0 in the
    # hand-built profiles (they describe hardware and compare policies); a measured GPU profile
    # takes the H200 run's (H200_SEEDS) until the probe measures them
    gpu_step_s: float = 0.0
    host_step_s: float = 0.0

    @property
    def expert_gbps(self) -> float:
        """The rate the accelerator computes experts at (bytes of expert weights per second)."""
        return self.accel_expert_gbps or self.vram_gbps

    def __post_init__(self) -> None:
        for f in ("vram_gbps", "pcie_gbps", "cpu_expert_gbps", "cpu_tflops", "gpu_tflops"):
            if getattr(self, f) <= 0:
                raise ValueError(f"profile {self.name}: {f} must be positive")
        for f in ("cpu_call_s", "copy_call_s", "host_layer_s", "accel_expert_gbps", "host_ram_bytes",
                  "gpu_step_s", "host_step_s"):
            if getattr(self, f) < 0:
                raise ValueError(f"profile {self.name}: {f} must not be negative")


# Vendor specs + assumed achievable fractions; every figure is cited in docs/residency.md.
PROFILES: dict[str, TierProfile] = {p.name: p for p in (
    # GDDR6 128-bit 16 Gbps = 256 GB/s; PCIe 4.0 x8 = 15.8 GB/s raw, ~12.5 pinned; DDR5-5600 2ch
    # = 89.6 GB/s raw, ~60 read, CPU expert kernel ~35 while DMA also reads DRAM. 64 GB: two 32 GB
    # SO-DIMMs, the most such laptops take.
    TierProfile("rtx4060-laptop-8g", 8 * 2**30, 256, 12.5, 35, 0.6, 30, host_ram_bytes=64 * 2**30),
    # GDDR6X 384-bit 21 Gbps = 1008 GB/s; PCIe 4.0 x16 = 31.5 raw, ~25 pinned; DDR5-6000 2ch
    # = 96 raw, ~70 read, CPU kernel ~40 concurrent (16 cores). 96 GB: two 48 GB DIMMs (four would
    # not run at 6000).
    TierProfile("rtx4090", 24 * 2**30, 1008, 25, 40, 1.5, 150, host_ram_bytes=96 * 2**30),
    # GDDR7 512-bit 28 Gbps = 1792 GB/s; PCIe 5.0 x16 = 63 raw, ~50 pinned; same desktop DRAM,
    # but a 50 GB/s DMA leaves the CPU kernel ~30 of the ~75 GB/s the DRAM delivers. 128 GB: two
    # 64 GB DIMMs.
    TierProfile("rtx5090", 32 * 2**30, 1792, 50, 30, 1.5, 200, host_ram_bytes=128 * 2**30),
    # RTX PRO 6000 Blackwell: 96 GB GDDR7, 1792 GB/s, PCIe 5.0 x16 ~52 pinned; Threadripper PRO
    # 8ch DDR5-5200 = 333 raw, ~220 read, CPU kernel ~110 concurrent (32 cores, AVX-512). 512 GB:
    # eight 64 GB RDIMMs.
    TierProfile("rtx-pro-6000", 96 * 2**30, 1792, 52, 110, 3.0, 250, host_ram_bytes=512 * 2**30),
)}


# The fixed costs of a decode layer-step measured on the one GPU run (H200, 2026-12-04; the recorded
# figures: tests/data/h200_residency_run.json, derived in docs/residency.md "The fixed costs"):
# gpu_step_s: the Triton experts' layer-step (0.383 ms for Qwen3-30B-A3B, bench/gpu_moe_kernels.py)
# less its 75.5 MB at the device's 4.17 TB/s; host_step_s: the decode token's time less the
# executor's expert time, per MoE layer (27.62 - 13.9 ms over 8 layers), less the dense read
H200_SEEDS = {"gpu_step_s": 0.365e-3, "host_step_s": 1.712e-3}


def get_profile(name: str) -> TierProfile:
    if name not in PROFILES:
        raise ValueError(f"unknown hardware profile {name!r}; choose one of {', '.join(PROFILES)}")
    return PROFILES[name]


def emulated(profile: TierProfile, vram_bytes: Optional[int] = None) -> TierProfile:
    """The same numbers, labelled as an emulated accelerator (optionally with another VRAM size)."""
    return replace(profile, emulated=True, vram_bytes=vram_bytes or profile.vram_bytes,
                   name=profile.name if profile.name.startswith("emulated:") else f"emulated:{profile.name}")


def from_hardware_profile(hw, name: str = "measured", expert_format: str = "bf16") -> Optional[TierProfile]:
    """A measured `hw.profile.HardwareProfile` as a TierProfile; None without GPU figures.
    `expert_format` (bf16, fp32, int8, int4): the experts' format in the tiers, whose CPU kernel
    rate the CPU side takes (the figure measured alongside PCIe traffic is bf16's: another
    format's is scaled by its ratio to bf16 alone)."""
    gpus = hw.gpu.gpus
    # bytes move at the device's read rate (the dense weights and the experts alike): the fixed
    # cost of a layer-step's launches is its own term (gpu_step_s, host_step_s; issue 40), so the
    # probe's expert-kernel figures, which include the launches at its small experts, are used only
    # where it measured no VRAM rate (they made the H200 run's dense part 3.8 ms per token, not 0.03)
    d2d = hw.gbps("vram_d2d")
    vram = d2d if d2d is not None else hw.gbps("gpu_expert_kernel")
    accel = hw.gbps("gpu_expert_kernel_int4", 0.0) if expert_format == "int4" and d2d is None else 0.0
    pcie = hw.gbps("pcie_h2d_pinned_concurrent", hw.gbps("pcie_h2d_pinned"))
    cpu = hw.gbps("cpu_expert_bf16_concurrent", hw.gbps("cpu_expert_bf16", hw.gbps("dram_read_all_cores")))
    alone, bf16 = hw.gbps(f"cpu_expert_{expert_format}"), hw.gbps("cpu_expert_bf16")
    if expert_format != "bf16" and alone is not None:
        cpu = cpu * alone / bf16 if cpu is not None and bf16 else alone
    if not gpus or gpus[0].vram_total_bytes is None or None in (vram, pcie, cpu):
        return None
    # compute ceilings are not probed yet: rough per-core / per-GPU class guesses
    # the fixed step costs: the H200 run's until the probe measures them on this machine (issue 40)
    fixed = dict(H200_SEEDS)
    return TierProfile(name, gpus[0].vram_total_bytes, vram, pcie, cpu,
                       cpu_tflops=0.1 * max(1, hw.cpu.physical_cores), gpu_tflops=100, accel_expert_gbps=accel,
                       host_ram_bytes=hw.memory.total_bytes or 0, **fixed)


@dataclass(frozen=True)
class ModelSpec:
    """Byte geometry of an MoE for the simulator: what one expert and the dense part weigh."""
    name: str
    num_layers: int            # MoE layers (dense-FFN layers are folded into dense_params)
    num_experts: int
    top_k: int
    hidden: int
    moe_intermediate: int
    dense_params: float        # everything except routed experts (attention, shared experts, lm_head, ...)
    bits_per_weight: float = 4.5   # Q4_K_M-class quantisation, what these models run as on one box

    @property
    def expert_bytes(self) -> int:
        return int(3 * self.hidden * self.moe_intermediate * self.bits_per_weight / 8)

    @property
    def expert_flops_per_token(self) -> float:
        return 2.0 * 3 * self.hidden * self.moe_intermediate

    @property
    def dense_bytes(self) -> int:
        return int(self.dense_params * self.bits_per_weight / 8)

    @property
    def total_bytes(self) -> int:
        return self.dense_bytes + self.num_layers * self.num_experts * self.expert_bytes

    def fits_in_vram(self, profile: TierProfile, kv_bytes: int = 2**30) -> bool:
        return self.total_bytes + kv_bytes + profile.vram_reserve_bytes <= profile.vram_bytes

    @property
    def expert_host_bytes(self) -> int:
        """Every routed expert's host copy (what the host banks hold)."""
        return self.num_layers * self.num_experts * self.expert_bytes

    def fits_in_host_ram(self, profile: TierProfile, os_bytes: int = 8 * 2**30) -> Optional[bool]:
        """Whether the routed experts' host copies and `os_bytes` (the OS, the engine, the page
        cache it needs) fit in the profile's host memory; None where that is not known."""
        if not profile.host_ram_bytes:
            return None
        return self.expert_host_bytes + os_bytes <= profile.host_ram_bytes

    def expert_slots(self, profile: TierProfile, kv_bytes: int = 2**30) -> int:
        """Expert slots left once dense weights, KV and the reserve are in VRAM (>= 0)."""
        spare = profile.vram_bytes - profile.vram_reserve_bytes - kv_bytes - self.dense_bytes
        return max(0, min(spare // self.expert_bytes, self.num_layers * self.num_experts))


# Geometry from each model's config.json; dense_params = total - routed expert params.
FRONTIER_MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("qwen3-30b-a3b", 48, 128, 8, 2048, 768, dense_params=1.5e9),       # 30.5B total
    ModelSpec("qwen3-235b-a22b", 94, 128, 8, 4096, 1536, dense_params=7.9e9),    # 235B total
    ModelSpec("deepseek-v3", 58, 256, 8, 7168, 2048, dense_params=17.1e9),       # 671B, 3 dense layers
)}
