"""Absorbed MLA decode attention over the paged latent cache, read in place (numba).

For each new token t and head h (R = kv_lora_rank, dr = rope dims, dv = v_head_dim)::

    q_lat[h]   = W_UK[h]^T q_nope[h]                          [R]
    score[h,j] = (q_lat[h] . c_j + q_rope[h] . k_rope_j) * scale
    o_lat[h]   = softmax_j(score[h]) . c                      [R]
    out[h]     = W_UV[h] o_lat[h]                             [dv]

W_UK and W_UV are read in place from kv_b_proj's weight viewed as [H, dn + dv, R] (rows 0..dn of a
head are W_UK[h], the next dv rows W_UV[h]), at its stored precision: fp32, or bf16 bits (uint16)
widened per element, so no fp32 copy of them is kept (2 bytes per element for a bf16 checkpoint,
not 4 + 4 for a widened kv_b plus split copies).

The context is split into key chunks (cpu_decode._chunk_size, a function of its length alone);
each chunk widens its latent rows once for every head (the cache is streamed once, not once per
head) and keeps a partial softmax (max, sum, unnormalised o_lat), merged per token afterwards.
Cache rows may be fp32, bf16 bits (uint16) or FP8 e4m3 bits (uint8, a 256-entry table times the
layer's scale). Reference: layers.mla.absorbed_decode (tests/test_mla_kernel.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from freetoken_py.kernels import _cache  # noqa: F401  (package-wide cache stamp; before any @njit)
from freetoken_py.kernels.cpu_decode import _chunk_plan, kv_widen


@njit(fastmath=True, cache=True)
def _row(src, lut, scale, out):
    for i in range(out.shape[0]):
        out[i] = kv_widen(src[i], lut) * scale


@njit(fastmath=True, cache=True)
def _chunk(q_lat, q_rope, kc, vc, kscale, vscale, lut, exact_c, exact_r, exact_last, toks, j0, j1, scale,
           m_out, l_out, acc_out):
    """Keys j0..j1 of one token (slots toks) for every head: partial max m_out [H], sum l_out [H],
    unnormalised latent acc_out [H, R]."""
    H, R, dr, n = q_lat.shape[0], q_lat.shape[1], q_rope.shape[1], toks.shape[0]
    rows = np.empty((j1 - j0, R), np.float32)
    rope = np.empty(dr, np.float32)
    scores = np.empty((H, j1 - j0), np.float32)
    for j in range(j0, j1):
        c = rows[j - j0]
        if exact_last and j == n - 1:  # FP8: the new token attends to its own exact latent
            c[:] = exact_c
            rope[:] = exact_r
        else:
            _row(kc[toks[j], 0], lut, kscale, c)
            _row(vc[toks[j], 0], lut, vscale, rope)
        for h in range(H):
            acc = np.float32(0.0)
            for r in range(R):
                acc += q_lat[h, r] * c[r]
            for r in range(dr):
                acc += q_rope[h, r] * rope[r]
            scores[h, j - j0] = acc * scale
    for h in range(H):
        m = scores[h].max()
        tot = np.float32(0.0)
        for j in range(j1 - j0):
            p = np.exp(scores[h, j] - m)
            scores[h, j] = p
            tot += p
        m_out[h], l_out[h] = m, tot
        acc_out[h, :] = 0.0
        for j in range(j1 - j0):
            p = scores[h, j]
            for r in range(R):
                acc_out[h, r] += p * rows[j, r]


@njit(parallel=True, fastmath=True, cache=True)
def mla_decode(q_nope, q_rope, kv_b, kc, vc, kscale, vscale, lut, exact_c, exact_r, exact_last,
               ctx, ctx_off, scale, out):
    """q_nope [T, H, dn], q_rope [T, H, dr] (roped), fp32; kv_b [H, dn + dv, R] (W_UK | W_UV per
    head: kv_b_proj's weight viewed per head), fp32 or bf16 bits (uint16);
    kc [S, 1, R] / vc [S, 1, dr]: one layer's latent / rope-key cache; kscale, vscale: FP8 scales
    (1 otherwise); exact_c [T, R], exact_r [T, dr]: the new tokens' own rows (used when exact_last);
    ctx [sum n_t] / ctx_off [T + 1]: each token's key slots, its own last. out [T, H*dv]."""
    T, H, dn = q_nope.shape
    R, dv = kv_b.shape[2], kv_b.shape[1] - dn
    q_lat = np.zeros((T, H, R), np.float32)
    for task in prange(T * H):
        t, h = task // H, task % H
        for d in range(dn):
            qd = q_nope[t, h, d]
            for r in range(R):
                q_lat[t, h, r] += qd * kv_widen(kv_b[h, d, r], lut)
    first, cs, owner, m, l, acc = _chunk_plan(ctx_off, T, H, R)
    for task in prange(first[T]):
        t = owner[task]
        toks = ctx[ctx_off[t]:ctx_off[t + 1]]
        j0 = (task - first[t]) * cs[t]
        _chunk(q_lat[t], q_rope[t], kc, vc, kscale, vscale, lut, exact_c[t], exact_r[t], exact_last, toks, j0,
               min(toks.shape[0], j0 + cs[t]), scale, m[task], l[task], acc[task])
    for task in prange(T * H):
        t, h = task // H, task % H
        mx = m[first[t], h]
        for c in range(first[t] + 1, first[t + 1]):
            mx = max(mx, m[c, h])
        o_lat = np.zeros(R, np.float32)
        tot = np.float32(0.0)
        for c in range(first[t], first[t + 1]):
            w = np.exp(m[c, h] - mx)
            tot += w * l[c, h]
            for r in range(R):
                o_lat[r] += w * acc[c, h, r]
        for v in range(dv):
            s = np.float32(0.0)
            for r in range(R):
                s += kv_widen(kv_b[h, dn + v, r], lut) * o_lat[r]
            out[t, h * dv + v] = s / tot


@njit(parallel=True, fastmath=True, cache=True)
def index_scores(q, w, keys, slots, scale, lut, out):
    """DSA's lightning-indexer scores of one query over its cached index keys, read in place
    (layers/dsa.index_scores is the reference): out[j] = sum_h w[h] * relu(q[h] . k_j * scale).
    q [Hi, di] fp32 (roped); w [Hi] fp32 (Hi^-0.5 folded in); keys [S, 1, di]: one layer's index
    rows, fp32 or bf16 bits (uint16); slots [n]: the context's slots; out [n] fp32. Keys are
    streamed once, in blocks of 256 per task, each widened once for every head."""
    Hi, di = q.shape
    n = slots.shape[0]
    for b in prange((n + 255) // 256):
        k = np.empty(di, np.float32)
        for j in range(b * 256, min(n, b * 256 + 256)):
            row = keys[slots[j], 0]
            for d in range(di):
                k[d] = kv_widen(row[d], lut)
            s = np.float32(0.0)
            for h in range(Hi):
                acc = np.float32(0.0)
                for d in range(di):
                    acc += q[h, d] * k[d]
                acc *= scale
                if acc > 0:
                    s += w[h] * acc
            out[j] = s


def top_slots(scores: np.ndarray, slots: np.ndarray, k: int) -> np.ndarray:
    """The slots of the k highest scores, in context order (a partial sort: O(n), not O(n log n))."""
    keep = np.argpartition(scores, len(scores) - k)[len(scores) - k:]
    keep.sort()
    return slots[keep]
