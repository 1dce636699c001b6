"""The decoder forward pass: the model file's layers (models/architecture.py) run in order.

Each layer is a token mixer and a feed-forward part of the kinds in layers/ (GQA, MLA, Gated
DeltaNet; MoE block, dense MLP) around two RMSNorms of the model's norm kind; the kinds carry
their families' options, so this file has neither a family's name nor a family's switch.
"""
from __future__ import annotations

import torch

from freetoken_py.kvcache import KVCache, StatePool, StateSpec
from freetoken_py.layers.attention import AttentionMetadata
from freetoken_py.layers.decoder import StepContext
from freetoken_py.layers.dsa import IndexerWeights
from freetoken_py.layers.gated_deltanet import GdnWeights, gated_deltanet
from freetoken_py.layers.linear import TorchLinear
from freetoken_py.layers.mla import MlaWeights
from freetoken_py.layers.moe import ExpertExecutor, TorchExpertExecutor
from freetoken_py.models import architecture_of
from freetoken_py.models.args import ModelArgs
from freetoken_py.models.weights import ModelWeights


class MoeTransformer:
    def __init__(self, args: ModelArgs, weights: ModelWeights, dtype: torch.dtype,
                 experts: ExpertExecutor | None = None, arch=None):
        """arch: the model file's Architecture (default: built from args by its model file)."""
        self.args = args
        self.arch = arch or architecture_of(args)
        self.layers = self.arch.layers
        self.weights = weights
        self.dtype = dtype
        self.rope = self.arch.rope  # cos / sin [T, rope_dim] for every attention layer of a step
        paged = [layer.mixer for layer in self.layers if layer.mixer.paged]
        self.scale = paged[0].scale if paged else args.head_dim ** -0.5   # the attention layers' softmax scale
        biased = any(getattr(layer.ffn, "expert_bias", False) for layer in self.layers)
        self.experts = experts or TorchExpertExecutor(
            [lw.w13 for lw in weights.layers], [lw.w2 for lw in weights.layers], args.hidden_act,
            [lw.b13 for lw in weights.layers] if biased else None, [lw.b2 for lw in weights.layers] if biased else None)
        self.device = torch.device("cpu")   # where the dense weights, the activations and the KV live
        # model layer -> its layer in the paged KV cache (hybrids: only the paged mixers have one)
        self.kv_layer = {layer: j for j, layer in enumerate(self.arch.paged_layers)}
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
        cos, sin = (t.to(self.device) for t in self.rope.cos_sin(positions, self.dtype))  # [T, rope dims]
        if self.device.type != "cpu":
            meta = meta.to(self.device)
        norm, eps = self.arch.norm, self.args.rms_norm_eps
        ctx = StepContext(cos, sin, meta, cache, states, self.kv_layer, self.experts, eps, self.gdn_mixer)
        for i, (layer, lw) in enumerate(zip(self.layers, self.weights.layers)):
            h = h + layer.mixer.forward(lw, norm(h, lw.input_norm, eps), ctx, i)
            h = h + layer.ffn.forward(lw, norm(h, lw.post_norm, eps), ctx, i)
        return norm(h, self.weights.final_norm, eps)

    def state_specs(self) -> list[StateSpec]:
        """Each layer's state kind (kvcache/spec.py), as its mixer keeps it: paged K/V (over a
        window or the whole context), paged latent (with index keys), or recurrent."""
        return [layer.mixer.state_spec() for layer in self.layers]

    def paged_specs(self) -> list[StateSpec]:
        """The paged layers' specs, in paged-layer order (the KV pool's layers)."""
        return [self.layers[i].mixer.state_spec() for i in self.arch.paged_layers]

    @property
    def num_paged_layers(self) -> int:
        return len(self.kv_layer)

    @property
    def hybrid(self) -> bool:
        """Some layer keeps a fixed-size recurrent state (a StatePool slot per request)."""
        return len(self.kv_layer) < len(self.layers)

    def route(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's router: expert ids and weights [T, k] for x [T, D] (its MoE block's router kind)."""
        return self.layers[i].ffn.route(self.weights.layers[i], x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, D] -> fp32 logits [N, V] on the host (the sampler's side)."""
        return self.weights.lm_head(hidden).float().cpu()


def _linear_to(linear, device: torch.device):
    """A TorchLinear's weight and bias on `device` (the numba KernelLinear is host-only)."""
    if not isinstance(linear, TorchLinear):
        raise TypeError(f"{type(linear).__name__} weights cannot move to {device}; load with the torch backend")
    return TorchLinear(linear.weight.to(device), None if linear.bias is None else linear.bias.to(device))
