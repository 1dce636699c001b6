"""A decoder layer as two parts of given kinds, and what one forward hands every layer.

A model file (models/<model_type>.py) composes its layers from the kinds in this package: a
token mixer (`gqa.GqaAttention`, `mla.MlaAttention`, `gated_deltanet.GdnMixer`) and a feed-forward
part (`moe.MoeBlock`, `mlp.DenseMlp`), each around the layer's two RMSNorms. Every kind owns its
checkpoint names and shapes under the layer's prefix (`shapes`), how it loads them into the
layer's `LayerWeights` fields (`load`), what loading holds in memory (`held`), its torch forward
(`forward`) and, for mixers, the per-layer state kind it keeps (`state_spec`: kvcache/spec.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from freetoken_py.layers.norm import rms_norm

NORMS = {"input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight"}

Getter = Callable[..., torch.Tensor]            # get(name, at_dtype=None) -> tensor at the load dtype
Held = Callable[..., int]                       # held(name, copied, at_dtype=load dtype) -> bytes held


@dataclass(frozen=True)
class RmsNorm:
    """The model's RMSNorm kind. plain: x * w in the activation dtype; fp32_scale (gpt-oss,
    FAMILIES §0 (b)): the product in fp32, then cast; zero_centred (Qwen3-Next / 3.5, §0 (c)):
    stored w, applied as (1 + w) in fp32 (`prepare` turns the stored weight into that)."""
    fp32_scale: bool = False
    zero_centred: bool = False

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        return 1.0 + w.float() if self.zero_centred else w

    def __call__(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        if self.zero_centred or self.fp32_scale:
            return F.rms_norm(x.float(), w.shape, w.float(), eps).to(x.dtype)
        return rms_norm(x, w, eps)


@dataclass
class StepContext:
    """What one forward hands each layer: RoPE rows, the batch's attention metadata, the KV pool
    and recurrent states, the routed-expert executor, and the last DSA selection (shared layers
    reuse the one their full layer made)."""
    cos: torch.Tensor
    sin: torch.Tensor
    meta: object                 # layers.attention.AttentionMetadata
    cache: object                # kvcache.KVCache
    states: object               # kvcache.StatePool or None
    kv_layer: dict               # model layer -> its layer in the paged pool
    experts: Callable            # layers.moe.ExpertExecutor
    eps: float
    gdn: Callable                # the Gated DeltaNet mixer function (torch, or the cpu backend's)
    selection: object = None


class Mixer(Protocol):
    paged: bool                  # keeps pages in the KV pool (else a fixed-size recurrent state)

    def shapes(self) -> dict[str, tuple[int, ...]]: ...
    def load(self, get: Getter, prefix: str) -> dict: ...
    def held(self, held: Held, prefix: str) -> int: ...
    def forward(self, lw, x: torch.Tensor, ctx: StepContext, i: int) -> torch.Tensor: ...
    def state_spec(self): ...


@dataclass(frozen=True)
class DecoderLayer:
    """h += mixer(norm(h)); h += ffn(norm(h)) — the pre-norm residual layer every family here runs."""
    mixer: Mixer
    ffn: object                  # MoeBlock | DenseMlp

    @property
    def sparse(self) -> bool:
        return getattr(self.ffn, "router", None) is not None

    def shapes(self, hidden: int) -> dict[str, tuple[int, ...]]:
        return {**{name: (hidden,) for name in NORMS.values()}, **self.mixer.shapes(), **self.ffn.shapes()}
