"""Loading, as one pipeline that runs downward once (docs/architecture.md, "Loading"):

    1. checkpoint   models.loader.open_checkpoint: config.json -> ModelArgs, the model file's
                    names (WeightScheme), the safetensors headers, the format's decoder
    2. decode       formats/: stored tensors -> the model file's logical tensors, as floats or as
                    packed weights in an execution format (fp8, int4)
    3. place        `load_engine_model`: dense weights (torch, or the cpu backend's kernels), the
                    routed experts in the expert store's banks (built or mapped from its cache
                    file), the dense part on the GPU for the tiers
    4. finish       `load`: the tokenizer, generation defaults and the KV dtype of `--kv-dtype
                    auto`, all in one `LoadedModel`; then, once the engine has sized the KV
                    cache, `attach_tiers`: the residency tiers over the store's banks

`load` returns a finished, typed `LoadedModel`; the `Engine` (engine/engine.py) is built from it
and nothing below reads anything back from the model by attribute probing or calls back up.
May import models, engine (cpu_backend, expert_store), residency (attach), tokenizer, config.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from freetoken_py.config import EngineConfig
from freetoken_py.core import SamplingParams
from freetoken_py.errors import FreetokenError, ModelLoadError
from freetoken_py.models.loader import GenerationDefaults, load_model, read_generation_defaults
from freetoken_py.tokenizer import Tokenizer, bundled_chat_template


@dataclass(frozen=True)
class LoadedModel:
    """What the load pipeline hands the engine, finished: nothing is patched onto it afterwards.
    `model` runs the forward (dense weights, its expert executor); `expert_store` /
    `prefill_expert_store` hold the routed experts' banks (None: experts stacked in torch, or
    one copy); `kv_dtype` is the KV storage `--kv-dtype auto` means for this model;
    `snapshots_in_layer`: the linear-attention mixer captures prefix-state snapshots itself."""
    model: object
    backend: str
    tokenizer: Tokenizer | None
    generation: GenerationDefaults
    kv_dtype: torch.dtype
    expert_store: object | None = None
    prefill_expert_store: object | None = None
    snapshots_in_layer: bool = False

    @property
    def args(self):
        return self.model.args

    def paged_specs(self) -> list:
        return self.model.paged_specs()

    def state_specs(self) -> list:
        return self.model.state_specs()


def resolve_backend(c: EngineConfig) -> str:
    if c.backend != "auto":
        return c.backend
    if c.residency != "off":
        return "torch"  # the residency tiers run the dense weights in torch (experts: theirs or the store's)
    # the numba kernels (the only ones that quantise), with or without a GPU: the torch backend
    # keeps everything on the host too (only the residency tiers, --gpu-experts, put weights
    # in VRAM) and is the reference path
    return "cpu"


def load(c: EngineConfig) -> LoadedModel:
    """Stages 1-4: the model with its experts placed, its tokenizer and generation defaults."""
    model_dir, backend = Path(c.model), resolve_backend(c)
    model, stores, kv_dtype = load_engine_model(c, backend)
    tokenizer = Tokenizer(model_dir) if (model_dir / "tokenizer.json").exists() else None
    if tokenizer is not None and not tokenizer.chat_template:   # DeepSeek-V3.2: our own
        tokenizer.chat_template = bundled_chat_template(model.args.model_type)
    generation = read_generation_defaults(model_dir)
    try:                            # its sampling defaults in range, said at load with the file's name
        SamplingParams(**generation.sampling)
    except FreetokenError as e:
        raise ModelLoadError(f"{model_dir / 'generation_config.json'}: {e}") from None
    in_layer = bool(getattr(model.gdn_mixer, "captures", False))   # (a plain function attribute)
    return LoadedModel(model, backend, tokenizer, generation, kv_dtype, *stores, snapshots_in_layer=in_layer)


def _auto(v):
    return None if v == "auto" else v


def load_engine_model(c: EngineConfig, backend: str):
    """The model `backend` runs, with its experts placed (stages 1-3 above, before the KV cache):
    (model, (expert store, prefill expert store), KV dtype of `--kv-dtype auto`)."""
    model_dir, stores = Path(c.model), (None, None)
    if backend == "cpu":  # experts come from the expert store (built or mapped), never stacked in torch
        from freetoken_py.engine.cpu_backend import load_cpu_parts

        cpu = load_cpu_parts(model_dir, c.dtype, _auto(c.expert_dtype), c.expert_group_size, _auto(c.dense_dtype),
                             c.expert_cache, c.show_progress, prefill_format=_auto(c.prefill_expert_dtype))
        model, stores, kv_dtype = cpu.model, (cpu.expert_store, cpu.prefill_expert_store), cpu.kv_dtype
    elif c.residency != "off" and (c.expert_dtype != "auto" or _native_tier_format(model_dir) is not None):
        model, store = _load_tier_experts(model_dir, c)
        stores, kv_dtype = (store, None), model.dtype
    else:
        model = load_model(model_dir, c.dtype, c.show_progress)
        kv_dtype = model.dtype
    if c.residency == "cuda":   # (EngineConfig checked that a CUDA GPU is there)
        model.to_accelerator("cuda")   # dense weights, activations and (later) the KV cache in VRAM
    return model, stores, kv_dtype


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
    return model, store


def _native_tier_format(model_dir: Path):
    """(format, group size) of a checkpoint whose experts the tiers hold as stored without
    `--expert-dtype` (NVFP4, compressed-tensors INT4, FP8 block-scaled: its own bytes in the
    banks and slots), else None (float checkpoints: torch's stacked experts)."""
    from freetoken_py.models.loader import open_checkpoint

    dec = open_checkpoint(model_dir).decoder
    return (dec.exec_format, dec.group_size) if dec.exec_format in ("nvfp4", "int4", "fp8") else None


def attach_tiers(loaded: LoadedModel, c: EngineConfig):
    """The expert residency tiers (residency/), when asked for; None otherwise. After the KV
    cache: on a GPU the slots take what is left. They become the model's expert executor."""
    if c.residency == "off":
        return None
    from freetoken_py.residency.attach import build_residency

    store = loaded.expert_store
    tiers = build_residency(loaded.model, c.residency, c.residency_profile, c.vram_budget_bytes, c.residency_policy,
                            banks=store.banks if store is not None else None)
    loaded.model.experts = tiers   # the one change to the model after load, made here where it is seen
    return tiers
