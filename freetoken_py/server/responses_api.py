"""OpenAI Responses API: POST /v1/responses (streamed and not) — what Codex CLI speaks.

The request's `instructions` + `input` items become template messages (chat.responses_messages),
its flat function tools template tools (tools we cannot run are skipped); generation and output
parsing are the chat routes' own (generation.prepare_chat, toolcalls.OutputParser). The server
keeps no state: `previous_response_id` / `conversation` are refused with a 400.

A stream is the documented event sequence, each with `event:` and `sequence_number`:
response.created, response.in_progress, then per output item response.output_item.added, its
content (message: content_part.added, output_text.delta..., output_text.done, content_part.done;
reasoning: the same with reasoning_text; function_call: function_call_arguments.delta...,
function_call_arguments.done), response.output_item.done; and last response.completed
(response.incomplete when max_output_tokens cut it, response.failed on an engine error).
`: keep-alive` comments go out while nothing else does.
"""
from __future__ import annotations

import dataclasses
import secrets
import time
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from freetoken_py.server.chat import (
    openai_template_kwargs,
    responses_functions,
    responses_messages,
    responses_tools,
)
from freetoken_py.server.constraints import openai_constrained
from freetoken_py.core import MAX_LOGPROBS
from freetoken_py.server.generation import Prepared, collect_or_disconnect, prepare_chat, stream_error
from freetoken_py.server.logprobs import TokenText, chat_content
from freetoken_py.server.media import responses_media
from freetoken_py.server.protocol import bad, get, parse_json_object, sampling_fields
from freetoken_py.server.sse import KEEPALIVE_COMMENT, Final, Logprobs, SSEResponse, engine_events, event_line
from freetoken_py.server.toolcalls import (
    ParsedOutput,
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
)

router = APIRouter()
STATEFUL = ("previous_response_id", "conversation")  # need responses stored server-side
ECHOED_REASONING = {"effort": ("none", "minimal", "low", "medium", "high", "xhigh", "max"),   # the published
                    "summary": ("auto", "concise", "detailed")}                            # enums; else null
LOGPROBS = "message.output_text.logprobs"   # the `include` value asking for them


def _logprobs_field(body: dict) -> int | None:
    """`include: ["message.output_text.logprobs"]` with `top_logprobs` (0..20) -> SamplingParams.logprobs.
    Other `include` values are accepted and ignored (none changes the generated text)."""
    top = get(body, "top_logprobs", int, lo=0, hi=MAX_LOGPROBS)
    include = body.get("include")
    return (top or 0) if isinstance(include, list) and LOGPROBS in include else None


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


@dataclass(frozen=True)
class _Meta:
    """What every Response object of one request carries (echoed from the request)."""
    id: str
    created_at: int
    model: str
    echo: dict
    namespaces: dict  # tool name -> the namespace it was declared in (a function_call names it)

    def response(self, status: str, output: list, usage: dict | None = None, error: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": error, "incomplete_details": incomplete, "model": self.model, "output": output,
                "previous_response_id": None, "store": False, "text": {"format": {"type": "text"}},
                "truncation": "disabled", **self.echo, **({"usage": usage} if usage is not None else {})}


