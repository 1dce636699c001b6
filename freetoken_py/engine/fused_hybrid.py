"""The cpu backend's decode step for hybrid models (Qwen3-Next, Qwen3.5 / 3.6 MoE: Gated DeltaNet
layers with a per-request recurrent state, every 4th layer gated full attention).

Per layer: rms_norm (numba) -> the mixer -> h += out_proj / o_proj -> rms_norm -> router -> the
routed experts added straight into h (the expert bank's numba kernel) and the sigmoid-gated shared
expert. The mixer of a GDN layer is the fused in_proj GEMV plus one `kernels/cpu_gdn.gdn_core`
call for the whole batch (conv step, delta-rule step and gated norm of every request, its state
slot read and written in place); of a full-attention layer the model's own attention (query gate,
partial RoPE) over the paged K/V, from the step's key slots. Same math as MoeTransformer.forward
with layers/gdn_cpu.py (tests/test_hybrid_models.py runs the cpu backend, whose decode steps take
this path, against transformers).
"""
from __future__ import annotations

import numpy as np
import torch

from freetoken_py.engine.cpu_backend import KernelExpertExecutor
from freetoken_py.engine.fused_mla import add_ffn
from freetoken_py.kernels import cpu_decode as kd
from freetoken_py.kernels.cpu_moe import ACTIVATIONS
from freetoken_py.kvcache import KVCache
from freetoken_py.layers.attention import AttentionMetadata, SeqAttention
from freetoken_py.layers.gdn_cpu import gdn_rows
from freetoken_py.layers.linear import KernelLinear
from freetoken_py.models.moe_transformer import MoeTransformer


class HybridDecoder:
    def __init__(self, model: MoeTransformer, cache: KVCache, states):
        self.model, self.cache, self.states, self.args = model, cache, states, model.args
        self.conv = [None if c is None else c.numpy() for c in states.conv]  # zero-copy views of the pool
        self.rec = [None if r is None else r.numpy() for r in states.rec]

    @staticmethod
    def supports(model: MoeTransformer) -> bool:
        """A hybrid on the numba kernels (fp32 activations, KernelLinear projections)."""
        layers = model.weights.layers
        lins = [x for lw in layers for x in (lw.gdn.in_proj if lw.gdn is not None else lw.qkv, lw.o)]
        return model.hybrid and model.dtype == torch.float32 and all(isinstance(x, KernelLinear) for x in lins)

    def forward(self, token_ids: list[int], positions: list[int], ctx: np.ndarray, ctx_off: np.ndarray,
                new_slots: np.ndarray, state_slots: np.ndarray) -> torch.Tensor:
        """One new token per row (FusedDecoder.forward's contract) and each row's StatePool slot.
        Returns final-normed h [T, D] fp32."""
        a, m = self.args, self.model
        T, D, eps = len(token_ids), a.hidden_size, a.rms_norm_eps
        h = m.weights.embed[token_ids].float().numpy()  # [T, D], a fresh copy we own
        cos, sin = m.rope.cos_sin(torch.tensor(positions), torch.float32)
        meta = None  # the full-attention layers' view of the step, built once
        x = np.empty((T, D), np.float32)
        mixed = np.empty((T, 1, a.gdn.value_dim), np.float32)
        slots = np.ascontiguousarray(state_slots, np.int64)
        ex = m.experts  # looked up per step: LLM may wrap it (--record-routing)
        banks = ex.banks if type(ex) is KernelExpertExecutor else None
        act = ACTIVATIONS[ex.activation] if banks is not None else 0
        for i, lw in enumerate(m.weights.layers):
            kd.rms_rows(h, lw.input_norm.numpy(), eps, x)
            xt = torch.from_numpy(x)
            if lw.gdn is not None:
                proj = lw.gdn.in_proj(xt).numpy()  # [T, proj_rows] fp32
                gdn_rows(a.gdn, lw.gdn, proj[:, None], self.conv[i], self.rec[i], slots, mixed)
                h += lw.o(torch.from_numpy(mixed[:, 0])).numpy()
            else:
                if meta is None:
                    seqs = [SeqAttention(t, t + 1, torch.from_numpy(ctx[ctx_off[t]:ctx_off[t + 1]]), None)
                            for t in range(T)]
                    meta = AttentionMetadata(torch.from_numpy(new_slots), seqs, list(slots))
                h += m._attention(i, lw, xt, cos, sin, meta, self.cache).numpy()
            kd.rms_rows(h, lw.post_norm.numpy(), eps, x)
            add_ffn(m, i, lw, x, h, banks, act)
        out = np.empty_like(h)
        kd.rms_rows(h, m.weights.final_norm.numpy(), eps, out)
        return torch.from_numpy(out)
