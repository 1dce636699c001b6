"""Qwen3-Next / Qwen3-Coder-Next (`model_type: qwen3_next`): a hybrid of Gated DeltaNet linear
attention (layers/gated_deltanet.py; a fixed-size recurrent state per request) and gated full
attention (q_proj rows per head [query | gate], zero-centred per-head q/k norm, partial RoPE),
`layer_types` saying which layer is which (default: every `full_attention_interval`-th is full).
Softmax router with optional renormalisation, and a shared expert behind a sigmoid gate. Every
RMSNorm but the GDN output norm is zero-centred: applied as (1 + w). GDN input projections are
grouped per key head (`in_proj_qkvz`, `in_proj_ba`; reordered at load). Layers beyond
num_hidden_layers and `mtp.*` (multi-token prediction) are not read."""
from __future__ import annotations

import sys

from freetoken_py.errors import ModelLoadError
from freetoken_py.layers.gated_deltanet import GdnConfig
from freetoken_py.models.args import ConfigReader, ModelArgs
from freetoken_py.models.weights import WeightScheme
from freetoken_py.layers.decoder import DecoderLayer, RmsNorm
from freetoken_py.layers.gated_deltanet import GdnMixer
from freetoken_py.layers.moe import SoftmaxRouter
from freetoken_py.models.architecture import Architecture, feed_forward, gqa, plain_rope

SCHEME = WeightScheme(shared_expert="mlp.shared_expert.", gdn_proj="grouped")
LAYER_KINDS = ("full_attention", "linear_attention")


def layer_kinds(c: ConfigReader, num_layers: int) -> tuple[str, ...]:
    kinds = c.cfg.get("layer_types")
    if kinds is None:
        interval = c.get("full_attention_interval", default=4)
        if interval < 1:
            raise ModelLoadError(f"{c.path}: 'full_attention_interval' ({interval}) must be positive")
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers))
    return c.layer_types(num_layers, LAYER_KINDS)


def gdn_config(c: ConfigReader) -> GdnConfig:
    hk, hv = c.get("linear_num_key_heads"), c.get("linear_num_value_heads")
    dk, dv = c.get("linear_key_head_dim"), c.get("linear_value_head_dim")
    kernel = c.get("linear_conv_kernel_dim", default=4)
    for key, value in (("linear_num_key_heads", hk), ("linear_num_value_heads", hv), ("linear_key_head_dim", dk),
                       ("linear_value_head_dim", dv), ("linear_conv_kernel_dim", kernel)):
        if value <= 0:
            raise ModelLoadError(f"{c.path}: '{key}' ({value}) must be positive")
    if hv % hk:
        raise ModelLoadError(f"{c.path}: 'linear_num_value_heads' ({hv}) must be a multiple of "
                             f"'linear_num_key_heads' ({hk})")
    return GdnConfig(hk, hv, dk, dv, kernel, c.get("rms_norm_eps", default=1e-6, kind=float))


def parse_hybrid(c: ConfigReader, model_type: str, norm_topk_prob: bool | None = None) -> ModelArgs:
    """The config of either hybrid family (qwen3_5_moe passes norm_topk_prob=True: it always renormalises)."""
    num_layers = c.get("num_hidden_layers")
    num_experts = c.get("num_experts")
    step = c.get("decoder_sparse_step", default=1)
    mlp_only = set(c.cfg.get("mlp_only_layers") or [])
    sparse = tuple(i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    common = c.common()
    head_dim = common["head_dim"]
    if norm_topk_prob is None:
        norm_topk_prob = c.get("norm_topk_prob", default=True, kind=bool)
    return ModelArgs(
        model_type=model_type, qk_norm="head", clip_qkv=None, sliding_window=None,
        num_experts=num_experts, top_k=c.get("num_experts_per_tok"),
        moe_intermediate_size=c.get("moe_intermediate_size"),
        intermediate_size=c.get("intermediate_size", default=0), norm_topk_prob=norm_topk_prob,
        sparse_layers=sparse, shared_intermediate_size=c.get("shared_expert_intermediate_size", default=0),
        rotary_dim=c.partial_rotary_dim(head_dim), layer_kinds=layer_kinds(c, num_layers), gdn=gdn_config(c),
        **common)


def parse_config(c: ConfigReader) -> ModelArgs:
    return parse_hybrid(c, "qwen3_next")


def rename(name: str) -> str | None:
    """The multi-token-prediction head (`mtp.*`) is not run: not loaded."""
    return None if name.startswith("mtp.") else name


def note_skipped(count: int) -> None:
    if count:
        print(f"freetoken: qwen3_next: {count} multi-token-prediction (mtp.*) tensors not loaded", file=sys.stderr)


def hybrid_architecture(a: ModelArgs, names: WeightScheme) -> Architecture:
    """Gated DeltaNet layers (a recurrent state) and gated full-attention layers (per-head q/k
    norm, partial RoPE), as `layer_types` says; a softmax router and a shared expert behind a
    sigmoid gate; every RMSNorm but the GDN output norm zero-centred (qwen3_5_moe too)."""
    norm, router = RmsNorm(zero_centred=True), SoftmaxRouter(a.top_k, a.norm_topk_prob)
    attn, gdn = gqa(a, qk_norm="head", output_gate=True, norm=norm), GdnMixer(a.gdn, a.hidden_size, names.gdn_proj)
    layers = tuple(DecoderLayer(gdn if a.is_linear(i) else attn,
                                feed_forward(a, i, router, names, shared_width=a.shared_intermediate_size,
                                             shared_gate=True)) for i in range(a.num_layers))
    return Architecture(layers, plain_rope(a), norm)


def architecture(a: ModelArgs) -> Architecture:
    return hybrid_architecture(a, SCHEME)
