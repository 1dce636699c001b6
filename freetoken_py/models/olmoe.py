"""OLMoE (`model_type: olmoe`): q/k RMSNorm over the full projection width, then `clip_qkv`
clamping of q, k and v; softmax router, renormalised only if `norm_topk_prob`."""
from freetoken_py.models.args import ConfigReader, ModelArgs
from freetoken_py.models.weights import WeightScheme
from freetoken_py.layers.decoder import DecoderLayer
from freetoken_py.layers.moe import SoftmaxRouter
from freetoken_py.models.architecture import Architecture, feed_forward, gqa, plain_rope

SCHEME = WeightScheme()


def parse_config(c: ConfigReader) -> ModelArgs:
    num_layers = c.get("num_hidden_layers")
    return ModelArgs(
        model_type="olmoe", qk_norm="full", clip_qkv=c.get("clip_qkv", default=None, kind=float),
        sliding_window=None,  # transformers' OLMoE builds a plain causal mask
        num_experts=c.get("num_experts", "num_local_experts"), top_k=c.get("num_experts_per_tok"),
        moe_intermediate_size=c.get("intermediate_size"), intermediate_size=c.get("intermediate_size"),
        norm_topk_prob=c.get("norm_topk_prob", default=False, kind=bool),
        sparse_layers=(True,) * num_layers, **c.common())


def architecture(a: ModelArgs) -> Architecture:
    """GQA with q/k norm over the whole projection, then clip_qkv; softmax router."""
    attn, router = gqa(a, qk_norm="full", clip=a.clip_qkv), SoftmaxRouter(a.top_k, a.norm_topk_prob)
    return Architecture(tuple(DecoderLayer(attn, feed_forward(a, i, router, SCHEME)) for i in range(a.num_layers)),
                        plain_rope(a))
