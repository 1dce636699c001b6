"""The cpu backend's decode step for MLA models: absorbed attention over the latent pages in numba.

Per layer: rms_norm -> MLA projections (numba GEMVs through KernelLinear; rope on the rope dims)
-> the new tokens' (latent, rope key) written to the pool -> kernels/cpu_mla.mla_decode (absorbed
scores and values, the cache and kv_b's W_UK / W_UV read in place) -> o_proj added into h -> rms_norm -> router ->
routed experts (the expert bank's numba kernel) and the shared expert / dense MLP added into h.
Same math as MoeTransformer.forward with layers/mla.py (tests/test_mla_models.py compares both
backends with transformers).
"""
from __future__ import annotations

import numpy as np
import torch

from freetoken_py.engine.cpu_backend import KernelExpertExecutor
from freetoken_py.kernels import cpu_decode as kd
from freetoken_py.kernels.cpu_mla import index_scores as index_scores_kernel
from freetoken_py.kernels.cpu_mla import mla_decode, top_slots
from freetoken_py.kernels.cpu_moe import ACTIVATIONS, add_moe_experts
from freetoken_py.kvcache import KVCache
from freetoken_py.layers.dsa import index_keys, index_queries
from freetoken_py.layers.linear import KernelLinear
from freetoken_py.layers.mla import mla_project
from freetoken_py.layers.mlp import swiglu
from freetoken_py.models.moe_transformer import MoeTransformer

_ONE = np.ones(1, np.float32)


