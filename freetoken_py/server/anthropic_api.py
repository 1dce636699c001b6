"""Anthropic Messages wire format: /v1/messages (streamed and not) and /v1/messages/count_tokens.

Streams use `event:` lines in the documented order: message_start (with usage.input_tokens:
Claude Code crashes without it), then per block content_block_start / *_delta / content_block_stop
(text, thinking + signature_delta, tool_use with input_json_delta), then message_delta with
stop_reason and usage, then message_stop; `ping` while waiting.
"""
from __future__ import annotations

import asyncio
import json
import secrets

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from freetoken_py.server.chat import anthropic_messages, anthropic_template_kwargs, anthropic_tools
from freetoken_py.server.constraints import anthropic_constrained
from freetoken_py.server.generation import (
    Prepared,
    collect_or_disconnect,
    prepare_chat,
    render_chat,
    stream_error,
)
from freetoken_py.server.media import anthropic_media
from freetoken_py.server.protocol import (
    anthropic_error_body,
    bad,
    get,
    get_stop,
    parse_json_object,
    sampling_fields,
)
from freetoken_py.server.sse import (
    Final,
    SSEResponse,
    engine_events,
    event_line,
)
from freetoken_py.server.toolcalls import (
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
)

router = APIRouter()
SIGNATURE = "freetoken-local"  # thinking blocks need one; ours are never verified (dropped from history)


def _tool_id(call_id: str) -> str:
    """Our own `call_...` ids in Anthropic's `toolu_...` style; an id the model wrote itself (Kimi's
    `functions.NAME:IDX`) is kept as written: the client sends it back and the template re-renders
    it, so the history holds the model's own tokens."""
    return "toolu_" + call_id[len("call_"):] if call_id.startswith("call_") else call_id


def _stop_reason(final: Final, stops: tuple[str, ...], has_tools: bool) -> tuple[str, str | None]:
    out = final.output
    if out.finish_reason == "length":
        return "max_tokens", None
    if isinstance(out.stop_reason, str) and out.stop_reason in stops:
        return "stop_sequence", out.stop_reason
    return ("tool_use" if has_tools else "end_turn"), None


