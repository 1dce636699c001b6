"""Architecture-independent description of a MoE decoder, parsed from config.json.

Each model file (named after config.json's `model_type`) turns its config into a `ModelArgs` (the
geometry and the config's own choices) and composes its layers from them (`architecture(args)`,
models/architecture.py); what a family always has (gpt-oss's sinks, Qwen3-Next's gated attention
and zero-centred norms) is said there, in the layer kinds' options, not here.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from freetoken_py.errors import ModelLoadError, UnsupportedModelError
from freetoken_py.layers.dsa import DsaConfig
from freetoken_py.layers.gated_deltanet import GdnConfig
from freetoken_py.layers.mla import MlaConfig, YarnParams

ACTIVATIONS = ("silu", "gptoss")  # gptoss: clamped SwiGLU, alpha 1.702, limit 7, (up + 1) (kernels/_dots.act)
ROUTERS = ("softmax", "sigmoid", "topk")


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
    # router kind: "softmax" (Qwen3 / Mixtral / OLMoE) or "sigmoid" (DeepSeek noaux_tc, GLM-4.5,
    # MiniMax-M2: sigmoid + e_score_correction_bias for the choice, n_group / topk_group groups,
    # x routed_scaling_factor); see layers.moe.sigmoid_group_route
    # "topk" (gpt-oss): top-k of the router's biased logits, softmax over those k (layers.moe.topk_softmax_route)
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0  # ungated shared expert on every MoE layer (0: none)
    rotary_dim: int | None = None  # RoPE on the first rotary_dim dims of each head (None: all)
    o_bias: bool | None = None  # o_proj bias; None: as attention_bias (GLM-4.5: q/k/v biases only)
    mla: MlaConfig | None = None  # the attention kind: None = GQA (q/k/v projections), else MLA (layers/mla.py)
    dsa: DsaConfig | None = None  # MLA with DeepSeek sparse attention's indexer (layers/dsa.py)
    # hybrids (qwen3_next, qwen3_5_moe): per layer "full_attention" or "linear_attention" (Gated
    # DeltaNet, layers/gated_deltanet.py, configured by `gdn`); None = every layer full attention
    layer_kinds: tuple[str, ...] | None = None
    gdn: GdnConfig | None = None
    rope_yarn: YarnParams | None = None  # GQA RoPE with YaRN's blend and cos/sin factor (gpt-oss)

    def window(self, i: int) -> int | None:
        """Layer i's sliding window: every layer's, or with `layer_kinds` naming "sliding_attention"
        layers (gpt-oss), those layers' only."""
        if self.layer_kinds is not None and "sliding_attention" in self.layer_kinds:
            return self.sliding_window if self.layer_kinds[i] == "sliding_attention" else None
        return self.sliding_window

    @property
    def mixed_windows(self) -> bool:
        """Windowed and full-attention layers in one model: attention metadata comes in both kinds."""
        return len({self.window(i) for i in range(self.num_layers)}) > 1

    @property
    def rope_dim(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def is_linear(self, i: int) -> bool:
        """Layer i is a linear-attention (recurrent state) layer."""
        return self.layer_kinds is not None and self.layer_kinds[i] == "linear_attention"

    @property
    def has_o_bias(self) -> bool:
        return self.attention_bias if self.o_bias is None else self.o_bias

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"config.json: num_attention_heads ({self.num_heads}) is not a multiple "
                                 f"of num_key_value_heads ({self.num_kv_heads})")
        if self.top_k > self.num_experts and any(self.sparse_layers):
            raise ModelLoadError(f"config.json: num_experts_per_tok ({self.top_k}) > number of experts "
                                 f"({self.num_experts})")
        if self.router not in ROUTERS:
            raise UnsupportedModelError(f"config.json: router '{self.router}' is not supported "
                                        f"(supported: {', '.join(ROUTERS)})")
        if not (0 < self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0):
            raise ModelLoadError(f"config.json: rotary dim {self.rope_dim} must be even and in "
                                 f"(0, head_dim {self.head_dim}] (rotary_dim / partial_rotary_factor)")
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(f"config.json: hidden_act '{self.hidden_act}' is not supported "
                                        "(supported: silu)")


