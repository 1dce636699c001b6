"""The cpu backend's decode step for hybrid models (Qwen3-Next, Qwen3.5 / 3.6 MoE: Gated DeltaNet
layers with a per-request recurrent state, every 4th layer gated full attention).

Every layer is a few numba calls over the whole batch, no torch op between them:

    GDN layer        cpu_gdn.gdn_decode    rms_norm -> fused in_proj GEMV -> conv step, delta-rule step and
                                           gated norm of every request (its state slot read and written in place)
                     cpu_decode.decode_tail   out_proj added into h -> post-norm -> router GEMV -> top-k
    attention layer  cpu_decode.decode_gated_qkv   rms_norm -> q|gate|k|v GEMV -> per-head qk-norm,
                                           partial rotary, sigmoid of the query gate
                     cpu_decode.decode_attn   K/V written to the pages, attention over them read in place
                                           (FusedDecoder's kernel), times the gate -> decode_tail
    feed-forward     the routed experts added straight into h (the expert bank's numba kernel), then
                     cpu_decode.add_swiglu: the shared expert times sigmoid(shared_gate . x)

Same math as MoeTransformer.forward with layers/gdn_cpu.py (tests/test_hybrid_models.py runs the cpu
backend, whose decode steps take this path, against transformers; tests/test_fused_hybrid.py each
layer kind against the torch layers).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from freetoken_py.engine.cpu_backend import KernelExpertExecutor
from freetoken_py.engine.fused_decode import _NO_SINKS, _kv_view, _vec, route_args
from freetoken_py.kernels import cpu_decode as kd
from freetoken_py.kernels.cpu_gdn import gdn_decode
from freetoken_py.kernels.cpu_moe import ACTIVATIONS, add_moe_experts
from freetoken_py.kvcache import KVCache
from freetoken_py.layers.gdn_cpu import gdn_params
from freetoken_py.layers.linear import KernelLinear
from freetoken_py.layers.gqa import GqaAttention
from freetoken_py.models.moe_transformer import MoeTransformer

_ONE = np.ones(1, np.float32)


def _w(lin) -> tuple:
    """(w, s, group_size) of a KernelLinear: dense_rows' arguments."""
    return lin.dense.w, lin.dense.s, lin.dense.group_size


def _none(like: tuple) -> tuple:
    """A 0-row weight of like's type: 'absent' without another compiled specialisation."""
    return like[0][:0], like[1][:0], like[2]


@dataclass
class _Layer:
    mixer: tuple  # (w, s, gs): GDN in_proj, or the fused q|gate|k|v projection
    o: tuple
    o_bias: np.ndarray
    router: tuple  # 0 rows for a dense-MLP layer
    router_bias: np.ndarray
    ln1: np.ndarray
    ln2: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    up: tuple  # shared13 (MoE layer) or mlp13 (dense layer); None: no shared expert
    down: tuple
    gate: tuple  # shared_gate [1, D], or 0 rows: ungated
    inter: int  # the shared expert's (dense MLP's) intermediate width


