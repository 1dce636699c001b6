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


class ExpertExecutor(Protocol):
    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [T, D]; ids, weights: [T, k]. Returns sum_j weights[t, j] * expert_{ids[t, j]}(x[t])."""


class TorchExpertExecutor:
    """Reference executor: stacked expert weights, one SwiGLU per expert hit (gpt-fast style)."""

    def __init__(self, w13: list[torch.Tensor | None], w2: list[torch.Tensor | None]):
        self.w13 = w13  # per layer [E, 2I, D]
        self.w2 = w2  # per layer [E, D, I]

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
            gate, up = F.linear(x[rows], w13[e]).chunk(2, dim=-1)  # [n, I] each
            y = F.linear(F.silu(gate) * up, w2[e])  # [n, D]
            out.index_add_(0, rows, y * w_sorted[start:start + n, None])
            start += n
        return out
