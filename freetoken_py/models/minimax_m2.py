"""MiniMax-M2 / M2.1 / M2.5 (`model_type: minimax_m2`).

Parts: GQA attention without biases, RMSNorm over the full q and k projections before the head
split (OLMoE's `qk_norm="full"`), rotate-half RoPE on the first `rotary_dim` dims of each head;
a sigmoid router whose `e_score_correction_bias` sits on the block (no groups, no scaling,
always renormalised); Mixtral's w1 / w3 / w2 expert names; no shared expert, no dense layers.
"""
from freetoken_py.errors import UnsupportedModelError
from freetoken_py.models.args import ConfigReader, ModelArgs
from freetoken_py.models.weights import WeightScheme
from freetoken_py.layers.decoder import DecoderLayer
from freetoken_py.layers.moe import SigmoidRouter
from freetoken_py.models.architecture import Architecture, feed_forward, gqa, plain_rope

SCHEME = WeightScheme(router="block_sparse_moe.gate.weight", router_bias="block_sparse_moe.e_score_correction_bias",
                      expert="block_sparse_moe.experts.{e}.", expert_proj=("w1", "w3", "w2"))

# config keys of the original release that transformers' class does not read: only the values it implies
_FIXED = {"scoring_func": "sigmoid", "use_routing_bias": True, "qk_norm_type": "per_layer", "use_qk_norm": True,
          "shared_intermediate_size": 0}


def parse_config(c: ConfigReader) -> ModelArgs:
    for key, value in _FIXED.items():
        if c.cfg.get(key) is not None and c.cfg[key] != value:
            raise UnsupportedModelError(f"{c.path}: '{key}' {c.cfg[key]!r} is not supported (supported: {value!r})")
    num_layers, common = c.get("num_hidden_layers"), c.common()
    common["attention_bias"] = False  # q/k/v/o have no bias whatever the config says (as transformers)
    inter = c.get("intermediate_size")
    return ModelArgs(
        model_type="minimax_m2", qk_norm="full", clip_qkv=None, sliding_window=None,
        num_experts=c.get("num_local_experts"), top_k=c.get("num_experts_per_tok"),
        moe_intermediate_size=inter, intermediate_size=inter, norm_topk_prob=True,
        sparse_layers=(True,) * num_layers, router="sigmoid",
        rotary_dim=c.partial_rotary_dim(common["head_dim"]), **common)


def architecture(a: ModelArgs) -> Architecture:
    """GQA, no biases, q/k norm over the whole projection, partial RoPE; a sigmoid router with its
    choice bias, one group, renormalised; every layer MoE, no shared expert."""
    attn = gqa(a, qk_norm="full")
    router = SigmoidRouter(a.top_k, a.n_group, a.topk_group, a.norm_topk_prob, a.routed_scaling_factor)
    return Architecture(tuple(DecoderLayer(attn, feed_forward(a, i, router, SCHEME)) for i in range(a.num_layers)),
                        plain_rope(a))
