"""MoE routing and the expert-executor interface.

The router turns hidden states into (expert ids, weights); where the experts run is the
executor's business (torch reference here; numba CPU kernels and the residency tiers plug in
behind the same call).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from freetoken_py.layers.linear import TorchLinear
from freetoken_py.layers.mlp import held_swiglu, load_swiglu, swiglu, swiglu_shapes


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


@dataclass(frozen=True)
class SoftmaxRouter:
    """Qwen3-MoE / OLMoE / Mixtral / Qwen3-Next: softmax_topk_route (renormalise: norm_topk_prob)."""
    top_k: int
    renormalize: bool
    bias: bool = False

    def load(self, get, weight: str, bias: str):
        return TorchLinear(get(weight)), None

    def held(self, held, weight: str, bias: str) -> int:
        return held(weight, False)

    def route(self, lw, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk_route(lw.router(x), self.top_k, self.renormalize)


@dataclass(frozen=True)
class SigmoidRouter:
    """DeepSeek "noaux_tc" (DeepSeek-V3, Kimi K2, GLM-4.5+, MiniMax-M2 with one group): sigmoid_group_route.
    Runs in fp32 as transformers keeps it (`_keep_in_fp32_modules_strict`): weight and choice bias
    are read at fp32 whatever the load dtype."""
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = True
    scaling: float = 1.0
    bias: bool = True

    def load(self, get, weight: str, bias: str):
        return TorchLinear(get(weight, torch.float32)), get(bias, torch.float32)

    def held(self, held, weight: str, bias: str) -> int:
        return held(weight, False, torch.float32) + held(bias, False, torch.float32)

    def route(self, lw, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return sigmoid_group_route(lw.router(x.float()), lw.router_bias, self.top_k, self.n_group,
                                   self.topk_group, self.renormalize, self.scaling)


@dataclass(frozen=True)
class TopKRouter:
    """gpt-oss: topk_softmax_route over a router linear with its own bias (in the model dtype)."""
    top_k: int
    bias: bool = True

    def load(self, get, weight: str, bias: str):
        return TorchLinear(get(weight), get(bias)), None

    def held(self, held, weight: str, bias: str) -> int:
        return held(weight, False) + held(bias, False)

    def route(self, lw, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return topk_softmax_route(lw.router(x), self.top_k)


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


@dataclass(frozen=True)
class MoeBlock:
    """A MoE layer's feed-forward part (a model file's layer kind, layers/decoder.py): a router
    (SoftmaxRouter, SigmoidRouter, TopKRouter), the routed experts (run by the step's expert
    executor: only they are its business), an optional ungated shared expert, optionally behind a
    per-token sigmoid gate (Qwen3-Next / 3.5), and optional expert biases (gpt-oss).
    names: the model file's checkpoint names (a models.weights.WeightScheme: router, router_bias,
    expert, expert_proj, shared_expert, shared_expert_gate)."""
    router: object
    num_experts: int
    width: int
    hidden: int
    names: object
    shared_width: int = 0
    shared_gate: bool = False
    expert_bias: bool = False

    def _experts(self, prefix: str) -> list[str]:
        return [prefix + self.names.expert.format(e=e) for e in range(self.num_experts)]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        s, (g, u, d), I, D = self.names, self.names.expert_proj, self.width, self.hidden
        shapes = {s.router: (self.num_experts, D)}
        if self.router.bias:
            shapes[s.router_bias] = (self.num_experts,)
        if self.shared_width:
            shapes.update(swiglu_shapes(s.shared_expert, self.shared_width, D))
            if self.shared_gate:
                shapes[s.shared_expert_gate] = (1, D)
        for p in self._experts(""):
            shapes.update({f"{p}{g}.weight": (I, D), f"{p}{u}.weight": (I, D), f"{p}{d}.weight": (D, I)})
            if self.expert_bias:
                shapes.update({f"{p}{g}.bias": (I,), f"{p}{u}.bias": (I,), f"{p}{d}.bias": (D,)})
        return shapes

    def load(self, get, prefix: str, skip_experts: bool = False) -> dict:
        """skip_experts: the routed experts' weights left None (the cpu backend's expert store builds
        its banks from the checkpoint itself); their biases are small and load either way."""
        s, (g, u, d) = self.names, self.names.expert_proj
        out = dict(zip(("router", "router_bias"), self.router.load(get, prefix + s.router, prefix + s.router_bias)))
        if self.shared_width:
            out["shared13"], out["shared2"] = load_swiglu(get, prefix + s.shared_expert)
            if self.shared_gate:
                out["shared_gate"] = TorchLinear(get(prefix + s.shared_expert_gate))
        experts = self._experts(prefix)
        if not skip_experts:
            out["w13"] = torch.stack([torch.cat([get(f"{x}{g}.weight"), get(f"{x}{u}.weight")]) for x in experts])
            out["w2"] = torch.stack([get(f"{x}{d}.weight") for x in experts])
        if self.expert_bias:   # b13 [E, 2I] gate then up, b2 [E, D]
            out["b13"] = torch.stack([torch.cat([get(f"{x}{g}.bias"), get(f"{x}{u}.bias")]) for x in experts])
            out["b2"] = torch.stack([get(f"{x}{d}.bias") for x in experts])
        return out

    def held(self, held, prefix: str, skip_experts: bool = False) -> tuple[int, int]:
        """(bytes held, the moment on top): the stacking holds each expert's gate and up rows
        concatenated (w13's size) besides the stack for a moment."""
        s, (g, u, d) = self.names, self.names.expert_proj
        total = self.router.held(held, prefix + s.router, prefix + s.router_bias)
        if self.shared_width:
            total += held_swiglu(held, prefix + s.shared_expert)
            if self.shared_gate:
                total += held(prefix + s.shared_expert_gate, False)
        if skip_experts:
            return total, 0
        names = self._experts(prefix)
        w13 = sum(held(f"{x}{g}.weight", True) + held(f"{x}{u}.weight", True) for x in names)
        return total + w13 + sum(held(f"{x}{d}.weight", True) for x in names), w13

    def route(self, lw, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.router.route(lw, x)

    def forward(self, lw, x: torch.Tensor, ctx, i: int) -> torch.Tensor:
        ids, weights = self.router.route(lw, x)
        out = ctx.experts(i, x, ids, weights.to(x.dtype))
        if lw.shared13 is not None:
            shared = swiglu(lw.shared13, lw.shared2, x)
            if lw.shared_gate is not None:  # sigmoid-gated per token
                shared = torch.sigmoid(lw.shared_gate(x)) * shared
            out = out + shared
        return out
