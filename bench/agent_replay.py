"""Replay an agent conversation: time-to-first-token per turn with and without the prefix cache,
against llama.cpp with its prompt cache, plus the integrity check's decode cost and FP8 capacity.

    python bench/agent_replay.py [--turns 10] [--system-len 2000] [--call-len 50] [--result-len 250]
                                 [--gen-tokens 8] [--decode-tokens 32] [--decode-batch 4] [--no-llama-cpp]
                                 [--model dense|hybrid] [--layers 4] [--experts 32] [--tiny] [--samples 3]

The trace (seeded random token ids on the ~0.5B qwen3_moe of bench/common.py): a system prompt plus
tool schemas of --system-len tokens, then each turn the request is the whole history; the engine
generates --gen-tokens tokens, and the client appends its own rendering of the assistant's tool call
(--call-len tokens, deliberately NOT the generated tokens, as agents re-serialise tool-call JSON)
and a tool result (--result-len tokens). So every turn diverges from the cached generation right
after the previous prompt: the cache can serve only whole pages before that point.

Per turn: prompt length, cached tokens, TTFT with the cache, TTFT without it, two "prefill only the
new tokens" baselines — the uncached suffix as a stand-alone prompt (no attention over the cached
context, a strict floor no engine reaches) and the uncached suffix computed by the runner alone
with the context already in the KV cache (the same attention work as any cached turn, so the ratio
is what the cache machinery and page granularity cost; the median of --samples runs interleaved
around the cached turn, one before it and the rest after) — and llama.cpp's TTFT (llama-cpp-python's `Llama.generate` reuses the longest
common prefix of its previous evaluation, which is llama.cpp's prompt cache). Prints one JSON line.

--model hybrid: the same trace on a hybrid (Gated DeltaNet + full attention) checkpoint, the
Qwen3.6-35B-A3B-shaped one of bench/hybrid_decode.py (real widths, --layers in the 3:1 pattern,
--experts; --tiny: its smoke geometry), where freetoken resumes each turn from a snapshot of the
recurrent state (kvcache/snapshots.py), against llama.cpp on the same weights (its qwen35moe
conversion). llama_cpp.server answers a completion through the same `Llama.generate` (its prompt
field takes text only, so this token-id trace calls generate in-process); per turn the row adds
what llama.cpp reused (`llama_cpp_reused_tokens`: the prefix it kept when its memory could be
truncated there, 0 when it re-processed the whole prompt, as it must for recurrent memory it
cannot roll back). The integrity and FP8 sections are the dense line's only.

Every row also counts the cached turn's path to its first token (`ttft_path`: forward passes,
tokens computed, seconds inside the forward passes and outside them, and for hybrids the state
bytes copied / checksummed / zeroed), so a ratio above 1 can be told apart: more work on the
critical path shows in the counts and `outside_forward_s`, noise only in the timings.
"""
from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def make_trace(args, vocab: int) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    import torch

    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    return rand(args.system_len), [(rand(args.call_len), rand(args.result_len)) for _ in range(args.turns)]


def _ttft(llm, prompt, n):
    from freetoken_py.core import SamplingParams

    gc.collect()  # every timed run starts from the same heap (no collection of an earlier run's garbage inside it)
    out = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
    return out.ttft_s, out.num_cached_tokens


def _state_counts(llm) -> dict:
    """Hybrids: the snapshot store's and state pool's byte counters (kvcache/snapshots.py)."""
    st = getattr(llm, "snapshots", None)
    if st is None:
        return {}
    return {"state_bytes_copied": st.bytes_copied, "state_bytes_checksummed": st.bytes_checksummed,
            "state_bytes_zeroed": st.pool.bytes_zeroed}


