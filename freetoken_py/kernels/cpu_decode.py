"""Fused decode kernels: one numba call per layer half instead of ~40 torch ops.

A decode step computes one new token for each of T sequences. Outside the weight-streaming
kernels, the torch path spent ~1 ms per layer per step in small ops (norms, rotary, splits, KV
gather, softmax), more than the experts themselves at int4 (docs/kernels.md, "Fused decode").
Here each half of a layer is one call:

    decode_qkv   h -> rms_norm -> qkv GEMV (+bias) -> qk-norm / clip -> rotary           -> qkv [T, (Hq+2Hkv)*hd]
    decode_attn  [write K/V] -> attention over the paged cache, read in place -> o GEMV -> h += ...
                 -> rms_norm -> router GEMV -> softmax top-k                             -> x2, ids, weights

The experts (moe_rows) then add into h directly. Weights use the dense kernels' row dots
(`cpu_linear.dense_rows`, called from jitted code), so every format of `DenseWeight` works;
the KV cache may hold fp32,
bf16 bits (uint16) or FP8 e4m3 bits (uint8, decoded through a 256-entry table times a per-head
scale) — one compiled specialisation per (weight format, KV format).

Semantics match `models/moe_transformer.py` + `layers/attention.py` (tested against them):
rms_norm in fp32, qk_kind 1 = per-head norm (Qwen3), 2 = norm over the whole projection before
clipping (OLMoE), clip < 0 = no clipping, rotate-half rotary, softmax over every expert in fp32,
top-k by value (ties: the lower expert id), optional renormalisation.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from freetoken_py.kernels import _cache  # noqa: F401  (package-wide cache stamp; before any @njit)
from freetoken_py.kernels._simd import exp_shift_sum
from freetoken_py.kernels.cpu_linear import dense_rows

QK_NONE, QK_HEAD, QK_FULL = 0, 1, 2
ROUTE_SOFTMAX, ROUTE_SIGMOID, ROUTE_TOPK = 0, 1, 2  # ModelArgs.router


@njit(fastmath=True, cache=True)
def rms_row(x, w, eps, out):
    """out = x * rsqrt(mean(x^2) + eps) * w, fp32 (F.rms_norm)."""
    ss = np.float32(0.0)
    for d in range(x.shape[0]):
        ss += x[d] * x[d]
    r = np.float32(1.0) / np.sqrt(ss / np.float32(x.shape[0]) + np.float32(eps))
    for d in range(x.shape[0]):
        out[d] = x[d] * r * w[d]


@njit(fastmath=True, cache=True)
def rms_rows(x, w, eps, out):
    """rms_row for every row of x [T, D]."""
    for t in range(x.shape[0]):
        rms_row(x[t], w, eps, out[t])


@njit(fastmath=True, cache=True)
def _rotate(x, cos, sin, tmp):
    """Rotate-half rotary on one head x [hd] in place (tmp [hd] scratch)."""
    half = x.shape[0] // 2
    for i in range(half):
        tmp[i] = x[i] * cos[i] - x[half + i] * sin[i]
        tmp[half + i] = x[half + i] * cos[half + i] + x[i] * sin[half + i]
    for i in range(x.shape[0]):
        x[i] = tmp[i]


@njit(fastmath=True, cache=True)
def _qk_post(row, bias, qn, kn, qk_kind, clip, cos, sin, nq, nkv, hd, eps):
    """Bias, qk-norm, clipping and rotary of one token's fused q|k|v row, in place."""
    if bias.shape[0]:
        for i in range(row.shape[0]):
            row[i] += bias[i]
    q_end, k_end = nq * hd, (nq + nkv) * hd
    if qk_kind == QK_FULL:
        rms_row(row[:q_end], qn, eps, row[:q_end])
        rms_row(row[q_end:k_end], kn, eps, row[q_end:k_end])
    if clip >= 0:
        for i in range(row.shape[0]):
            row[i] = min(max(row[i], -clip), clip)
    rd = cos.shape[0]  # rotary dims: the first rd of each head (partial RoPE), the rest pass through
    tmp = np.empty(rd, np.float32)
    for head in range(nq + nkv):
        x = row[head * hd:(head + 1) * hd]
        if qk_kind == QK_HEAD:
            rms_row(x, qn if head < nq else kn, eps, x)
        _rotate(x[:rd], cos, sin, tmp)