def _usage(num_prompt: int, final: Final | None) -> dict:
    out = final.output if final else None
    cached = out.num_cached_tokens if out else 0
    return {"input_tokens": num_prompt - cached, "output_tokens": len(out.token_ids) if out else 0,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


async def _prepare(st, body: dict) -> tuple[Prepared, tuple[str, ...]]:
    anthropic_media(body, st.llm.args.model_type)  # image / document blocks: a 400, not dropped
    messages, tools = anthropic_messages(body, st.limits), anthropic_tools(body, st.limits)
    stops = get_stop(body, "stop_sequences", st.limits)
    if body.get("max_tokens") is None:   # the real API's 400 (Claude Code always sends it)
        raise bad("max_tokens: Field required", "max_tokens")
    max_tokens = get(body, "max_tokens", int, lo=1)
    prep = await prepare_chat(st.llm, st.engine, messages, tools, sampling_fields(body), max_tokens, stops,
                              anthropic_template_kwargs(body),  # thinking -> the template's enable_thinking
                              template_tools=anthropic_tools(body, st.limits, for_template=True))
    prep = await anthropic_constrained(prep, body, tools, st.llm.tokenizer)   # tool_choice, output_format
    return prep, stops


@router.post("/v1/messages")
async def messages(request: Request):
    st = request.app.state.freetoken
    body = parse_json_object(await request.body())
    prep, stops = await _prepare(st, body)
    model = body.get("model") if isinstance(body.get("model"), str) else st.model_name
    msg_id = "msg_" + secrets.token_hex(12)
    parser = prep.parser()
    stream_flag = get(body, "stream", bool, False)  # validated before submitting: a 400 must not leave work running
    stream = st.engine.submit(prep.prompt_ids, prep.params, get(body, "cache_salt", str))
    if stream_flag:
        events = _events(st, stream, parser, prep, stops, msg_id, model)
        return SSEResponse(events, on_close=lambda: st.engine.abort(stream))
    got = await collect_or_disconnect(request.receive, st, stream, parser)
    if got is None:
        return Response(status_code=499)
    parsed = got.parsed
    content = []
    if parsed.reasoning:
        content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": SIGNATURE})
    if parsed.content:
        content.append({"type": "text", "text": parsed.content})
    for call in parsed.tool_calls:
        content.append({"type": "tool_use", "id": _tool_id(call.id), "name": call.name,
                        "input": json.loads(call.arguments)})
    reason, seq = _stop_reason(got.final, stops, bool(parsed.tool_calls))
    return JSONResponse({"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
                         "stop_reason": reason, "stop_sequence": seq,
                         "usage": _usage(len(prep.prompt_ids), got.final)})


class _Blocks:
    """Open/close content blocks as the parser's events change kind; yields SSE strings."""

    def __init__(self):
        self.index = -1
        self.kind: str | None = None
        self.has_tools = False

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        out = []
        if self.kind == "thinking":
            out.append(event_line({"type": "content_block_delta", "index": self.index,
                                   "delta": {"type": "signature_delta", "signature": SIGNATURE}}))
        out.append(event_line({"type": "content_block_stop", "index": self.index}))
        self.kind = None
        return out

    def open(self, kind: str, block: dict) -> list[str]:
        out = self.close()
        self.index += 1
        self.kind = kind
        return out + [event_line({"type": "content_block_start", "index": self.index, "content_block": block})]

    def delta(self, delta: dict) -> str:
        return event_line({"type": "content_block_delta", "index": self.index, "delta": delta})

    def feed(self, ev) -> list[str]:
        if isinstance(ev, TextDelta):
            head = self.open("text", {"type": "text", "text": ""}) if self.kind != "text" else []
            return head + [self.delta({"type": "text_delta", "text": ev.text})]
        if isinstance(ev, ReasoningDelta):
            head = (self.open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                    if self.kind != "thinking" else [])
            return head + [self.delta({"type": "thinking_delta", "thinking": ev.text})]
        if isinstance(ev, ToolCallStart):
            self.has_tools = True
            return self.open("tool_use", {"type": "tool_use", "id": _tool_id(ev.id), "name": ev.name, "input": {}})
        if isinstance(ev, ToolCallArgs):
            return [self.delta({"type": "input_json_delta", "partial_json": ev.text})]
        if isinstance(ev, ToolCallEnd):
            return self.close()
        return []


async def _events(st, stream, parser, prep: Prepared, stops, msg_id: str, model: str):
    num_prompt = len(prep.prompt_ids)
    usage = {"input_tokens": num_prompt, "output_tokens": 0, "cache_read_input_tokens": 0,
             "cache_creation_input_tokens": 0}
    yield event_line({"type": "message_start", "message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": usage}})
    blocks = _Blocks()
    async for ev in engine_events(st.engine, stream, parser, st.limits.ping_interval_s):
        if ev is None:
            yield event_line({"type": "ping"})
        elif isinstance(ev, Final):
            if ev.error:
                yield event_line(anthropic_error_body(stream_error(ev)))
                return
            for line in blocks.close():
                yield line
            reason, seq = _stop_reason(ev, stops, blocks.has_tools)
            yield event_line({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                              "usage": _usage(num_prompt, ev)})
            yield event_line({"type": "message_stop"})
        else:
            for line in blocks.feed(ev):
                yield line


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    st = request.app.state.freetoken
    body = parse_json_object(await request.body())
    anthropic_media(body, st.llm.args.model_type)
    messages, tools = anthropic_messages(body, st.limits), anthropic_tools(body, st.limits, for_template=True)
    ids, _ = await asyncio.to_thread(render_chat, st.llm, messages, tools, anthropic_template_kwargs(body))
    return {"input_tokens": len(ids)}