def _ttft_path(llm, prompt, n) -> tuple[float, int, dict]:
    """_ttft through add_request / step, with what the engine did before the first token counted:
    forward passes, tokens computed, the seconds inside the forward passes (the rest of the TTFT is
    the machinery: admission, prefix match, snapshot restore / capture / checksum, publishing,
    sampling) and the state bytes copied / checksummed / zeroed."""
    from freetoken_py.core import SamplingParams

    forward, acc = llm.runner.forward_batch, {"passes": 0, "tokens_computed": 0, "forward_s": 0.0}

    def timed(chunks, *a, **k):
        t = time.perf_counter()
        try:
            return forward(chunks, *a, **k)
        finally:
            acc["forward_s"] += time.perf_counter() - t
            acc["passes"] += 1
            acc["tokens_computed"] += sum(ch.num_new for ch in chunks)

    gc.collect()
    before = _state_counts(llm)
    llm.runner.forward_batch = timed
    try:
        req = llm.add_request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        while not req.output_token_ids:
            llm.step()
        path = dict(acc) | {k: v - before[k] for k, v in _state_counts(llm).items()}
        while llm.has_unfinished:
            llm.step()
    finally:
        llm.runner.forward_batch = forward
    ttft = req.first_token_time - req.arrival_time
    path["forward_s"] = round(path["forward_s"], 4)
    path["outside_forward_s"] = round(ttft - path["forward_s"], 4)
    return ttft, req.num_cached_tokens, path