class ConfigReader:
    """Typed access to config.json with one-line errors naming the missing or bad key."""

    def __init__(self, cfg: dict, path: Path | str = "config.json"):
        self.cfg = cfg
        self.path = path

    def layer_types(self, num_layers: int, supported: tuple[str, ...]) -> tuple[str, ...]:
        """`layer_types` as given: one entry per layer, each one of `supported`."""
        kinds = self.cfg["layer_types"]
        if not isinstance(kinds, list) or len(kinds) != num_layers:
            raise ModelLoadError(f"{self.path}: 'layer_types' must list one entry per layer ({num_layers})")
        for i, k in enumerate(kinds):
            if k not in supported:
                raise ModelLoadError(f"{self.path}: 'layer_types'[{i}] is {k!r} (supported: {', '.join(supported)})")
        return tuple(kinds)

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

    def partial_rotary_dim(self, head_dim: int) -> int | None:
        """`rotary_dim` (MiniMax-M2), else head_dim x `partial_rotary_factor` (top level or in
        rope_parameters, as transformers 5 moves it); None when RoPE covers the whole head."""
        if self.cfg.get("rotary_dim") is not None:
            dim = self.get("rotary_dim")
        else:
            params = self.cfg.get("rope_parameters") or {}
            factor = params.get("partial_rotary_factor", self.cfg.get("partial_rotary_factor", 1.0))
            if not isinstance(factor, (int, float)) or isinstance(factor, bool):
                raise ModelLoadError(f"{self.path}: 'partial_rotary_factor' has a bad value {factor!r}")
            dim = int(head_dim * factor)
        return None if dim == head_dim else dim

    def sigmoid_router(self, num_experts: int, top_k: int) -> dict:
        """ModelArgs fields of the DeepSeek "noaux_tc" router (deepseek_v3, glm4_moe, ...), checked:
        `scoring_func` sigmoid, `topk_method` noaux_tc where given; n_group groups of >= 2 experts
        (a group scores its top-2), topk_group of them able to hold top_k experts."""
        scoring = self.get("scoring_func", default="sigmoid", kind=str)
        if scoring != "sigmoid":
            raise UnsupportedModelError(f"{self.path}: scoring_func '{scoring}' is not supported (supported: sigmoid)")
        method = self.get("topk_method", default="noaux_tc", kind=str)
        if method != "noaux_tc":
            raise UnsupportedModelError(f"{self.path}: topk_method '{method}' is not supported (supported: noaux_tc)")
        n_group, topk_group = self.get("n_group", default=1), self.get("topk_group", default=1)
        if n_group < 1 or num_experts % n_group or (n_group > 1 and num_experts // n_group < 2):
            raise ModelLoadError(f"{self.path}: 'n_group' ({n_group}) must split the {num_experts} experts "
                                 "into equal groups of at least 2")
        if not 1 <= topk_group <= n_group or topk_group * (num_experts // n_group) < top_k:
            raise ModelLoadError(f"{self.path}: 'topk_group' ({topk_group}) must be in [1, n_group {n_group}] "
                                 f"and its groups must hold num_experts_per_tok ({top_k}) experts")
        return dict(router="sigmoid", n_group=n_group, topk_group=topk_group,
                    routed_scaling_factor=self.get("routed_scaling_factor", default=1.0, kind=float),
                    norm_topk_prob=self.get("norm_topk_prob", default=True, kind=bool))

    def common(self, rope: tuple[float, float] | None = None) -> dict:
        """rope: (theta, linear factor) when the model file parses RoPE itself (MLA: YaRN)."""
        hidden = self.get("hidden_size")
        heads = self.get("num_attention_heads")
        theta, factor = rope or self.rope()
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
