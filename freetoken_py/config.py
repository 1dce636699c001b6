"""Engine configuration: a frozen dataclass; "auto" values are resolved by returning a new config."""
from __future__ import annotations

from dataclasses import dataclass

from freetoken_py.errors import FreetokenError


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    page_size: int = 16  # tokens per KV page
    kv_cache_bytes: int = 0  # 0 = auto (see llm.py)
    max_model_len: int = 0  # 0 = the model's max_position_embeddings
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    backend: str = "auto"  # auto | torch | cpu (numba kernels); auto = cpu kernels (torch with the residency tiers)
    expert_dtype: str = "auto"  # cpu backend and residency tiers: auto (as loaded) | bf16 | fp32 | int8 | int4
    dense_dtype: str = "auto"  # cpu backend: attention/router/lm_head weights: auto (as loaded) | bf16 | fp32 | int8 | int4 (router and lm_head int8)
    expert_group_size: int = 32  # int4 quantisation group (elements sharing one scale)
    prefill_expert_dtype: str = "auto"  # cpu backend: experts of prefill chunks as auto (= expert_dtype, one copy) | bf16 | fp32 | int8 (a second, mapped copy; decode steps keep expert_dtype)
    expert_cache: str = "auto"  # expert store (cpu backend, tiers with expert_dtype): auto (map the expert-bank cache file, else build + write it) | off | rebuild
    show_progress: bool = True
    kv_dtype: str = "auto"  # auto (the checkpoint dtype on the cpu backend, else the compute dtype) | fp32 | bf16 | fp8 (e4m3, per-head scales fixed at warm-up)
    kv_scales: str = ""  # fp8 KV: JSON cache of the calibrated scales (read if it exists, else written)
    enable_prefix_cache: bool = True  # share full KV pages of common prefixes across requests and turns
    kv_integrity_check: bool = True  # page generation tags checked before every step (see kvcache/tags.py)
    prefix_snapshots: int = 0  # hybrids: recurrent-state snapshot slots in the prefix cache (0 = auto, llm.py)
    snapshot_every_pages: int = 0  # hybrids: pages between periodic snapshots (0 = the cost rule, kvcache/snapshots.py)
    residency: str = "off"  # off | emulate (accelerator tier on CPU tensors, times from a profile) | cuda
    residency_profile: str = "rtx4090"  # hand-built tier profile (residency/profiles.py), or "measured" (cuda)
    residency_policy: str = "ours"  # ours | lru | static
    vram_budget_bytes: int = 0  # expert slots; 0 = cuda: the VRAM left; emulated: half the experts
    record_routing: str = ""  # write the routing trace (JSON lines) here

    def __post_init__(self) -> None:
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise FreetokenError(f"{name} must be positive")
        if self.backend not in ("auto", "torch", "cpu"):
            raise FreetokenError(f"backend must be auto, torch or cpu (got {self.backend!r})")
        if self.expert_dtype not in ("auto", "bf16", "fp32", "int8", "int4"):
            raise FreetokenError(f"expert dtype must be auto, bf16, fp32, int8 or int4 (got {self.expert_dtype!r})")
        if self.prefill_expert_dtype not in ("auto", "bf16", "fp32", "int8"):
            raise FreetokenError(f"prefill expert dtype must be auto, bf16, fp32 or int8 (got {self.prefill_expert_dtype!r})")
        if self.prefill_expert_dtype != "auto" and (self.backend == "torch" or self.residency != "off"):
            raise FreetokenError("--prefill-expert-dtype needs the cpu backend without the residency tiers "
                                 "(the tiers and the torch backend run one copy of the experts)")
        if self.expert_cache not in ("auto", "off", "rebuild"):
            raise FreetokenError(f"expert cache must be auto, off or rebuild (got {self.expert_cache!r})")
        if self.dense_dtype not in ("auto", "bf16", "fp32", "int8", "int4"):
            raise FreetokenError(f"dense dtype must be auto, bf16, fp32, int8 or int4 (got {self.dense_dtype!r})")
        if self.dense_dtype != "auto" and self.backend == "torch":
            raise FreetokenError("--dense-dtype needs the cpu backend (the torch backend runs weights as stored)")
        if self.expert_dtype != "auto" and self.backend == "torch" and self.residency == "off":
            raise FreetokenError("--expert-dtype needs the cpu backend or the residency tiers (--emulate-gpu / "
                                 "--gpu-experts); the torch backend runs weights as stored")
        self._check_residency()
        if self.record_routing:
            self._check_record_routing()
        if self.kv_dtype not in ("auto", "fp32", "bf16", "fp8"):
            raise FreetokenError(f"kv dtype must be auto, fp32, bf16 or fp8 (got {self.kv_dtype!r})")
        if self.kv_cache_bytes < 0 or self.max_model_len < 0:
            raise FreetokenError("kv_cache_bytes and max_model_len must be >= 0")
        for name in ("prefix_snapshots", "snapshot_every_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise FreetokenError(f"{name} (--{name.replace('_', '-')}) must be an integer >= 0 (0 = auto), "
                                     f"got {value!r}")

    def _check_record_routing(self) -> None:
        """The trace is written at the end of a run: a path it cannot be written to is said now,
        before the model loads and the run is spent."""
        import os
        from pathlib import Path

        out = Path(self.record_routing)
        folder = out.parent
        if out.is_dir():
            raise FreetokenError(f"--record-routing {out}: is a directory; give a file path")
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise FreetokenError(f"--record-routing {out}: cannot write into {folder}; give a file path in a "
                                 "writable directory")

    def _check_residency(self) -> None:
        if self.residency not in ("off", "emulate", "cuda"):
            raise FreetokenError(f"residency must be off, emulate or cuda (got {self.residency!r})")
        if self.residency == "off":
            return
        from freetoken_py.residency.profiles import PROFILES

        if self.residency_profile == "measured":
            if self.residency != "cuda":
                raise FreetokenError("the measured profile describes this machine's GPU: it needs residency=cuda "
                                     "(--gpu-experts); to emulate, name a profile")
        elif self.residency_profile not in PROFILES:
            raise FreetokenError(f"unknown hardware profile {self.residency_profile!r}; "
                                 f"choose one of {', '.join(PROFILES)}")
        if self.residency_policy not in ("ours", "lru", "static"):
            raise FreetokenError(f"residency policy must be ours, lru or static (got {self.residency_policy!r})")
        if self.backend == "cpu" or self.dense_dtype != "auto":
            raise FreetokenError("the residency tiers run the dense weights on the torch backend, as stored; "
                                 "drop --backend cpu / --dense-dtype (--expert-dtype is fine)")
        if self.vram_budget_bytes < 0:
            raise FreetokenError("vram budget must be >= 0")
        if self.residency == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise FreetokenError("--gpu-experts needs a CUDA GPU; use --emulate-gpu PROFILE on this machine")
