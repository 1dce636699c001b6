"""What one layer keeps per token: its state kind, described by a small spec.

The pool (pool.KVCache) stores, per layer and per slot, two rows whose shapes come from the spec:

    kind            row "k"                   row "v"                 values per token per layer
    paged_kv        K [num_kv_heads, head_dim] V [num_kv_heads, head_dim]   2 * Hkv * hd
    paged_latent    c [1, latent_dim]          k_rope [1, rope_dim]         latent + rope (576: DeepSeek)
    paged_indexed_latent  c, k_rope as above, and a third row: the DSA index key [1, index_dim]
                                                                         latent + rope + index (704: GLM-5)

Every kind is paged the same way (slot = page * page_size + offset), so the page allocator, the
prefix cache, page tags and FP8 (one scale per layer and per row head) work on either unchanged.

A model's state is a per-layer list of kinds (`MoeTransformer.state_specs()`), one entry a layer:

    kind            where it lives                                  size
    paged_kv        KVCache (pages), the paged layers only           per token
    paged_latent    KVCache (pages), the paged layers only           per token
    recurrent       state.StatePool: one slot per request            fixed (conv + recurrent state)

Only the paged layers count in page bytes (`page_bytes(spec, num_paged_layers, ...)`); the model
maps its layer index to a paged-layer index (`MoeTransformer.kv_layer`). A fixed-size kind is
held per request, not per token: the scheduler allocates a slot at admission, frees it when the
request finishes, aborts or is preempted (recompute starts from a zeroed slot), and a chunked
prefill continues from it.

Later kinds plug in the same way, without special cases elsewhere: a sliding-window layer
(`PagedWindowKV`) is a paged kind whose pages behind the window are given back: its layers keep
their rows in their own page pool with its own allocator, tags and one page table per request
(window.py), addressed like the others; a sparse-attention index key
(DSA) is one more paged row per token (`PagedIndexedLatent`: its third row, held only by the layers
of that kind, in the pool's `index` rows; a GLM-5.2 "shared" layer is a plain `PagedLatent`), and any per-request
state of fixed size is a `StatePool`-held kind with its own tensors. Each kind is one spec class
here with a `kind` name, and the code that stores it keys on that name only.
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
class PagedWindowKV:
    """Sliding-window attention (gpt-oss's "sliding_attention" layers): K and V rows as `PagedKV`,
    but a token at position p reads only keys (p - window, p], so the pages wholly behind the
    window are given back as the sequence advances (window.WindowPages: these layers' own page
    table per request and their own page pool). A request holds at most ceil((window - 1) /
    page_size) + 1 pages of these layers between steps (window + one page of rows when the page
    size divides the window), plus the chunk being prefilled during a step."""
    num_kv_heads: int
    head_dim: int
    window: int
    kind = "paged_window_kv"

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


@dataclass(frozen=True)
class PagedIndexedLatent:
    """MLA with DSA's lightning indexer (layers/dsa.py): the latent and rope key rows of
    `PagedLatent`, plus the index key (post-LayerNorm, post-RoPE, one head) per token that the
    indexer scores later queries against. The pool keeps that third row in its own per-layer
    tensor (pool.KVCache.index), paged and addressed like the other two."""
    latent_dim: int
    rope_dim: int
    index_dim: int
    kind = "paged_indexed_latent"

    @property
    def rows(self) -> tuple[tuple[int, int], ...]:
        return (1, self.latent_dim), (1, self.rope_dim), (1, self.index_dim)


@dataclass(frozen=True)
class Recurrent:
    """Linear attention (Gated DeltaNet): a fixed-size state per request, not per token: the last
    `conv_width` (= kernel - 1) pre-conv inputs of the causal conv [conv_dim, conv_width] and the
    delta-rule state [num_v_heads, k_head_dim, v_head_dim], both fp32 (kvcache/state.py)."""
    conv_dim: int
    conv_width: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    kind = "recurrent"

    @property
    def values_per_request(self) -> int:
        return self.conv_dim * self.conv_width + self.num_v_heads * self.k_head_dim * self.v_head_dim

    @property
    def bytes_per_request(self) -> int:
        return 4 * self.values_per_request  # fp32


StateSpec = PagedKV | PagedWindowKV | PagedLatent | PagedIndexedLatent | Recurrent
PAGED_KINDS = ("paged_kv", "paged_window_kv", "paged_latent", "paged_indexed_latent")


def is_paged(spec: StateSpec) -> bool:
    return spec.kind in PAGED_KINDS


def window_of(spec: StateSpec) -> int | None:
    """The sliding window of a windowed kind (its pages behind it are given back), else None."""
    return getattr(spec, "window", None)


def window_pages_per_seq(window: int, page_size: int) -> int:
    """Pages of a windowed layer one sequence holds between steps: the keys (p - window, p] of
    its next token p span at most this many pages."""
    return -(-(window - 1) // page_size) + 1


def window_pool_pages(window: int, page_size: int, max_num_seqs: int, max_chunk_tokens: int) -> int:
    """Pages a windowed layers' pool needs for the running sequences: each holds
    `window_pages_per_seq` between steps, and a step's chunks (at most `max_chunk_tokens` tokens in
    all) add at most ceil(n / page_size) + 1 pages each. Pages the prefix cache keeps come on top
    and are given back first when the pool runs short (RadixCache.evict_windows)."""
    return max_num_seqs * (window_pages_per_seq(window, page_size) + 1) + -(-max_chunk_tokens // page_size)


def values_per_token(spec: StateSpec) -> int:
    """Stored values per token per layer."""
    return sum(h * w for h, w in spec.rows)


def page_bytes(spec: StateSpec, num_layers: int, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one page across every layer (fp8: one byte a value)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    return num_layers * page_size * values_per_token(spec) * elem


INDEX_FP8_DTYPE = torch.bfloat16  # index keys under an FP8 cache: kept at bf16 (the top-k is sensitive)


def paged_bytes(specs: list[StateSpec], page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one page across the paged layers of mixed kinds (their specs, one a layer)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    total = 0
    for spec in specs:
        (kh, kw), (vh, vw), *extra = spec.rows
        total += (kh * kw + vh * vw) * elem
        for h, w in extra:  # the index row: not FP8 (INDEX_FP8_DTYPE)
            total += h * w * (INDEX_FP8_DTYPE.itemsize if elem == 1 else elem)
    return total * page_size
