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
    show_progress: bool = True

    def __post_init__(self) -> None:
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise FreetokenError(f"{name} must be positive")
        if self.kv_cache_bytes < 0 or self.max_model_len < 0:
            raise FreetokenError("kv_cache_bytes and max_model_len must be >= 0")
