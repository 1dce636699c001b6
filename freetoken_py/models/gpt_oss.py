"""gpt-oss-20b / gpt-oss-120b (`model_type: gpt_oss`).

Attention: GQA with biases on q / k / v / o, rotate-half RoPE over the whole head with YaRN (its
frequency blend, cos / sin times the attention factor 0.1 ln(factor) + 1), scale head_dim^-0.5,
and a learnt sink logit per head (`self_attn.sinks [H]`) in every softmax, its share dropped.
`layer_types` alternates "sliding_attention" (keys j with i - W < j <= i, W = `sliding_window`)
and "full_attention". RMSNorm multiplies in fp32 (equal to the shared one in fp32).
MoE on every layer, no shared expert: the router `mlp.router` (weight and bias) takes the top-k
of its logits and a softmax over those k; experts with biases and the clamped SwiGLU
(gate <= 7, up in [-7, 7], (up + 1) * gate * sigmoid(1.702 gate): ModelArgs.hidden_act "gptoss").

Checkpoints keep the experts fused: bf16 / fp32 `mlp.experts.gate_up_proj [E, D, 2I]` (input-
major, gate and up interleaved: even columns gate, odd up), `gate_up_proj_bias [E, 2I]`,
`down_proj [E, I, D]`, `down_proj_bias [E, D]`; the release's MXFP4 `*_blocks` / `*_scales`
(output-major, [E, 2I, D/32, 16] / [E, 2I, D/32], rows interleaved the same way; formats/mxfp4.py).
`expand` reads them as per-expert gate / up / down tensors (views, no copy of the stack).
"""
from __future__ import annotations

import dataclasses
import math
import re

from freetoken_py.errors import ModelLoadError, UnsupportedModelError
from freetoken_py.models.args import ConfigReader, ModelArgs
from freetoken_py.models.deepseek_v3 import _yarn
from freetoken_py.models.weights import WeightScheme
from freetoken_py.layers.decoder import DecoderLayer, RmsNorm
from freetoken_py.layers.mla import YarnRotary
from freetoken_py.layers.moe import TopKRouter
from freetoken_py.models.architecture import Architecture, feed_forward, gqa, plain_rope

SCHEME = WeightScheme(router="mlp.router.weight", router_bias="mlp.router.bias")
LAYER_KINDS = ("sliding_attention", "full_attention")
_FIXED = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0, "hidden_act": "silu"}   # what the kernels' "gptoss" computes
_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


def layer_kinds(c: ConfigReader, num_layers: int) -> tuple[str, ...]:
    kinds = c.cfg.get("layer_types")
    if kinds is None:  # transformers' default: sliding on even layers
        return tuple(LAYER_KINDS[i % 2] for i in range(num_layers))
    return c.layer_types(num_layers, LAYER_KINDS)


def parse_config(c: ConfigReader) -> ModelArgs:
    for key, value in _FIXED.items():
        if c.cfg.get(key) is not None and c.cfg[key] != value:
            raise UnsupportedModelError(f"{c.path}: '{key}' {c.cfg[key]!r} is not supported (supported: {value!r})")
    params = dict(c.cfg.get("rope_parameters") or c.cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", c.cfg.get("rope_theta", 150000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("yarn", "default"):
        raise UnsupportedModelError(f"{c.path}: rope type '{kind}' is not supported for gpt_oss (supported: yarn, default)")
    yarn = _yarn(c, params)[0] if kind == "yarn" else None
    num_layers, common = c.get("num_hidden_layers"), c.common(rope=(theta, 1.0))
    common.update(attention_bias=True, hidden_act="gptoss")   # q / k / v / o biases always (as transformers)
    kinds = layer_kinds(c, num_layers)
    window = c.get("sliding_window", default=None) if "sliding_attention" in kinds else None
    if window is not None and window < 1:
        raise ModelLoadError(f"{c.path}: 'sliding_window' ({window}) must be positive")
    inter = c.get("intermediate_size")
    return ModelArgs(
        model_type="gpt_oss", qk_norm="none", clip_qkv=None, sliding_window=window,
        num_experts=c.get("num_local_experts"), top_k=c.get("num_experts_per_tok"),
        moe_intermediate_size=inter, intermediate_size=inter, norm_topk_prob=True,
        sparse_layers=(True,) * num_layers, router="topk", layer_kinds=kinds,
        rope_yarn=yarn, **common)


def _part(info, shape: tuple[int, ...], e: int, start: int, end: int, step: int = 1, transposed: bool = False):
    """Expert e's rows start:end:step of a fused stack (after the transpose), as a TensorInfo."""
    return dataclasses.replace(info, shape=tuple(shape), nbytes=info.nbytes * math.prod(shape) // math.prod(info.shape),
                               part=(e, start, end), step=step, transposed=transposed)


def expand(tensors: dict) -> dict:
    """The fused expert stacks read as per-expert `experts.{e}.{gate,up,down}_proj.{weight,bias}`
    (MXFP4: `weight_blocks` / `weight_scales`), gate the even and up the odd rows of gate_up."""
    out = {}
    for name, info in tensors.items():
        m = _FUSED.match(name)
        if m is None:
            out[name] = info
            continue
        prefix, kind, suffix = m.groups()
        suffix = suffix or ""
        dims = {"_bias": 2, "_blocks": 4, "_scales": 3, "": 3}[suffix]
        if len(info.shape) != dims:
            raise ModelLoadError(f"{info.file}: tensor '{info.name}' has shape {list(info.shape)}, expected "
                                 f"{dims} dims (a fused gpt-oss expert stack)")
        leaf = {"_bias": "bias", "_blocks": "weight_blocks", "_scales": "weight_scales", "": "weight"}[suffix]
        transposed = suffix == ""   # the plain stacks are [E, in, out]; the others output-major already
        rows_dim = 2 if transposed else 1
        rows, rest = info.shape[rows_dim], (() if suffix == "_bias" else
                                            (info.shape[1],) if transposed else tuple(info.shape[2:]))
        for e in range(info.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}{e}.down_proj.{leaf}"] = _part(info, (rows, *rest), e, 0, rows, 1, transposed)
                continue
            if rows % 2:
                raise ModelLoadError(f"{info.file}: tensor '{info.name}' has an odd gate/up width {rows} "
                                     "(gate and up interleaved)")
            for j, proj in enumerate(("gate_proj", "up_proj")):
                out[f"{prefix}{e}.{proj}.{leaf}"] = _part(info, (rows // 2, *rest), e, j, rows, 2, transposed)
    return out


def architecture(a: ModelArgs) -> Architecture:
    """GQA with q/k/v/o biases and a sink per head, windowed layers (their own pages) alternating
    with full ones; the top-k router with its bias; biased experts (the clamped SwiGLU: the
    experts' activation "gptoss"); RMSNorm multiplying in fp32; YaRN RoPE."""
    norm, router = RmsNorm(fp32_scale=True), TopKRouter(a.top_k)
    layers = tuple(DecoderLayer(gqa(a, sinks=True, norm=norm, window=a.window(i) if a.mixed_windows else None),
                                feed_forward(a, i, router, SCHEME, expert_bias=True)) for i in range(a.num_layers))
    rope = plain_rope(a) if a.rope_yarn is None else YarnRotary.from_params(a.rope_dim, a.rope_theta, a.rope_yarn)
    return Architecture(layers, rope, norm)
