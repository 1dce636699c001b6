"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5 / 3.6 MoE) over a per-request state.

Per token (Hk key heads of dk, Hv value heads of dv, Hv a multiple of Hk; conv_dim = 2*Hk*dk + Hv*dv)::

    [q | k | v | z | b | a] = in_proj(x)          (one fused projection, rows in this order)
    [q | k | v] = silu(causal_conv1d([q | k | v]))  depthwise, kernel K, over the request's history
    q, k = l2norm(q), l2norm(k) per head; repeated to the Hv value heads; q *= dk^-0.5
    beta = sigmoid(b),  g = -exp(A_log) * softplus(a + dt_bias)           per value head
    S <- exp(g) S;  S <- S + k (beta (v - k^T S))^T;  o = q^T S             (the delta rule, S [dk, dv])
    out = out_proj(rmsnorm(o) * w_norm * silu(z))                         per value head

The state a request keeps (kvcache/state.py): the last K-1 conv inputs and S per value head.
A prefill runs the delta rule in chunks of 64 tokens (the WY form: one triangular solve per chunk,
then matmuls), a decode step one recurrent update; both continue from the slot's state and leave
the new state there, so chunked prefill, decode and batches are the same operation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from freetoken_py.kvcache.spec import Recurrent

CHUNK = 64


@dataclass(frozen=True)
class GdnConfig:
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    eps: float = 1e-6  # the gated output norm's epsilon (rms_norm_eps)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def proj_rows(self) -> int:
        """Rows of the fused in_proj: q, k, v, z, b, a."""
        return self.conv_dim + self.value_dim + 2 * self.num_v_heads

    @property
    def state_spec(self) -> Recurrent:
        return Recurrent(self.conv_dim, self.conv_kernel - 1, self.num_v_heads, self.k_head_dim, self.v_head_dim)


@dataclass
class GdnWeights:
    """One GDN layer (out_proj stays in LayerWeights.o). in_proj rows: [q | k | v | z | b | a]
    (qwen3_next's per-key-head grouped rows are reordered to this at load time)."""
    in_proj: object  # TorchLinear / KernelLinear [proj_rows, D]
    conv: torch.Tensor  # [conv_dim, K]
    A_log: torch.Tensor  # [Hv] fp32
    dt_bias: torch.Tensor  # [Hv] fp32
    norm: torch.Tensor  # [dv]

    def to(self, device: torch.device, move_linear) -> "GdnWeights":
        return GdnWeights(move_linear(self.in_proj, device), self.conv.to(device), self.A_log.to(device),
                          self.dt_bias.to(device), self.norm.to(device))

    @property
    def nbytes(self) -> int:
        return self.in_proj.nbytes + sum(t.numel() * t.element_size()
                                         for t in (self.conv, self.A_log, self.dt_bias, self.norm))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """x: [n, C] new inputs; weight [C, K]; conv_state [C, K-1] fp32, the previous K-1 inputs
    (updated in place to the last K-1). Returns silu(conv) [n, C] fp32."""
    n, K = x.shape[0], weight.shape[1]
    full = torch.cat([conv_state, x.float().T], dim=1)  # [C, K-1+n]
    out = (full.unfold(1, K, 1) * weight.float()[:, None, :]).sum(-1)  # [C, n]: depthwise, no padding
    conv_state.copy_(full[:, n:])
    return F.silu(out.T)


