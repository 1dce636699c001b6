"""What one layer keeps per token: its state kind, described by a small spec.

The pool (pool.KVCache) stores, per layer and per slot, two rows whose shapes come from the spec:

    kind            row "k"                   row "v"                 values per token per layer
    paged_kv        K [num_kv_heads, head_dim] V [num_kv_heads, head_dim]   2 * Hkv * hd
    paged_latent    c [1, latent_dim]          k_rope [1, rope_dim]         latent + rope (576: DeepSeek)

Both kinds are paged the same way (slot = page * page_size + offset), so the page allocator, the
prefix cache, page tags and FP8 (one scale per layer and per row head) work on either unchanged.
A new kind whose state is not per token (recurrent state, a window) adds its own spec here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedKV:
    """Full attention: every KV head's K and V row per token."""
    num_kv_heads: int
    head_dim: int
    kind = "paged_kv"

    @property
    def rows(self) -> tuple[tuple[int, int], tuple[int, int]]:
        return (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class PagedLatent:
    """MLA: the normed compressed latent c and the roped shared key, one row each per token
    (queries absorb the up-projection, so K/V are never expanded in the cache)."""
    latent_dim: int
    rope_dim: int
    kind = "paged_latent"

    @property
    def rows(self) -> tuple[tuple[int, int], tuple[int, int]]:
        return (1, self.latent_dim), (1, self.rope_dim)


StateSpec = PagedKV | PagedLatent


def values_per_token(spec: StateSpec) -> int:
    """Stored values per token per layer."""
    return sum(h * w for h, w in spec.rows)


def page_bytes(spec: StateSpec, num_layers: int, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one page across every layer (fp8: one byte a value)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    return num_layers * page_size * values_per_token(spec) * elem
