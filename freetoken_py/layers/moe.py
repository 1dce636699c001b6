"""MoE routing and the expert-executor interface.

The router turns hidden states into (expert ids, weights); where the experts run is the
executor's business (torch reference here; numba CPU kernels and the residency tiers plug in
behind the same call).
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


def softmax_topk_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE / OLMoE / Mixtral: softmax over all experts (fp32) -> top-k -> optional renorm.

    logits: [T, E]. Returns ids [T, k] int64 and weights [T, k] in logits' dtype.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(logits.dtype)


def sigmoid_group_route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int = 1,
                        topk_group: int = 1, renormalize: bool = True,
                        scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek "noaux_tc" (DeepSeek-V3, GLM-4.5) and, with n_group = 1 and scaling = 1, MiniMax-M2.

    Sigmoid scores in fp32; `bias` (e_score_correction_bias, [E]) shifts the choice only; with
    n_group > 1 the experts split into n_group contiguous groups, a group scores the sum of its
    top-2 biased scores, and only the topk_group best groups may be picked; the weights are the
    unbiased scores of the chosen experts, renormalised if asked, times `scaling`.
    logits: [T, E]. Returns ids [T, k] int64 and weights [T, k] fp32.
    """
    scores = torch.sigmoid(logits.float())  # [T, E]
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        T, E = choice.shape
        grouped = choice.view(T, n_group, E // n_group)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(T, E)
    ids = choice.topk(top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


def topk_softmax_route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss: top-k of the raw (biased) logits, then softmax over those k, in logits' dtype.
    logits: [T, E]. Returns ids [T, k] int64 and weights [T, k]."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return ids, torch.softmax(values, dim=-1, dtype=values.dtype)


def expert_activation(kind: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The expert MLP's activation (ModelArgs.hidden_act): SwiGLU, or gpt-oss's clamped SwiGLU
    (gate <= 7, up in [-7, 7], (up + 1) * gate * sigmoid(1.702 gate); kernels/_dots.act likewise)."""
    if kind == "silu":
        return F.silu(gate) * up
    gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    return (up + 1) * (gate * torch.sigmoid(gate * 1.702))


class ExpertExecutor(Protocol):
    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [T, D]; ids, weights: [T, k]. Returns sum_j weights[t, j] * expert_{ids[t, j]}(x[t])."""


class TorchExpertExecutor:
    """Reference executor: stacked expert weights, one SwiGLU per expert hit (gpt-fast style)."""

    def __init__(self, w13: list[torch.Tensor | None], w2: list[torch.Tensor | None], activation: str = "silu",
                 b13: list[torch.Tensor | None] | None = None, b2: list[torch.Tensor | None] | None = None):
        self.w13 = w13  # per layer [E, 2I, D]
        self.w2 = w2  # per layer [E, D, I]
        self.activation = activation  # ModelArgs.hidden_act
        self.b13 = b13  # per layer [E, 2I] (gate then up) or None: expert biases (gpt-oss)
        self.b2 = b2  # per layer [E, D]

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.w13[layer], self.w2[layer]
        out = torch.zeros_like(x)  # [T, D]
        flat = ids.flatten()  # [T*k]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
        token_of = order // ids.shape[1]  # [T*k] token row of each sorted pair
        w_sorted = weights.flatten()[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = token_of[start:start + n]
            b13, b2 = (None, None) if self.b13 is None else (self.b13[layer][e], self.b2[layer][e])
            gate, up = F.linear(x[rows], w13[e], b13).chunk(2, dim=-1)  # [n, I] each
            y = F.linear(expert_activation(self.activation, gate, up), w2[e], b2)  # [n, D]
            out.index_add_(0, rows, y * w_sorted[start:start + n, None])
            start += n
        return out
