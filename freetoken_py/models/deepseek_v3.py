"""DeepSeek-V3 / R1 / V3.1 and Kimi K2 text (`model_type: deepseek_v3`, also `kimi_k2`): MLA
attention over a latent KV cache (layers/mla.py), the sigmoid "noaux_tc" router with groups and
an ungated shared expert, dense MLPs in the first `first_k_dense_replace` layers. Layers at or
beyond num_hidden_layers (the MTP head, `model.layers.61`) are not read."""
from __future__ import annotations

from freetoken_py.errors import ModelLoadError, UnsupportedModelError
from freetoken_py.layers.mla import MlaConfig, YarnParams, yarn_get_mscale
from freetoken_py.models.args import ConfigReader, ModelArgs
from freetoken_py.models.weights import WeightScheme
from freetoken_py.layers.decoder import DecoderLayer
from freetoken_py.layers.mla import MlaAttention
from freetoken_py.layers.moe import SigmoidRouter
from freetoken_py.models.architecture import Architecture, feed_forward

SCHEME = WeightScheme()

# configs of other attention kinds that share this model_type's keys (DSA's indexer: deepseek_v32)
_OTHER_ATTENTION = ("index_topk", "index_n_heads", "index_head_dim")


def mla_config(c: ConfigReader, sparse_attention: bool = False, interleave: bool | None = None) -> MlaConfig:
    """The MLA geometry and its RoPE / softmax scale (FAMILIES.md §1: m² only when rope_type is
    not default, m = 0.1·mscale_all_dim·ln(factor) + 1). sparse_attention: the family reads the
    DSA keys itself (deepseek_v32, glm_moe_dsa); interleave: fixed by the family (None: the config's)."""
    for key in () if sparse_attention else _OTHER_ATTENTION:
        if c.cfg.get(key) is not None:
            raise UnsupportedModelError(f"{c.path}: '{key}' (DSA sparse attention) is not supported for "
                                        f"model_type {c.cfg.get('model_type')}")
    nope, rope_dim = c.get("qk_nope_head_dim"), c.get("qk_rope_head_dim")
    if rope_dim <= 0 or rope_dim % 2:
        raise ModelLoadError(f"{c.path}: 'qk_rope_head_dim' ({rope_dim}) must be even and positive")
    kv_lora = c.get("kv_lora_rank")
    if kv_lora <= 0:
        raise ModelLoadError(f"{c.path}: 'kv_lora_rank' ({kv_lora}) must be positive")
    params = rope_parameters(c)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta", c.cfg.get("rope_theta", 10000.0)))
    scale = (nope + rope_dim) ** -0.5
    yarn = None
    if rope_type == "yarn":
        yarn, m_all = _yarn(c, params)
        scale *= m_all * m_all
    elif rope_type != "default":
        raise UnsupportedModelError(f"{c.path}: rope type '{rope_type}' is not supported for MLA "
                                    "(supported: default, yarn)")
    return MlaConfig(num_heads=c.get("num_attention_heads"), q_lora_rank=c.get("q_lora_rank", default=None),
                     kv_lora_rank=kv_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
                     v_head_dim=c.get("v_head_dim"),
                     rope_interleave=c.get("rope_interleave", default=True, kind=bool) if interleave is None else interleave,
                     softmax_scale=scale, rope_theta=theta, yarn=yarn,
                     bias=c.get("attention_bias", default=False, kind=bool))


def rope_parameters(c: ConfigReader) -> dict:
    """`rope_parameters` (transformers 5) or `rope_scaling`; nested by layer type ({"indexed_attention":
    {...}}) where every layer here is one attention kind: the one set of them, or a one-line error."""
    params = c.cfg.get("rope_parameters") or c.cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"{c.path}: 'rope_parameters' must be an object, got {params!r}")
    nested = [v for v in params.values() if isinstance(v, dict)]
    if nested and len(nested) == len(params):
        if any(v != nested[0] for v in nested):
            raise UnsupportedModelError(f"{c.path}: 'rope_parameters' differ between layer types "
                                        f"({', '.join(params)}); MLA layers here share one RoPE")
        params = nested[0]
    return params


def _yarn(c: ConfigReader, params: dict) -> tuple[YarnParams, float]:
    """(YaRN parameters, the softmax-scale mscale m) as transformers 5.24 derives them."""
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ModelLoadError(f"{c.path}: yarn RoPE needs 'original_max_position_embeddings'")
    factor = params.get("factor") or c.get("max_position_embeddings") / original
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all)
                            if mscale and mscale_all else yarn_get_mscale(factor))
    m_all = yarn_get_mscale(factor, mscale_all) if mscale_all else 1.0
    yarn = YarnParams(float(factor), int(original), float(params.get("beta_fast") or 32),
                      float(params.get("beta_slow") or 1), float(attention_factor), bool(params.get("truncate", True)))
    return yarn, m_all


def parse_config(c: ConfigReader, sparse: tuple[bool, ...] | None = None, model_type: str = "deepseek_v3",
                 mla=None, dsa=None) -> ModelArgs:
    """sparse: per-layer MoE flags when the family says so itself (glm4_moe_lite's mlp_layer_types);
    default: layers from first_k_dense_replace on are MoE. mla / dsa: the family's own MLA and DSA
    configs (deepseek_v32, glm_moe_dsa); default: mla_config(c), no DSA."""
    num_layers = c.get("num_hidden_layers")
    num_experts, top_k = c.get("n_routed_experts"), c.get("num_experts_per_tok")
    if sparse is None:
        first_dense = c.get("first_k_dense_replace", default=0)
        sparse = tuple(i >= first_dense for i in range(num_layers))
    mla = mla or mla_config(c)
    common = c.common(rope=(mla.rope_theta, 1.0))
    common.update(num_kv_heads=mla.num_heads, head_dim=mla.v_head_dim)  # o_proj reads H * v_head_dim
    return ModelArgs(
        model_type=model_type, qk_norm="none", clip_qkv=None, sliding_window=None,
        num_experts=num_experts, top_k=top_k, moe_intermediate_size=c.get("moe_intermediate_size"),
        intermediate_size=c.get("intermediate_size", default=0), sparse_layers=sparse,
        shared_intermediate_size=c.get("moe_intermediate_size") * c.get("n_shared_experts", default=0),
        mla=mla, dsa=dsa, **c.sigmoid_router(num_experts, top_k), **common)


def architecture(a: ModelArgs) -> Architecture:
    """MLA (with DSA's indexer on its "full" layers where the family has one: deepseek_v32,
    glm_moe_dsa); the grouped sigmoid router and an ungated shared expert; dense first layers.
    Every family reading its config through parse_config above (glm4_moe_lite, kimi_k25 too)."""
    router = SigmoidRouter(a.top_k, a.n_group, a.topk_group, a.norm_topk_prob, a.routed_scaling_factor)
    layers = tuple(DecoderLayer(MlaAttention(a.mla, a.hidden_size, a.dsa, a.dsa is not None and a.dsa.is_full(i)),
                                feed_forward(a, i, router, SCHEME, shared_width=a.shared_intermediate_size))
                   for i in range(a.num_layers))
    return Architecture(layers, a.mla.rotary())
