"""OpenAI wire format: /v1/chat/completions, /v1/completions, /v1/models.

Chunks follow what OpenCode and the `openai` SDK consume: role only in the first delta, tool calls
keyed by `index` (id and name first, then arguments), `finish_reason` "tool_calls", with
`stream_options.include_usage` a last chunk with empty `choices` carrying usage, then `[DONE]`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from freetoken_py import __version__
from freetoken_py.core import MAX_LOGPROBS, SamplingParams
from freetoken_py.server.chat import openai_messages, openai_template_kwargs, openai_tools
from freetoken_py.server.constraints import openai_constrained
from freetoken_py.server.generation import (
    Prepared,
    collect_all_or_disconnect,
    make_params,
    prepare_chat,
    stream_error,
)
from freetoken_py.server.logprobs import TokenText, chat_fields, chat_logprobs, completion_logprobs
from freetoken_py.server.media import openai_media
from freetoken_py.server.protocol import (
    bad,
    get,
    get_stop,
    openai_error_body,
    parse_json_object,
    sampling_fields,
)
from freetoken_py.server.sse import (
    KEEPALIVE_COMMENT,
    Final,
    Logprobs,
    SSEResponse,
    data_line,
    engine_events,
    merged,
)
from freetoken_py.server.toolcalls import (
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallStart,
)

router = APIRouter()
# OpenAI's schema wants a string: the build serving the request (the model is in `model`)
SYSTEM_FINGERPRINT = f"fp_freetoken_{__version__}"


def _common(st, body: dict, min_tokens: int = 1) -> tuple[dict, int | None, int]:
    """Sampling fields, max_tokens and n, validated (n: at most --max-num-seqs, which run at once)."""
    n = get(body, "n", int, 1, lo=1)
    if n > st.llm.config.max_num_seqs:
        raise bad(f"'n' is {n}, but this server runs at most {st.llm.config.max_num_seqs} sequences at once "
                  "(--max-num-seqs)", "n")
    sampling = sampling_fields(body)
    sampling.update(presence_penalty=get(body, "presence_penalty", float, lo=-2.0, hi=2.0),
                    frequency_penalty=get(body, "frequency_penalty", float, lo=-2.0, hi=2.0))
    sampling["logit_bias"] = _logit_bias(body, st.llm.args.vocab_size)
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise bad("'functions' / 'function_call' (deprecated) are not supported; send 'tools' / 'tool_choice'",
                  "functions" if body.get("functions") is not None else "function_call")
    max_tokens = get(body, "max_completion_tokens", int, lo=min_tokens)
    if max_tokens is None:
        max_tokens = get(body, "max_tokens", int, lo=min_tokens)
    return sampling, max_tokens, n


def _refuse_unavailable_outputs(body: dict) -> None:
    """Chat fields asking for output this server cannot make: a 400, not text without it."""
    modalities = body.get("modalities")
    if body.get("audio") is not None or (isinstance(modalities, list) and "audio" in modalities):
        raise bad("audio output is not supported (text only)", "audio" if body.get("audio") is not None else "modalities")
    if body.get("web_search_options") is not None:
        raise bad("'web_search_options' is not supported: this server has no web search", "web_search_options")


def _logit_bias(body: dict, vocab: int) -> tuple[tuple[int, float], ...] | None:
    """{"token id": bias in [-100, 100]} -> SamplingParams.logit_bias."""
    value = get(body, "logit_bias", dict)
    if value is None:
        return None
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.strip().isdigit() and int(key) < vocab):
            raise bad(f"'logit_bias' keys must be token ids in [0, {vocab}) (got {key!r})", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad(f"'logit_bias' values must be numbers in [-100, 100] (got {bias!r})", "logit_bias")
        out.append((int(key), float(bias)))
    return tuple(out)


def _n_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One SamplingParams per choice: a seed gives choice i the seed + i (the same seed would give
    n equal samples); without one every choice draws from the shared generator."""
    if params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=(params.seed + i) % 2**63) for i in range(n)]


def _usage(num_prompt: int, finals: list[Final | None], num_output: int) -> dict:
    """The prompt counts once whatever n (its cached part: the first choice's; the others read
    it from the prefix cache: /v1/freetoken/stats counts each)."""
    first = finals[0] if finals else None
    cached = first.output.num_cached_tokens if first and first.output else 0
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _num_output(finals: list[Final]) -> int:
    return sum(len(f.output.token_ids) for f in finals)