def _meta(st, body: dict) -> _Meta:
    reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {}
    echo = {"instructions": body.get("instructions") if isinstance(body.get("instructions"), str) else None,
            "max_output_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": _echo_tools(body.get("tools")),
            "reasoning": {k: reasoning.get(k) if reasoning.get(k) in ECHOED_REASONING[k] else None
                          for k in ECHOED_REASONING},
            "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {}}
    model = body.get("model") if isinstance(body.get("model"), str) else st.model_name
    namespaces = {t["function"]["name"]: ns for ns, t in responses_functions(echo["tools"]) if ns}
    return _Meta(_new_id("resp_"), int(time.time()), model, echo, namespaces)


def _echo_tools(tools) -> list:
    """The request's tools as a Response echoes them: a function tool with the fields the
    published schema requires (`strict`, `parameters`: null when not sent); others as sent."""
    if not isinstance(tools, list):
        return []
    return [{"strict": None, "parameters": None, **t} if isinstance(t, dict) and t.get("type") == "function" else t
            for t in tools]


def _usage(st, prep: Prepared, final: Final, reasoning: str) -> dict:
    out = final.output
    num_output = len(out.token_ids)
    # the reasoning's share of the output, counted by re-encoding its text
    num_reasoning = min(num_output, len(st.llm.tokenizer.encode(reasoning))) if reasoning else 0
    return {"input_tokens": len(prep.prompt_ids),
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": num_reasoning},
            "total_tokens": len(prep.prompt_ids) + num_output}


def _status(final: Final) -> str:
    return "incomplete" if final.output.finish_reason == "length" else "completed"


@router.post("/v1/responses")
async def responses(request: Request):
    st = request.app.state.freetoken
    body = parse_json_object(await request.body())
    for name in STATEFUL:
        if body.get(name) is not None:
            raise bad(f"'{name}' is not supported: this server stores no responses; send the whole "
                      "conversation in 'input' (Codex: store=false does this)", name)
    if body.get("background") is True:
        raise bad("'background' is not supported: this server stores no responses; send a normal or "
                  "streamed request", "background")
    responses_media(body, st.llm.args.model_type)  # input_image / input_file: a 400, not dropped
    messages, tools = responses_messages(body, st.limits), responses_tools(body, st.limits)
    max_tokens = get(body, "max_output_tokens", int, lo=1)
    stream_flag = get(body, "stream", bool, False)  # validated before submitting: a 400 leaves no work running
    reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {}
    template_kwargs = openai_template_kwargs(body, reasoning.get("effort"), "reasoning.effort")
    prep = await prepare_chat(st.llm, st.engine, messages, tools, sampling_fields(body), max_tokens, (),
                              template_kwargs)
    prep = await openai_constrained(prep, _as_chat_fields(body), tools, st.llm.tokenizer)  # tool_choice, text.format
    prep.params = dataclasses.replace(prep.params, logprobs=_logprobs_field(body))
    meta = _meta(st, body)
    parser = prep.parser()
    stream = st.engine.submit(prep.prompt_ids, prep.params, get(body, "cache_salt", str))
    if stream_flag:
        return SSEResponse(_events(st, stream, parser, prep, meta), on_close=lambda: st.engine.abort(stream))
    got = await collect_or_disconnect(request.receive, st, stream, parser)
    if got is None:
        return Response(status_code=499)
    usage = _usage(st, prep, got.final, got.parsed.reasoning)
    out = got.final.output
    lps = chat_content(out.logprobs, TokenText(st.llm.tokenizer)) if out.logprobs is not None else []
    return JSONResponse(meta.response(_status(got.final), _items(got.parsed, meta.namespaces, lps), usage))


def _as_chat_fields(body: dict) -> dict:
    """The Responses fields constraints read, in their Chat Completions shape: `tool_choice`
    (hosted-tool choices such as {"type": "web_search"} force nothing we run: "auto"),
    `parallel_tool_calls`, and `text.format` as `response_format`."""
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") != "function":
        choice = "auto"
    fmt = body.get("text").get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema"), "name": fmt.get("name")}}
    out = {"tool_choice": choice, "response_format": fmt}
    if "parallel_tool_calls" in body:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    return out


# ---- output items -----------------------------------------------------------------------------
def _message(text: str, status: str = "completed", logprobs: list | None = None) -> dict:
    """logprobs (include message.output_text.logprobs): every generated token's, reasoning and
    tool-call tokens included (one message part carries them all)."""
    content = ([{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]
               if status == "completed" else [])
    return {"type": "message", "id": _new_id("msg_"), "status": status, "role": "assistant", "content": content}


def _reasoning(text: str, status: str = "completed") -> dict:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": _new_id("rs_"), "status": status, "summary": [], "content": content}


def _call(call_id: str, name: str, arguments: str, namespaces: dict, status: str = "completed") -> dict:
    item = {"type": "function_call", "id": _new_id("fc_"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}
    if name in namespaces:
        item["namespace"] = namespaces[name]
    return item


def _items(parsed: ParsedOutput, namespaces: dict, logprobs: list) -> list[dict]:
    """A whole generation's output items, in the order the model writes them."""
    items = [_reasoning(parsed.reasoning)] if parsed.reasoning else []
    if parsed.content or not (parsed.tool_calls or parsed.reasoning):
        items.append(_message(parsed.content, logprobs=logprobs))
    return items + [_call(c.id, c.name, c.arguments, namespaces) for c in parsed.tool_calls]


class _Stream:
    """Parser events -> Responses SSE lines; keeps the finished items for response.completed."""

    PART = {"message": "output_text", "reasoning": "reasoning_text"}

    def __init__(self, namespaces: dict):
        self.namespaces = namespaces
        self.pending: list[dict] = []  # logprobs not sent yet (they ride on the next output_text.delta)
        self.logprobs: list[dict] = []  # all of them so far (output_text.done and the finished part)
        self.seq = -1
        self.items: list[dict] = []  # finished
        self.item: dict | None = None  # the open one
        self.text = ""  # the open item's text so far

    def line(self, kind: str, **fields) -> str:
        self.seq += 1
        return event_line({"type": kind, "sequence_number": self.seq, **fields})

    def _where(self) -> dict:
        return {"item_id": self.item["id"], "output_index": len(self.items)}

    def open(self, item: dict) -> list[str]:
        out = self.close()
        self.item, self.text = item, ""
        out.append(self.line("response.output_item.added", output_index=len(self.items), item=item))
        if item["type"] in self.PART:
            part = {"type": self.PART[item["type"]], "text": ""}
            if item["type"] == "message":
                part["annotations"], part["logprobs"] = [], []
            out.append(self.line("response.content_part.added", **self._where(), content_index=0, part=part))
        return out

    def delta(self, text: str) -> str:
        self.text += text
        kind = self.item["type"]
        if kind == "function_call":
            return self.line("response.function_call_arguments.delta", **self._where(), delta=text)
        extra = {"logprobs": self.pending} if kind == "message" else {}
        if kind == "message":
            self.pending = []
        return self.line(f"response.{self.PART[kind]}.delta", **self._where(), content_index=0, delta=text, **extra)

    def close(self) -> list[str]:
        if self.item is None:
            return []
        kind, where, out = self.item["type"], self._where(), []
        if kind == "function_call":
            done = dict(self.item, arguments=self.text, status="completed")
            out.append(self.line("response.function_call_arguments.done", **where, name=done["name"],
                                 arguments=self.text))
        else:
            done = _message(self.text, logprobs=self.logprobs) if kind == "message" else _reasoning(self.text)
            done["id"] = self.item["id"]
            part = done["content"][0]
            extra = {"logprobs": self.logprobs} if kind == "message" else {}
            out.append(self.line(f"response.{self.PART[kind]}.done", **where, content_index=0, text=self.text, **extra))
            out.append(self.line("response.content_part.done", **where, content_index=0, part=part))
        out.append(self.line("response.output_item.done", output_index=len(self.items), item=done))
        self.items.append(done)
        self.item = None
        return out

    def feed(self, ev) -> list[str]:
        kind = self.item["type"] if self.item else None
        if isinstance(ev, (TextDelta, ReasoningDelta)):
            want = "message" if isinstance(ev, TextDelta) else "reasoning"
            head = [] if kind == want else self.open((_message if want == "message" else _reasoning)("", "in_progress"))
            return head + [self.delta(ev.text)]
        if isinstance(ev, ToolCallStart):
            return self.open(_call(ev.id, ev.name, "", self.namespaces, "in_progress"))
        if isinstance(ev, ToolCallArgs):
            return [self.delta(ev.text)]
        if isinstance(ev, ToolCallEnd):
            return self.close()
        return []


async def _events(st, stream, parser, prep: Prepared, meta: _Meta):
    out = _Stream(meta.namespaces)
    yield out.line("response.created", response=meta.response("in_progress", []))  # at once, before prefill
    yield out.line("response.in_progress", response=meta.response("in_progress", []))
    reasoning, text = "", TokenText(st.llm.tokenizer)
    logprobs = stream.params.logprobs is not None
    async for ev in engine_events(st.engine, stream, parser, st.limits.ping_interval_s, logprobs):
        if ev is None:
            yield KEEPALIVE_COMMENT
        elif isinstance(ev, Logprobs):
            new = chat_content(ev.tokens, text)
            out.pending += new
            out.logprobs += new
        elif isinstance(ev, Final):
            if ev.error:
                err = stream_error(ev)
                failed = meta.response("failed", out.items, error={"code": "server_error", "message": err.message})
                yield out.line("response.failed", response=failed)
                return
            for line in out.close():
                yield line
            status = _status(ev)
            done = meta.response(status, out.items, _usage(st, prep, ev, reasoning))
            yield out.line(f"response.{status}", response=done)
        else:
            reasoning += ev.text if isinstance(ev, ReasoningDelta) else ""
            for line in out.feed(ev):
                yield line
