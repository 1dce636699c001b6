"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2.x, GLM-4.7-Flash) over a latent cache.

Per token (R = kv_lora_rank, dn / dr = nope / rope head dims, dv = v_head_dim, H heads)::

    q            = q_b(rms(q_a(x)))  or  q_proj(x)            [H, dn + dr]   -> q_nope [H, dn], q_rope [H, dr]
    [c | k_rope] = kv_a_proj_with_mqa(x);  c = rms(c)          [R], [dr]      (k_rope shared by every head)
    rope on q_rope, k_rope only (interleaved pairs or half-split)
    cache        <- (c, k_rope)                                R + dr values per token per layer
    kv_b(c)      = per head [k_nope | v]                       W_UK [H, dn, R], W_UV [H, dv, R]

Prefill expands the cached latents through kv_b and attends as ordinary attention. Decode runs
absorbed: q_lat[h] = W_UK[h]^T q_nope[h] (R wide), score = (q_lat . c_t + q_rope . k_rope_t) * scale,
o_lat[h] = sum_t p_t c_t, o[h] = W_UV[h] o_lat[h] — it never expands a cached token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from freetoken_py.kvcache import KVCache, PagedLatent
from freetoken_py.layers.norm import rms_norm
from freetoken_py.layers.rotary import RotaryEmbedding, apply_rotary


@dataclass(frozen=True)
class YarnParams:
    """rope_type yarn (transformers' _compute_yarn_parameters): the frequency blend and the cos/sin factor."""
    factor: float
    original_max: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class MlaConfig:
    num_heads: int
    q_lora_rank: int | None  # None: one q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # pairs (x0, x1), (x2, x3) ... (DeepSeek's default) vs rotate-half
    softmax_scale: float  # qk_head_dim^-0.5, times mscale^2 under YaRN
    rope_theta: float = 10000.0
    yarn: YarnParams | None = None
    bias: bool = False  # attention_bias: biases on q_a_proj, kv_a_proj_with_mqa and o_proj

    def rotary(self) -> RotaryEmbedding:
        """The rope dims' cos/sin table (YaRN-blended when configured)."""
        if self.yarn is None:
            return RotaryEmbedding(self.qk_rope_head_dim, self.rope_theta)
        y = self.yarn
        return YarnRotary(self.qk_rope_head_dim, self.rope_theta, y.factor, y.original_max, y.beta_fast,
                          y.beta_slow, y.attention_factor, y.truncate)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def state_spec(self) -> PagedLatent:
        return PagedLatent(self.kv_lora_rank, self.qk_rope_head_dim)

    def tensor_shapes(self, hidden: int) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensors under a layer's `self_attn.` (o_proj included)."""
        H, R = self.num_heads, self.kv_lora_rank
        s = {"kv_a_proj_with_mqa.weight": (R + self.qk_rope_head_dim, hidden), "kv_a_layernorm.weight": (R,),
             "kv_b_proj.weight": (H * (self.qk_nope_head_dim + self.v_head_dim), R),
             "o_proj.weight": (hidden, H * self.v_head_dim)}
        if self.q_lora_rank is None:
            s["q_proj.weight"] = (H * self.qk_head_dim, hidden)
        else:
            s.update({"q_a_proj.weight": (self.q_lora_rank, hidden), "q_a_layernorm.weight": (self.q_lora_rank,),
                      "q_b_proj.weight": (H * self.qk_head_dim, self.q_lora_rank)})
        if self.bias:
            s.update({"kv_a_proj_with_mqa.bias": (R + self.qk_rope_head_dim,), "o_proj.bias": (hidden,)})
            if self.q_lora_rank is not None:
                s["q_a_proj.bias"] = (self.q_lora_rank,)
        return s


