"""Gated DeltaNet (Qwen3-Next, Qwen3.5 / 3.6 MoE linear-attention layers) on the CPU, in numba.

One layer's core, after the input projections and before ``out_proj`` (FAMILIES.md §9-10), for N
requests of L new tokens each (decode: N requests x 1 token; prefill: 1 request x L tokens)::

    x      = silu(causal depthwise conv1d over [conv state | qkv])    conv_dim = 2*Hk*dk + Hv*dv
    q, k   = l2norm(x[q]), l2norm(x[k]) per k-head (eps 1e-6); q *= dk^-0.5; k-head h // (Hv/Hk)
    beta   = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)              per v-head scalars
    S      = S * exp(g);  u = beta * (v - S^T k);  S += k u^T;  o = S^T q      S [dk, dv] fp32
    out    = rmsnorm(o) * norm.weight * silu(z)                                per v-head row [dv]

(transformers' ``torch_recurrent_gated_delta_rule`` order; ``torch_chunk_gated_delta_rule`` is the
same recurrence in the WY/UT chunk form). Prefill runs the recurrence token by token too (a
blocked recurrent form: the state of a head, 64 KiB at dk = dv = 128, stays in L2 over the
chunk): per token and head it costs ~4*dk*dv flops, the chunk form's count is the same
(3*64*dk + 3*dk*dv per token at chunk 64), and its advantage is only matrix-multiply
throughput, which numba loops over contiguous dv rows already get from the vectoriser.

States are read and written in place: ``conv_state [P, C, W]`` (the last W >= K-1 conv inputs,
oldest first, transformers' layout when W = K) and ``rec_state [P, Hv, dk, dv]`` fp32, row
``slots[n]`` for request n. Parallel over (request, channel block) for the conv and over
(request, v-head) for the recurrence. References: transformers' torch functions
(tests/test_cpu_gdn.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from freetoken_py.kernels import _cache  # noqa: F401  (package-wide cache stamp; before any @njit)
from freetoken_py.kernels.cpu_decode import rms_rows
from freetoken_py.kernels.cpu_linear import dense_rows

_CONV_BLOCK = 512  # channels per conv task


@njit(fastmath=True, cache=True, inline="always")
def _silu(x):
    return x / (np.float32(1.0) + np.exp(-x))


@njit(fastmath=True, cache=True, inline="always")
def _softplus(x):
    return x if x > np.float32(20.0) else np.log1p(np.exp(x))  # torch's threshold 20


@njit(fastmath=True, cache=True)
def _conv_block(x, w, state, slots, out, task, nb):
    """Channels of block task % nb of request task // nb (conv1d_update's work item)."""
    L, C = x.shape[1], x.shape[2]
    K, W = w.shape[1], state.shape[2]
    n, blk = task // nb, task % nb
    st = state[slots[n]]
    ext = np.empty(W + L, np.float32)
    for c in range(blk * _CONV_BLOCK, min(C, (blk + 1) * _CONV_BLOCK)):
        for j in range(W):
            ext[j] = st[c, j]
        for t in range(L):
            ext[W + t] = x[n, t, c]
        for t in range(L):
            acc = np.float32(0.0)
            base = W + t - K + 1
            for j in range(K):
                acc += w[c, j] * ext[base + j]
            out[n, t, c] = _silu(acc)
        for j in range(W):
            st[c, j] = ext[L + j]


@njit(parallel=True, fastmath=True, cache=True)
def conv1d_update(x, w, state, slots, out):
    """x [N, L, C] (pre-conv), w [C, K], state [P, C, W] (W >= K - 1) -> out [N, L, C] = silu(conv),
    causal over [state | x]; each state row then holds the last W inputs."""
    nb = (x.shape[2] + _CONV_BLOCK - 1) // _CONV_BLOCK
    for task in prange(x.shape[0] * nb):
        _conv_block(x, w, state, slots, out, task, nb)


@njit(fastmath=True, cache=True)
def _l2n(src, scale, dst):
    ss = np.float32(0.0)
    for i in range(src.shape[0]):
        ss += src[i] * src[i]
    r = scale / np.sqrt(ss + np.float32(1e-6))
    for i in range(src.shape[0]):
        dst[i] = src[i] * r


@njit(fastmath=True, cache=True)
def _step(S, qn, kn, v, beta, eg, mem, o):
    """One token of the gated delta rule on one head: S [dk, dv] in place, o [dv] = S^T q."""
    dk, dv = S.shape
    mem[:] = 0.0
    for i in range(dk):
        ki = kn[i]
        for j in range(dv):
            mem[j] += S[i, j] * ki
    for j in range(dv):
        mem[j] = (v[j] - eg * mem[j]) * beta  # the delta u
    o[:] = 0.0
    for i in range(dk):
        ki, qi = kn[i], qn[i]
        for j in range(dv):
            s = S[i, j] * eg + ki * mem[j]
            S[i, j] = s
            o[j] += s * qi