def _finish_reason(final: Final, has_tools: bool) -> str:
    reason = final.output.finish_reason
    return "tool_calls" if has_tools and reason == "stop" else reason


# ---- chat completions -----------------------------------------------------------------------
@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    st = request.app.state.freetoken
    body = parse_json_object(await request.body())
    openai_media(body, st.llm.args.model_type)  # images / audio / files: a 400, not dropped
    messages, tools = openai_messages(body, st.limits), openai_tools(body, st.limits)
    sampling, max_tokens, n = _common(st, body)
    _refuse_unavailable_outputs(body)
    top = chat_fields(body)
    stop = get_stop(body, "stop", st.limits)
    stream_flag = get(body, "stream", bool, False)
    opts = get(body, "stream_options", dict, {})
    thinking = openai_template_kwargs(body, body.get("reasoning_effort"))  # the template's enable_thinking
    prep = await prepare_chat(st.llm, st.engine, messages, tools, sampling, max_tokens, stop, thinking)
    prep = await openai_constrained(prep, body, tools, st.llm.tokenizer)   # tool_choice, response_format
    prep.params = dataclasses.replace(prep.params, logprobs=top)
    meta = dict(id="chatcmpl-" + secrets.token_hex(12), created=int(time.time()),
                model=body.get("model") if isinstance(body.get("model"), str) else st.model_name)
    parsers = [prep.parser() for _ in range(n)]
    streams = st.engine.submit_n(prep.prompt_ids, _n_params(prep.params, n), get(body, "cache_salt", str))
    if stream_flag:
        usage = bool(opts.get("include_usage"))
        chunks = _chat_chunks(st, streams, parsers, prep, meta, usage)
        return SSEResponse(chunks, on_close=lambda: [st.engine.abort(s) for s in streams])
    got = await collect_all_or_disconnect(request.receive, st, streams, parsers)
    if got is None:
        return Response(status_code=499)
    return JSONResponse(_chat_body(got, prep, meta, TokenText(st.llm.tokenizer)))


def _chat_body(got: list, prep: Prepared, meta: dict, text: TokenText) -> dict:
    choices = []
    for i, g in enumerate(got):
        parsed, final = g.parsed, g.final
        message = {"role": "assistant", "content": parsed.content if (parsed.content or not parsed.tool_calls) else None,
                   "refusal": None}
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.tool_calls]
        choices.append({"index": i, "message": message, "logprobs": chat_logprobs(final.output.logprobs, text),
                        "finish_reason": _finish_reason(final, bool(parsed.tool_calls))})
    finals = [g.final for g in got]
    return {**meta, "object": "chat.completion", "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices,
            "usage": _usage(len(prep.prompt_ids), finals, _num_output(finals))}


def chat_delta(ev) -> dict | None:
    """A parser event as a chat.completion.chunk delta (None: an event this wire format does not
    carry, e.g. a tool call's end). Tool calls: id and name first, then the arguments."""
    if isinstance(ev, TextDelta):
        return {"content": ev.text}
    if isinstance(ev, ReasoningDelta):
        return {"reasoning_content": ev.text}
    if isinstance(ev, ToolCallStart):
        return {"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                "function": {"name": ev.name, "arguments": ""}}]}
    if isinstance(ev, ToolCallArgs):
        return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]}
    return None


async def _chat_chunks(st, streams, parsers, prep: Prepared, meta: dict, include_usage: bool):
    """The n choices' chunks as they come, then (with include_usage) one usage chunk, then [DONE]."""
    finals: list[Final] = []
    text = TokenText(st.llm.tokenizer)
    async for line in merged([_chat_choice(st, s, p, meta, i, include_usage, finals, text)
                              for i, (s, p) in enumerate(zip(streams, parsers))]):
        yield line
    if include_usage and len(finals) == len(streams):
        yield data_line({**meta, "object": "chat.completion.chunk", "system_fingerprint": SYSTEM_FINGERPRINT,
                         "choices": [], "usage": _usage(len(prep.prompt_ids), finals, _num_output(finals))})
    yield "data: [DONE]\n\n"