@dataclass
class MlaWeights:
    """One layer's MLA projections (linears are TorchLinear or KernelLinear); o_proj stays in
    LayerWeights.o. w_uk / w_uv are views of kv_b's weight, split per head."""
    q_a: object | None  # [q_lora, D]; None without q_lora_rank
    q_a_norm: torch.Tensor | None  # [q_lora]
    q_b: object  # [H*(dn+dr), q_lora] (or q_proj [H*(dn+dr), D])
    kv_a: object  # [R + dr, D]
    kv_a_norm: torch.Tensor  # [R]
    kv_b: torch.Tensor  # [H*(dn+dv), R]

    def split_kv_b(self, cfg: MlaConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, dn, R], W_UV [H, dv, R] (views)."""
        w = self.kv_b.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
        return w[:, :cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim:]

    def to(self, device: torch.device, move_linear) -> "MlaWeights":
        t = lambda x: None if x is None else x.to(device)  # noqa: E731
        lin = lambda x: None if x is None else move_linear(x, device)  # noqa: E731
        return MlaWeights(lin(self.q_a), t(self.q_a_norm), lin(self.q_b), lin(self.kv_a), t(self.kv_a_norm),
                          t(self.kv_b))

    @property
    def nbytes(self) -> int:
        parts = [self.q_a, self.q_b, self.kv_a]
        tensors = [self.q_a_norm, self.kv_a_norm, self.kv_b]
        return sum(p.nbytes for p in parts if p is not None) + sum(
            t.numel() * t.element_size() for t in tensors if t is not None)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class YarnRotary(RotaryEmbedding):
    """RoPE with YaRN's frequency blend and cos/sin factor (transformers' _compute_yarn_parameters)."""

    def __init__(self, dim: int, theta: float, factor: float, original_max: int, beta_fast: float = 32,
                 beta_slow: float = 1, attention_factor: float = 1.0, truncate: bool = True):
        super().__init__(dim, theta)

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [dr/2]
        extrapolation = 1 - ramp
        pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
        self.inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        self.attention_factor = attention_factor

    @classmethod
    def from_params(cls, dim: int, theta: float, y: YarnParams) -> "YarnRotary":
        return cls(dim, theta, y.factor, y.original_max, y.beta_fast, y.beta_slow, y.attention_factor, y.truncate)

    def _grow(self, num_positions: int) -> None:
        super()._grow(num_positions)
        if self.attention_factor != 1.0:
            self._cos, self._sin = self._cos * self.attention_factor, self._sin * self.attention_factor


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x: [T, H, dr]; cos/sin: [T, dr] (cat(freqs, freqs)). Interleaved: pairs (x0, x1) ... rotated by
    one frequency each, written out de-interleaved [evens' | odds'] as transformers does (q and k
    alike, so their dot products are the pairwise ones)."""
    if not interleave:
        return apply_rotary(x, cos, sin)
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def mla_project(cfg: MlaConfig, w: MlaWeights, x: torch.Tensor, cos, sin, eps: float, resid: bool = False):
    """x: [T, D] -> q_nope [T, H, dn], q_rope [T, H, dr] (roped), c [T, R] (normed), k_rope [T, dr] (roped);
    resid: also the q-LoRA residual rms(q_a(x)) [T, q_lora] (the DSA indexer's query input)."""
    T, H = x.shape[0], cfg.num_heads
    q_in = x if w.q_a is None else rms_norm(w.q_a(x), w.q_a_norm, eps)
    q = w.q_b(q_in).view(T, H, cfg.qk_head_dim)
    q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
    c, k_rope = w.kv_a(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    c = rms_norm(c, w.kv_a_norm, eps)
    q_rope = rope(q_rope, cos, sin, cfg.rope_interleave)
    k_rope = rope(k_rope[:, None], cos, sin, cfg.rope_interleave)[:, 0]
    return (q_nope, q_rope, c, k_rope, q_in) if resid else (q_nope, q_rope, c, k_rope)


def mla_attention(cfg: MlaConfig, w: MlaWeights, cache: KVCache, layer: int, meta, x: torch.Tensor,
                  cos, sin, eps: float, sparse=None) -> torch.Tensor:
    """x: [T, D] (normed hidden states of the new tokens). Writes their (c, k_rope) to the latent
    cache and returns the attention output [T, H*dv] (before o_proj).
    sparse: DSA (layers/dsa.py): a callable q_resid -> per sequence None (dense) or [n, ctx] bool
    (True = the keys each query attends to, causality included)."""
    q_nope, q_rope, c, k_rope, q_resid = mla_project(cfg, w, x, cos, sin, eps, resid=True)
    cache.write(layer, meta.new_slots, c[:, None], k_rope[:, None])
    chosen = sparse(q_resid) if sparse is not None else [None] * len(meta.seqs)
    w_uk, w_uv = w.split_kv_b(cfg)
    out = x.new_empty(x.shape[0], cfg.num_heads, cfg.v_head_dim)
    for seq, sel in zip(meta.seqs, chosen):
        cc, kr = cache.read(layer, seq.ctx_slots)  # [ctx, 1, R], [ctx, 1, dr]
        cc, kr = cc[:, 0].to(x.dtype), kr[:, 0].to(x.dtype)
        a, b = seq.q_start, seq.q_end
        if cache.quantized:  # the new tokens end the context: use their exact latents
            cc[a - b:], kr[a - b:] = c[a:b], k_rope[a:b]
        if b - a == 1 and seq.mask is None:
            if sel is not None:  # DSA: only the selected latents (in context order)
                keep = sel[0].nonzero()[:, 0]
                cc, kr = cc[keep], kr[keep]
            out[a] = absorbed_decode(q_nope[a], q_rope[a], cc, kr, w_uk.to(x.dtype), w_uv.to(x.dtype),
                                     cfg.softmax_scale)
        else:
            out[a:b] = _expanded(cfg, w, q_nope[a:b], q_rope[a:b], cc, kr, seq.mask if sel is None else sel)
    return out.flatten(1)


def absorbed_decode(q_nope: torch.Tensor, q_rope: torch.Tensor, c: torch.Tensor, k_rope: torch.Tensor,
                    w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """One query over cached latents. q_nope [H, dn], q_rope [H, dr]; c [ctx, R], k_rope [ctx, dr];
    w_uk [H, dn, R], w_uv [H, dv, R]. Returns [H, dv]."""
    q_lat = torch.bmm(q_nope[:, None, :], w_uk)[:, 0]  # [H, R]
    scores = (q_lat @ c.T + q_rope @ k_rope.T) * scale  # [H, ctx]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float).to(c.dtype)
    o_lat = probs @ c  # [H, R]
    return torch.bmm(w_uv, o_lat[:, :, None])[:, :, 0]  # [H, dv]


def _expanded(cfg: MlaConfig, w: MlaWeights, q_nope, q_rope, c, k_rope, mask) -> torch.Tensor:
    """Prefill: expand the context's latents to per-head K/V. q_*: [n, H, *]; c [ctx, R]; mask [n, ctx]
    (True = attend) or None. Returns [n, H, dv]."""
    H, dn = cfg.num_heads, cfg.qk_nope_head_dim
    kv = F.linear(c, w.kv_b.to(c.dtype)).view(-1, H, dn + cfg.v_head_dim)  # [ctx, H, dn+dv]
    k = torch.cat([kv[..., :dn], k_rope[:, None, :].expand(-1, H, -1)], dim=-1).transpose(0, 1)  # [H, ctx, dqk]
    v = kv[..., dn:].transpose(0, 1)  # [H, ctx, dv]
    q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)  # [H, n, dqk]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=cfg.softmax_scale)  # [H, n, dv]
    return o.transpose(0, 1)


@dataclass(frozen=True)
class MlaAttention:
    """The MLA token mixer (a model file's layer kind, layers/decoder.py): projections and
    attention above over the paged latent pool. With DSA (`dsa`, layers/dsa.py) a layer with an
    `indexer` runs DeepSeek sparse attention's selection, caches its index keys beside the
    latents and leaves the selection to the shared layers after it, which reuse it as it is."""
    cfg: MlaConfig
    hidden: int
    dsa: object = None                 # layers.dsa.DsaConfig, or None: dense MLA
    indexer: bool = False              # this layer owns an indexer (DSA "full" layer)
    paged = True

    @property
    def scale(self) -> float:
        return self.cfg.softmax_scale

    def state_spec(self):
        if self.indexer:   # latent, rope key and index key per token
            from freetoken_py.kvcache import PagedIndexedLatent
            return PagedIndexedLatent(self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim, self.dsa.head_dim)
        return self.cfg.state_spec

    def shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {f"self_attn.{k}": v for k, v in self.cfg.tensor_shapes(self.hidden).items()}
        if self.indexer:
            shapes.update({f"self_attn.indexer.{k}": v
                           for k, v in self.dsa.tensor_shapes(self.hidden, self.cfg.q_lora_rank).items()})
        return shapes

    def load(self, get, prefix: str) -> dict:
        """kv_b stays one [H*(dn+dv), R] tensor, split into W_UK / W_UV by view; the indexer's
        weights_proj at fp32 whatever the load dtype (transformers' _keep_in_fp32_modules)."""
        from freetoken_py.layers.dsa import IndexerWeights
        from freetoken_py.layers.linear import TorchLinear

        p, m = prefix + "self_attn.", self.cfg
        bias = (lambda n: get(p + n + ".bias")) if m.bias else (lambda n: None)  # noqa: E731
        lora = m.q_lora_rank is not None
        mla = MlaWeights(
            q_a=TorchLinear(get(p + "q_a_proj.weight"), bias("q_a_proj")) if lora else None,
            q_a_norm=get(p + "q_a_layernorm.weight") if lora else None,
            q_b=TorchLinear(get(p + ("q_b_proj.weight" if lora else "q_proj.weight"))),
            kv_a=TorchLinear(get(p + "kv_a_proj_with_mqa.weight"), bias("kv_a_proj_with_mqa")),
            kv_a_norm=get(p + "kv_a_layernorm.weight"), kv_b=get(p + "kv_b_proj.weight"))
        i = p + "indexer."
        indexer = IndexerWeights(
            wq_b=TorchLinear(get(i + "wq_b.weight")), wk=TorchLinear(get(i + "wk.weight")),
            k_norm=get(i + "k_norm.weight"), k_norm_bias=get(i + "k_norm.bias"),
            weights_proj=TorchLinear(get(i + "weights_proj.weight", torch.float32))) if self.indexer else None
        return dict(mla=mla, o=TorchLinear(get(p + "o_proj.weight"), bias("o_proj")), indexer=indexer)

    def held(self, held, prefix: str) -> int:
        return sum(held(prefix + name, False) for name in self.shapes())

    def forward(self, lw, x: torch.Tensor, ctx, i: int) -> torch.Tensor:
        kvi, sparse = ctx.kv_layer[i], None
        if self.dsa is not None:
            from freetoken_py.layers.dsa import dsa_selection

            def sparse(q_resid: torch.Tensor):
                if lw.indexer is not None:
                    ctx.selection = dsa_selection(self.dsa, lw.indexer, ctx.cache, kvi, ctx.meta, x, q_resid,
                                                  ctx.cos, ctx.sin)
                return ctx.selection
        return lw.o(mla_attention(self.cfg, lw.mla, ctx.cache, kvi, ctx.meta, x, ctx.cos, ctx.sin, ctx.eps, sparse))
