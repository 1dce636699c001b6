"""ModelRunner: one forward pass over a batch of scheduled chunks -> logits of the rows to sample."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from freetoken_py.core import Request
from freetoken_py.engine.fused_decode import FusedDecoder, decode_slots
from freetoken_py.engine.fused_hybrid import HybridDecoder
from freetoken_py.engine.fused_mla import MlaDecoder
from freetoken_py.engine.threads_governor import ThreadGovernor
from freetoken_py.kernels.threads import set_kernel_threads
from freetoken_py.kvcache import KVCache, StatePool
from freetoken_py.layers.attention import AttentionMetadata, build_seq_attention
from freetoken_py.layers.gated_deltanet import GdnMixer
from freetoken_py.layers.gqa import GqaAttention
from freetoken_py.layers.mla import MlaAttention
from freetoken_py.models.moe_transformer import MoeTransformer


@dataclass
class ScheduledChunk:
    """Compute tokens [req.num_computed, req.num_computed + num_new) of `req`."""
    req: Request
    num_new: int
    # hybrids: [(rows into the chunk, snapshot slot)]: capture the recurrent state after those rows
    # (prefix-state snapshots, scheduler/prefix_state.py)
    captures: list[tuple[int, int]] = field(default_factory=list)

    @property
    def samples(self) -> bool:  # the chunk reaches the newest token, whose logits pick the next one
        return self.req.num_computed + self.num_new == self.req.num_tokens


# the fused numba decode step of each set of mixer kinds a model's layers use (layers/decoder.py)
DECODERS = {frozenset({GqaAttention}): FusedDecoder, frozenset({MlaAttention}): MlaDecoder,
            frozenset({GdnMixer, GqaAttention}): HybridDecoder}


def fused_decoder(model: MoeTransformer):
    """The decode step for the model's mixer kinds (GQA; MLA, DSA's included; Gated DeltaNet with
    gated GQA), or None: prefill's forward then runs every step."""
    return DECODERS.get(frozenset(type(layer.mixer) for layer in model.layers))