def _kv_view(t: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view of one layer's rows (or of kv_b): fp32, bf16 as uint16 bits, fp8 as uint8."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


class MlaDecoder:
    def __init__(self, model: MoeTransformer, cache: KVCache):
        a = model.args
        self.model, self.cache, self.args, self.cfg = model, cache, a, a.mla
        self.k = [_kv_view(cache.k[i]) for i in range(a.num_layers)]  # [S, 1, R] latents
        self.v = [_kv_view(cache.v[i]) for i in range(a.num_layers)]  # [S, 1, dr] rope keys
        self.fp8 = cache.quantized
        self.lut = kd.fp8_table() if self.fp8 else _ONE
        # W_UK | W_UV per layer: kv_b_proj's own storage viewed [H, dn + dv, R] (fp32, or bf16 as
        # uint16 bits), no copy: the kernel splits and widens them as it reads
        H, dn, dv = self.cfg.num_heads, self.cfg.qk_nope_head_dim, self.cfg.v_head_dim
        self.kv_b = [_kv_view(lw.mla.kv_b.contiguous()).reshape(H, dn + dv, -1) for lw in model.weights.layers]
        # DSA: each full layer's index-key rows [S, 1, di] (fp32, or bf16 bits), read in place
        self.index = {i: _kv_view(cache.index[j]) for i, j in cache.index_layer.items()}

    @property
    def absorb_bytes(self) -> int:
        """Bytes of W_UK / W_UV the decode step holds (kv_b_proj at its stored precision; the
        model's own tensors, shared, not copies)."""
        return sum(a.nbytes for a in self.kv_b)

    @staticmethod
    def supports(model: MoeTransformer) -> bool:
        """An MLA model on the numba kernels (the cpu backend: fp32 activations, KernelLinear projections)."""
        layers = model.weights.layers
        lins = [x for lw in layers for x in (lw.mla.q_a, lw.mla.q_b, lw.mla.kv_a, lw.o) if x is not None]
        return model.args.mla is not None and model.dtype == torch.float32 and all(
            isinstance(x, KernelLinear) for x in lins)

    def forward(self, token_ids: list[int], positions: list[int], ctx: np.ndarray, ctx_off: np.ndarray,
                new_slots: np.ndarray) -> torch.Tensor:
        """One new token per row (FusedDecoder.forward's contract). Returns final-normed h [T, D] fp32."""
        a, m, cfg = self.args, self.model, self.cfg
        T, D, eps = len(token_ids), a.hidden_size, a.rms_norm_eps
        h = m.weights.embed[token_ids].float().numpy()  # [T, D], a fresh copy we own
        cos, sin = m.rope.cos_sin(torch.tensor(positions), torch.float32)  # [T, dr]
        x = np.empty((T, D), np.float32)
        attn = np.empty((T, cfg.num_heads * cfg.v_head_dim), np.float32)
        slots = torch.from_numpy(new_slots)
        ex = m.experts  # looked up per step: LLM may wrap it (--record-routing)
        banks = ex.banks if type(ex) is KernelExpertExecutor else None
        act = ACTIVATIONS[ex.activation] if banks is not None else 0
        keys = (ctx, ctx_off, self.fp8)  # the keys each token attends to (DSA: its selection)
        for i, lw in enumerate(m.weights.layers):
            kd.rms_rows(h, lw.input_norm.numpy(), eps, x)
            xt = torch.from_numpy(x)
            q_nope, q_rope, c, k_rope, q_resid = mla_project(cfg, lw.mla, xt, cos, sin, eps, resid=True)
            self.cache.write(i, slots, c[:, None], k_rope[:, None])
            if lw.indexer is not None:  # DSA full layer; a shared one keeps the last full layer's keys
                keys = self._select(i, lw.indexer, xt, q_resid, cos, sin, slots, ctx, ctx_off, new_slots)
            ks, vs = (float(self.cache.k_scale[i, 0]), float(self.cache.v_scale[i, 0])) if self.fp8 else (1.0, 1.0)
            c_np, r_np = c.contiguous().numpy(), k_rope.contiguous().numpy()
            mla_decode(q_nope.contiguous().numpy(), q_rope.contiguous().numpy(), self.kv_b[i],
                       self.k[i], self.v[i], ks, vs, self.lut, c_np, r_np, keys[2], keys[0], keys[1],
                       cfg.softmax_scale, attn)
            h += lw.o(torch.from_numpy(attn)).numpy()
            kd.rms_rows(h, lw.post_norm.numpy(), eps, x)
            add_ffn(m, i, lw, x, h, banks, act)
        out = np.empty_like(h)
        kd.rms_rows(h, m.weights.final_norm.numpy(), eps, out)
        return torch.from_numpy(out)


    def _select(self, i: int, w, x: torch.Tensor, q_resid: torch.Tensor, cos, sin, slots: torch.Tensor,
                ctx: np.ndarray, ctx_off: np.ndarray, new_slots: np.ndarray):
        """DSA (layers/dsa.py): write the new tokens' index keys, and return (ctx, ctx_off, exact_last)
        with each token's context cut to its top-k keys in context order (whole where it holds no
        more than index_topk). exact_last (FP8: the last key is the token's own, use its exact
        row) holds only where every token kept its own key last."""
        d = self.args.dsa
        new = index_keys(d, w, x, cos, sin)  # [T, di]
        self.cache.write_index(i, slots, new)
        if ctx_off[-1] - ctx_off[0] <= d.topk:  # no token's context exceeds index_topk: nothing to choose
            return ctx, ctx_off, self.fp8
        q, weights = index_queries(d, w, x, q_resid, cos, sin)
        q_np, w_np = q.contiguous().numpy(), weights.contiguous().numpy()
        parts = []
        for t in range(len(ctx_off) - 1):
            own = ctx[ctx_off[t]:ctx_off[t + 1]]
            if len(own) <= d.topk:
                parts.append(own)
                continue
            scores = np.empty(len(own), np.float32)
            index_scores_kernel(q_np[t], w_np[t], self.index[i], own, d.head_dim ** -0.5, _ONE, scores)
            parts.append(top_slots(scores, own, d.topk))
        off = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([len(p) for p in parts], out=off[1:])
        exact = self.fp8 and all(p[-1] == s for p, s in zip(parts, new_slots))
        return np.ascontiguousarray(np.concatenate(parts)), off, exact


def add_ffn(m: MoeTransformer, i: int, lw, x: np.ndarray, h: np.ndarray, banks, act) -> None:
    """h += layer i's feed-forward of the normed rows x: a dense SwiGLU MLP, or the routed experts
    (straight into h through the fused banks when there are some) plus the shared expert, gated by
    sigmoid(shared_gate(x)) where the checkpoint has that gate (the generic loader reads any
    `shared_expert_gate`). The hybrid decode step runs its own numba form (cpu_decode.add_swiglu)."""
    xt = torch.from_numpy(x)
    if lw.router is None:
        h += swiglu(lw.mlp13, lw.mlp2, xt).numpy()
        return
    ids, wts = m.route(i, xt)
    ids, wts = ids.contiguous(), wts.float().contiguous()
    if banks is not None:
        add_moe_experts(banks[i], x, ids.numpy(), wts.numpy(), h, act)
    else:
        h += m.experts(i, xt, ids, wts).numpy()
    if lw.shared13 is not None:
        shared = swiglu(lw.shared13, lw.shared2, xt)
        if lw.shared_gate is not None:
            shared = torch.sigmoid(lw.shared_gate(xt)) * shared
        h += shared.numpy()
