"""The Gated DeltaNet mixer on the cpu backend: `layers.gated_deltanet.gated_deltanet`'s contract,
with the conv, the delta rule and the gated norm in one numba call (kernels/cpu_gdn.gdn_core).

The fused input projection runs on the dense kernels (KernelLinear, fp32 out); its rows are split
in place (views, no copies); the decode rows of a batch (one token each) go through one
`gdn_core` call across their state slots, every longer chunk (a prefill) through one call of its
own, continuing from and leaving its slot's conv and recurrent state. Same math as the torch layer
(tests/test_hybrid_models.py runs both backends against transformers; tests/test_cpu_gdn.py the
kernels against transformers' torch functions).
"""
from __future__ import annotations

import numpy as np
import torch

from freetoken_py.kernels.cpu_gdn import gdn_core
from freetoken_py.layers.gated_deltanet import state_segments


def _np(t: torch.Tensor) -> np.ndarray:
    """fp32 contiguous numpy view (a copy only when the tensor is not already that)."""
    return np.ascontiguousarray(t.detach().float().numpy())


def gdn_params(w) -> tuple:
    """(conv [C, K], A_log [Hv], dt_bias [Hv], norm [dv]) fp32 numpy of one GdnWeights, cached on it."""
    p = getattr(w, "_cpu_params", None)
    if p is None:
        p = tuple(_np(t) for t in (w.conv, w.A_log, w.dt_bias, w.norm))
        w._cpu_params = p
    return p


def gdn_rows(cfg, w, proj: np.ndarray, conv_state: np.ndarray, rec_state: np.ndarray, slots: np.ndarray,
             out: np.ndarray) -> None:
    """proj [N, L, proj_rows] fp32 (the in_proj rows of N requests of L tokens each) -> out [N, L, Hv*dv]
    through gdn_core; conv_state / rec_state: the layer's StatePool arrays, rows `slots`."""
    C, Vd, Hv = cfg.conv_dim, cfg.value_dim, cfg.num_v_heads
    conv, A_log, dt_bias, norm = gdn_params(w)
    gdn_core(proj[:, :, :C], proj[:, :, C:C + Vd], proj[:, :, C + Vd:C + Vd + Hv], proj[:, :, C + Vd + Hv:],
             conv, conv_state, rec_state, slots, A_log, dt_bias, norm, cfg.eps, cfg.num_k_heads, cfg.k_head_dim,
             out)


def gated_deltanet_cpu(cfg, w, x: torch.Tensor, meta, conv_state: torch.Tensor,
                       rec_state: torch.Tensor) -> torch.Tensor:
    """gated_deltanet on the numba kernels. x [T, D] fp32 (normed); meta.seqs / meta.state_slots as
    there; conv_state [S, C, K-1], rec_state [S, Hv, dk, dv] fp32 host tensors, updated in place.
    Returns [T, Hv*dv] fp32 (before out_proj)."""
    proj = w.in_proj(x).float().contiguous().numpy()  # [T, proj_rows]
    T = proj.shape[0]
    cs, rs = conv_state.numpy(), rec_state.numpy()  # zero-copy views of the pool
    out = np.empty((T, cfg.value_dim), np.float32)
    decode = [i for i, s in enumerate(meta.seqs) if s.q_end - s.q_start == 1]
    if len(decode) > 1:  # one token each: one call across the slots
        rows = np.array([meta.seqs[i].q_start for i in decode], np.int64)
        slots = np.array([meta.state_slots[i] for i in decode], np.int64)
        o = np.empty((len(rows), 1, cfg.value_dim), np.float32)
        gdn_rows(cfg, w, proj[rows][:, None], cs, rs, slots, o)
        out[rows] = o[:, 0]
    else:
        decode = []
    done = set(decode)
    for i, s in enumerate(meta.seqs):
        if i in done:
            continue
        slot = meta.state_slots[i]
        for r, dst in state_segments(meta, i):
            gdn_rows(cfg, w, proj[None, r], cs, rs, np.array([slot], np.int64), out[None, r])
            if dst is not None:  # a prefix-state snapshot after these rows
                cs[dst], rs[dst] = cs[slot], rs[slot]
    return torch.from_numpy(out)


gated_deltanet_cpu.captures = True  # honours meta.state_captures (scheduler/prefix_state.py)
