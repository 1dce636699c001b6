"""Qwen3-MoE (`model_type: qwen3_moe`): per-head q/k RMSNorm, softmax router with optional
renormalisation, dense MLP layers via `decoder_sparse_step` / `mlp_only_layers`."""
from freetoken_py.models.args import ConfigReader, ModelArgs
from freetoken_py.models.weights import WeightScheme
from freetoken_py.layers.decoder import DecoderLayer
from freetoken_py.layers.moe import SoftmaxRouter
from freetoken_py.models.architecture import Architecture, feed_forward, gqa, plain_rope

SCHEME = WeightScheme()


def parse_config(c: ConfigReader) -> ModelArgs:
    num_layers = c.get("num_hidden_layers")
    num_experts = c.get("num_experts", "num_local_experts")
    step = c.get("decoder_sparse_step", default=1)
    mlp_only = set(c.cfg.get("mlp_only_layers") or [])
    sparse = tuple(i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    window = c.get("sliding_window", default=None) if c.get("use_sliding_window", default=False, kind=bool) else None
    return ModelArgs(
        model_type="qwen3_moe", qk_norm="head", clip_qkv=None, sliding_window=window,
        num_experts=num_experts, top_k=c.get("num_experts_per_tok"),
        moe_intermediate_size=c.get("moe_intermediate_size"),
        intermediate_size=c.get("intermediate_size", default=0),
        norm_topk_prob=c.get("norm_topk_prob", default=False, kind=bool),
        sparse_layers=sparse, **c.common())


def architecture(a: ModelArgs) -> Architecture:
    """GQA with per-head q/k norm; softmax router; dense MLP layers where the config says."""
    attn, router = gqa(a, qk_norm="head"), SoftmaxRouter(a.top_k, a.norm_topk_prob)
    return Architecture(tuple(DecoderLayer(attn, feed_forward(a, i, router, SCHEME)) for i in range(a.num_layers)),
                        plain_rope(a))
