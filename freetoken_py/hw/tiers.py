"""Decode roofline per tier plan: where a model's bytes would live on this machine and the
tokens/s ceiling that follows from the measured bandwidths (bytes read per token / GB/s).

Plans: all-CPU (everything in host RAM, DRAM figure); all-VRAM (only if weights + KV fit in free
VRAM; VRAM figure); hybrid (dense weights, lm_head and KV in VRAM, as many experts as fit resident;
a routed expert hits VRAM with probability = resident fraction — uniform routing, a lower bound
since real routing is skewed — and a miss takes the faster of PCIe streaming or CPU evaluation,
both at their *concurrent* figures because they share DRAM with each other).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from freetoken_py.hw.model_bytes import ModelBytes
from freetoken_py.hw.profile import HardwareProfile

CONTEXT_LEN = 4096             # KV cache reserved in VRAM plans
VRAM_RESERVE_BYTES = 2**30     # CUDA context, activations, allocator slack
_CPU_FORMAT = {"BF16": "bf16", "F16": "bf16", "F32": "fp32", "I8": "int8", "F8_E4M3": "int8",
               "U8": "int4", "I32": "int4"}   # checkpoint dtype -> nearest CPU kernel format


@dataclass(frozen=True)
class TierPlan:
    name: str
    feasible: bool
    reason: str                                    # assumptions, or why the plan is impossible
    tokens_per_s: Optional[float] = None
    placement_bytes: dict[str, int] = field(default_factory=dict)      # tier -> bytes stored
    per_token_bytes: dict[str, float] = field(default_factory=dict)    # source -> bytes read
    figures_used: dict[str, float] = field(default_factory=dict)       # figure -> GB/s
    resident_expert_fraction: Optional[float] = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rate(reads: dict[str, float], gbps: dict[str, float]) -> float:
    seconds = sum(b / (gbps[src] * 1e9) for src, b in reads.items() if b)
    return 1.0 / seconds if seconds > 0 else float("inf")


def cpu_plan(model: ModelBytes, profile: HardwareProfile) -> TierPlan:
    dram = profile.gbps("dram_read_all_cores")
    if dram is None:
        return TierPlan("all-CPU", False, "no DRAM figure in the profile")
    used = {"dram_read_all_cores": dram}
    reason = "all weights in host RAM; every byte read at the DRAM figure"
    kernel = f"cpu_expert_{_CPU_FORMAT.get(model.expert_dtype or '', 'bf16')}"
    if profile.gbps(kernel) is not None:
        used[kernel] = profile.gbps(kernel)
        reason += f" ({kernel} = {used[kernel]:.1f} GB/s measured for the expert kernel itself)"
    reads = {"dram_read_all_cores": float(model.per_token_bytes)}
    return TierPlan("all-CPU", True, reason, _rate(reads, used), {"host": model.total_bytes},
                    reads, used)


def _vram_budget(profile: HardwareProfile) -> Optional[int]:
    gpus = profile.gpu.gpus
    if not gpus or gpus[0].vram_free_bytes is None:
        return None
    return gpus[0].vram_free_bytes - VRAM_RESERVE_BYTES


def _no_gpu(profile: HardwareProfile) -> str:
    if not profile.gpu.gpus:
        return "no GPU on this machine"
    return "the GPU figures (vram_d2d) were not measured: " + profile.unavailable.get(
        "vram_d2d", "unknown reason")


def vram_plan(model: ModelBytes, profile: HardwareProfile) -> TierPlan:
    budget, vram = _vram_budget(profile), profile.gbps("vram_d2d")
    if budget is None or vram is None:
        return TierPlan("all-VRAM", False, _no_gpu(profile))
    need = model.total_bytes + model.kv_bytes(CONTEXT_LEN)
    if need > budget:
        return TierPlan("all-VRAM", False, f"needs {need / 2**30:.1f} GiB (weights + KV for "
                        f"{CONTEXT_LEN} tokens), {budget / 2**30:.1f} GiB of VRAM is free")
    reads = {"vram_d2d": float(model.per_token_bytes)}
    return TierPlan("all-VRAM", True, f"weights + KV for {CONTEXT_LEN} tokens fit in free VRAM",
                    _rate(reads, {"vram_d2d": vram}), {"vram": need}, reads, {"vram_d2d": vram})


def _miss_figures(profile: HardwareProfile, fmt: str) -> tuple[dict[str, float], list[str]]:
    """{figure: GB/s} for the two ways to serve an expert miss, concurrent figures first."""
    options = {"PCIe": ("pcie_h2d_pinned_concurrent", "pcie_h2d_pinned"),
               "CPU": (f"cpu_expert_{fmt}_concurrent", "cpu_expert_bf16_concurrent",
                       f"cpu_expert_{fmt}", "dram_read_all_cores")}
    found: dict[str, float] = {}
    notes = []
    for path, names in options.items():
        name = next((n for n in names if profile.gbps(n) is not None), None)
        if name is not None:
            found[name] = profile.gbps(name)
            if "concurrent" not in name:
                notes.append(f"{path} via {name}: no concurrent figure")
    return found, notes


def hybrid_plan(model: ModelBytes, profile: HardwareProfile) -> TierPlan:
    budget, vram = _vram_budget(profile), profile.gbps("vram_d2d")
    if budget is None or vram is None:
        return TierPlan("hybrid", False, _no_gpu(profile))
    emb = model.by_category.get("embedding", 0)
    dense = model.total_bytes - model.routed_expert_bytes - emb          # lm_head included
    if model.tied_embeddings:
        dense += emb                                                      # lm_head reads it
    dense += model.kv_bytes(CONTEXT_LEN)
    spare = budget - dense
    if spare < 0:
        return TierPlan("hybrid", False, f"dense weights + KV need {dense / 2**30:.1f} GiB, "
                        f"{budget / 2**30:.1f} GiB of VRAM is free")
    experts = model.routed_expert_bytes
    frac = min(1.0, spare / experts) if experts else 1.0
    misses, note = _miss_figures(profile, _CPU_FORMAT.get(model.expert_dtype or "", "bf16"))
    expert_tok = float(model.per_token["routed_experts"])
    reads = {"vram_d2d": model.per_token_bytes - expert_tok * (1 - frac)}
    used = {"vram_d2d": vram}
    if frac < 1.0:
        if not misses:
            return TierPlan("hybrid", False, "no PCIe, CPU-kernel or DRAM figure for expert misses")
        best = max(misses, key=misses.get)
        reads[best] = expert_tok * (1 - frac)
        used.update(misses)
    reason = (f"dense + lm_head + KV({CONTEXT_LEN}) in VRAM, {frac:.0%} of experts resident; "
              f"misses go to the faster of PCIe / CPU" + (f" ({'; '.join(note)})" if note else ""))
    placement = {"vram": int(dense + experts * frac), "host": int(emb + experts * (1 - frac))}
    return TierPlan("hybrid", True, reason, _rate(reads, used), placement, reads, used, frac)


def tier_plans(model: ModelBytes, profile: HardwareProfile) -> list[TierPlan]:
    return [cpu_plan(model, profile), vram_plan(model, profile), hybrid_plan(model, profile)]