@njit(fastmath=True, cache=True)
def decode_qkv(h, ln_w, eps, w, s, gs, bias, qn, kn, qk_kind, clip, cos, sin, nq, nkv, hd, x, qkv):
    """qkv [T, (nq+2nkv)*hd] of the new tokens from the residual stream h [T, D] (x: [T, D] scratch)."""
    rms_rows(h, ln_w, eps, x)
    dense_rows(w, s, x, gs, qkv)
    for t in range(h.shape[0]):
        _qk_post(qkv[t], bias, qn, kn, qk_kind, clip, cos[t], sin[t], nq, nkv, hd, eps)


@njit(fastmath=True, cache=True)
def decode_gated_qkv(h, ln_w, eps, w, s, gs, qn, kn, cos, sin, nq, nkv, hd, x, proj, qkv, gate):
    """decode_qkv for gated attention (Qwen3-Next / 3.5: q_proj rows per head [query | gate],
    per-head qk-norm, partial rotary): proj [T, 2*(nq+nkv)*hd] scratch for the fused projection ->
    qkv [T, (nq+2nkv)*hd] in decode_attn's layout, gate [T, nq*hd] = sigmoid(gate rows)."""
    rms_rows(h, ln_w, eps, x)
    dense_rows(w, s, x, gs, proj)
    q_out = nq * hd
    none = np.zeros(0, np.float32)
    for t in range(h.shape[0]):
        for head in range(nq):
            src = 2 * head * hd
            for i in range(hd):
                qkv[t, head * hd + i] = proj[t, src + i]
                gate[t, head * hd + i] = np.float32(1.0) / (np.float32(1.0) + np.exp(-proj[t, src + hd + i]))
        for i in range(2 * nkv * hd):
            qkv[t, q_out + i] = proj[t, 2 * q_out + i]
        _qk_post(qkv[t], none, qn, kn, QK_HEAD, -1.0, cos[t], sin[t], nq, nkv, hd, eps)


def kv_widen(v, lut):
    """One stored K/V element as float32 (jitted only): fp32 as is, uint16 = bf16 bits,
    uint8 = FP8 e4m3 bits through the 256-entry table (the per-head scale is applied by the caller)."""
    raise NotImplementedError("kv_widen is only callable from numba-compiled code")


@overload(kv_widen, inline="always")
def _kv_widen_impl(v, lut):
    if v == types.uint16:
        return lambda v, lut: np.uint32(np.uint32(v) << np.uint32(16)).view(np.float32)
    if v == types.uint8:
        return lambda v, lut: lut[v]
    if v == types.float32:
        return lambda v, lut: v
    return None


def kv_narrow(x, like):
    """float32 -> the cache's storage type (jitted only): bf16 round-to-nearest-even (torch's
    rounding, NaN kept quiet), fp32 as is. FP8 caches are written by KVCache.write instead."""
    raise NotImplementedError("kv_narrow is only callable from numba-compiled code")


@overload(kv_narrow, inline="always")
def _kv_narrow_impl(x, like):
    if like == types.uint16:
        def impl(x, like):
            u = np.float32(x).view(np.uint32)
            if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                return np.uint16(0x7FC0)
            return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        return impl
    if like == types.float32:
        return lambda x, like: np.float32(x)
    return None


def _write_kv(qkv, nq, nkv, hd, new_slots, kc, vc):
    """Store the new tokens' K and V rows at their slots (jitted only; fp32 / bf16 caches — an
    FP8 cache is written by KVCache.write, with torch's e4m3 rounding, before decode_attn)."""
    raise NotImplementedError("_write_kv is only callable from numba-compiled code")


@overload(_write_kv, jit_options={"fastmath": True})
def _write_kv_impl(qkv, nq, nkv, hd, new_slots, kc, vc):
    if kc.dtype == types.uint8:
        def refuse(qkv, nq, nkv, hd, new_slots, kc, vc):
            raise ValueError("FP8 caches are written by KVCache.write (pass write_kv=False)")
        return refuse

    def impl(qkv, nq, nkv, hd, new_slots, kc, vc):
        zero = kc[0, 0, 0]
        for t in range(qkv.shape[0]):
            slot = new_slots[t]
            for g in range(nkv):
                k0, v0 = (nq + g) * hd, (nq + nkv + g) * hd
                for i in range(hd):
                    kc[slot, g, i] = kv_narrow(qkv[t, k0 + i], zero)
                    vc[slot, g, i] = kv_narrow(qkv[t, v0 + i], zero)
    return impl


@njit(fastmath=True, cache=True)
def _widen_row(src, lut, scale, out):
    for i in range(out.shape[0]):
        out[i] = kv_widen(src[i], lut) * scale


ATTN_CHUNK = 256     # keys per attention task at most: tasks split the context, not the heads (see _chunk_attention)
ATTN_SPLIT = 8       # a context of 8 * 32 keys or more is split into at least this many tasks ...
ATTN_MIN_CHUNK = 32  # ... of at least this many keys


