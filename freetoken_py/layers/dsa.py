"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5.x): the lightning indexer and its top-k choice.

Per token (Hi = index_n_heads, di = index_head_dim, dr = the MLA's qk_rope_head_dim)::

    q   = wq_b(q_resid)                  [Hi, di]   q_resid = rms(q_a(x)), the MLA's own q-LoRA residual
    k   = LayerNorm(wk(x)) (with bias)   [di]       one head; cached per token (the index key)
    RoPE on the first dr dims of q and k (rotate-half: deepseek_v32, interleaved pairs: glm_moe_dsa)
    w   = weights_proj(x) * Hi^-0.5      [Hi]       fp32 (transformers keeps weights_proj fp32)
    score[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t] * di^-0.5)         (fp32)

A query attends only to the `topk` causal keys of highest score; where its context holds no more
than `topk` keys that is all of them, and the selection is skipped (plain MLA, bit for bit where
torch's BLAS is reproducible: MKL's alignment-dependent paths can move the last bits, MKL_CBWR).
GLM-5.2's `shared` layers have no indexer: they reuse the last `full` layer's selection (the
selection is a function of positions, and every MLA layer sees the same context slots).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from freetoken_py.layers.mla import rope

LAYER_NORM_EPS = 1e-6
SCORE_BLOCK = 1 << 26  # prefill: index scores computed per block of queries, [rows, Hi, ctx] <= 256 MiB fp32  # the indexer's k_norm (nn.LayerNorm(eps=1e-6) in both families)


@dataclass(frozen=True)
class DsaConfig:
    n_heads: int
    head_dim: int
    topk: int
    rope_dim: int  # RoPE on the first rope_dim dims of q and k (the MLA's qk_rope_head_dim)
    interleave: bool  # glm_moe_dsa: interleaved pairs; deepseek_v32: rotate-half
    layer_types: tuple[str, ...]  # per layer "full" (own indexer, index keys cached) or "shared"

    def is_full(self, i: int) -> bool:
        return self.layer_types[i] == "full"

    def tensor_shapes(self, hidden: int, q_lora_rank: int) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensors under a full layer's `self_attn.indexer.`."""
        H, d = self.n_heads, self.head_dim
        return {"wq_b.weight": (H * d, q_lora_rank), "wk.weight": (d, hidden), "k_norm.weight": (d,),
                "k_norm.bias": (d,), "weights_proj.weight": (H, hidden)}


@dataclass
class IndexerWeights:
    wq_b: object  # [Hi*di, q_lora] (TorchLinear or KernelLinear)
    wk: object  # [di, D]
    k_norm: torch.Tensor  # [di]
    k_norm_bias: torch.Tensor  # [di]
    weights_proj: object  # [Hi, D], fp32

    def to(self, device: torch.device, move_linear) -> "IndexerWeights":
        return IndexerWeights(move_linear(self.wq_b, device), move_linear(self.wk, device), self.k_norm.to(device),
                              self.k_norm_bias.to(device), move_linear(self.weights_proj, device))

    @property
    def nbytes(self) -> int:
        return (self.wq_b.nbytes + self.wk.nbytes + self.weights_proj.nbytes
                + 2 * self.k_norm.numel() * self.k_norm.element_size())


def _rope_first(cfg: DsaConfig, x: torch.Tensor, cos, sin) -> torch.Tensor:
    """x: [T, H, di] -> RoPE on the first rope_dim dims, the rest passed through."""
    r = cfg.rope_dim
    return torch.cat([rope(x[..., :r], cos, sin, cfg.interleave), x[..., r:]], dim=-1)


def index_keys(cfg: DsaConfig, w: IndexerWeights, x: torch.Tensor, cos, sin) -> torch.Tensor:
    """x: [T, D] (normed hidden states) -> the cached index keys [T, di] (post-norm, post-RoPE)."""
    k = F.layer_norm(w.wk(x), (cfg.head_dim,), w.k_norm.to(x.dtype), w.k_norm_bias.to(x.dtype), LAYER_NORM_EPS)
    return _rope_first(cfg, k[:, None], cos, sin)[:, 0]


def index_queries(cfg: DsaConfig, w: IndexerWeights, x: torch.Tensor, q_resid: torch.Tensor, cos, sin):
    """-> q [T, Hi, di] (roped, fp32) and head weights [T, Hi] (fp32, times Hi^-0.5)."""
    q = _rope_first(cfg, w.wq_b(q_resid).view(x.shape[0], cfg.n_heads, cfg.head_dim), cos, sin)
    weights = w.weights_proj(x.float()).float() * cfg.n_heads ** -0.5
    return q.float(), weights


def index_scores(cfg: DsaConfig, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [n, Hi, di], weights [n, Hi], keys [ctx, di] -> scores [n, ctx] (fp32)."""
    s = F.relu(torch.matmul(q, keys.float().T) * cfg.head_dim ** -0.5)  # [n, Hi, ctx]
    return torch.matmul(weights[:, None, :], s)[:, 0]


def select(cfg: DsaConfig, scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
    """scores [n, ctx]; mask [n, ctx] (True = causal-visible) or None (every key visible) ->
    [n, ctx] bool, True at each query's top-k visible keys; None where ctx <= topk (all of them)."""
    ctx = scores.shape[1]
    if ctx <= cfg.topk:
        return None
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    idx = scores.topk(cfg.topk, dim=-1).indices  # [n, k]
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, idx, True)
    return chosen if mask is None else chosen & mask


def dsa_selection(cfg: DsaConfig, w: IndexerWeights, cache, layer: int, meta, x: torch.Tensor,
                  q_resid: torch.Tensor, cos, sin) -> list[torch.Tensor | None]:
    """A full layer: writes the new tokens' index keys to the cache's index rows and returns each
    sequence's selection (`select`'s [n, ctx] mask, or None = dense) in meta.seqs order."""
    keys = index_keys(cfg, w, x, cos, sin)  # [T, di]
    cache.write_index(layer, meta.new_slots, keys)
    q, weights = index_queries(cfg, w, x, q_resid, cos, sin)
    out = []
    for seq in meta.seqs:
        if seq.ctx_slots.shape[0] <= cfg.topk:
            out.append(None)
            continue
        a, b = seq.q_start, seq.q_end
        ctx_keys = cache.read_index(layer, seq.ctx_slots)  # [ctx, di], as stored (new ones too: chunking-proof)
        # query rows in blocks: the [rows, Hi, ctx] fp32 scores stay under SCORE_BLOCK values
        rows = max(1, SCORE_BLOCK // (cfg.n_heads * len(ctx_keys)))
        out.append(torch.cat([
            select(cfg, index_scores(cfg, q[r:min(b, r + rows)], weights[r:min(b, r + rows)], ctx_keys),
                   None if seq.mask is None else seq.mask[r - a:min(b, r + rows) - a])
            for r in range(a, b, rows)]))
    return out
