"""`freetoken run`: one-shot generation (streamed or --json) and the interactive chat REPL."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from freetoken_py.core import RequestOutput
from freetoken_py.errors import FreetokenError


@dataclass(frozen=True)
class RunOptions:
    model_dir: Path
    prompt: str | None
    chat: bool
    system: str | None
    as_json: bool
    dtype: str
    max_model_len: int
    kv_cache_bytes: int
    backend: str = "auto"
    expert_dtype: str = "auto"
    dense_dtype: str = "auto"
    expert_cache: str = "auto"
    prefill_expert_dtype: str = "auto"   # --prefill-expert-dtype
    threads: int = 0
    kv_dtype: str = "auto"
    kv_scales: str = ""            # --kv-scales FILE (fp8 KV scales cache)
    prefix_cache: bool = True
    stats: bool = False
    residency: dict = field(default_factory=dict)  # EngineConfig residency_* / record_routing overrides
    snapshots: dict = field(default_factory=dict)  # EngineConfig prefix_snapshots / snapshot_every_pages (hybrids)
    sampling: dict = field(default_factory=dict)


def run_main(opts: RunOptions) -> None:
    from freetoken_py.kernels import configure_threads
    from freetoken_py.llm import GPU_HINT, LLM

    configure_threads(opts.threads or None)
    llm = LLM(opts.model_dir, dtype=opts.dtype, max_model_len=opts.max_model_len, backend=opts.backend,
              expert_dtype=opts.expert_dtype, dense_dtype=opts.dense_dtype, expert_cache=opts.expert_cache,
              prefill_expert_dtype=opts.prefill_expert_dtype,
              kv_cache_bytes=opts.kv_cache_bytes, max_num_seqs=4,
              show_progress=not opts.as_json, kv_dtype=opts.kv_dtype, kv_scales=opts.kv_scales, enable_prefix_cache=opts.prefix_cache,
              **opts.residency, **opts.snapshots)
    if llm.unused_gpu:
        print(GPU_HINT, file=sys.stderr)
    try:
        _run(llm, opts)
    finally:
        llm.save_routing()
        if opts.stats:
            _print_residency(llm)


def _print_residency(llm) -> None:
    if llm.residency is None:
        print("[--stats: the residency tiers are off; pass --gpu-experts (CUDA) or --emulate-gpu PROFILE]",
              file=sys.stderr)
        return
    llm.residency.flush_timing()
    print("\n".join(llm.residency.telemetry.format_lines()), file=sys.stderr)


def _run(llm, opts: RunOptions) -> None:
    params = llm.default_sampling(**opts.sampling)
    if opts.prompt is None:
        if opts.as_json:
            raise FreetokenError("--json needs a prompt")
        return _repl(llm, params, opts.system)
    if opts.chat:
        messages = ([{"role": "system", "content": opts.system}] if opts.system else [])
        prompt_ids = llm.chat_prompt_ids(messages + [{"role": "user", "content": opts.prompt}])
    else:
        prompt_ids = llm.encode_prompt(opts.prompt)
    t0 = time.perf_counter()
    final = _generate(llm, prompt_ids, params, echo=not opts.as_json)
    if opts.as_json:
        print(json.dumps(_json_result(final, t0)))
    else:
        print(file=sys.stdout, flush=True)
        _print_stats(final, llm.kv_bytes_per_token, llm.state_bytes_per_request)


def _generate(llm, prompt_ids: list[int], params, echo: bool) -> RequestOutput:
    final = None
    for out in llm.stream(prompt_ids, params):
        if echo and out.new_text:
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
        final = out
    return final


def _decode_rate(out: RequestOutput) -> float | None:
    if out.total_s is None or out.ttft_s is None or len(out.token_ids) < 2:
        return None
    span = out.total_s - out.ttft_s
    return (len(out.token_ids) - 1) / span if span > 0 else None


def _json_result(out: RequestOutput, t0: float) -> dict:
    return {
        "text": out.text, "token_ids": out.token_ids, "prompt_token_ids": out.prompt_token_ids,
        "finish_reason": out.finish_reason,
        "timings": {"prompt_tokens": len(out.prompt_token_ids), "cached_tokens": out.num_cached_tokens,
                    "completion_tokens": len(out.token_ids),
                    "ttft_s": out.ttft_s, "total_s": out.total_s, "decode_tokens_per_s": _decode_rate(out),
                    "wall_s": time.perf_counter() - t0},
    }


def _print_stats(out: RequestOutput, kv_bytes_per_token: int, state_bytes_per_request: int = 0) -> None:
    """kv_bytes_per_token: measured from the KV pool (an MLA model's latent + rope key; a hybrid's
    full-attention layers only); state_bytes_per_request: a hybrid's fixed per-request state."""
    rate = _decode_rate(out)
    rate_s = f"{rate:.1f} tok/s" if rate else "n/a"
    state = f"state {state_bytes_per_request} B/req | " if state_bytes_per_request else ""
    print(f"[prompt {len(out.prompt_token_ids)} tok ({out.num_cached_tokens} cached) | TTFT {out.ttft_s * 1000:.0f} ms | "
          f"decode {len(out.token_ids)} tok at {rate_s} | KV {kv_bytes_per_token} B/tok | {state}"
          f"finish: {out.finish_reason}]", file=sys.stderr)


def _repl(llm, params, system: str | None) -> None:
    has_template = llm.tokenizer is not None and llm.tokenizer.chat_template
    print("freetoken chat: type a message; /reset clears the conversation, /exit or Ctrl-D quits.",
          file=sys.stderr)
    messages = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            messages = messages[:1] if system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        ids = llm.chat_prompt_ids(messages) if has_template else llm.encode_prompt(line)
        out = _generate(llm, ids, params, echo=True)
        print(flush=True)
        _print_stats(out, llm.kv_bytes_per_token, llm.state_bytes_per_request)
        messages.append({"role": "assistant", "content": out.text})