@njit(cache=True)
def _chunk_size(n):
    """Keys per attention task for a context of n keys: ATTN_CHUNK, or for a short context an even
    split into min(ATTN_SPLIT, ceil(n / ATTN_MIN_CHUNK)) chunks (so ~32 keys each or more). One
    256-key task per short context left every other thread idle: at 256-512 keys the attention
    was ~13% of a 2-thread decode step, run on one thread. A function of n alone, not of the
    thread count or the batch, so results do not change when the thread governor does."""
    chunks = max(1, (n + ATTN_CHUNK - 1) // ATTN_CHUNK, min(ATTN_SPLIT, (n + ATTN_MIN_CHUNK - 1) // ATTN_MIN_CHUNK))
    return (n + chunks - 1) // chunks


@njit(fastmath=True, cache=True)
def _chunk_attention(qkv_t, nq, nkv, hd, ctx, j0, j1, kc, vc, kscale, vscale, lut, exact_last, scale,
                     m_out, l_out, acc_out):
    """Keys j0..j1 of one token's context (slots ctx) for every query head: the partial softmax
    (max m_out [nq], sum l_out [nq]) and the unnormalised P.V acc_out [nq, hd], combined across
    chunks by _combine. A chunk reads each slot's K (then V) rows of all KV heads together — one
    contiguous run per slot — so the cache is streamed once, not once per head."""
    n = ctx.shape[0]
    group = nq // nkv
    scores = np.empty((nq, j1 - j0), np.float32)
    row = np.empty(hd, np.float32)
    for j in range(j0, j1):
        for g in range(nkv):
            if exact_last and j == n - 1:  # FP8: the new token attends to its own exact K (as the torch path)
                row[:] = qkv_t[(nq + g) * hd:(nq + g + 1) * hd]
            else:
                _widen_row(kc[ctx[j], g], lut, kscale[g], row)
            for a in range(group):
                h = g * group + a
                q = qkv_t[h * hd:(h + 1) * hd]
                acc = np.float32(0.0)
                for i in range(hd):
                    acc += q[i] * row[i]
                scores[h, j - j0] = acc * scale
    for h in range(nq):
        m = scores[h].max()
        m_out[h] = m
        l_out[h] = exp_shift_sum(scores[h], m)  # vector exp (docs/kernels.md: numba np.exp is scalar libm)
    acc_out[:] = 0.0
    for j in range(j0, j1):
        for g in range(nkv):
            if exact_last and j == n - 1:
                row[:] = qkv_t[(nq + nkv + g) * hd:(nq + nkv + g + 1) * hd]
            else:
                _widen_row(vc[ctx[j], g], lut, vscale[g], row)
            for a in range(group):
                h = g * group + a
                p = scores[h, j - j0]
                for i in range(hd):
                    acc_out[h, i] += p * row[i]


@njit(fastmath=True, cache=True)
def _combine(m, l, acc, c0, c1, out_t, hd, sinks):
    """Merge chunks c0..c1 of one token: softmax over all keys = rescaled partial sums. sinks [nq]
    (gpt-oss; 0 entries: none): one more logit per head in the denominator, no value."""
    for h in range(m.shape[1]):
        mx = m[c0, h]
        for c in range(c0 + 1, c1):
            mx = max(mx, m[c, h])
        tot = np.float32(0.0)
        if sinks.shape[0]:
            mx = max(mx, sinks[h])
            tot = np.exp(sinks[h] - mx)
        o = out_t[h * hd:(h + 1) * hd]
        o[:] = 0.0
        for c in range(c0, c1):
            w = np.exp(m[c, h] - mx)
            tot += w * l[c, h]
            for i in range(hd):
                o[i] += w * acc[c, h, i]
        for i in range(hd):
            o[i] /= tot


@njit(fastmath=True, cache=True)
def _route(logits, top_k, renorm, ids, wts):
    """Softmax over all experts (fp32), the top_k largest (ties: lower id), optional renormalisation."""
    m = logits.max()
    probs = np.exp(logits - m)
    probs /= probs.sum()
    taken = np.zeros(logits.shape[0], np.bool_)
    tot = np.float32(0.0)
    for j in range(top_k):
        best = -1
        for e in range(logits.shape[0]):
            if not taken[e] and (best < 0 or probs[e] > probs[best]):
                best = e
        taken[best] = True
        ids[j] = best
        wts[j] = probs[best]
        tot += probs[best]
    if renorm:
        for j in range(top_k):
            wts[j] /= tot


@njit(fastmath=True, cache=True)
def _route_topk(logits, bias, top_k, ids, wts):
    """gpt-oss (layers.moe.topk_softmax_route): the top_k of logits + bias (ties: lower id), softmax
    over those k."""
    for e in range(logits.shape[0]):
        logits[e] += bias[e]
    taken = np.zeros(logits.shape[0], np.bool_)
    for j in range(top_k):
        best = -1
        for e in range(logits.shape[0]):
            if not taken[e] and (best < 0 or logits[e] > logits[best]):
                best = e
        taken[best] = True
        ids[j] = best
    m = logits[ids[0]]
    tot = np.float32(0.0)
    for j in range(top_k):
        wts[j] = np.exp(logits[ids[j]] - m)
        tot += wts[j]
    for j in range(top_k):
        wts[j] /= tot


@njit(fastmath=True, cache=True)
def _group_mask(c, n_group, topk_group, allowed):
    """allowed[e] = expert e's group is among the topk_group groups with the largest sum of their
    top-2 choice scores c (ties: the lower group). No infinities: fastmath assumes none."""
    per = c.shape[0] // n_group
    gs = np.empty(n_group, np.float32)
    for g in range(n_group):
        b1, b2 = max(c[g * per], c[g * per + 1]), min(c[g * per], c[g * per + 1])
        for e in range(g * per + 2, (g + 1) * per):
            if c[e] > b1:
                b1, b2 = c[e], b1
            elif c[e] > b2:
                b2 = c[e]
        gs[g] = b1 + b2
    keep = np.zeros(n_group, np.bool_)
    for _ in range(topk_group):
        best = -1
        for g in range(n_group):
            if not keep[g] and (best < 0 or gs[g] > gs[best]):
                best = g
        keep[best] = True
    for e in range(c.shape[0]):
        allowed[e] = keep[e // per]


@njit(fastmath=True, cache=True)
def _route_sigmoid(logits, bias, top_k, n_group, topk_group, renorm, scaling, ids, wts):
    """DeepSeek noaux_tc (layers.moe.sigmoid_group_route): sigmoid scores, bias for the choice
    only, group-limited top-k (ties: the lower id), unbiased weights, renormalised, x scaling."""
    E = logits.shape[0]
    s, c = np.empty(E, np.float32), np.empty(E, np.float32)
    for e in range(E):
        s[e] = np.float32(1.0) / (np.float32(1.0) + np.exp(-logits[e]))
        c[e] = s[e] + bias[e]
    allowed = np.ones(E, np.bool_)
    if n_group > 1:
        _group_mask(c, n_group, topk_group, allowed)
    tot = np.float32(0.0)
    for j in range(top_k):
        best = -1
        for e in range(E):
            if allowed[e] and (best < 0 or c[e] > c[best]):
                best = e
        allowed[best] = False
        ids[j] = best
        wts[j] = s[best]
        tot += s[best]
    for j in range(top_k):
        wts[j] = (wts[j] / (tot + np.float32(1e-20)) if renorm else wts[j]) * np.float32(scaling)


@njit(fastmath=True, cache=True)
def _chunk_plan(ctx_off, T, heads, width):
    """The key chunks of T tokens' contexts (ctx_off [T + 1]): chunks of token t are
    first[t]..first[t + 1], cs[t] keys each, owner[c] the token of chunk c; and per chunk the
    online-softmax scratch m, l [chunks, heads] and acc [chunks, heads, width]."""
    first = np.empty(T + 1, np.int64)
    cs = np.empty(T, np.int64)
    first[0] = 0
    for t in range(T):
        n = ctx_off[t + 1] - ctx_off[t]
        cs[t] = _chunk_size(n)
        first[t + 1] = first[t] + (n + cs[t] - 1) // cs[t]
    owner = np.empty(first[T], np.int64)
    for t in range(T):
        owner[first[t]:first[t + 1]] = t
    m = np.empty((first[T], heads), np.float32)
    l = np.empty((first[T], heads), np.float32)
    acc = np.empty((first[T], heads, width), np.float32)
    return first, cs, owner, m, l, acc


@njit(parallel=True, fastmath=True, cache=True)
def decode_attn(qkv, nq, nkv, hd, write_kv, exact_last, kc, vc, kscale, vscale, lut, new_slots, ctx, ctx_off,
                scale, attn, gate, wo, so, gs, o_bias, h, o_tmp, ln2_w, eps, wr, sr, gsr, x2, logits, top_k, renorm, ids,
                wts, route_kind, rbias, n_group, topk_group, scaling, sinks):
    """Attention of the new tokens over their contexts, times the output gate where gate [T, nq*hd]
    has rows (decode_gated_qkv's; 0 rows: none), then decode_tail (o projection added into h,
    post-norm into x2, routing).

    ctx [sum n_t] / ctx_off [T + 1]: the slots each token attends to (its own slot last);
    kscale / vscale [nkv]: FP8 per-head scales (ones otherwise); attn [T, nq*hd], o_tmp [T, D],
    logits [T, E]: scratch. route_kind: ROUTE_SOFTMAX (top_k, renorm) or ROUTE_SIGMOID (also the
    choice bias rbias [E], n_group / topk_group and the scaling factor).
    """
    if write_kv:
        _write_kv(qkv, nq, nkv, hd, new_slots, kc, vc)
    T = qkv.shape[0]
    first, cs, owner, m, l, acc = _chunk_plan(ctx_off, T, nq, hd)
    for task in prange(first[T]):
        t = owner[task]
        toks = ctx[ctx_off[t]:ctx_off[t + 1]]
        j0 = (task - first[t]) * cs[t]
        _chunk_attention(qkv[t], nq, nkv, hd, toks, j0, min(toks.shape[0], j0 + cs[t]), kc, vc, kscale,
                         vscale, lut, exact_last, scale, m[task], l[task], acc[task])
    for t in range(T):
        _combine(m, l, acc, first[t], first[t + 1], attn[t], hd, sinks)
        if gate.shape[0]:
            for i in range(attn.shape[1]):
                attn[t, i] *= gate[t, i]
    decode_tail(attn, wo, so, gs, o_bias, h, o_tmp, ln2_w, eps, wr, sr, gsr, x2, logits, top_k, renorm, ids, wts,
                route_kind, rbias, n_group, topk_group, scaling)


@njit(fastmath=True, cache=True)
def decode_tail(attn, wo, so, gs, o_bias, h, o_tmp, ln2_w, eps, wr, sr, gsr, x2, logits, top_k, renorm, ids, wts,
                route_kind, rbias, n_group, topk_group, scaling):
    """A layer's mixer output attn [T, W] -> h [T, D] += o projection (+ o_bias); then post-norm into
    x2 and, when wr has rows (router weights, group size gsr), routing into ids / wts [T, k] (a
    dense-MLP layer passes a 0-row router and gets x2 only). o_tmp [T, D], logits [T, E]: scratch."""
    T = attn.shape[0]
    dense_rows(wo, so, attn, gs, o_tmp)
    for t in range(T):
        for d in range(h.shape[1]):
            h[t, d] += o_tmp[t, d] + (o_bias[d] if o_bias.shape[0] else np.float32(0.0))
        rms_row(h[t], ln2_w, eps, x2[t])
    if wr.shape[0]:
        dense_rows(wr, sr, x2, gsr, logits)
        for t in range(T):
            if route_kind == ROUTE_SIGMOID:
                _route_sigmoid(logits[t], rbias, top_k, n_group, topk_group, renorm, scaling, ids[t], wts[t])
            elif route_kind == ROUTE_TOPK:
                _route_topk(logits[t], rbias, top_k, ids[t], wts[t])
            else:
                _route(logits[t], top_k, renorm, ids[t], wts[t])


@njit(fastmath=True, cache=True)
def add_swiglu(x2, w13, s13, gs13, w2, s2, gs2, wg, sg, gsg, gu, act, out, glog, h):
    """h [T, D] += w2(silu(gate) * up) of x2 [T, D] (w13: the gate | up rows, [2I, D]), times
    sigmoid(wg . x2) per token when wg has a row (the Qwen3-Next / 3.5 shared-expert gate; 0 rows:
    ungated, a shared expert or a dense MLP). gu [T, 2I], act [T, I], out [T, D], glog [T, 1]: scratch."""
    dense_rows(w13, s13, x2, gs13, gu)
    inter = act.shape[1]
    for t in range(x2.shape[0]):
        for i in range(inter):
            g = gu[t, i]
            act[t, i] = g / (np.float32(1.0) + np.exp(-g)) * gu[t, inter + i]
    dense_rows(w2, s2, act, gs2, out)
    gated = wg.shape[0] > 0
    if gated:
        dense_rows(wg, sg, x2, gsg, glog)
    for t in range(x2.shape[0]):
        c = np.float32(1.0) / (np.float32(1.0) + np.exp(-glog[t, 0])) if gated else np.float32(1.0)
        for d in range(h.shape[1]):
            h[t, d] += c * out[t, d]


def fp8_table() -> np.ndarray:
    """float32 value of every e4m3fn bit pattern (256 entries; 0x7f / 0xff are NaN)."""
    import torch

    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
