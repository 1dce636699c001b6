"""The cpu backend's decode step: each layer in two numba calls plus the experts.

`ModelRunner` uses this when every chunk of a step is one token (decode, or a 1-token prefill
tail) and the model runs on the numba kernels; everything else (prefill, the torch backend, the
residency tiers) takes `MoeTransformer.forward`. Same math (tests/test_fused_decode.py compares
the two), ~40 torch ops per layer fewer: see kernels/cpu_decode.py and docs/kernels.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from freetoken_py.engine.cpu_backend import KernelExpertExecutor
from freetoken_py.kernels import cpu_decode as kd
from freetoken_py.kernels.cpu_moe import ACTIVATIONS, add_moe_experts
from freetoken_py.kvcache import KVCache
from freetoken_py.layers.gqa import GqaAttention
from freetoken_py.layers.linear import KernelLinear
from freetoken_py.layers.moe import SigmoidRouter, TopKRouter
from freetoken_py.models.moe_transformer import MoeTransformer

_EMPTY = np.zeros(0, np.float32)
_ONE = np.ones(1, np.float32)
_NO_GATE = np.zeros((0, 0), np.float32)  # decode_attn's output gate: none
_NO_SINKS = np.zeros(0, np.float32)  # decode_attn's attention sinks: none


def _vec(t) -> np.ndarray:
    return _EMPTY if t is None else np.ascontiguousarray(t.detach().float().numpy())


def _kv_view(t: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view of one layer's cache [S, Hkv, hd]: fp32, bf16 as uint16 bits, fp8 as uint8."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


@dataclass
class _Layer:
    qkv: tuple  # (w, s, group_size) of the fused q|k|v projection
    qkv_bias: np.ndarray
    o: tuple
    o_bias: np.ndarray
    router: tuple  # (w, s, group_size); 0 rows for a dense-MLP layer
    ln1: np.ndarray
    ln2: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    router_bias: np.ndarray  # [E] sigmoid routers' choice bias, the top-k router's logit bias; empty otherwise
    sinks: np.ndarray  # [nq] attention sinks (gpt-oss); empty otherwise
    window: bool  # attends over the windowed contexts (a model mixing windowed and full layers)


class FusedDecoder:
    def __init__(self, model: MoeTransformer, cache: KVCache):
        a = model.args
        self.model, self.cache, self.args = model, cache, a
        attn = model.layers[0].mixer   # GQA on every layer, one qk-norm kind and clip (supports)
        self.qk_kind = {"none": kd.QK_NONE, "head": kd.QK_HEAD, "full": kd.QK_FULL}[attn.qk_norm]
        self.clip = float(attn.clip) if attn.clip is not None else -1.0  # < 0: no clipping
        self.renorm, *self.route = route_args(model)
        routers = [lw.router.dense for lw in model.weights.layers if lw.router is not None]
        self.layers = [self._layer(lw, routers[0] if routers else lw.o.dense, layer.mixer.window is not None)
                       for layer, lw in zip(model.layers, model.weights.layers)]
        self.final_norm = _vec(model.weights.final_norm)
        self.k = [_kv_view(cache.k[i]) for i in range(a.num_layers)]
        self.v = [_kv_view(cache.v[i]) for i in range(a.num_layers)]
        self.fp8 = cache.quantized
        self.lut = kd.fp8_table() if self.fp8 else _ONE
        ones = np.ones((a.num_layers, a.num_kv_heads), np.float32)
        # zero-copy views: KVCache calibrates its fp8 scales in place after this is built
        self.k_scale = cache.k_scale.numpy() if self.fp8 else ones
        self.v_scale = cache.v_scale.numpy() if self.fp8 else ones

    @staticmethod
    def supports(model: MoeTransformer) -> bool:
        """Every projection on the numba kernels (the cpu backend): attention in one format and
        group size, the routers in one format (one compiled specialisation per step)."""
        mixers = [layer.mixer for layer in model.layers]
        if not all(isinstance(m, GqaAttention) for m in mixers) or len({(m.qk_norm, m.clip) for m in mixers}) > 1:
            return False
        layers = model.weights.layers
        attn = [lin for lw in layers for lin in (lw.qkv, lw.o)]
        routers = [lw.router for lw in layers if lw.router is not None]
        if model.dtype != torch.float32 or not all(isinstance(x, KernelLinear) for x in attn + routers):
            return False
        return (len({(x.dense.fmt, x.dense.group_size) for x in attn}) == 1
                and len({x.dense.fmt for x in routers}) <= 1)

    @staticmethod
    def _layer(lw, router_like, window: bool = False) -> _Layer:
        w = lambda lin: (lin.dense.w, lin.dense.s, lin.dense.group_size)  # noqa: E731
        r = router_like  # a dense-MLP layer gets a 0-row router of the routers' type (no extra specialisation)
        router = (r.w[:0], r.s[:0], r.group_size) if lw.router is None else w(lw.router)
        return _Layer(w(lw.qkv), _vec(lw.qkv.bias), w(lw.o), _vec(lw.o.bias), router,
                      _vec(lw.input_norm), _vec(lw.post_norm),
                      _vec(lw.q_norm) if lw.q_norm is not None else _ONE,
                      _vec(lw.k_norm) if lw.k_norm is not None else _ONE,
                      _vec(lw.router_bias if lw.router_bias is not None else getattr(lw.router, "bias", None)),
                      _vec(lw.sinks) if lw.sinks is not None else _NO_SINKS, window)

    def forward(self, token_ids: list[int], positions: list[int], ctx: np.ndarray, ctx_off: np.ndarray,
                new_slots: np.ndarray, windowed: tuple | None = None) -> torch.Tensor:
        """One new token per row: ctx / ctx_off are each row's key slots (its own slot last);
        windowed: (ctx, ctx_off, new_slots) in the windowed layers' own pages, for those layers of a
        model mixing them (kvcache/window.py).
        Returns final-normed hidden states [T, D] (fp32)."""
        a, m = self.args, self.model
        T, D = len(token_ids), a.hidden_size
        nq, nkv, hd = a.num_heads, a.num_kv_heads, a.head_dim
        h = m.weights.embed[token_ids].float().numpy()  # [T, D], a fresh copy we own
        cos, sin = m.rope.cos_sin_numpy(positions)  # [T, hd] float32
        x = np.empty((T, D), np.float32)
        qkv = np.empty((T, (nq + 2 * nkv) * hd), np.float32)
        attn, o_tmp = np.empty((T, nq * hd), np.float32), np.empty((T, D), np.float32)
        x2 = np.empty((T, D), np.float32)
        k = a.top_k
        ids, wts = np.empty((T, k), np.int64), np.empty((T, k), np.float32)
        logits = np.empty((T, a.num_experts), np.float32)
        eps = a.rms_norm_eps
        ex = m.experts  # looked up per step: LLM may wrap it (--record-routing) after this was built
        banks = ex.banks if type(ex) is KernelExpertExecutor else None  # wrapped: the generic call
        act = ACTIVATIONS[ex.activation] if banks is not None else 0
        for i, L in enumerate(self.layers):
            kd.decode_qkv(h, L.ln1, eps, *L.qkv, L.qkv_bias, L.q_norm, L.k_norm, self.qk_kind, self.clip,
                          cos, sin, nq, nkv, hd, x, qkv)
            # a windowed layer (of a model mixing them) writes and reads its own pages (kvcache/window.py)
            lctx, loff, lnew = windowed if L.window else (ctx, ctx_off, new_slots)
            if self.fp8:  # KVCache quantises with its fixed per-head scales (torch's e4m3 rounding)
                kv = torch.from_numpy(qkv)
                self.cache.write(i, torch.from_numpy(lnew), kv[:, nq * hd:(nq + nkv) * hd].view(T, nkv, hd),
                                 kv[:, (nq + nkv) * hd:].view(T, nkv, hd))
            kd.decode_attn(qkv, nq, nkv, hd, not self.fp8, self.fp8, self.k[i], self.v[i], self.k_scale[i],
                           self.v_scale[i], self.lut, lnew, lctx, loff, m.scale,
                           attn, _NO_GATE, *L.o, L.o_bias, h, o_tmp, L.ln2, eps, *L.router, x2, logits, k,
                           self.renorm, ids, wts, self.route[0], L.router_bias, *self.route[1:], L.sinks)
            lw = m.weights.layers[i]
            if lw.router is None:  # dense MLP layer
                _add_swiglu(lw.mlp13, lw.mlp2, x2, h)
                continue
            if banks is not None:
                add_moe_experts(banks[i], x2, ids, wts, h, act)
            else:
                h += m.experts(i, torch.from_numpy(x2), torch.from_numpy(ids), torch.from_numpy(wts)).numpy()
            if lw.shared13 is not None:  # the shared expert: dense work, not the executor's
                _add_swiglu(lw.shared13, lw.shared2, x2, h)
        out = np.empty_like(h)
        kd.rms_rows(h, self.final_norm, eps, out)
        return torch.from_numpy(out)


def route_args(model: MoeTransformer) -> tuple[bool, int, int, int, float]:
    """The decode kernels' router arguments from the model's router kind (one per model):
    (renormalise, kind, n_group, topk_group, scaling); a model without MoE layers: softmax's."""
    router = next((layer.ffn.router for layer in model.layers if layer.sparse), None)
    if isinstance(router, SigmoidRouter):
        return router.renormalize, kd.ROUTE_SIGMOID, router.n_group, router.topk_group, float(router.scaling)
    if isinstance(router, TopKRouter):   # softmax over the k chosen logits: their weights sum to one
        return True, kd.ROUTE_TOPK, 1, 1, 1.0
    return router is not None and router.renormalize, kd.ROUTE_SOFTMAX, 1, 1, 1.0


def _add_swiglu(w13, w2, x2: np.ndarray, h: np.ndarray) -> None:
    """h += w2(silu(gate) * up) of x2 [T, D] (a dense MLP layer or a shared expert; KernelLinears)."""
    gate, up = w13(torch.from_numpy(x2)).chunk(2, dim=-1)
    h += w2(torch.nn.functional.silu(gate) * up).numpy()


def decode_slots(cache: KVCache, page_table: list[int], start: int, window: int | None) -> np.ndarray:
    """Key slots of a token at position `start` (itself last), sliding window applied."""
    lo = 0 if window is None else max(0, start - window + 1)
    pos = np.arange(lo, start + 1)
    pages = np.asarray(page_table, np.int64)
    return pages[pos // cache.page_size] * cache.page_size + pos % cache.page_size