async def _chat_choice(st, stream, parser, meta: dict, index: int, include_usage: bool, finals: list,
                       text: TokenText):
    """One choice's chunks. Logprobs ride on the next chunk after their tokens (the text the
    parser lets out; an output whose text is held back sends them on an empty delta)."""
    def chunk(delta: dict, finish: str | None = None, lps: list | None = None) -> str:
        body = {**meta, "object": "chat.completion.chunk", "system_fingerprint": SYSTEM_FINGERPRINT,
                "choices": [{"index": index, "delta": delta, "logprobs": chat_logprobs(lps or None, text),
                             "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return data_line(body)

    yield chunk({"role": "assistant", "content": ""})  # at once: headers + first bytes before prefill
    has_tools, pending = False, []
    logprobs = stream.params.logprobs is not None
    async for ev in engine_events(st.engine, stream, parser, st.limits.ping_interval_s, logprobs):
        if ev is None:
            yield KEEPALIVE_COMMENT
        elif isinstance(ev, Logprobs):
            if pending:
                yield chunk({}, lps=pending)
            pending = list(ev.tokens)
        elif (delta := chat_delta(ev)) is not None:
            has_tools = has_tools or isinstance(ev, ToolCallStart)
            yield chunk(delta, lps=pending)
            pending = []
        elif isinstance(ev, Final):
            if ev.error:
                yield data_line(openai_error_body(stream_error(ev)))
                break
            yield chunk({}, _finish_reason(ev, has_tools), lps=pending)
            finals.append(ev)


# ---- completions ----------------------------------------------------------------------------
def _completion_prompt(st, body: dict) -> tuple[list[int], str]:
    """The prompt's ids and its text (what `echo` returns: the string sent, or the ids decoded)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return st.llm.encode_prompt(prompt), prompt
    vocab = st.llm.args.vocab_size
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < vocab for t in prompt):
            raise bad(f"prompt token ids must be in [0, {vocab})", "prompt")
        tok = st.llm.tokenizer
        return list(prompt), tok.decode(list(prompt), skip_special_tokens=False) if tok else ""
    raise bad("'prompt' must be a string or an array of token ids (one prompt per request)", "prompt")


def _completion_fields(body: dict, n: int) -> tuple[int | None, bool]:
    """`logprobs` (0..20 alternatives; OpenAI allows 5, vLLM 20) and `echo`; suffix and a best_of
    other than n are refused (they would change the output)."""
    if body.get("suffix"):
        raise bad("'suffix' (fill-in-the-middle) is not supported", "suffix")
    best_of = get(body, "best_of", int, n, lo=1)
    if best_of != n:
        raise bad("'best_of' is not supported (only best_of equal to n, which returns every sample)", "best_of")
    return get(body, "logprobs", int, lo=0, hi=MAX_LOGPROBS), get(body, "echo", bool, False)


@router.post("/v1/completions")
async def completions(request: Request):
    st = request.app.state.freetoken
    body = parse_json_object(await request.body())
    sampling, max_tokens, n = _common(st, body, min_tokens=0)
    k, echo = _completion_fields(body, n)
    if max_tokens == 0 and not echo:
        raise bad("'max_tokens' 0 needs 'echo': true (it returns the prompt, scored)", "max_tokens")
    stop = get_stop(body, "stop", st.limits)
    ids, prompt_text = await asyncio.to_thread(_completion_prompt, st, body)
    st.engine.check_prompt(len(ids))
    score = (k if k is not None else 0) if max_tokens == 0 else k if echo else None   # prompt logprobs
    params = make_params(st.llm, st.engine, sampling, max_tokens if max_tokens is not None else 16, stop, len(ids),
                         logprobs=k, prompt_logprobs=score)
    if max_tokens == 0:
        params = dataclasses.replace(params, max_tokens=0)
    prep = Prepared(ids, params)
    meta = dict(id="cmpl-" + secrets.token_hex(12), created=int(time.time()),
                model=body.get("model") if isinstance(body.get("model"), str) else st.model_name)
    parsers = [prep.parser() for _ in range(n)]
    stream_flag = get(body, "stream", bool, False)  # validated before submitting (see chat_completions)
    usage = bool(get(body, "stream_options", dict, {}).get("include_usage"))
    echoed = prompt_text if echo else None
    streams = st.engine.submit_n(ids, _n_params(params, n), get(body, "cache_salt", str))
    if stream_flag:
        return SSEResponse(_completion_chunks(st, streams, parsers, prep, meta, usage, echoed),
                           on_close=lambda: [st.engine.abort(s) for s in streams])
    got = await collect_all_or_disconnect(request.receive, st, streams, parsers)
    if got is None:
        return Response(status_code=499)
    text = TokenText(st.llm.tokenizer)
    choices = [{"index": i, "text": (echoed or "") + g.parsed.content,
                "logprobs": _completion_choice_logprobs(g.final.output, k, echoed, text),
                "finish_reason": g.final.output.finish_reason} for i, g in enumerate(got)]
    finals = [g.final for g in got]
    return JSONResponse({**meta, "object": "text_completion", "system_fingerprint": SYSTEM_FINGERPRINT,
                         "choices": choices, "usage": _usage(len(ids), finals, _num_output(finals))})


def _completion_choice_logprobs(out, k: int | None, echoed: str | None, text: TokenText) -> dict | None:
    """The echoed prompt's tokens (the first with null logprobs), then the generated ones."""
    if k is None:
        return None
    parts = []
    if echoed is not None:
        parts.append(completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, text))
    parts.append(completion_logprobs(out.token_ids, out.logprobs, text, len(echoed or "")))
    return {key: [v for p in parts for v in p[key]] for key in parts[0]}


async def _completion_chunks(st, streams, parsers, prep: Prepared, meta: dict, include_usage: bool,
                             echoed: str | None):
    finals: list[Final] = []
    text = TokenText(st.llm.tokenizer)
    yield KEEPALIVE_COMMENT  # headers at once
    async for line in merged([_completion_choice(st, s, p, meta, i, include_usage, finals, text, echoed)
                              for i, (s, p) in enumerate(zip(streams, parsers))]):
        yield line
    if include_usage and len(finals) == len(streams):
        yield data_line({**meta, "object": "text_completion", "system_fingerprint": SYSTEM_FINGERPRINT,
                         "choices": [], "usage": _usage(len(prep.prompt_ids), finals, _num_output(finals))})
    yield "data: [DONE]\n\n"


async def _completion_choice(st, stream, parser, meta: dict, index: int, include_usage: bool, finals: list,
                             text: TokenText, echoed: str | None):
    """One choice's chunks: with echo the prompt first (with logprobs: once its scores came with
    the first output); logprobs ride on the next text chunk after their tokens."""
    def chunk(piece: str, finish: str | None = None, lps: dict | None = None) -> str:
        body = {**meta, "object": "text_completion", "system_fingerprint": SYSTEM_FINGERPRINT,
                "choices": [{"index": index, "text": piece, "logprobs": lps, "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return data_line(body)

    logprobs = stream.params.logprobs is not None
    offset, pending = len(echoed or ""), []

    def lps() -> dict | None:
        nonlocal pending, offset
        if not logprobs:
            return None
        out = completion_logprobs([e.token_id for e in pending], pending, text, offset)
        offset += sum(len(t) for t in out["tokens"])
        pending = []
        return out

    if echoed is not None and not logprobs:
        yield chunk(echoed)
    async for ev in engine_events(st.engine, stream, parser, st.limits.ping_interval_s, logprobs):
        if ev is None:
            yield KEEPALIVE_COMMENT
        elif isinstance(ev, Logprobs):
            if ev.prompt is not None and echoed is not None:
                yield chunk(echoed, lps=completion_logprobs(stream.prompt_ids, ev.prompt, text))
            if pending:
                yield chunk("", lps=lps())
            pending = list(ev.tokens)
        elif isinstance(ev, TextDelta):
            yield chunk(ev.text, lps=lps())
        elif isinstance(ev, Final):
            if ev.error:
                yield data_line(openai_error_body(stream_error(ev)))
                break
            yield chunk("", ev.output.finish_reason, lps=lps() if pending else None)
            finals.append(ev)


# ---- models ---------------------------------------------------------------------------------
def _model_card(st) -> dict:
    return {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "freetoken",
            "max_model_len": st.engine.context_limit, "context_length": st.engine.context_limit,
            "max_output_tokens": st.engine.context_limit - 1}  # a prompt needs one token at least


@router.get("/v1/models")
async def list_models(request: Request):
    st = request.app.state.freetoken
    return {"object": "list", "data": [_model_card(st)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str):
    return _model_card(request.app.state.freetoken)  # any name maps to the loaded model
