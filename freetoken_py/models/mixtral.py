"""Mixtral (`model_type: mixtral`): w1/w3/w2 experts under `block_sparse_moe`, router always
renormalised, optional sliding-window attention."""
from freetoken_py.models.args import ConfigReader, ModelArgs
from freetoken_py.models.weights import WeightScheme
from freetoken_py.layers.decoder import DecoderLayer
from freetoken_py.layers.moe import SoftmaxRouter
from freetoken_py.models.architecture import Architecture, feed_forward, gqa, plain_rope

SCHEME = WeightScheme(router="block_sparse_moe.gate.weight", expert="block_sparse_moe.experts.{e}.",
                      expert_proj=("w1", "w3", "w2"))


def parse_config(c: ConfigReader) -> ModelArgs:
    num_layers = c.get("num_hidden_layers")
    return ModelArgs(
        model_type="mixtral", qk_norm="none", clip_qkv=None,
        sliding_window=c.get("sliding_window", default=None),
        num_experts=c.get("num_local_experts", "num_experts"), top_k=c.get("num_experts_per_tok"),
        moe_intermediate_size=c.get("intermediate_size"), intermediate_size=c.get("intermediate_size"),
        norm_topk_prob=True, sparse_layers=(True,) * num_layers, **c.common())


def architecture(a: ModelArgs) -> Architecture:
    """Plain GQA; a softmax router that always renormalises; every layer MoE."""
    attn, router = gqa(a), SoftmaxRouter(a.top_k, True)
    return Architecture(tuple(DecoderLayer(attn, feed_forward(a, i, router, SCHEME)) for i in range(a.num_layers)),
                        plain_rope(a))
