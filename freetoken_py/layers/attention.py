"""Paged attention over the KV cache (CPU/torch path).

The batch is a flat list of tokens from several requests (varlen). For every request the new
tokens' K/V are written to their slots, then its whole context is gathered from the pages and
attended to with SDPA. Masks are built once per batch (`AttentionMetadata`) and reused by every layer.

With an FP8 cache the tokens a step computes attend to their own K/V at full precision (they are
the last rows of each context); everything earlier, including every decode step's history, is
read back from FP8 and dequantised.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from freetoken_py.kvcache import KVCache


@dataclass
class SeqAttention:
    q_start: int  # first row of this request in the batch
    q_end: int
    ctx_slots: torch.Tensor  # [ctx] slots of the keys this request may see (window applied)
    mask: torch.Tensor | None  # [n_q, ctx] True = attend; None = every key visible

    def to(self, device: torch.device) -> "SeqAttention":
        return SeqAttention(self.q_start, self.q_end, self.ctx_slots.to(device),
                            None if self.mask is None else self.mask.to(device))


@dataclass
class AttentionMetadata:
    new_slots: torch.Tensor  # [T] slot of each new token
    seqs: list[SeqAttention]
    state_slots: list[int] | None = None  # hybrids: each seq's StatePool slot (kvcache/state.py)
    # hybrids: seq index -> [(rows into its chunk, snapshot slot)]: the recurrent state after those
    # rows is copied into the snapshot slot (prefix-state snapshots inside a chunk, layers/gated_deltanet.py)
    state_captures: dict[int, list[tuple[int, int]]] | None = None
    # models mixing windowed and full layers (gpt-oss): `seqs` see every key, this the window's
    windowed: "AttentionMetadata | None" = None

    def to(self, device: torch.device) -> "AttentionMetadata":
        """The index tensors on the KV cache's device (built on the host, once per batch)."""
        return AttentionMetadata(self.new_slots.to(device), [s.to(device) for s in self.seqs], self.state_slots,
                                 self.state_captures, None if self.windowed is None else self.windowed.to(device))


def build_seq_attention(cache: KVCache, page_table: list[int], start: int, num_new: int,
                        q_start: int, sliding_window: int | None) -> SeqAttention:
    """Positions [start, start+num_new) are new; keys are positions [lo, start+num_new)."""
    end = start + num_new
    lo = 0 if sliding_window is None else max(0, start - sliding_window + 1)
    slots = cache.slots(page_table, lo, end)
    mask = None
    if num_new > 1:
        q_pos = torch.arange(start, end)[:, None]  # [n, 1]
        k_pos = torch.arange(lo, end)[None, :]  # [1, ctx]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
    return SeqAttention(q_start, q_start + num_new, slots, mask)


def paged_attention(cache: KVCache, layer: int, meta: AttentionMetadata, q: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, hd]; k, v: [T, Hkv, hd] (new tokens). Returns [T, Hq*hd].
    sinks [Hq] (gpt-oss): one more logit per head in each softmax, its probability dropped."""
    cache.write(layer, meta.new_slots, k, v)
    out = torch.empty_like(q)
    for seq in meta.seqs:
        kc, vc = cache.read(layer, seq.ctx_slots)  # [ctx, Hkv, hd]
        if cache.quantized:  # the new tokens end the context: use their exact K/V
            n = seq.q_end - seq.q_start
            kc[-n:], vc[-n:] = k[seq.q_start:seq.q_end], v[seq.q_start:seq.q_end]
        kc, vc = kc.to(q.dtype).transpose(0, 1), vc.to(q.dtype).transpose(0, 1)  # [Hkv, ctx, hd]
        if seq.q_end - seq.q_start == 1 and seq.mask is None:
            out[seq.q_start] = _decode_attention(q[seq.q_start], kc, vc, scale, sinks)
            continue
        qs = q[seq.q_start:seq.q_end].transpose(0, 1)  # [Hq, n, hd]
        if seq.mask is None and sinks is None:
            o = F.scaled_dot_product_attention(qs, kc, vc, scale=scale, enable_gqa=True)
        else:
            mask = seq.mask if seq.mask is not None else torch.ones(qs.shape[1], kc.shape[1], dtype=torch.bool,
                                                                   device=qs.device)
            o = _prefill_attention(qs, kc, vc, mask, scale, sinks=sinks)
        out[seq.q_start:seq.q_end] = o.transpose(0, 1)
    return out.flatten(1)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                       block: int = 64, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Masked attention of n new tokens that end a context of ctx keys, in query blocks.

    Each block reads keys only up to its last query's position (the rest are masked anyway), so a
    causal prefill does about half of the rectangle; query groups share their KV head via bmm.
    On the CPU this is ~3x faster than SDPA with a mask (measured in docs/performance.md).
    q: [Hq, n, hd]; k, v: [Hkv, ctx, hd]; mask: [n, ctx] True = attend. Returns [Hq, n, hd].
    """
    num_kv, n, ctx = k.shape[0], q.shape[1], k.shape[1]
    group = q.shape[0] // num_kv
    qg = q.reshape(num_kv, group, n, q.shape[-1])  # [Hkv, g, n, hd]
    out = torch.empty_like(qg)
    for s in range(0, n, block):
        e = min(n, s + block)
        limit = ctx - n + e  # keys after the block's last query position are never visible
        qb = qg[:, :, s:e].reshape(num_kv, group * (e - s), -1)  # [Hkv, g*b, hd]
        scores = torch.bmm(qb, k[:, :limit].transpose(1, 2)) * scale  # [Hkv, g*b, limit]
        scores = scores.view(num_kv, group, e - s, limit).masked_fill_(~mask[s:e, :limit], float("-inf"))
        probs = _softmax(scores, sinks).to(v.dtype)  # [Hkv, g, b, limit]
        out[:, :, s:e] = torch.bmm(probs.view(num_kv, group * (e - s), limit), v[:, :limit]).view(
            num_kv, group, e - s, -1)
    return out.reshape(q.shape)


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token, every key visible: two bmm's over query groups (q head h reads kv head
    h // group, as HF's repeat_kv). ~3x cheaper than SDPA's dispatch at decode sizes.
    q: [Hq, hd]; k, v: [Hkv, ctx, hd]. Returns [Hq, hd]."""
    num_kv = k.shape[0]
    qg = q.reshape(num_kv, -1, q.shape[-1])  # [Hkv, group, hd]
    probs = _softmax(torch.bmm(qg, k.transpose(1, 2)) * scale, sinks)  # [Hkv, g, ctx]
    return torch.bmm(probs.to(v.dtype), v).reshape(q.shape)


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """fp32 softmax over the last dim of scores [Hkv, g, ..., ctx]; with sinks [Hq = Hkv * g] a
    sink logit per head joins each row and its share is dropped (rows then sum to < 1)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float)
    sink = sinks.float().view(*scores.shape[:2], *([1] * (scores.dim() - 2))).expand(*scores.shape[:-1], 1)
    both = torch.cat([scores.float(), sink], dim=-1)
    return torch.softmax(both - both.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
