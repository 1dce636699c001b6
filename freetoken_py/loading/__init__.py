"""Loading, as one pipeline that runs downward once (docs/architecture.md, "Loading"):

    1. checkpoint   models.loader.open_checkpoint: config.json -> ModelArgs, the model file's
                    names (WeightScheme), the safetensors headers, the format's decoder
    2. decode       formats/: stored tensors -> the model file's logical tensors, as floats or as
                    packed weights in an execution format (fp8, int4)
    3. place        `load_engine_model`: dense weights (torch, or the cpu backend's kernels), the
                    routed experts in the expert store's banks (built or mapped from its cache
                    file), the dense part on the GPU for the tiers; then, once the KV cache is
                    sized, `attach_tiers`: the residency tiers over the store's banks

The `LLM` facade asks for a ready model here and keeps the request loop; nothing below calls
back into it. May import models, engine (cpu_backend, expert_store), residency (attach), config.
"""
from __future__ import annotations

from pathlib import Path

from freetoken_py.config import EngineConfig
from freetoken_py.models.loader import load_model


def _auto(v):
    return None if v == "auto" else v


def load_engine_model(c: EngineConfig, backend: str):
    """The model `backend` runs, with its experts placed (stages 1-3 above, before the KV cache)."""
    model_dir = Path(c.model)
    if backend == "cpu":  # experts come from the expert store (built or mapped), never stacked in torch
        from freetoken_py.engine.cpu_backend import load_cpu_model

        model = load_cpu_model(model_dir, c.dtype, _auto(c.expert_dtype), c.expert_group_size, _auto(c.dense_dtype),
                               c.expert_cache, c.show_progress, prefill_format=_auto(c.prefill_expert_dtype))
    elif c.residency != "off" and (c.expert_dtype != "auto" or _native_tier_format(model_dir) is not None):
        model = _load_tier_experts(model_dir, c)
    else:
        model = load_model(model_dir, c.dtype, c.show_progress)
    if c.residency == "cuda":   # (EngineConfig checked that a CUDA GPU is there)
        model.to_accelerator("cuda")   # dense weights, activations and (later) the KV cache in VRAM
    return model


def _load_tier_experts(model_dir: Path, c: EngineConfig):
    """The residency tiers with `--expert-dtype`: dense weights through the torch loader, the
    experts from the expert store (built from the checkpoint in that format, or mapped from
    its cache file), never stacked in torch; `attach_tiers` hands its banks to the tiers."""
    from freetoken_py.engine.expert_store import open_expert_store, pin_banks

    native = _native_tier_format(model_dir)
    fmt, group = (c.expert_dtype, c.expert_group_size) if c.expert_dtype != "auto" else native
    model = load_model(model_dir, c.dtype, c.show_progress, experts="skip")
    store = open_expert_store(model_dir, model.args, model.dtype, fmt, group, c.expert_cache, c.show_progress)
    if c.residency == "cuda":      # page-locked where they lie: the streamer's copies are asynchronous
        pin_banks(store.banks, show_progress=c.show_progress)
    model.expert_store = store
    return model


def _native_tier_format(model_dir: Path):
    """(format, group size) of a checkpoint whose experts the tiers hold as stored without
    `--expert-dtype` (NVFP4, compressed-tensors INT4, FP8 block-scaled: its own bytes in the
    banks and slots), else None (float checkpoints: torch's stacked experts)."""
    from freetoken_py.models.loader import open_checkpoint

    dec = open_checkpoint(model_dir).decoder
    return (dec.exec_format, dec.group_size) if dec.exec_format in ("nvfp4", "int4", "fp8") else None


def attach_tiers(model, c: EngineConfig):
    """The expert residency tiers (residency/), when asked for; None otherwise. After the KV
    cache: on a GPU the slots take what is left."""
    if c.residency == "off":
        return None
    from freetoken_py.residency.attach import attach_residency

    store = getattr(model, "expert_store", None)
    return attach_residency(model, c.residency, c.residency_profile, c.vram_budget_bytes, c.residency_policy,
                            banks=store.banks if store is not None else None)
