"""Start-up passes the engine runs before its first request, each a throwaway request outside the
scheduler (nothing is published to the prefix cache): FP8 KV calibration and the numba kernels'
warm-up."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from freetoken_py.core import Request, SamplingParams
from freetoken_py.engine.runner import ScheduledChunk
from freetoken_py.errors import FreetokenError
from freetoken_py.utils.progress import progress_bar

if TYPE_CHECKING:
    from freetoken_py.engine.engine import Engine

CORPUS_DIR = Path(__file__).parent.parent / "data" / "corpus"   # shipped real text (its README: sources, licence)
KV_CALIBRATION_TOKENS = 512   # FP8 KV scales: a prefill of this much shipped prose and code
RANDOM_CALIBRATION_TOKENS = 64   # without a tokenizer: the earlier fixed pseudo-random ids, as many as before


def calibrate_kv_at_start(engine: Engine) -> dict:
    """FP8 KV: fix the per-(layer, head) scales once, before any request (so no page is ever
    rescaled and the cache namespace never changes): from the `--kv-scales` file when it
    exists (made for this model and configuration), else from a prefill of the shipped
    calibration text (`calibration_ids`), then written to that file when one is named.
    Returns where the scales came from ({} without FP8)."""
    from freetoken_py import kv_scales

    cache, c = engine.runner.cache, engine.config
    if not cache.quantized:
        return {}
    path = c.kv_scales
    key = kv_scales.scales_key(Path(c.model), engine.backend, str(engine.model.dtype), c.expert_dtype,
                               c.dense_dtype, c.expert_group_size, c.prefill_expert_dtype)
    if path and Path(path).exists():
        k, v, source = kv_scales.load_scales(Path(path), key)
        try:
            cache.set_scales(k, v)
        except ValueError as exc:
            raise FreetokenError(f"--kv-scales {path}: {exc}") from None
        return source
    ids, what = calibration_ids(engine)
    calibrate_kv(engine, ids)
    source = {"source": what, "tokens": len(ids)}
    if path:
        kv_scales.save_scales(Path(path), key, cache.k_scale, cache.v_scale, source)
    return source


def calibration_ids(engine: Engine, num_tokens: int = KV_CALIBRATION_TOKENS) -> tuple[list[int], str]:
    """Token ids the FP8 scales are calibrated on, and what they are: half prose, half code
    from the shipped corpus (`data/corpus/calib_*.txt`, kept apart from the evaluation
    text) in the model's own tokenizer; without a tokenizer, the fixed pseudo-random ids of
    before (64 of them: the same scales as before for such a model)."""
    n = min(num_tokens, engine.kv_capacity_tokens - 1, engine.max_model_len - 1)
    tok = engine.tokenizer
    if tok is None:
        n = min(n, RANDOM_CALIBRATION_TOKENS)
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, engine.args.vocab_size, (n,), generator=g).tolist(), "random ids (no tokenizer)"
    parts = [tok.encode((CORPUS_DIR / f"calib_{kind}.txt").read_text(), add_special_tokens=False)
             for kind in ("prose", "code")]
    return parts[0][:n // 2] + parts[1][:n - n // 2], "corpus calib_prose.txt + calib_code.txt"


def calibrate_kv(engine: Engine, token_ids: list[int]) -> None:
    """Calibrate the FP8 scales again from a prefill of `token_ids` (each layer's first write
    fixes its per-head absmax x margin; nothing is published to the prefix cache). Only
    while no request holds pages."""
    cache, n = engine.runner.cache, len(token_ids)
    cache.recalibrate()
    engine.forget_namespace()
    req = _throwaway(engine, list(token_ids), n)
    try:
        engine.runner.forward_batch([ScheduledChunk(req, n)])
    finally:
        _release(engine, req)
    cache.clipped_per_layer.zero_()     # (the calibration's own write cannot clip; counted from here)


def warm_kernels(engine: Engine) -> None:
    """cpu backend: a 3-token prefill and one decode step of a throwaway request, so numba
    compiles (first run on a machine, ~30 s) or loads from its disk cache (~1 s) the kernels
    this model's formats need now, under a progress bar, instead of inside the first
    request's time to first token. Nothing is published to the prefix cache."""
    ps = engine.config.page_size
    if engine.backend != "cpu" or engine.kv_capacity_tokens < 4 or engine.allocator.num_free < -(-4 // ps):
        return
    req = _throwaway(engine, [t % engine.args.vocab_size for t in (1, 2, 3)], 4)
    try:
        with progress_bar("Preparing CPU kernels (compiled once per machine)", 2,
                          engine.config.show_progress) as advance:
            engine.runner.forward_batch([ScheduledChunk(req, 3)])  # prefill path: grouped experts, GEMM
            advance()
            req.output_token_ids.append(0)
            engine.runner.forward_batch([ScheduledChunk(req, 1)])  # decode path: the fused step
            advance()
    finally:
        _release(engine, req)
        if engine.runner.governor is not None:
            engine.runner.governor.reset()  # those step times include compiling / loading kernels


def _throwaway(engine: Engine, ids: list[int], num_tokens: int) -> Request:
    """A request run outside the scheduler, with pages for `num_tokens` and (hybrids) a state slot."""
    req = Request(ids, SamplingParams())
    req.page_table = engine.allocator.allocate(-(-num_tokens // engine.config.page_size))
    req.state_slot = engine.runner.states.allocate() if engine.runner.states is not None else None
    return req


def _release(engine: Engine, req: Request) -> None:
    engine.allocator.release(req.page_table)
    if req.state_slot is not None:
        engine.runner.states.free(req.state_slot)
        req.state_slot = None