@njit(fastmath=True, cache=True)
def _gated_norm(o, z, w, eps, out):
    """out = o * rsqrt(mean(o^2) + eps) * w * silu(z) (RMSNormGated, fp32)."""
    ss = np.float32(0.0)
    for j in range(o.shape[0]):
        ss += o[j] * o[j]
    r = np.float32(1.0) / np.sqrt(ss / np.float32(o.shape[0]) + np.float32(eps))
    for j in range(o.shape[0]):
        out[j] = o[j] * r * w[j] * _silu(z[j])


@njit(parallel=True, fastmath=True, cache=True)
def delta_rule(q, k, v, g, beta, state, slots, out):
    """q, k [N, L, Hk, dk], v [N, L, Hv, dv], g (log decay), beta [N, L, Hv]; state [P, Hv, dk, dv]
    in place -> out [N, L, Hv, dv]. l2norm on q, k and the dk^-0.5 query scale inside
    (transformers' use_qk_l2norm_in_kernel=True)."""
    N, L, Hk, dk = q.shape
    Hv, dv = v.shape[2], v.shape[3]
    rep = Hv // Hk
    scale = np.float32(1.0 / np.sqrt(dk))
    for task in prange(N * Hv):
        n, h = task // Hv, task % Hv
        S = state[slots[n], h]
        qn, kn = np.empty(dk, np.float32), np.empty(dk, np.float32)
        mem = np.empty(dv, np.float32)
        for t in range(L):
            _l2n(q[n, t, h // rep], scale, qn)
            _l2n(k[n, t, h // rep], np.float32(1.0), kn)
            _step(S, qn, kn, v[n, t, h], beta[n, t, h], np.exp(g[n, t, h]), mem, out[n, t, h])


@njit(parallel=True, fastmath=True, cache=True)
def gated_rmsnorm(x, z, w, eps, out):
    """x, z [R, dv] -> out [R, dv] = rmsnorm(x) * w * silu(z)."""
    for r in prange(x.shape[0]):
        _gated_norm(x[r], z[r], w, eps, out[r])


@njit(parallel=True, fastmath=True, cache=True)
def gdn_core(qkv, z, b, a, conv_w, conv_state, rec_state, slots, A_log, dt_bias, norm_w, eps, Hk, dk, out):
    """The whole core in one call: qkv [N, L, C] (pre-conv, C = 2*Hk*dk + Hv*dv), z [N, L, Hv*dv],
    b, a [N, L, Hv] (raw projections); conv_w [C, K]; conv_state [P, C, W], rec_state [P, Hv, dk, dv]
    (rows slots[n], updated in place); A_log, dt_bias [Hv], norm_w [dv] fp32 -> out [N, L, Hv*dv]
    (the gated-norm output, ready for out_proj)."""
    N, L, C = qkv.shape
    Hv, dv = rec_state.shape[1], rec_state.shape[3]
    rep = Hv // Hk
    xc = np.empty((N, L, C), np.float32)
    nb = (C + _CONV_BLOCK - 1) // _CONV_BLOCK
    for task in prange(N * nb):
        _conv_block(qkv, conv_w, conv_state, slots, xc, task, nb)
    scale = np.float32(1.0 / np.sqrt(dk))
    k0, v0 = Hk * dk, 2 * Hk * dk
    for task in prange(N * Hv):
        n, h = task // Hv, task % Hv
        S = rec_state[slots[n], h]
        kh = h // rep
        qn, kn = np.empty(dk, np.float32), np.empty(dk, np.float32)
        mem, o = np.empty(dv, np.float32), np.empty(dv, np.float32)
        decay = -np.exp(A_log[h])
        for t in range(L):
            row = xc[n, t]
            _l2n(row[kh * dk:(kh + 1) * dk], scale, qn)
            _l2n(row[k0 + kh * dk:k0 + (kh + 1) * dk], np.float32(1.0), kn)
            bt = np.float32(1.0) / (np.float32(1.0) + np.exp(-b[n, t, h]))
            eg = np.exp(decay * _softplus(a[n, t, h] + dt_bias[h]))
            _step(S, qn, kn, row[v0 + h * dv:v0 + (h + 1) * dv], bt, eg, mem, o)
            _gated_norm(o, z[n, t, h * dv:(h + 1) * dv], norm_w, eps, out[n, t, h * dv:(h + 1) * dv])


@njit(fastmath=True, cache=True)
def gdn_decode(h, ln_w, eps, w, s, gs, x, proj, C, Vd, Hv, conv_w, conv_state, rec_state, slots, A_log, dt_bias,
               norm_w, geps, Hk, dk, out):
    """One decode token of each of N requests through a GDN layer up to out_proj, in one call:
    x = rms_norm(h [N, D]) (x: scratch), proj [N, rows] = the fused in_proj (w, s, gs: a DenseWeight's
    arrays), then gdn_core over their state slots -> out [N, Hv*dv]."""
    N = h.shape[0]
    rms_rows(h, ln_w, eps, x)
    dense_rows(w, s, x, gs, proj)
    p = proj.reshape((N, 1, proj.shape[1]))
    gdn_core(p[:, :, :C], p[:, :, C:C + Vd], p[:, :, C + Vd:C + Vd + Hv], p[:, :, C + Vd + Hv:], conv_w, conv_state,
             rec_state, slots, A_log, dt_bias, norm_w, geps, Hk, dk, out.reshape((N, 1, out.shape[1])))
