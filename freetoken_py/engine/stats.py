"""`Engine.stats()`: a snapshot of the engine's state as plain values."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from freetoken_py.engine.engine import Engine


def engine_stats(engine: Engine) -> dict:
    """KV pages (total, free, held by the prefix cache, tokens per page), FP8 KV values clipped,
    requests running / waiting, and with the residency tiers on their telemetry (totals and per
    layer) and slot count under "residency". Call it where steps run (between steps): the
    counts are then consistent."""
    e, cache = engine, engine.prefix_cache
    out = {"num_pages": e.allocator.num_pages, "free_pages": e.allocator.num_free,
           "cached_pages": len(cache.cached_pages()) if cache is not None else 0,
           "page_size": e.config.page_size, "running": len(e.scheduler.running),
           "waiting": len(e.scheduler.waiting),
           "kv_fp8_clipped": e.runner.cache.clipped,  # FP8 KV values saturated (0 otherwise)
           "kv_bytes_per_token": e.kv_bytes_per_token,  # paged layers only
           "state_bytes_per_request": e.state_bytes_per_request}  # hybrids' recurrent layers (else 0)
    if e.runner.states is not None:
        out["state_slots"], out["free_state_slots"] = e.runner.states.num_slots, e.runner.states.num_free
    if e.snapshots is not None:   # hybrids: recurrent-state snapshots in the prefix cache
        sn = e.snapshots
        out["state_snapshots"] = {"slots": sn.capacity, "held": cache.num_snapshots,
                                  "bytes_held": sn.bytes_held, "every_pages": e.snapshot_every,
                                  "taken": sn.num_taken, "restored": sn.num_restored,
                                  "evicted": cache.num_snapshots_evicted,
                                  "refused": sn.num_mismatches}
    prefill = e.loaded.prefill_expert_store
    if prefill is not None:   # --prefill-expert-dtype: the second copy of the experts, and where it lies
        from freetoken_py.engine.cpu_backend import prefill_expert_memory

        out["prefill_experts"] = prefill_expert_memory(prefill)
    ex = e.residency
    if ex is not None:
        ex.flush_timing(wait=False)  # GPU-clock times of finished calls
        out["residency"] = {**ex.telemetry.as_dict(), "expert_slots": ex.slots.num_slots}
    return out
