"""Tool calls and reasoning parsed out of a model's generated text, one-shot or streaming.

The format is taken from the chat template (`detect_tool_format`): Qwen3 / Hermes JSON inside
`<tool_call>...</tool_call>`, or Qwen3-Coder XML (`<function=NAME><parameter=K>V</parameter>`) in
the same wrapper. Other families are recognised and refused with `UnsupportedToolFormat` when tools
are requested, instead of leaking raw markup to the client as text.

`OutputParser.feed` may be called with any split of the text (one token, one byte of a tag): it
holds back a suffix that could still become a tag, so every split yields the same events, in
concatenation, as one `feed` of the whole text. Tool calls are emitted whole (start, arguments,
end) once `</tool_call>` arrives: clients only act on complete calls, and a half-formed call that
never closes or does not parse becomes plain text rather than a broken call.

Pure Python, no model or tokenizer: the server owns when to feed and what to send.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from freetoken_py.errors import FreetokenError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SUPPORTED = ("qwen3_json", "qwen3_coder_xml", "none")

# (family, markers that identify it in a chat template); checked in order, first match wins.
# Qwen3-Coder must come before plain Qwen3 since both use <tool_call>.
_FAMILIES = (
    ("unsupported:harmony", ("<|channel|>", "<|call|>")),
    ("unsupported:glm45", ("<arg_key>", "<arg_value>")),
    ("unsupported:deepseek", ("tool▁calls▁begin", "tool▁call▁begin")),
    ("unsupported:mistral", ("[TOOL_CALLS]",)),
    ("unsupported:llama3", ("<|python_tag|>",)),
    ("qwen3_coder_xml", ("<function=", "<parameter=")),
    ("qwen3_json", ("<tool_call>",)),
)


class UnsupportedToolFormat(FreetokenError):
    """Tools were requested but the model's tool-call format is not implemented."""


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    index: int
    text: str  # a piece of the arguments' JSON object text; the pieces of one index concatenate


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON object text


