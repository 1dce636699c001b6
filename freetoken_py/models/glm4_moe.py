"""GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air (`model_type: glm4_moe`).

Parts: GQA attention with q/k/v biases and no o_proj bias, optional per-head q/k RMSNorm
(`use_qk_norm`) before a rotate-half RoPE on the first `partial_rotary_factor` of each head; the
DeepSeek "noaux_tc" sigmoid router (n_group / topk_group, routed_scaling_factor) with an ungated
shared expert; dense SwiGLU MLPs on the first `first_k_dense_replace` layers. The MTP layer
(`model.layers.{num_hidden_layers}`) is skipped (weights.validate).
"""
from freetoken_py.models.args import ConfigReader, ModelArgs
from freetoken_py.models.weights import WeightScheme
from freetoken_py.layers.decoder import DecoderLayer
from freetoken_py.layers.moe import SigmoidRouter
from freetoken_py.models.architecture import Architecture, feed_forward, gqa, plain_rope

SCHEME = WeightScheme()  # mlp.gate(.e_score_correction_bias), mlp.experts.{e}, mlp.shared_experts


def parse_config(c: ConfigReader) -> ModelArgs:
    num_layers, common = c.get("num_hidden_layers"), c.common()
    num_experts, top_k = c.get("n_routed_experts"), c.get("num_experts_per_tok")
    dense = c.get("first_k_dense_replace", default=0)
    moe_inter = c.get("moe_intermediate_size")
    return ModelArgs(
        model_type="glm4_moe", qk_norm="head" if c.get("use_qk_norm", default=False, kind=bool) else "none",
        clip_qkv=None, sliding_window=None, num_experts=num_experts, top_k=top_k,
        moe_intermediate_size=moe_inter, intermediate_size=c.get("intermediate_size"),
        sparse_layers=tuple(i >= dense for i in range(num_layers)),
        shared_intermediate_size=moe_inter * c.get("n_shared_experts", default=1),
        rotary_dim=c.partial_rotary_dim(common["head_dim"]), o_bias=False,
        **c.sigmoid_router(num_experts, top_k), **common)


def architecture(a: ModelArgs) -> Architecture:
    """GQA with q/k/v biases (no o bias), per-head q/k norm if use_qk_norm, partial RoPE; the
    grouped sigmoid router and an ungated shared expert; dense first layers."""
    attn = gqa(a, qk_norm=a.qk_norm)
    router = SigmoidRouter(a.top_k, a.n_group, a.topk_group, a.norm_topk_prob, a.routed_scaling_factor)
    return Architecture(tuple(DecoderLayer(attn, feed_forward(a, i, router, SCHEME, shared_width=a.shared_intermediate_size))
                              for i in range(a.num_layers)), plain_rope(a))
