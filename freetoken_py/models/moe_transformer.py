"""The decoder forward pass shared by every supported MoE family.

Differences between families live in `ModelArgs` (qk-norm kind, clip_qkv, sliding window, dense
layers, router renormalisation) and in each model file's `WeightScheme`; this file has none of
their names.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken_py.kvcache import KVCache, PagedIndexedLatent, PagedKV, PagedWindowKV, StatePool, StateSpec
from freetoken_py.layers.attention import AttentionMetadata, paged_attention
from freetoken_py.layers.dsa import IndexerWeights, dsa_selection
from freetoken_py.layers.gated_deltanet import GdnWeights, gated_deltanet
from freetoken_py.layers.linear import TorchLinear
from freetoken_py.layers.mla import MlaWeights, YarnRotary, mla_attention
from freetoken_py.layers.moe import (ExpertExecutor, TorchExpertExecutor, sigmoid_group_route, softmax_topk_route,
                                     topk_softmax_route)
from freetoken_py.layers.norm import rms_norm
from freetoken_py.layers.rotary import RotaryEmbedding, apply_partial_rotary
from freetoken_py.models.args import ModelArgs
from freetoken_py.models.weights import LayerWeights, ModelWeights


class MoeTransformer:
    def __init__(self, args: ModelArgs, weights: ModelWeights, dtype: torch.dtype,
                 experts: ExpertExecutor | None = None):
        self.args = args
        self.weights = weights
        self.dtype = dtype
        self.rope = RotaryEmbedding(args.rope_dim, args.rope_theta, args.rope_scaling_factor)  # cos/sin [T, rope_dim]
        self.scale = args.head_dim ** -0.5
        if args.mla is not None:  # MLA: RoPE (maybe YaRN) on the rope dims only, its own softmax scale
            self.rope, self.scale = args.mla.rotary(), args.mla.softmax_scale
        elif args.rope_yarn is not None:  # gpt-oss: YaRN's blend, cos/sin times its attention factor
            self.rope = YarnRotary.from_params(args.rope_dim, args.rope_theta, args.rope_yarn)
        biased = args.expert_bias
        self.experts = experts or TorchExpertExecutor(
            [lw.w13 for lw in weights.layers], [lw.w2 for lw in weights.layers], args.hidden_act,
            [lw.b13 for lw in weights.layers] if biased else None, [lw.b2 for lw in weights.layers] if biased else None)
        self.device = torch.device("cpu")   # where the dense weights, the activations and the KV live
        # model layer -> its layer in the paged KV cache (hybrids: only full-attention layers have one)
        self.kv_layer = {layer: j for j, layer in enumerate(args.paged_layers)}
        # the linear-attention mixer (layers/gated_deltanet.py's contract); the cpu backend swaps in its kernels
        self.gdn_mixer = gated_deltanet

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
                moved = (obj.to(device) if isinstance(obj, torch.Tensor) else obj.to(device, _linear_to)
                         if isinstance(obj, (MlaWeights, GdnWeights, IndexerWeights)) else _linear_to(obj, device))
                setattr(lw, name, moved)
        self.device = device

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                cache: KVCache, states: StatePool | None = None) -> torch.Tensor:
        """input_ids, positions: [T] (host). Returns final-normed hidden states [T, D] on `self.device`.
        states: the per-request state of the recurrent layers (hybrids; meta.state_slots says whose)."""
        h = self.weights.embed[input_ids].to(self.device, self.dtype)  # [T, D]
        cos, sin = (t.to(self.device) for t in self.rope.cos_sin(positions, self.dtype))  # [T, hd]
        if self.device.type != "cpu":
            meta = meta.to(self.device)
        norm, eps, a = self._norm, self.args.rms_norm_eps, self.args
        self._selection = None  # DSA: the last full layer's top-k per sequence (shared layers reuse it)
        for i, lw in enumerate(self.weights.layers):
            x = norm(h, lw.input_norm, eps)
            if lw.gdn is not None:  # linear attention over the request's recurrent state
                h = h + lw.o(self.gdn_mixer(a.gdn, lw.gdn, x, meta, states.conv[i], states.rec[i]))
            else:
                h = h + self._attention(i, lw, x, cos, sin, meta, cache)
            x = norm(h, lw.post_norm, eps)
            h = h + (self._moe(i, lw, x) if lw.router is not None else _swiglu(lw.mlp13, lw.mlp2, x))
        return norm(h, self.weights.final_norm, eps)

    def _norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        if self.args.zero_centred_norms or self.args.norm_fp32_scale:  # §0 (c): (1 + w) loaded; (b): w, in fp32
            return F.rms_norm(x.float(), w.shape, w.float(), eps).to(x.dtype)
        return rms_norm(x, w, eps)

    def state_spec(self) -> StateSpec:
        """What each paged layer keeps per token in the KV pool (kvcache/spec.py); with DSA, the
        rows every paged layer shares (the index key rows: `state_specs`)."""
        a = self.args
        return a.mla.state_spec if a.mla is not None else PagedKV(a.num_kv_heads, a.head_dim)

    def _layer_spec(self, i: int) -> StateSpec:
        a = self.args
        if a.is_linear(i):
            return a.gdn.state_spec
        if a.dsa is not None and a.dsa.is_full(i):  # DSA full layer: latent, rope key and index key
            return PagedIndexedLatent(a.mla.kv_lora_rank, a.mla.qk_rope_head_dim, a.dsa.head_dim)
        if a.mixed_windows and a.window(i) is not None:  # gpt-oss: pages behind the window given back
            return PagedWindowKV(a.num_kv_heads, a.head_dim, a.window(i))
        return self.state_spec()

    def state_specs(self) -> list[StateSpec]:
        """Each layer's state kind (kvcache/spec.py): the paged spec, or the recurrent one."""
        return [self._layer_spec(i) for i in range(self.args.num_layers)]

    def paged_specs(self) -> list[StateSpec]:
        """The paged layers' specs, in paged-layer order (the KV pool's layers)."""
        return [self._layer_spec(i) for i in self.args.paged_layers]

    @property
    def num_paged_layers(self) -> int:
        return len(self.kv_layer)

    @property
    def hybrid(self) -> bool:
        """Some layer keeps a fixed-size recurrent state (a StatePool slot per request)."""
        return self.args.gdn is not None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, D] -> fp32 logits [N, V] on the host (the sampler's side)."""
        return self.weights.lm_head(hidden).float().cpu()

    def _attention(self, i: int, lw: LayerWeights, x: torch.Tensor, cos, sin, meta, cache) -> torch.Tensor:
        a = self.args
        kvi = self.kv_layer[i]
        if a.mla is not None:  # the attention kind: MLA over the latent cache (layers/mla.py)
            sparse = self._dsa(i, lw, kvi, meta, x, cos, sin, cache) if a.dsa is not None else None
            return lw.o(mla_attention(a.mla, lw.mla, cache, kvi, meta, x, cos, sin, a.rms_norm_eps, sparse))
        T = x.shape[0]
        q_out, kv_out = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        gate = None
        if a.attn_output_gate:  # q_proj rows per head: [query | gate]
            qg, k, v = lw.qkv(x).split([2 * q_out, kv_out, kv_out], dim=-1)
            q, gate = qg.view(T, a.num_heads, 2 * a.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(T, q_out), gate.reshape(T, q_out)
        else:
            q, k, v = lw.qkv(x).split([q_out, kv_out, kv_out], dim=-1)
        if a.qk_norm == "full":  # OLMoE: norm over the whole projection, before clipping
            q, k = rms_norm(q, lw.q_norm, a.rms_norm_eps), rms_norm(k, lw.k_norm, a.rms_norm_eps)
        if a.clip_qkv is not None:
            q, k, v = (t.clamp(-a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        q = q.view(T, a.num_heads, a.head_dim)  # [T, Hq, hd]
        k = k.view(T, a.num_kv_heads, a.head_dim)  # [T, Hkv, hd]
        v = v.view(T, a.num_kv_heads, a.head_dim)
        if a.qk_norm == "head":  # Qwen3: per-head norm
            q, k = self._norm(q, lw.q_norm, a.rms_norm_eps), self._norm(k, lw.k_norm, a.rms_norm_eps)
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        if a.mixed_windows and a.window(i) is not None:  # gpt-oss: this layer sees the windowed contexts
            meta = meta.windowed
        o = paged_attention(cache, kvi, meta, q, k, v, self.scale, lw.sinks)  # [T, Hq*hd]
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return lw.o(o)

    def _dsa(self, i: int, lw: LayerWeights, kvi: int, meta, x: torch.Tensor, cos, sin, cache):
        """DSA's selection for mla_attention: a full layer runs its indexer (layers/dsa.py) and keeps
        the result for the shared layers after it, which reuse it as it is."""
        def sparse(q_resid: torch.Tensor):
            if lw.indexer is not None:
                self._selection = dsa_selection(self.args.dsa, lw.indexer, cache, kvi, meta, x, q_resid, cos, sin)
            return self._selection
        return sparse

    def _moe(self, i: int, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """Routed experts (through the executor: only they are its business) plus the layer's
        ungated shared expert, a dense MLP every token runs."""
        ids, weights = self._route(lw, x)
        out = self.experts(i, x, ids, weights.to(x.dtype))
        if lw.shared13 is not None:
            shared = _swiglu(lw.shared13, lw.shared2, x)
            if lw.shared_gate is not None:  # Qwen3-Next / 3.5: sigmoid-gated per token
                shared = torch.sigmoid(lw.shared_gate(x)) * shared
            out = out + shared
        return out

    def _route(self, lw: LayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, weights [T, k] from the router kind (ModelArgs.router)."""
        a = self.args
        if a.router == "topk":  # gpt-oss: top-k of the biased logits, softmax over those
            return topk_softmax_route(lw.router(x), a.top_k)
        if a.router == "sigmoid":  # fp32 router (weight and bias loaded fp32)
            return sigmoid_group_route(lw.router(x.float()), lw.router_bias, a.top_k, a.n_group, a.topk_group,
                                       a.norm_topk_prob, a.routed_scaling_factor)
        return softmax_topk_route(lw.router(x), a.top_k, a.norm_topk_prob)


def _swiglu(w13, w2, x: torch.Tensor) -> torch.Tensor:
    """A dense SwiGLU MLP (dense layers, shared experts): w2(silu(gate) * up), w13 = gate|up rows."""
    gate, up = w13(x).chunk(2, dim=-1)
    return w2(F.silu(gate) * up)


def _linear_to(linear, device: torch.device):
    """A TorchLinear's weight and bias on `device` (the numba KernelLinear is host-only)."""
    if not isinstance(linear, TorchLinear):
        raise TypeError(f"{type(linear).__name__} weights cannot move to {device}; load with the torch backend")
    return TorchLinear(linear.weight.to(device), None if linear.bias is None else linear.bias.to(device))
