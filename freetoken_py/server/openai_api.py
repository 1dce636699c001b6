"""OpenAI wire format: /v1/chat/completions, /v1/completions, /v1/models.

Chunks follow what OpenCode and the `openai` SDK consume: role only in the first delta, tool calls
keyed by `index` (id and name first, then arguments), `finish_reason` "tool_calls", with
`stream_options.include_usage` a last chunk with empty `choices` carrying usage, then `[DONE]`.
"""
from __future__ import annotations

import asyncio
import secrets
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from freetoken_py.server.chat import openai_messages, openai_template_kwargs, openai_tools
from freetoken_py.server.constraints import openai_constrained
from freetoken_py.server.generation import (
    Prepared,
    collect_or_disconnect,
    make_params,
    prepare_chat,
    stream_error,
)
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
    SSEResponse,
    data_line,
    engine_events,
)
from freetoken_py.server.toolcalls import (
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallStart,
)

router = APIRouter()


def _common(body: dict) -> tuple[dict, int | None]:
    """Sampling fields, max_tokens and stop, validated; n must be 1."""
    n = get(body, "n", int, 1)
    if n != 1:
        raise bad("only n=1 is supported", "n")
    sampling = sampling_fields(body)
    sampling.update(presence_penalty=get(body, "presence_penalty", float, lo=-2.0, hi=2.0),
                    frequency_penalty=get(body, "frequency_penalty", float, lo=-2.0, hi=2.0))
    max_tokens = get(body, "max_completion_tokens", int, lo=1) or get(body, "max_tokens", int, lo=1)
    return sampling, max_tokens


def _usage(num_prompt: int, final: Final | None, num_output: int) -> dict:
    cached = final.output.num_cached_tokens if final and final.output else 0
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": cached}}


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
    sampling, max_tokens = _common(body)
    stop = get_stop(body, "stop", st.limits)
    stream_flag = get(body, "stream", bool, False)
    opts = get(body, "stream_options", dict, {})
    thinking = openai_template_kwargs(body, body.get("reasoning_effort"))  # the template's enable_thinking
    prep = await prepare_chat(st.llm, st.engine, messages, tools, sampling, max_tokens, stop, thinking)
    prep = await openai_constrained(prep, body, tools, st.llm.tokenizer)   # tool_choice, response_format
    meta = dict(id="chatcmpl-" + secrets.token_hex(12), created=int(time.time()),
                model=body.get("model") if isinstance(body.get("model"), str) else st.model_name)
    parser = prep.parser()
    stream = st.engine.submit(prep.prompt_ids, prep.params, get(body, "cache_salt", str))
    if stream_flag:
        usage = bool(opts.get("include_usage"))
        chunks = _chat_chunks(st, stream, parser, prep, meta, usage)
        return SSEResponse(chunks, on_close=lambda: st.engine.abort(stream))
    got = await collect_or_disconnect(request.receive, st, stream, parser)
    if got is None:
        return Response(status_code=499)
    return JSONResponse(_chat_body(got, prep, meta))


def _chat_body(got, prep: Prepared, meta: dict) -> dict:
    parsed, final = got.parsed, got.final
    message = {"role": "assistant", "content": parsed.content if (parsed.content or not parsed.tool_calls) else None}
    if parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in parsed.tool_calls]
    return {**meta, "object": "chat.completion", "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": _finish_reason(final, bool(parsed.tool_calls))}],
            "usage": _usage(len(prep.prompt_ids), final, len(final.output.token_ids))}


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