def _prepare(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """l2-normalised, repeated to the value heads, q scaled: [n, Hv, dk] each (fp32)."""
    q, k = l2norm(q.float()), l2norm(k.float())
    rep = num_v_heads // q.shape[1]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    return q * q.shape[-1] ** -0.5, k


def gdn_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor) -> torch.Tensor:
    """The delta rule for one request. q, k [n, Hk, dk] (after the conv, not normalised), v [n, Hv, dv],
    g, beta [n, Hv] fp32; state [Hv, dk, dv] fp32, updated in place. Returns o [n, Hv, dv] fp32."""
    q, k = _prepare(q, k, v.shape[1])
    v = v.float()
    if q.shape[0] == 1:
        o, new = recurrent_step(q, k, v, g, beta, state[None])
        state.copy_(new[0])
        return o
    outs = []
    for s in range(0, q.shape[0], CHUNK):
        e = s + CHUNK
        outs.append(_chunk(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], state))
    return torch.cat(outs)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B requests: q, k [B, Hv, dk] (prepared), v [B, Hv, dv], g, beta [B, Hv];
    states [B, Hv, dk, dv]. Returns (o [B, Hv, dv], new states)."""
    s = states * g.exp()[..., None, None]
    pred = torch.einsum("bhk,bhkv->bhv", k, s)  # k^T S
    delta = (v - pred) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, s), s


def _chunk(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One chunk of n <= 64 tokens (WY form). q, k [n, H, dk]; v [n, H, dv]; g, beta [n, H];
    state [H, dk, dv] updated in place. Returns o [n, H, dv].

    With G_t = sum_{s<=t} g_s (within the chunk) and S0 the state before it, the per-token updates
    u_t = beta_t (v_t - k_t^T S_{t-1} e^{g_t}) satisfy (I + L) U = beta (V - e^G K S0), where
    L_tj = beta_t (k_t . k_j) e^{G_t - G_j} for j < t; then o_t = e^{G_t} q_t S0 + sum_{j<=t}
    e^{G_t - G_j} (q_t . k_j) u_j and S = e^{G_n} S0 + sum_j e^{G_n - G_j} k_j u_j^T."""
    n = q.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, n, d]
    G = g.T.cumsum(-1)  # [H, n]
    bt = beta.T[..., None]  # [H, n, 1]
    diff = G[:, :, None] - G[:, None, :]  # [H, n, n]: G_t - G_j
    lower = torch.ones(n, n, dtype=torch.bool).tril()
    decay = diff.masked_fill(~lower, float("-inf")).exp()  # e^{G_t - G_j}, j <= t
    kk = kh @ kh.transpose(1, 2)  # [H, n, n]
    L = (bt * kk * decay).tril(-1)
    eye = torch.eye(n)
    rhs = bt * (vh - G.exp()[..., None] * (kh @ state))  # [H, n, dv]
    u = torch.linalg.solve_triangular(eye + L, rhs, upper=False, unitriangular=True)
    o = G.exp()[..., None] * (qh @ state) + ((qh @ kh.transpose(1, 2)) * decay) @ u
    tail = (G[:, -1:] - G).exp()[..., None]  # [H, n, 1]: e^{G_n - G_j}
    state.mul_(G[:, -1].exp()[:, None, None]).add_((kh * tail).transpose(1, 2) @ u)
    return o.transpose(0, 1)


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """rmsnorm(o) * weight * silu(z) per value head, as transformers' RMSNormGated (o, z [n, Hv, dv])."""
    of = o.float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * of.to(dtype) * F.silu(z.float())).to(dtype)


def split_projection(cfg: GdnConfig, proj: torch.Tensor):
    """proj [n, proj_rows] -> mixed qkv [n, conv_dim], z [n, Hv, dv], b [n, Hv], a [n, Hv]."""
    n = proj.shape[0]
    qkv, z, b, a = proj.split([cfg.conv_dim, cfg.value_dim, cfg.num_v_heads, cfg.num_v_heads], dim=-1)
    return qkv, z.reshape(n, cfg.num_v_heads, cfg.v_head_dim), b, a