class ModelRunner:
    def __init__(self, model: MoeTransformer, num_pages: int, page_size: int, kv_dtype: torch.dtype | None = None,
                 fused_decode: bool = True, state_slots: int = 0, window_pages: int | None = None):
        """state_slots: per-request recurrent-state slots of a hybrid model (max_num_seqs plus the
        spares kept for prefix-state snapshots); ignored by models without recurrent layers.
        window_pages: the windowed layers' own pool (kvcache/window.py; default num_pages)."""
        self.model = model
        # only the paged layers (every layer but a hybrid's linear-attention ones) have K/V pages
        self.cache = KVCache.for_specs(model.paged_specs(), num_pages, page_size,
                                       kv_dtype or model.dtype, model.device, window_pages)   # with the dense weights: VRAM when on a GPU
        self.states = (StatePool(model.state_specs(), max(1, state_slots), model.device)
                       if model.hybrid else None)   # kvcache/state.py: one slot per request
        self.fused = None  # the cpu backend's numba decode step (engine/fused_decode.py)
        self.governor = None  # its thread count, re-decided from step times (threads_governor.py)
        decoder = fused_decoder(model)
        if fused_decode and decoder is not None and decoder.supports(model):
            from freetoken_py.envs import adaptive_threads
            from freetoken_py.kernels.threads import configured_threads

            self.fused = decoder(model, self.cache, self.states) if model.hybrid else decoder(model, self.cache)
            self._max_threads = configured_threads()
            self.governor = ThreadGovernor(self._max_threads) if adaptive_threads() else None
        # --prefill-expert-dtype: the executor holding a second copy of the experts (kept here:
        # LLM may wrap model.experts, e.g. --record-routing); each pass tells it which rows prefill
        ex = model.experts
        self._asym = ex if getattr(ex, "prefill_banks", None) is not None else None

    def forward_batch(self, chunks: list[ScheduledChunk], all_rows: bool = False) -> torch.Tensor:
        """Runs every chunk in one forward; returns fp32 logits [num_sampling_chunks, V] in chunk order
        (all_rows: of every token computed, [sum num_new, V], for teacher-forced evaluation)."""
        if self.fused is not None:
            if all(ch.num_new == 1 for ch in chunks):
                return self._forward_decode(chunks, all_rows)
            set_kernel_threads(self._max_threads)  # prefill: long regions, every core
        ids, positions, seqs, windowed, sample_rows = [], [], [], [], []
        row, a = 0, self.model.args
        mixed = self.cache.windows is not None   # windowed layers (their own pages) besides full ones: gpt-oss
        for ch in chunks:
            req, start = ch.req, ch.req.num_computed
            tokens = req.all_token_ids[start:start + ch.num_new]
            ids.extend(tokens)
            positions.extend(range(start, start + ch.num_new))
            seqs.append(build_seq_attention(self.cache, req.page_table, start, ch.num_new, row,
                                            None if mixed else a.sliding_window))
            if mixed:
                windowed.append(build_seq_attention(self.cache, self._window_table(ch), start, ch.num_new, row,
                                                    a.sliding_window))
            row += ch.num_new
            if ch.samples:
                sample_rows.append(row - 1)
        new_slots = _new_slots(seqs)
        meta = AttentionMetadata(new_slots, seqs,
                                 [ch.req.state_slot for ch in chunks] if self.states is not None else None,
                                 {i: ch.captures for i, ch in enumerate(chunks) if ch.captures} or None,
                                 AttentionMetadata(_new_slots(windowed), windowed) if mixed else None)
        if self._asym is not None:   # tokens of chunks of several: prefill precision; of chunks of one: decode's
            self._asym.prefill_rows = torch.tensor([ch.num_new > 1 for ch in chunks for _ in range(ch.num_new)])
        try:
            hidden = self.model.forward(torch.tensor(ids), torch.tensor(positions), meta, self.cache,
                                        self.states)  # [T, D]
        finally:
            if self._asym is not None:
                self._asym.prefill_rows = None
        logits = self.model.logits(hidden if all_rows else hidden[sample_rows])  # [S, V]
        for ch in chunks:   # only once the whole pass is done: a failed pass can be run again as is
            ch.req.num_computed += ch.num_new
        return logits

    def _forward_decode(self, chunks: list[ScheduledChunk], all_rows: bool = False) -> torch.Tensor:
        """One token per chunk through the fused numba step (same results as forward_batch's path)."""
        a, sample_rows = self.model.args, [i for i, ch in enumerate(chunks) if ch.samples]
        mixed = self.cache.windows is not None   # the windowed layers' contexts besides the full ones
        flat, ctx_off = self._decode_contexts(chunks, None if mixed else a.sliding_window)
        extra = {}
        if mixed:   # the windowed layers' own pages: their contexts and the new tokens' slots
            wflat, woff = self._decode_contexts(chunks, a.sliding_window, [self._window_table(ch) for ch in chunks])
            extra = {"windowed": (wflat, woff, wflat[woff[1:] - 1])}
        new_slots = flat[ctx_off[1:] - 1]  # each token's own slot ends its context
        gov, rows, context = self.governor, len(chunks), len(flat)
        threads = gov.choose(rows, context) if gov is not None else self._max_threads
        set_kernel_threads(threads)
        t0 = time.perf_counter()
        slots = () if self.states is None else (np.array([ch.req.state_slot for ch in chunks], np.int64),)
        hidden = self.fused.forward([ch.req.token_at(ch.req.num_computed) for ch in chunks],
                                    [ch.req.num_computed for ch in chunks], flat, ctx_off, new_slots, *slots, **extra)
        for ch in chunks:
            ch.req.num_computed += 1
        logits = self.model.logits(hidden if all_rows else hidden[sample_rows])
        if gov is not None:
            gov.record(rows, threads, time.perf_counter() - t0, context)
        return logits

    def _window_table(self, ch: ScheduledChunk) -> list[int]:
        """The windowed layers' page table of the chunk's request, its pages ensured (the
        scheduler allocates them first; a pass driven without it gets them here)."""
        w = self.cache.windows
        w.ensure(ch.req, ch.req.num_computed + ch.num_new)
        return w.table(ch.req.request_id)

    def _decode_contexts(self, chunks: list[ScheduledChunk], window: int | None,
                         tables: list[list[int]] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Each one-token chunk's key slots (its own last), flat, and the offsets [len + 1]
        (tables: the windowed layers' page tables instead of the requests' own)."""
        tables = tables or [ch.req.page_table for ch in chunks]
        ctx = [decode_slots(self.cache, t, ch.req.num_computed, window) for ch, t in zip(chunks, tables)]
        ctx_off = np.zeros(len(ctx) + 1, np.int64)
        np.cumsum([len(c) for c in ctx], out=ctx_off[1:])
        return np.concatenate(ctx), ctx_off


def _new_slots(seqs) -> torch.Tensor:
    """The new tokens' slots: they end each sequence's context."""
    return torch.cat([s.ctx_slots[s.q_start - s.q_end:] for s in seqs])
