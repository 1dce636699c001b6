"""Grouped-query attention over paged K/V, with the options the GQA families here use.

One class, its options fields (a model file sets those its family has): q / k / v biases and an
o_proj bias, q/k RMSNorm per head (Qwen3, GLM-4.5 with use_qk_norm) or over the whole projection
(OLMoE, MiniMax-M2), clamping of q, k and v (OLMoE's clip_qkv), an output gate (Qwen3-Next / 3.5:
q_proj rows per head [query | gate], o = o_proj(attn * sigmoid(gate))), a learnt sink logit per
head (gpt-oss), and a sliding window kept in its own pages (gpt-oss's windowed layers next to full
ones). RoPE (partial or whole head) comes in as the step's cos / sin rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken_py.kvcache import PagedKV, PagedWindowKV
from freetoken_py.layers.attention import paged_attention
from freetoken_py.layers.decoder import Getter, Held, RmsNorm, StepContext
from freetoken_py.layers.linear import TorchLinear
from freetoken_py.layers.norm import rms_norm
from freetoken_py.layers.rotary import apply_partial_rotary

QK_NORMS = ("none", "head", "full")
_P = "self_attn."


@dataclass(frozen=True)
class GqaAttention:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool = False                 # q / k / v biases
    o_bias: bool = False
    qk_norm: str = "none"              # "head": per head; "full": over the whole q / k projection
    clip: float | None = None          # q, k, v clamped to [-clip, clip] (after a "full" norm)
    output_gate: bool = False
    sinks: bool = False
    window: int | None = None          # a windowed layer of a model mixing them: its own pages
    norm: RmsNorm = RmsNorm()          # the model's RMSNorm kind, for the per-head q/k norm
    paged = True

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def q_rows(self) -> int:
        return (2 if self.output_gate else 1) * self.num_heads * self.head_dim

    def state_spec(self):
        if self.window is not None:   # pages behind the window given back (kvcache/window.py)
            return PagedWindowKV(self.num_kv_heads, self.head_dim, self.window)
        return PagedKV(self.num_kv_heads, self.head_dim)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        q_out, kv_out, D = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.hidden
        shapes = {f"{_P}q_proj.weight": (self.q_rows, D), f"{_P}k_proj.weight": (kv_out, D),
                  f"{_P}v_proj.weight": (kv_out, D), f"{_P}o_proj.weight": (D, q_out)}
        if self.bias:
            shapes.update({f"{_P}q_proj.bias": (self.q_rows,), f"{_P}k_proj.bias": (kv_out,),
                           f"{_P}v_proj.bias": (kv_out,)})
        if self.o_bias:
            shapes[f"{_P}o_proj.bias"] = (D,)
        if self.sinks:
            shapes[f"{_P}sinks"] = (self.num_heads,)
        if self.qk_norm != "none":
            q, k = (self.head_dim, self.head_dim) if self.qk_norm == "head" else (q_out, kv_out)
            shapes.update({f"{_P}q_norm.weight": (q,), f"{_P}k_norm.weight": (k,)})
        return shapes

    def load(self, get: Getter, prefix: str) -> dict:
        """q / k / v fused into one linear (and their biases); o_proj; norms and sinks as they are."""
        p = prefix + _P
        qkv_b = torch.cat([get(f"{p}{x}_proj.bias") for x in "qkv"]) if self.bias else None
        out = dict(qkv=TorchLinear(torch.cat([get(f"{p}{x}_proj.weight") for x in "qkv"]), qkv_b),
                   o=TorchLinear(get(p + "o_proj.weight"), get(p + "o_proj.bias") if self.o_bias else None))
        if self.qk_norm != "none":
            q, k = get(p + "q_norm.weight"), get(p + "k_norm.weight")
            out.update(q_norm=self.norm.prepare(q), k_norm=self.norm.prepare(k))
        if self.sinks:
            out["sinks"] = get(p + "sinks")
        return out

    def held(self, held: Held, prefix: str) -> int:
        fused = (f"{_P}q_proj.", f"{_P}k_proj.", f"{_P}v_proj.")
        return sum(held(prefix + name, name.startswith(fused)) for name in self.shapes())

    def forward(self, lw, x: torch.Tensor, ctx: StepContext, i: int) -> torch.Tensor:
        T, eps = x.shape[0], ctx.eps
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        gate = None
        if self.output_gate:  # q_proj rows per head: [query | gate]
            qg, k, v = lw.qkv(x).split([2 * q_out, kv_out, kv_out], dim=-1)
            q, gate = qg.view(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(T, q_out), gate.reshape(T, q_out)
        else:
            q, k, v = lw.qkv(x).split([q_out, kv_out, kv_out], dim=-1)
        if self.qk_norm == "full":  # norm over the whole projection, before clipping
            q, k = rms_norm(q, lw.q_norm, eps), rms_norm(k, lw.k_norm, eps)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.norm(q, lw.q_norm, eps), self.norm(k, lw.k_norm, eps)
        q, k = apply_partial_rotary(q, ctx.cos, ctx.sin), apply_partial_rotary(k, ctx.cos, ctx.sin)
        meta = ctx.meta.windowed if self.window is not None else ctx.meta
        o = paged_attention(ctx.cache, ctx.kv_layer[i], meta, q, k, v, self.scale, lw.sinks)  # [T, Hq*hd]
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return lw.o(o)