def decay_and_beta(w: GdnWeights, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b): fp32 [n, Hv]."""
    g = -w.A_log.float().exp() * F.softplus(a.float() + w.dt_bias.float())
    return g, b.sigmoid().float()


def state_segments(meta, i: int) -> list[tuple[slice, int | None]]:
    """The rows of seq i in order, split where its state is captured (meta.state_captures): a
    mixer processes each segment in turn and, after one that names a slot, copies the request's
    state into that slot (a prefix-state snapshot at a page boundary inside the chunk)."""
    s = meta.seqs[i]
    caps = (getattr(meta, "state_captures", None) or {}).get(i, ())
    out, start = [], s.q_start
    for rows, dst in sorted(caps):
        if 0 < rows < s.q_end - s.q_start:
            out.append((slice(start, s.q_start + rows), dst))
            start = s.q_start + rows
    out.append((slice(start, s.q_end), None))
    return out


def gated_deltanet(cfg: GdnConfig, w: GdnWeights, x: torch.Tensor, meta, conv_state: torch.Tensor,
                   rec_state: torch.Tensor) -> torch.Tensor:
    """The whole mixer for a batch. x [T, D] (normed); meta.seqs (q_start, q_end) rows per request,
    meta.state_slots the slot of each; conv_state [S, conv_dim, K-1], rec_state [S, Hv, dk, dv]
    (a StatePool layer's tensors, updated in place). Returns the output before out_proj [T, Hv*dv]."""
    proj = w.in_proj(x)
    qkv, z, b, a = split_projection(cfg, proj)
    g, beta = decay_and_beta(w, a, b)
    kd, Hk, Hv = cfg.key_dim, cfg.num_k_heads, cfg.num_v_heads
    out = torch.empty(x.shape[0], Hv, cfg.v_head_dim, dtype=torch.float32, device=x.device)
    decode = [i for i, s in enumerate(meta.seqs) if s.q_end - s.q_start == 1]
    if len(decode) > 1:  # one token each: a batched conv step and a batched recurrent step
        rows = torch.tensor([meta.seqs[i].q_start for i in decode], device=x.device)
        slots = torch.tensor([meta.state_slots[i] for i in decode], device=x.device)
        full = torch.cat([conv_state[slots], qkv[rows].float()[:, :, None]], dim=2)  # [B, C, K]
        conv_state[slots] = full[:, :, 1:]
        mixed = F.silu((full * w.conv.float()[None]).sum(-1))  # [B, C]
        B = mixed.shape[0]
        q, k, v = mixed.split([kd, kd, cfg.value_dim], dim=-1)
        q, k = _prepare(q.reshape(B, Hk, -1), k.reshape(B, Hk, -1), Hv)
        o, new = recurrent_step(q, k, v.reshape(B, Hv, -1), g[rows], beta[rows], rec_state[slots])
        rec_state[slots] = new
        out[rows] = o
        decode = set(decode)
    else:
        decode = set()
    for i, s in enumerate(meta.seqs):
        if i in decode:
            continue
        slot = meta.state_slots[i]
        for r, dst in state_segments(meta, i):
            mixed = causal_conv(qkv[r], w.conv, conv_state[slot])
            n = mixed.shape[0]
            q, k, v = mixed.split([kd, kd, cfg.value_dim], dim=-1)
            out[r] = gdn_core(q.reshape(n, Hk, -1), k.reshape(n, Hk, -1), v.reshape(n, Hv, -1), g[r], beta[r],
                              rec_state[slot])
            if dst is not None:  # a snapshot of the state after these rows
                conv_state[dst].copy_(conv_state[slot])
                rec_state[dst].copy_(rec_state[slot])
    return gated_norm(out, z, w.norm, cfg.eps, x.dtype).flatten(1)


gated_deltanet.captures = True  # honours meta.state_captures (scheduler/prefix_state.py)


@dataclass(frozen=True)
class GdnMixer:
    """The Gated DeltaNet token mixer (a model file's layer kind, layers/decoder.py): a recurrent
    state per request instead of pages. proj: the checkpoint's input projections, "separate"
    (in_proj_qkv / z / b / a: Qwen3.5) or "grouped" per key head (in_proj_qkvz / ba: Qwen3-Next),
    read as one fused [q | k | v | z | b | a] linear either way."""
    cfg: GdnConfig
    hidden: int
    proj: str = "separate"
    paged = False

    def state_spec(self) -> Recurrent:
        return self.cfg.state_spec

    def shapes(self) -> dict[str, tuple[int, ...]]:
        g, D, p = self.cfg, self.hidden, "linear_attn."
        shapes = {p + "conv1d.weight": (g.conv_dim, 1, g.conv_kernel), p + "dt_bias": (g.num_v_heads,),
                  p + "A_log": (g.num_v_heads,), p + "norm.weight": (g.v_head_dim,),
                  p + "out_proj.weight": (D, g.value_dim)}
        if self.proj == "grouped":
            shapes.update({p + "in_proj_qkvz.weight": (2 * g.key_dim + 2 * g.value_dim, D),
                           p + "in_proj_ba.weight": (2 * g.num_v_heads, D)})
        else:
            shapes.update({p + "in_proj_qkv.weight": (g.conv_dim, D), p + "in_proj_z.weight": (g.value_dim, D),
                           p + "in_proj_b.weight": (g.num_v_heads, D), p + "in_proj_a.weight": (g.num_v_heads, D)})
        return shapes

    def load(self, get, prefix: str) -> dict:
        """The input projections fused (grouped rows per key head [q k v z] and [b a] reordered)."""
        from freetoken_py.layers.linear import TorchLinear

        g, p = self.cfg, prefix + "linear_attn."
        if self.proj == "grouped":
            Hk, dk, dv, r = g.num_k_heads, g.k_head_dim, g.v_head_dim, g.num_v_heads // g.num_k_heads
            q, k, v, z = get(p + "in_proj_qkvz.weight").view(Hk, 2 * dk + 2 * r * dv, -1).split(
                [dk, dk, r * dv, r * dv], dim=1)
            b, a = get(p + "in_proj_ba.weight").view(Hk, 2 * r, -1).split([r, r], dim=1)
            rows = [t.reshape(-1, t.shape[-1]) for t in (q, k, v, z, b, a)]
        else:
            rows = [get(p + f"in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")]
        gdn = GdnWeights(in_proj=TorchLinear(torch.cat(rows).contiguous()), conv=get(p + "conv1d.weight")[:, 0].contiguous(),
                         A_log=get(p + "A_log", torch.float32), dt_bias=get(p + "dt_bias", torch.float32),
                         norm=get(p + "norm.weight"))
        return dict(gdn=gdn, o=TorchLinear(get(p + "out_proj.weight")))

    def held(self, held, prefix: str) -> int:
        return sum(held(prefix + name, name.startswith("linear_attn.in_proj")) for name in self.shapes())

    def forward(self, lw, x: torch.Tensor, ctx, i: int) -> torch.Tensor:
        return lw.o(ctx.gdn(self.cfg, lw.gdn, x, ctx.meta, ctx.states.conv[i], ctx.states.rec[i]))
