"""Architecture-independent description of a MoE decoder, parsed from config.json.

Each model file (named after config.json's `model_type`) turns its config into a `ModelArgs` and
owns all knowledge of its checkpoint's tensor names; the forward pass in `moe_transformer.py` only
sees `ModelArgs` and `ModelWeights`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from freetoken_py.errors import ModelLoadError, UnsupportedModelError


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_factor: float  # linear position interpolation; 1.0 = none
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: str  # "none" | "head" (per head, Qwen3) | "full" (over the full projection, OLMoE)
    clip_qkv: float | None
    sliding_window: int | None
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    intermediate_size: int  # width of dense (non-MoE) MLP layers
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or dense MLP (False)
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"config.json: num_attention_heads ({self.num_heads}) is not a multiple "
                                 f"of num_key_value_heads ({self.num_kv_heads})")
        if self.top_k > self.num_experts and any(self.sparse_layers):
            raise ModelLoadError(f"config.json: num_experts_per_tok ({self.top_k}) > number of experts "
                                 f"({self.num_experts})")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"config.json: hidden_act '{self.hidden_act}' is not supported "
                                        "(supported: silu)")


class ConfigReader:
    """Typed access to config.json with one-line errors naming the missing or bad key."""

    def __init__(self, cfg: dict, path: Path | str = "config.json"):
        self.cfg = cfg
        self.path = path

    def get(self, *keys: str, default=..., kind=int):
        for key in keys:
            if key in self.cfg and self.cfg[key] is not None:
                value = self.cfg[key]
                try:
                    if kind is bool:
                        if not isinstance(value, bool):
                            raise ValueError
                        return value
                    return kind(value)
                except (TypeError, ValueError):
                    raise ModelLoadError(f"{self.path}: '{key}' has a bad value {value!r}") from None
        if default is ...:
            raise ModelLoadError(f"{self.path}: missing required key '{keys[0]}'")
        return default

    def rope(self) -> tuple[float, float]:
        """(theta, linear scaling factor); accepts both `rope_theta`/`rope_scaling` and
        transformers 5's `rope_parameters`."""
        params = self.cfg.get("rope_parameters") or {}
        scaling = self.cfg.get("rope_scaling") or {}
        theta = params.get("rope_theta", self.cfg.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type == "default":
            return float(theta), 1.0
        if rope_type == "linear":
            factor = params.get("factor", scaling.get("factor", 1.0))
            return float(theta), float(factor)
        raise UnsupportedModelError(f"{self.path}: rope type '{rope_type}' is not supported yet "
                                    "(supported: default, linear)")

    def common(self) -> dict:
        hidden = self.get("hidden_size")
        heads = self.get("num_attention_heads")
        theta, factor = self.rope()
        return dict(
            vocab_size=self.get("vocab_size"),
            hidden_size=hidden,
            num_layers=self.get("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=self.get("num_key_value_heads", default=heads),
            head_dim=self.get("head_dim", default=hidden // heads),
            rms_norm_eps=self.get("rms_norm_eps", default=1e-6, kind=float),
            rope_theta=theta,
            rope_scaling_factor=factor,
            max_position_embeddings=self.get("max_position_embeddings", default=4096),
            tie_word_embeddings=self.get("tie_word_embeddings", default=False, kind=bool),
            attention_bias=self.get("attention_bias", default=False, kind=bool),
            hidden_act=self.get("hidden_act", default="silu", kind=str),
        )
