"""Memory planning before the engine allocates anything: how many KV pages, how many recurrent-state
snapshot slots (hybrids with the prefix cache), and whose budget each comes out of.

A pure function of the config, the model's state specs, the KV dtype and the free memory it is
given (RAM, or VRAM when the dense weights went to a GPU); the engine allocates what it says.
"""
from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from freetoken_py.config import EngineConfig
from freetoken_py.errors import FreetokenError
from freetoken_py.kvcache import paged_bytes
from freetoken_py.kvcache.spec import window_of, window_pool_pages


@dataclass(frozen=True)
class MemoryPlan:
    page_bytes: int        # one page over every paged layer (DSA: + index keys)
    state_bytes: int       # one request's recurrent state (0: not a hybrid)
    snapshot_slots: int    # recurrent-state slots kept for prefix snapshots, beyond max_num_seqs
    num_pages: int
    window_pages: int | None = None   # windowed layers' own pool (kvcache/window.py); None: not such a model


def kv_dtype_of(c: EngineConfig, auto: torch.dtype) -> torch.dtype:
    """`--kv-dtype`: `auto` is the load pipeline's choice for this model (LoadedModel.kv_dtype)."""
    from freetoken_py.kvcache.pool import FP8

    return {"auto": auto, "fp32": torch.float32, "bf16": torch.bfloat16, "fp8": FP8}[c.kv_dtype]


def plan_memory(c: EngineConfig, paged_specs, state_specs, kv_dtype: torch.dtype, max_model_len: int,
                on_cuda: bool) -> MemoryPlan:
    # only the paged layers count (a hybrid's linear-attention layers keep a per-request state)
    windowed = [s for s in paged_specs if window_of(s) is not None]
    if windowed:   # the kinds summed: full layers per token, windowed ones bounded per sequence
        return _plan_windowed(c, paged_specs, windowed, kv_dtype, max_model_len, on_cuda)
    page_bytes = paged_bytes(paged_specs, c.page_size, kv_dtype)
    state = sum(s.bytes_per_request for s in state_specs if s.kind == "recurrent")
    budget = kv_budget(c, page_bytes, max_model_len, on_cuda)
    slots = snapshot_slot_count(c, state, budget)   # hybrids: out of the KV budget, before the pages
    return MemoryPlan(page_bytes, state, slots, num_pages(c, budget, page_bytes, slots, state))


WINDOW_CHUNK_FLOOR = 512   # a pass outside the scheduler (FP8 calibration: warmup.KV_CALIBRATION_TOKENS)


def _plan_windowed(c: EngineConfig, specs, windowed, kv_dtype: torch.dtype, max_model_len: int,
                   on_cuda: bool) -> MemoryPlan:
    """Windowed layers (kvcache/window.py) next to full ones: the full layers' pages for the
    budget, the windowed layers' pool at its bound (spec.window_pool_pages), never more pages
    than the full layers have (a windowed page is only held where a full one is)."""
    full_bytes = paged_bytes([s for s in specs if window_of(s) is None], c.page_size, kv_dtype)
    win_bytes = paged_bytes(windowed, c.page_size, kv_dtype)
    bound = window_pool_pages(window_of(windowed[0]), c.page_size, c.max_num_seqs,
                              max(c.max_num_batched_tokens, WINDOW_CHUNK_FLOOR))
    budget = kv_budget(c, full_bytes, max_model_len, on_cuda) + (0 if c.kv_cache_bytes else bound * win_bytes)
    mirrored = max(2, budget // (full_bytes + win_bytes))
    if bound >= mirrored:
        return MemoryPlan(full_bytes + win_bytes, 0, 0, mirrored, mirrored)
    return MemoryPlan(full_bytes, 0, 0, max(2, (budget - bound * win_bytes) // full_bytes), bound)


def kv_budget(c: EngineConfig, page_bytes: int, max_model_len: int, on_cuda: bool) -> int:
    budget = c.kv_cache_bytes
    if budget == 0:  # enough for every sequence at full length, capped at 1/8 of free RAM
        want = c.max_num_seqs * max_model_len * page_bytes // c.page_size
        if on_cuda:   # in VRAM: a quarter of what the dense weights left
            from freetoken_py.residency.elastic import cuda_free_bytes   # (as the slots will see it)

            budget = min(want, cuda_free_bytes() // 4)
        else:
            budget = min(want, psutil.virtual_memory().available // 8)
    return budget


def snapshot_slot_count(c: EngineConfig, state_bytes: int, budget: int) -> int:
    """Hybrids with the prefix cache: prefix_snapshots, else a quarter of the KV budget in
    snapshots (at least 2, at most 4 per sequence); see num_pages for whose bytes they are."""
    if not state_bytes or not c.enable_prefix_cache:
        return 0
    if c.prefix_snapshots:
        return c.prefix_snapshots
    return max(2, min(4 * c.max_num_seqs, budget // 4 // state_bytes))


def num_pages(c: EngineConfig, budget: int, page_bytes: int, snapshot_slots: int, state_bytes: int) -> int:
    """Pages of the KV budget. An explicit budget (kv_cache_bytes) holds the prefix-state
    snapshots too (hybrids), so theirs is taken out first; the automatic one sizes the pages
    for every sequence at full length and the snapshots come on top."""
    if c.kv_cache_bytes:
        held, each = snapshot_slots * state_bytes, state_bytes
        if c.prefix_snapshots and budget - held < 2 * page_bytes:
            raise FreetokenError(
                f"prefix_snapshots (--prefix-snapshots) {c.prefix_snapshots}: that many state snapshots "
                f"take {held / 2**30:.3f} GiB ({each} B each) of the {budget / 2**30:.3f} GiB KV "
                "budget (--kv-cache-gb), leaving no room for pages; ask for fewer or a larger budget")
        budget -= held
    return max(2, budget // page_bytes)
