"""Will a checkpoint fit this machine, and if not, which quantised variant would?

The weights (+ bf16 KV for `tiers.CONTEXT_LEN` tokens) against available RAM + the free VRAM the
tier plans use; a variant is the same checkpoint as `freetoken quantize --to FMT` writes it (every
linear of attention, dense / shared MLPs and routed experts converted; embeddings, norms, routers
and lm_head as stored), sized from its bytes per weight, and run through the same tier plans.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from freetoken_py.hw.model_bytes import LayerBytes, ModelBytes, per_token_bytes
from freetoken_py.hw.profile import HardwareProfile
from freetoken_py.hw.tiers import CONTEXT_LEN, VRAM_RESERVE_BYTES, tier_plans

CONVERTED = ("attention", "dense_mlp", "shared_experts", "routed_experts")   # loading/quantize.py
# bytes per weight as `freetoken quantize` stores them, with the dtype the planner reads them as
VARIANTS = (("fp8", 1 + 4 / (128 * 128), "F8_E4M3"),     # e4m3 + an fp32 scale per 128 x 128 block
            ("int4", 0.5 + 2 / 32, "I32"))                 # packed nibbles + a 16-bit scale per 32
_FLOAT_BYTES = {"F32": 4, "BF16": 2, "F16": 2}


def memory_bytes(profile: HardwareProfile) -> tuple[int, int]:
    """(available host RAM, free VRAM the plans may use) in bytes."""
    gpus = profile.gpu.gpus if profile.gpu.torch_cuda_available else ()
    vram = sum(max(0, (g.vram_free_bytes or 0) - VRAM_RESERVE_BYTES) for g in gpus[:1])
    return profile.memory.available_bytes, vram


def need_bytes(model: ModelBytes) -> int:
    return model.total_bytes + model.kv_bytes(CONTEXT_LEN)


def fit(model: ModelBytes, profile: HardwareProfile) -> dict[str, Any]:
    ram, vram = memory_bytes(profile)
    out = {"need_bytes": need_bytes(model), "ram_available_bytes": ram, "vram_free_bytes": vram,
           "fits_memory": need_bytes(model) <= ram + vram, "variant": None}
    if not out["fits_memory"]:
        out["variant"] = smallest_fitting_variant(model, profile, ram + vram)
    return out


def smallest_fitting_variant(model: ModelBytes, profile: HardwareProfile, room: int) -> Optional[dict]:
    """The most precise variant that fits `room` bytes (fp8 before int4), with its best plan."""
    for fmt, per_weight, dtype in VARIANTS:
        m = variant(model, fmt, per_weight, dtype)
        if m is not None and need_bytes(m) <= room:
            feasible = [p for p in tier_plans(m, profile) if p.feasible]
            best = max(feasible, key=lambda p: p.tokens_per_s) if feasible else None
            return {"format": fmt, "total_bytes": m.total_bytes, "need_bytes": need_bytes(m),
                    "plan": best.name if best else None, "tokens_per_s": best.tokens_per_s if best else None}
    return None


def variant(model: ModelBytes, fmt: str, per_weight: float, dtype: str) -> Optional[ModelBytes]:
    """`model` as `freetoken quantize --to fmt` would write it; None unless it is a float
    checkpoint that the variant makes smaller."""
    src = max((d for d in model.dtypes if d in _FLOAT_BYTES), key=lambda d: model.dtypes[d], default=None)
    if model.weight_format != "unquantised" or src is None or per_weight >= _FLOAT_BYTES[src]:
        return None
    ratio = per_weight / _FLOAT_BYTES[src]

    def scale(cats: dict[str, int]) -> dict[str, int]:
        return {c: int(n * ratio) if c in CONVERTED else n for c, n in cats.items()}

    layers = tuple(LayerBytes(x.layer, scale(x.by_category), x.num_experts, int(x.bytes_per_expert * ratio))
                   for x in model.layers)
    cats = scale(model.by_category)
    row = model.per_token.get("embedding_row", 0)
    rows = model.by_category.get("embedding", 0) // row if row else 0
    return replace(model, by_category=cats, layers=layers, total_bytes=sum(cats.values()),
                   expert_dtype=dtype, dtypes={dtype: sum(cats.values())}, weight_format=f"{fmt} (estimated)",
                   per_token=per_token_bytes(cats, layers, model.top_k, rows, model.tied_embeddings))