class HybridDecoder:
    def __init__(self, model: MoeTransformer, cache: KVCache, states):
        a = model.args
        self.model, self.cache, self.states, self.args = model, cache, states, a
        self.conv = [None if c is None else c.numpy() for c in states.conv]  # zero-copy views of the pool
        self.rec = [None if r is None else r.numpy() for r in states.rec]
        self.renorm, *self.route = route_args(model)
        layers = model.weights.layers
        routers = [_w(lw.router) for lw in layers if lw.router is not None]
        self.layers = [self._layer(lw, routers[0] if routers else _w(lw.o)) for lw in layers]
        self.kv = {i: model.kv_layer[i] for i, lw in enumerate(layers) if lw.gdn is None}
        self.k = {i: _kv_view(cache.k[j]) for i, j in self.kv.items()}
        self.v = {i: _kv_view(cache.v[j]) for i, j in self.kv.items()}
        self.final_norm = _vec(model.weights.final_norm)
        self.fp8 = cache.quantized
        self.lut = kd.fp8_table() if self.fp8 else _ONE
        ones = np.ones((max(1, model.num_paged_layers), a.num_kv_heads), np.float32)
        # zero-copy views: KVCache calibrates its fp8 scales in place after this is built
        self.k_scale = cache.k_scale.numpy() if self.fp8 else ones
        self.v_scale = cache.v_scale.numpy() if self.fp8 else ones

    @staticmethod
    def supports(model: MoeTransformer) -> bool:
        """A hybrid on the numba kernels (fp32 activations, KernelLinear projections) whose full
        attention is the gated kind of Qwen3-Next / 3.5 (per-head qk-norm, no bias, no clipping)."""
        layers = model.weights.layers
        lins = [x for lw in layers for x in (lw.gdn.in_proj if lw.gdn is not None else lw.qkv, lw.o, lw.router,
                                             lw.shared13, lw.shared2, lw.shared_gate, lw.mlp13, lw.mlp2)
                if x is not None]
        attn = [layer.mixer for layer in model.layers if layer.mixer.paged]
        attn_ok = all(isinstance(m, GqaAttention) and m.output_gate and m.qk_norm == "head" and m.clip is None
                      and not m.bias for m in attn)
        return (model.hybrid and model.dtype == torch.float32 and attn_ok
                and all(isinstance(x, KernelLinear) for x in lins))

    @staticmethod
    def _layer(lw, router_like: tuple) -> _Layer:
        moe = lw.router is not None
        up, down = (lw.shared13, lw.shared2) if moe else (lw.mlp13, lw.mlp2)
        up_w = None if up is None else _w(up)
        gate = _w(lw.shared_gate) if moe and lw.shared_gate is not None and up is not None else (
            None if up_w is None else _none(up_w))
        return _Layer(_w(lw.gdn.in_proj if lw.gdn is not None else lw.qkv), _w(lw.o), _vec(lw.o.bias),
                      _w(lw.router) if moe else _none(router_like), _vec(lw.router_bias),
                      _vec(lw.input_norm), _vec(lw.post_norm),
                      _vec(lw.q_norm) if lw.q_norm is not None else _ONE,
                      _vec(lw.k_norm) if lw.k_norm is not None else _ONE,
                      up_w, None if down is None else _w(down), gate, 0 if down is None else down.dense.in_features)

    def forward(self, token_ids: list[int], positions: list[int], ctx: np.ndarray, ctx_off: np.ndarray,
                new_slots: np.ndarray, state_slots: np.ndarray) -> torch.Tensor:
        """One new token per row (FusedDecoder.forward's contract) and each row's StatePool slot.
        Returns final-normed h [T, D] fp32."""
        a, m, g = self.args, self.model, self.args.gdn
        T, D, eps, k = len(token_ids), a.hidden_size, a.rms_norm_eps, a.top_k
        nq, nkv, hd = a.num_heads, a.num_kv_heads, a.head_dim
        h = m.weights.embed[token_ids].float().numpy()  # [T, D], a fresh copy we own
        cos, sin = m.rope.cos_sin_numpy(positions)  # [T, rotary dims]
        x, x2, o_tmp = (np.empty((T, D), np.float32) for _ in range(3))
        mixed = np.empty((T, g.value_dim), np.float32)
        ids, wts = np.empty((T, k), np.int64), np.empty((T, k), np.float32)
        logits = np.empty((T, max(1, a.num_experts)), np.float32)
        glog = np.empty((T, 1), np.float32)
        slots = np.ascontiguousarray(state_slots, np.int64)
        scratch = {}  # one buffer per use, shared by the layers

        def buf(name, *shape):
            if name not in scratch:
                scratch[name] = np.empty(shape, np.float32)
            return scratch[name]

        ex = m.experts  # looked up per step: LLM may wrap it (--record-routing)
        banks = ex.banks if type(ex) is KernelExpertExecutor else None
        act = ACTIVATIONS[ex.activation] if banks is not None else 0
        renorm = self.renorm
        for i, L in enumerate(self.layers):
            lw = m.weights.layers[i]
            if lw.gdn is not None:
                conv, A_log, dt_bias, norm = gdn_params(lw.gdn)
                gdn_decode(h, L.ln1, eps, *L.mixer, x, buf("proj", T, L.mixer[0].shape[0]), g.conv_dim, g.value_dim,
                           g.num_v_heads, conv, self.conv[i], self.rec[i], slots, A_log, dt_bias, norm, g.eps,
                           g.num_k_heads, g.k_head_dim, mixed)
                kd.decode_tail(mixed, *L.o, L.o_bias, h, o_tmp, L.ln2, eps, *L.router, x2, logits, k, renorm, ids,
                               wts, self.route[0], L.router_bias, *self.route[1:])
            else:
                j = self.kv[i]
                qkv, gate = buf("qkv", T, (nq + 2 * nkv) * hd), buf("gate", T, nq * hd)
                kd.decode_gated_qkv(h, L.ln1, eps, *L.mixer, L.q_norm, L.k_norm, cos, sin, nq, nkv, hd, x,
                                    buf("qproj", T, 2 * (nq + nkv) * hd), qkv, gate)
                if self.fp8:  # KVCache quantises with its fixed per-head scales (torch's e4m3 rounding)
                    kv = torch.from_numpy(qkv)
                    self.cache.write(j, torch.from_numpy(new_slots), kv[:, nq * hd:(nq + nkv) * hd].view(T, nkv, hd),
                                     kv[:, (nq + nkv) * hd:].view(T, nkv, hd))
                kd.decode_attn(qkv, nq, nkv, hd, not self.fp8, self.fp8, self.k[i], self.v[i], self.k_scale[j],
                               self.v_scale[j], self.lut, new_slots, ctx, ctx_off, m.scale, buf("attn", T, nq * hd), gate,
                               *L.o, L.o_bias, h, o_tmp, L.ln2, eps, *L.router, x2, logits, k, renorm, ids, wts,
                               self.route[0], L.router_bias, *self.route[1:], _NO_SINKS)
            if lw.router is not None:
                if banks is not None:
                    add_moe_experts(banks[i], x2, ids, wts, h, act)
                else:
                    h += m.experts(i, torch.from_numpy(x2), torch.from_numpy(ids), torch.from_numpy(wts)).numpy()
            if L.up is not None:  # the shared expert (gated) or the dense MLP
                kd.add_swiglu(x2, *L.up, *L.down, *L.gate, buf(f"gu{L.inter}", T, 2 * L.inter),
                              buf(f"act{L.inter}", T, L.inter), o_tmp, glog, h)
        out = np.empty_like(h)
        kd.rms_rows(h, self.final_norm, eps, out)
        return torch.from_numpy(out)