@dataclass
class ParsedOutput:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def detect_tool_format(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches: "qwen3_json", "qwen3_coder_xml", "none" (the
    template has no tool support), or "unsupported:<family>" (recognised, not implemented)."""
    if not chat_template:
        return "none"
    for family, markers in _FAMILIES:
        if any(m in chat_template for m in markers):
            return family
    # renders tools somehow, in a format we cannot name: refuse rather than guess
    return "unsupported:unknown" if re.search(r"\btools\b", chat_template) else "none"


def detect_reasoning(chat_template: str | None) -> bool:
    """True when the template knows `<think>` blocks (Qwen3, DeepSeek-R1 style)."""
    return bool(chat_template) and THINK_OPEN in chat_template


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)  # 24 hex digits


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (to hold back)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class OutputParser:
    """Streaming parser: `feed(delta) -> events`, then `finish() -> events`.

    States: "start" (reasoning=True: does the text open with <think>?), "think" (reasoning until
    </think>), "text" (content, watching for <tool_call>), "call" (buffering one call's body).
    """

    def __init__(self, tool_format: str = "none", reasoning: bool | str = False, tools_enabled: bool = False,
                 tools: list[dict] | None = None):
        if tool_format.startswith("unsupported:"):
            if tools_enabled:
                raise UnsupportedToolFormat(
                    f"this model's tool-call format ({tool_format.split(':', 1)[1]}) is not supported yet; "
                    "send the request without tools")
        elif tool_format not in SUPPORTED:
            raise ValueError(f"unknown tool format {tool_format!r}")
        if reasoning not in (True, False, "open"):
            raise ValueError(f"reasoning must be True, False or 'open', not {reasoning!r}")
        self.tool_format = tool_format
        self._tools_active = tools_enabled and tool_format in ("qwen3_json", "qwen3_coder_xml")
        self._schemas = _schemas_by_name(tools)
        self._state = "think" if reasoning == "open" else ("start" if reasoning else "text")
        self._strip_ws = reasoning == "open"  # drop whitespace right after a tag / a call
        self._buf = ""
        self._index = 0
        self._finished = False

    def feed(self, text: str) -> list:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list:
        events = self._drain(final=True)
        self._finished = True
        return events

    def _drain(self, final: bool) -> list:
        events: list = []
        step = {"start": self._step_start, "think": self._step_think, "text": self._step_text,
                "call": self._step_call}
        while step[self._state](events, final):
            pass
        return [e for e in events if not isinstance(e, (TextDelta, ReasoningDelta)) or e.text]

    def _take_leading_ws(self) -> bool:
        """After a tag, skip whitespace; False while only whitespace has arrived."""
        if self._strip_ws:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._strip_ws = False
        return True

    def _step_start(self, events: list, final: bool) -> bool:
        head = self._buf.lstrip()
        if head.startswith(THINK_OPEN):
            self._buf, self._state, self._strip_ws = head[len(THINK_OPEN):], "think", True
            return True
        if THINK_OPEN.startswith(head) and not final:
            return False  # still could be "<think>" (or only whitespace so far)
        self._state = "text"
        return True

    def _step_think(self, events: list, final: bool) -> bool:
        if not self._take_leading_ws():
            return False
        end = self._buf.find(THINK_CLOSE)
        if end >= 0:
            events.append(ReasoningDelta(self._buf[:end]))
            self._buf, self._state, self._strip_ws = self._buf[end + len(THINK_CLOSE):], "text", True
            return True
        keep = 0 if final else _partial_suffix(self._buf, THINK_CLOSE)
        events.append(ReasoningDelta(self._buf[:len(self._buf) - keep]))  # an unclosed thought stays reasoning
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _step_text(self, events: list, final: bool) -> bool:
        if not self._take_leading_ws():
            return False
        if not self._tools_active:
            events.append(TextDelta(self._buf))
            self._buf = ""
            return False
        start = self._buf.find(CALL_OPEN)
        if start >= 0:
            events.append(TextDelta(self._buf[:start]))
            self._buf, self._state = self._buf[start + len(CALL_OPEN):], "call"
            return True
        keep = 0 if final else _partial_suffix(self._buf, CALL_OPEN)
        events.append(TextDelta(self._buf[:len(self._buf) - keep]))
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _step_call(self, events: list, final: bool) -> bool:
        end = self._buf.find(CALL_CLOSE)
        if end < 0:
            if final:  # never closed: show what the model wrote rather than invent a call
                events.append(TextDelta(CALL_OPEN + self._buf))
                self._buf, self._state = "", "text"
            return False
        body, self._buf = self._buf[:end], self._buf[end + len(CALL_CLOSE):]
        self._state = "text"
        parsed = self._parse_call(body)
        if parsed is None:
            events.append(TextDelta(CALL_OPEN + body + CALL_CLOSE))
            return True
        name, arguments = parsed
        events += [ToolCallStart(self._index, new_call_id(), name), ToolCallArgs(self._index, arguments),
                   ToolCallEnd(self._index)]
        self._index += 1
        self._strip_ws = True  # the template puts newlines between calls
        return True

    def _parse_call(self, body: str) -> tuple[str, str] | None:
        if self.tool_format == "qwen3_coder_xml":
            return _parse_xml_call(body, self._schemas)
        return _parse_json_call(body)


def _schemas_by_name(tools: list[dict] | None) -> dict[str, dict]:
    """name -> JSON schema of the parameters, from OpenAI ({"function": {...}}) or Anthropic
    ({"name", "input_schema"}) tool definitions."""
    out: dict[str, dict] = {}
    for tool in tools or []:
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        schema = fn.get("parameters", fn.get("input_schema"))
        if isinstance(fn.get("name"), str) and isinstance(schema, dict):
            out[fn["name"]] = schema
    return out


def _parse_json_call(body: str) -> tuple[str, str] | None:
    """`{"name": ..., "arguments": {...}}` -> (name, arguments JSON text), or None if malformed."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


def _parse_xml_call(body: str, schemas: dict[str, dict]) -> tuple[str, str] | None:
    """Qwen3-Coder `<function=NAME><parameter=K>\\nV\\n</parameter>...</function>` -> (name, JSON)."""
    match = _FUNCTION.match(body)
    if match is None:
        return None
    name = match.group(1).strip()
    props = schemas.get(name, {}).get("properties", {})
    args = {}
    for key, raw in _PARAMETER.findall(match.group(2)):
        key = key.strip()
        value = raw[1:] if raw.startswith("\n") else raw  # the template wraps values in newlines
        value = value[:-1] if value.endswith("\n") else value
        args[key] = _typed(value, props.get(key) if isinstance(props, dict) else None)
    return name, json.dumps(args, ensure_ascii=False)


def _typed(value: str, schema) -> object:
    """An XML parameter value as its schema's JSON type; a string when untyped or it does not fit."""
    types = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(schema, dict) and not types:
        types = [s.get("type") for s in schema.get("anyOf", []) if isinstance(s, dict)]
    for typ in types if isinstance(types, list) else [types]:
        converted = _convert(value, typ)
        if converted is not _NO:
            return converted
    return value


_NO = object()


def _convert(value: str, typ) -> object:
    text = value.strip()
    if typ == "string":
        return value
    if typ == "null":
        return None if text.lower() in ("null", "none") else _NO
    if typ == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _NO)
    try:
        if typ == "integer":
            return int(text)
        if typ == "number":
            num = float(text)
            return int(num) if num.is_integer() and re.fullmatch(r"-?\d+", text) else num
        if typ in ("object", "array"):
            obj = json.loads(text)
            return obj if isinstance(obj, dict if typ == "object" else list) else _NO
    except ValueError:
        return _NO
    return _NO


def collect(events: list, parsed: ParsedOutput | None = None) -> ParsedOutput:
    """Fold events into a ParsedOutput (what a non-streaming response returns)."""
    out = parsed if parsed is not None else ParsedOutput()
    pending: dict[int, list] = {}
    for ev in events:
        if isinstance(ev, TextDelta):
            out.content += ev.text
        elif isinstance(ev, ReasoningDelta):
            out.reasoning += ev.text
        elif isinstance(ev, ToolCallStart):
            pending[ev.index] = [ev.id, ev.name, ""]
        elif isinstance(ev, ToolCallArgs):
            pending[ev.index][2] += ev.text
        elif isinstance(ev, ToolCallEnd):
            out.tool_calls.append(ToolCall(*pending.pop(ev.index)))
    return out


def parse_output(text: str, tool_format: str = "none", reasoning: bool | str = False,
                 tools_enabled: bool = False, tools: list[dict] | None = None) -> ParsedOutput:
    """One-shot parse of a whole generation (the same parser as streaming, fed once)."""
    parser = OutputParser(tool_format, reasoning, tools_enabled, tools=tools)
    return collect(parser.feed(text) + parser.finish())