async def _chat_chunks(st, stream, parser, prep: Prepared, meta: dict, include_usage: bool):
    def chunk(delta: dict, finish: str | None = None) -> str:
        body = {**meta, "object": "chat.completion.chunk", "system_fingerprint": None,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return data_line(body)

    yield chunk({"role": "assistant", "content": ""})  # at once: headers + first bytes before prefill
    has_tools = False
    async for ev in engine_events(st.engine, stream, parser, st.limits.ping_interval_s):
        if ev is None:
            yield KEEPALIVE_COMMENT
        elif (delta := chat_delta(ev)) is not None:
            has_tools = has_tools or isinstance(ev, ToolCallStart)
            yield chunk(delta)
        elif isinstance(ev, Final):
            if ev.error:
                yield data_line(openai_error_body(stream_error(ev)))
                break
            yield chunk({}, _finish_reason(ev, has_tools))
            if include_usage:
                yield data_line({**meta, "object": "chat.completion.chunk", "system_fingerprint": None,
                                 "choices": [], "usage": _usage(len(prep.prompt_ids), ev, len(ev.output.token_ids))})
    yield "data: [DONE]\n\n"


# ---- completions ----------------------------------------------------------------------------
def _completion_prompt(st, body: dict) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return st.llm.encode_prompt(prompt)
    vocab = st.llm.args.vocab_size
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < vocab for t in prompt):
            raise bad(f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(prompt)
    raise bad("'prompt' must be a string or an array of token ids (one prompt per request)", "prompt")


@router.post("/v1/completions")
async def completions(request: Request):
    st = request.app.state.freetoken
    body = parse_json_object(await request.body())
    if body.get("echo") is True or body.get("logprobs") not in (None, 0) or body.get("suffix"):
        raise bad("echo, logprobs and suffix are not supported", "echo")
    if get(body, "best_of", int, 1) != 1:
        raise bad("only best_of=1 is supported", "best_of")
    sampling, max_tokens = _common(body)
    stop = get_stop(body, "stop", st.limits)
    ids = await asyncio.to_thread(_completion_prompt, st, body)
    st.engine.check_prompt(len(ids))
    params = make_params(st.llm, st.engine, sampling, max_tokens if max_tokens else 16, stop, len(ids))
    prep = Prepared(ids, params)
    meta = dict(id="cmpl-" + secrets.token_hex(12), created=int(time.time()),
                model=body.get("model") if isinstance(body.get("model"), str) else st.model_name)
    parser = prep.parser()
    stream_flag = get(body, "stream", bool, False)  # validated before submitting (see chat_completions)
    usage = bool(get(body, "stream_options", dict, {}).get("include_usage"))
    stream = st.engine.submit(ids, params, get(body, "cache_salt", str))
    if stream_flag:
        return SSEResponse(_completion_chunks(st, stream, parser, prep, meta, usage),
                           on_close=lambda: st.engine.abort(stream))
    got = await collect_or_disconnect(request.receive, st, stream, parser)
    if got is None:
        return Response(status_code=499)
    out = got.final.output
    return JSONResponse({**meta, "object": "text_completion", "system_fingerprint": None,
                         "choices": [{"index": 0, "text": got.parsed.content, "logprobs": None,
                                      "finish_reason": out.finish_reason}],
                         "usage": _usage(len(ids), got.final, len(out.token_ids))})


async def _completion_chunks(st, stream, parser, prep: Prepared, meta: dict, include_usage: bool):
    def chunk(text: str, finish: str | None = None) -> str:
        body = {**meta, "object": "text_completion", "system_fingerprint": None,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return data_line(body)

    yield KEEPALIVE_COMMENT  # headers at once
    async for ev in engine_events(st.engine, stream, parser, st.limits.ping_interval_s):
        if ev is None:
            yield KEEPALIVE_COMMENT
        elif isinstance(ev, TextDelta):
            yield chunk(ev.text)
        elif isinstance(ev, Final):
            if ev.error:
                yield data_line(openai_error_body(stream_error(ev)))
                break
            yield chunk("", ev.output.finish_reason)
            if include_usage:
                yield data_line({**meta, "object": "text_completion", "choices": [],
                                 "usage": _usage(len(prep.prompt_ids), ev, len(ev.output.token_ids))})
    yield "data: [DONE]\n\n"


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
