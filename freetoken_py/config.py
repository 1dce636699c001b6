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
    backend: str = "auto"  # auto | torch | cpu (numba kernels); auto = cpu kernels on a CPU-only machine
    expert_dtype: str = "auto"  # cpu backend: auto (as loaded) | bf16 | fp32 | int8 | int4
    dense_dtype: str = "auto"  # cpu backend: attention/router/lm_head weights: auto (as loaded) | bf16 | fp32 | int8
    expert_group_size: int = 32  # int4 quantisation group (elements sharing one scale)
    show_progress: bool = True

    def __post_init__(self) -> None:
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise FreetokenError(f"{name} must be positive")
        if self.backend not in ("auto", "torch", "cpu"):
            raise FreetokenError(f"backend must be auto, torch or cpu (got {self.backend!r})")
        if self.expert_dtype not in ("auto", "bf16", "fp32", "int8", "int4"):
            raise FreetokenError(f"expert dtype must be auto, bf16, fp32, int8 or int4 (got {self.expert_dtype!r})")
        if self.dense_dtype not in ("auto", "bf16", "fp32", "int8"):
            raise FreetokenError(f"dense dtype must be auto, bf16, fp32 or int8 (got {self.dense_dtype!r})")
        if (self.expert_dtype != "auto" or self.dense_dtype != "auto") and self.backend == "torch":
            raise FreetokenError("--expert-dtype needs the cpu backend (the torch backend runs weights as stored)")
        if self.kv_cache_bytes < 0 or self.max_model_len < 0:
            raise FreetokenError("kv_cache_bytes and max_model_len must be >= 0")