def _llama_ttft(peer, prompt, n) -> float:
    t = time.perf_counter()
    ttft = None
    for i, _ in enumerate(peer.llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
        ttft = ttft or time.perf_counter() - t
        if i + 1 >= n:
            break
    return ttft


def _llama_reuse_probe(peer) -> list:
    """Records llama.cpp's memory truncations: Llama.generate keeps a common prefix of p tokens
    only when its first kv_cache_seq_rm(-1, p, -1) succeeds. Returns a list that each call
    appends (p, ok) to (each eval truncates too; `_llama_reused` picks the prefix-match call)."""
    calls, ctx = [], peer.llm._ctx
    seq_rm = ctx.kv_cache_seq_rm

    def recorded(seq_id, p0, p1):
        ok = seq_rm(seq_id, p0, p1)
        calls.append((p0, bool(ok)))
        return ok

    ctx.kv_cache_seq_rm = recorded
    return calls


def _llama_prefix(peer, prompt: list[int]) -> int:
    """The prefix Llama.generate will try to keep for `prompt` (its own rule: the common prefix
    with what it evaluated last, one token less when that is the whole prompt)."""
    lp = 0
    for a, b in zip(peer.llm._input_ids[:peer.llm.n_tokens], prompt):
        if a != b:
            break
        lp += 1
    return lp - 1 if lp == len(prompt) else lp


def _prefill_suffix_s(llm, history: list[int], cached: int) -> float:
    """Seconds to compute exactly the uncached suffix with the context already in the KV cache and
    pick the first token: the runner alone (no scheduler, no prefix matching), the context
    prefilled beforehand and not timed. The same attention over the context as any engine's
    cached turn, so this is the floor a prefix cache can reach."""
    from freetoken_py.core import Request, SamplingParams
    from freetoken_py.engine.runner import ScheduledChunk

    req = Request(list(history), SamplingParams())
    req.page_table = llm.allocator.allocate(-(-len(history) // llm.config.page_size))
    states = llm.runner.states  # hybrids: the recurrent state is computed with the context too
    req.state_slot = states.allocate() if states is not None else None
    try:
        budget = llm.config.max_num_batched_tokens
        while req.num_computed < cached:  # the context, in the engine's own chunk sizes
            llm.runner.forward_batch([ScheduledChunk(req, min(budget, cached - req.num_computed))])
        gc.collect()
        t = time.perf_counter()
        while req.num_computed < len(history):
            logits = llm.runner.forward_batch([ScheduledChunk(req, min(budget, len(history) - req.num_computed))])
        int(logits[-1].argmax())
        return time.perf_counter() - t
    finally:
        llm.allocator.release(req.page_table)
        if req.state_slot is not None:
            states.free(req.state_slot)


def _cached_at(llm, prompt: list[int]) -> int:
    """The tokens a cached turn of `prompt` will skip, read without touching the cache's state:
    the deepest page boundary before its last token (hybrids: holding a snapshot)."""
    from freetoken_py.core import Request, SamplingParams

    ns = llm._cache_namespace(Request([1], SamplingParams()))
    limit = (len(prompt) - 1) // llm.config.page_size * llm.config.page_size
    cache = llm.prefix_cache
    if getattr(llm, "snapshots", None) is None:
        return cache.match(ns, prompt[:limit]).num_tokens if cache is not None else 0
    for n in range(limit, 0, -llm.config.page_size):
        if cache.snapshot_at(ns, prompt[:n]) is not None:
            return n
    return 0


def replay(args, on, off, peer, system, turns) -> list[dict]:
    history, rows = list(system), []
    probe = _llama_reuse_probe(peer) if peer is not None and args.model == "hybrid" else None
    for t, (call, result) in enumerate(turns):
        # interleaved: the with-context baseline once before the cached turn and the rest after it
        # (it is repeatable: the cached turn is not, it changes the cache); ratios use its median
        pre = _cached_at(on, history) if t else 0
        suffixes = [_prefill_suffix_s(off, history, pre)] if pre else []
        ttft_on, cached, path = _ttft_path(on, history, args.gen_tokens)
        if pre != cached:
            suffixes = []  # the turn skipped another prefix than predicted: that sample measured other work
        ttft_off, _ = _ttft(off, history, args.gen_tokens)
        new_only, _ = _ttft(off, history[cached:], 1)
        suffixes += [_prefill_suffix_s(off, history, cached) for _ in range(args.samples - len(suffixes))]
        suffix = common.median(suffixes)
        row = {"turn": t + 1, "prompt_tokens": len(history), "cached_tokens": cached,
               "hit": cached > 0, "ttft_cache_s": round(ttft_on, 4), "ttft_nocache_s": round(ttft_off, 4),
               "prefill_new_only_s": round(new_only, 4), "ratio_vs_new_only": round(ttft_on / new_only, 3),
               "prefill_new_with_context_s": round(suffix, 4),
               "prefill_new_with_context_samples": [round(x, 4) for x in suffixes],
               "ratio_vs_new_with_context": round(ttft_on / suffix, 3),
               "ratio_forward_vs_new_with_context": round(path["forward_s"] / suffix, 3),
               "ttft_path": path}
        if peer is not None:
            before = len(probe) if probe is not None else 0
            want = _llama_prefix(peer, history) if probe is not None else 0
            row["ttft_llama_cpp_s"] = round(_llama_ttft(peer, history, args.gen_tokens), 4)
            row["ratio_vs_llama_cpp"] = round(ttft_on / row["ttft_llama_cpp_s"], 3)
            if probe is not None:   # kept only if its first truncation, to that prefix, succeeded
                first = probe[before] if len(probe) > before else None
                row["llama_cpp_reused_tokens"] = want if want > 0 and first == (want, True) else 0
        common.log(str(row))
        rows.append(row)
        history += call + result
    return rows


def _set_integrity(llm, enabled: bool) -> None:
    from freetoken_py.kvcache.tags import IntegrityTracker, NullTracker

    llm.tracker = llm.scheduler.tracker = (IntegrityTracker if enabled else NullTracker)(llm.allocator)


def integrity_cost(args, llm, context: list[int]) -> dict:
    """Decode tok/s of a batch sharing the agent context, check on vs off, interleaved rounds;
    plus the check's own time per step measured directly."""
    from freetoken_py.core import SamplingParams

    params = SamplingParams(max_tokens=args.decode_tokens + 1, temperature=0, ignore_eos=True)
    prompts = [context + [i] for i in range(args.decode_batch)]
    llm.generate(prompts, SamplingParams(max_tokens=1))  # cache the context: rounds measure decode
    rates = {True: [], False: []}
    for _ in range(args.rounds):
        for enabled in (True, False):
            _set_integrity(llm, enabled)
            outs = llm.generate(prompts, params)
            span = max(o.total_s for o in outs) - max(o.ttft_s for o in outs)
            rates[enabled].append(args.decode_batch * args.decode_tokens / span)
    _set_integrity(llm, True)
    reqs = [llm.add_request(p, SamplingParams(max_tokens=2, ignore_eos=True)) for p in prompts]
    llm.step()  # all admitted, pages recorded
    pages = sum(len(r.page_table) for r in reqs)
    t = time.perf_counter()
    for _ in range(200):
        llm.tracker.check()
    check_s = (time.perf_counter() - t) / 200
    while llm.has_unfinished:
        llm.step()
    on, off = common.median(rates[True]), common.median(rates[False])
    step_s = args.decode_batch / on
    return {"decode_tps_check_on": round(on, 2), "decode_tps_check_off": round(off, 2),
            "decode_cost_fraction": round(1 - on / off, 4), "samples_on": [round(x, 2) for x in rates[True]],
            "samples_off": [round(x, 2) for x in rates[False]], "check_us_per_step": round(check_s * 1e6, 1),
            "check_fraction_of_step": round(check_s / step_s, 5),
            "pages_checked": pages}


def _page_bytes(args, page_size: int, kv_dtype: str) -> int:
    import torch

    from freetoken_py.kvcache import KVCache
    from freetoken_py.kvcache.pool import FP8

    dt = {"bf16": torch.bfloat16, "fp8": FP8, "fp32": torch.float32}[kv_dtype]
    return KVCache.bytes_per_page(args.num_layers, page_size, args.num_kv_heads, args.head_dim, dt)


def fp8_capacity(llm, kv_bytes: int) -> dict:
    """Tokens the engine's own page sizing fits into the same KV memory, bf16 vs fp8 pages."""
    ps = llm.config.page_size
    return {f"max_cached_tokens_{k}": kv_bytes // _page_bytes(llm.args, ps, k) * ps for k in ("bf16", "fp8")
            } | {"kv_cache_bytes": kv_bytes}


def hybrid_main(args) -> None:
    """The hybrid model line (module docstring)."""
    import hybrid_decode

    from freetoken_py.kernels import configure_threads
    from freetoken_py.llm import LLM

    configure_threads(args.threads)
    name = f"qwen35moe-{'tiny' if args.tiny else 'real'}-l{args.layers}-e{args.experts}"
    model_dir = hybrid_decode.build(common.WORK / name, hybrid_decode.TINY if args.tiny else hybrid_decode.REAL,
                                    args.layers, args.experts)
    max_len = args.system_len + args.turns * (args.call_len + args.result_len) + args.gen_tokens + 64
    make = lambda cache: LLM(model_dir, dtype="bfloat16", max_model_len=max_len, show_progress=False,  # noqa: E731
                             backend=args.backend, enable_prefix_cache=cache, kv_dtype=args.kv_dtype,
                             max_num_seqs=2)
    on, off = make(True), make(False)
    peer, peer_error = None, None
    if not args.no_llama_cpp:
        try:
            peer = common.LlamaCppPeer(common.convert_to_gguf(model_dir, "bf16", hybrid_decode.CONVERT_ARGS),
                                       args.threads, n_ctx=max_len)
        except Exception as exc:  # conversion or load failed: say why in the JSON line
            peer_error = f"{type(exc).__name__}: {exc}"
            common.log(f"llama.cpp unavailable: {peer_error}")
    system, turns = make_trace(args, on.args.vocab_size)
    warm = [(t + 7) % on.args.vocab_size for t in system[:64]]
    _ttft(on, warm, 1), _ttft(off, warm, 1)
    rows = replay(args, on, off, peer, system, turns)
    later = rows[1:]
    result = {"bench": "agent_replay", "model": f"{name} (bench/hybrid_decode.py, layer types "
                                                f"{hybrid_decode.layer_types(args.layers)})",
              "backend": on.backend, "threads": args.threads, "turns": args.turns, "system_len": args.system_len,
              "call_len": args.call_len, "result_len": args.result_len, "gen_tokens": args.gen_tokens,
              "page_size": on.config.page_size, "kv_dtype": args.kv_dtype,
              "state_bytes_per_request": on.state_bytes_per_request, "kv_bytes_per_token": on.kv_bytes_per_token,
              "snapshot_slots": on.spare_state_slots(), "snapshot_every_pages": on.snapshot_every,
              "per_turn": rows,
              "min_cached_share_turn2plus": min((r["cached_tokens"] / r["prompt_tokens"] for r in later), default=None),
              "max_ratio_vs_new_only_turn2plus": max((r["ratio_vs_new_only"] for r in later), default=None),
              "max_ratio_vs_new_with_context_turn2plus": max((r["ratio_vs_new_with_context"] for r in later),
                                                             default=None),
              "max_ratio_forward_vs_new_with_context_turn2plus":
                  max((r["ratio_forward_vs_new_with_context"] for r in later), default=None),
              "max_outside_forward_s_turn2plus": max((r["ttft_path"]["outside_forward_s"] for r in later),
                                                     default=None),
              "snapshots": {"taken": on.snapshots.num_taken, "restored": on.snapshots.num_restored,
                            "mismatches": on.snapshots.num_mismatches,
                            "bytes_copied": on.snapshots.bytes_copied,
                            "bytes_checksummed": on.snapshots.bytes_checksummed}}
    if peer is not None:
        result["max_ratio_vs_llama_cpp_turn2plus"] = max((r["ratio_vs_llama_cpp"] for r in later), default=None)
        result["llama_cpp_reused_tokens_turn2plus"] = [r["llama_cpp_reused_tokens"] for r in later]
    if peer_error is not None:
        result["llama_cpp_error"] = peer_error
    common.emit(result)


def main() -> None:
    ap = common.bench_args(__doc__)
    for flag, default in (("--turns", 10), ("--system-len", 2000), ("--call-len", 50), ("--result-len", 250),
                          ("--gen-tokens", 8), ("--decode-batch", 4), ("--layers", 4), ("--experts", 32),
                          ("--samples", 3)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--kv-dtype", default="bf16", help="bf16 (as llama.cpp's f16 KV), fp8, or auto")
    ap.add_argument("--model", choices=("dense", "hybrid"), default="dense",
                    help="dense: the ~0.5B qwen3_moe; hybrid: the Qwen3.6-shaped Gated DeltaNet checkpoint")
    ap.add_argument("--tiny", action="store_true", help="--model hybrid: the smoke geometry (hidden 256)")
    args = ap.parse_args()
    if args.model == "hybrid":
        return hybrid_main(args)
    model_dir, _ = common.setup(args)
    from freetoken_py.llm import LLM

    max_len = args.system_len + args.turns * (args.call_len + args.result_len) + args.gen_tokens + 64
    from freetoken_py.models.loader import read_model_args

    kv_bytes = 2 * (args.decode_batch + 1) * max_len // 16 * _page_bytes(read_model_args(model_dir), 16, "fp32")
    make = lambda cache: LLM(model_dir, dtype="bfloat16", max_model_len=max_len, show_progress=False,  # noqa: E731
                             backend=args.backend, enable_prefix_cache=cache, kv_cache_bytes=kv_bytes,
                             kv_dtype=args.kv_dtype)
    on, off = make(True), make(False)
    peer = None if args.no_llama_cpp else common.LlamaCppPeer(common.convert_to_gguf(model_dir, "bf16"),
                                                              args.threads, n_ctx=max_len)
    system, turns = make_trace(args, on.args.vocab_size)
    warm = [(t + 7) % on.args.vocab_size for t in system[:64]]  # not a prefix of the trace
    _ttft(on, warm, 1), _ttft(off, warm, 1)  # warm-up (kernels compiled, caches touched)
    rows = replay(args, on, off, peer, system, turns)
    later = rows[1:]
    result = {"bench": "agent_replay", "model": "qwen3_moe ~0.49B (bench/common.py)", "backend": on.backend,
              "threads": args.threads, "turns": args.turns, "system_len": args.system_len,
              "call_len": args.call_len, "result_len": args.result_len, "gen_tokens": args.gen_tokens,
              "page_size": on.config.page_size, "kv_dtype": args.kv_dtype, "per_turn": rows,
              "max_ratio_vs_new_only_turn2plus": max((r["ratio_vs_new_only"] for r in later), default=None),
              "max_ratio_vs_new_with_context_turn2plus": max((r["ratio_vs_new_with_context"] for r in later),
                                                             default=None),
              "integrity": integrity_cost(args, on, system),
              "fp8": fp8_capacity(on, kv_bytes)}
    if peer is not None:
        result["max_ratio_vs_llama_cpp"] = max(r["ratio_vs_llama_cpp"] for r in rows)
    common.emit(result)


if __name__ == "__main__":
    main()
