"""The decoder forward pass shared by every supported MoE family.

Differences between families live in `ModelArgs` (qk-norm kind, clip_qkv, sliding window, dense
layers, router renormalisation) and in each model file's `WeightScheme`; this file has none of
their names.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken_py.kvcache import KVCache
from freetoken_py.layers.attention import AttentionMetadata, paged_attention
from freetoken_py.layers.linear import TorchLinear
from freetoken_py.layers.moe import ExpertExecutor, TorchExpertExecutor, softmax_topk_route
from freetoken_py.layers.norm import rms_norm
from freetoken_py.layers.rotary import RotaryEmbedding, apply_rotary
from freetoken_py.models.args import ModelArgs
from freetoken_py.models.weights import LayerWeights, ModelWeights


class MoeTransformer:
    def __init__(self, args: ModelArgs, weights: ModelWeights, dtype: torch.dtype,
                 experts: ExpertExecutor | None = None):
        self.args = args
        self.weights = weights
        self.dtype = dtype
        self.rope = RotaryEmbedding(args.head_dim, args.rope_theta, args.rope_scaling_factor)
        self.scale = args.head_dim ** -0.5
        self.experts = experts or TorchExpertExecutor([lw.w13 for lw in weights.layers],
                                                      [lw.w2 for lw in weights.layers])
        self.device = torch.device("cpu")   # where the dense weights, the activations and the KV live

    def to_accelerator(self, device: str | torch.device) -> None:
        """Move every dense weight (attention, norms, routers, dense MLPs, the LM head) to `device`;
        the routed experts stay where they are (the residency tiers own them) and so does the
        token embedding (one row per token is looked up on the host and sent over). The KV cache
        is allocated on `self.device` by whoever builds it (engine.runner)."""
        device = torch.device(device)
        w = self.weights
        w.final_norm = w.final_norm.to(device)
        w.lm_head = _linear_to(w.lm_head, device)
        for lw in w.layers:
            for name, obj in lw.dense().items():
                setattr(lw, name, obj.to(device) if isinstance(obj, torch.Tensor) else _linear_to(obj, device))
        self.device = device

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                cache: KVCache) -> torch.Tensor:
        """input_ids, positions: [T] (host). Returns final-normed hidden states [T, D] on `self.device`."""
        h = self.weights.embed[input_ids].to(self.device, self.dtype)  # [T, D]
        cos, sin = (t.to(self.device) for t in self.rope.cos_sin(positions, self.dtype))  # [T, hd]
        if self.device.type != "cpu":
            meta = meta.to(self.device)
        for i, lw in enumerate(self.weights.layers):
            x = rms_norm(h, lw.input_norm, self.args.rms_norm_eps)
            h = h + self._attention(i, lw, x, cos, sin, meta, cache)
            x = rms_norm(h, lw.post_norm, self.args.rms_norm_eps)
            h = h + (self._moe(i, lw, x) if lw.router is not None else self._mlp(lw, x))
        return rms_norm(h, self.weights.final_norm, self.args.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, D] -> fp32 logits [N, V] on the host (the sampler's side)."""
        return self.weights.lm_head(hidden).float().cpu()

    def _attention(self, i: int, lw: LayerWeights, x: torch.Tensor, cos, sin, meta, cache) -> torch.Tensor:
        a = self.args
        T = x.shape[0]
        q_out, kv_out = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        q, k, v = lw.qkv(x).split([q_out, kv_out, kv_out], dim=-1)
        if a.qk_norm == "full":  # OLMoE: norm over the whole projection, before clipping
            q, k = rms_norm(q, lw.q_norm, a.rms_norm_eps), rms_norm(k, lw.k_norm, a.rms_norm_eps)
        if a.clip_qkv is not None:
            q, k, v = (t.clamp(-a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        q = q.view(T, a.num_heads, a.head_dim)  # [T, Hq, hd]
        k = k.view(T, a.num_kv_heads, a.head_dim)  # [T, Hkv, hd]
        v = v.view(T, a.num_kv_heads, a.head_dim)
        if a.qk_norm == "head":  # Qwen3: per-head norm
            q, k = rms_norm(q, lw.q_norm, a.rms_norm_eps), rms_norm(k, lw.k_norm, a.rms_norm_eps)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = paged_attention(cache, i, meta, q, k, v, self.scale)  # [T, Hq*hd]
        return lw.o(o)

    def _moe(self, i: int, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        router_logits = lw.router(x)  # [T, E]
        ids, weights = softmax_topk_route(router_logits, self.args.top_k, self.args.norm_topk_prob)
        return self.experts(i, x, ids, weights)

    @staticmethod
    def _mlp(lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate, up = lw.mlp13(x).chunk(2, dim=-1)
        return lw.mlp2(F.silu(gate) * up)


def _linear_to(linear, device: torch.device):
    """A TorchLinear's weight and bias on `device` (the numba KernelLinear is host-only)."""
    if not isinstance(linear, TorchLinear):
        raise TypeError(f"{type(linear).__name__} weights cannot move to {device}; load with the torch backend")
    return TorchLinear(linear.weight.to(device), None if linear.bias is None else linear.bias.to(device))
