"""gpt-oss's harmony format: one table (`HARMONY`) from which both the streaming parser below and
the grammar (server/harmony_grammar.py) are made.

A generation continues the prompt's `<|start|>assistant` with messages of the form

    [<|start|>assistant] <|channel|>CHANNEL [to=RECIPIENT] [<|constrain|>TYPE] <|message|> BODY END

where the recipient may also stand before the channel (`<|start|>assistant to=functions.f<|channel|>...`,
as the published chat template writes history) and END is `<|end|>` (more messages follow),
`<|return|>` (the answer is done) or `<|call|>` (a tool call: the client runs it). Channels go
where the APIs expect them: `analysis` -> reasoning; `final` -> content; `commentary` to
`functions.NAME` -> a call of NAME with the body as its JSON arguments; `commentary` without a
recipient (a "preamble" the model writes for the user) -> content. A message to another
recipient (the built-in `browser.*` / `python` tools, which this server does not run) is shown as
text of its channel's kind, as is a call whose body is not a JSON object or that arrives while no
tools were offered.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from freetoken_py.server.toolcalls.bodies import _json_object
from freetoken_py.server.toolcalls.events import (
    StreamParser,
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
    new_call_id,
)


@dataclass(frozen=True)
class HarmonySyntax:
    """The tags (each one token of the o200k_harmony vocabulary) and the header words."""
    start: str = "<|start|>"
    channel: str = "<|channel|>"
    message: str = "<|message|>"
    end: str = "<|end|>"
    ret: str = "<|return|>"
    call: str = "<|call|>"
    constrain: str = "<|constrain|>"
    role: str = "assistant"
    reasoning_channel: str = "analysis"
    final_channel: str = "final"
    tool_channel: str = "commentary"
    namespace: str = "functions."
    max_header_chars: int = 256   # a header that never reaches <|message|> is shown as text

    @property
    def tags(self) -> tuple[str, ...]:
        return (self.start, self.channel, self.message, self.end, self.ret, self.call, self.constrain)

    @property
    def ends(self) -> tuple[str, ...]:
        """What ends a message body (a new <|start|> too: a model that forgot <|end|>)."""
        return (self.end, self.ret, self.call, self.start)

    def header(self, channel: str) -> str:
        """A message header as the model writes it, after `<|start|>assistant`."""
        return f"{self.channel}{channel}{self.message}"

    def call_header(self, name: str) -> str:
        """A tool call's header as gpt-oss writes it (openai-harmony renders calls this way)."""
        return f"{self.channel}{self.tool_channel} to={self.namespace}{name} {self.constrain}json{self.message}"

    def render_call(self, name: str, args: dict) -> str:
        """A whole tool call as gpt-oss writes it (compact JSON arguments, as its grammar writes them)."""
        return self.call_header(name) + json.dumps(args, ensure_ascii=False, separators=(",", ":")) + self.call

    def next_message(self) -> str:
        """Between two messages of one turn."""
        return f"{self.end}{self.start}{self.role}"


HARMONY = HarmonySyntax()
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def _partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(text), len(tag) - 1), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def _first(text: str, tags: tuple[str, ...]) -> tuple[int, str | None]:
    hits = [(pos, tag) for tag in tags if (pos := text.find(tag)) >= 0]
    return min(hits) if hits else (-1, None)


@dataclass
class Header:
    channel: str = ""
    recipient: str = ""


def parse_header(text: str, syntax: HarmonySyntax = HARMONY) -> Header:
    """`assistant to=functions.f<|channel|>commentary json` / `<|channel|>commentary to=functions.f
    <|constrain|>json` -> channel and recipient (the content type is not needed)."""
    text = text.replace(syntax.start, "")
    recipient = _RECIPIENT.search(text)
    channel = ""
    if syntax.channel in text:
        after = text.split(syntax.channel, 1)[1].split(syntax.constrain, 1)[0]
        words = [w for w in after.split() if not w.startswith("to=")]
        channel = words[0] if words else ""
    return Header(channel, recipient.group(1) if recipient else "")


class HarmonyParser(StreamParser):
    """Streaming harmony parser with OutputParser's interface: `feed(delta) -> events`, then
    `finish() -> events`; any split of the text gives the same events (a suffix that could still
    become a tag is held back; a header and a call's body are buffered until they end).

    States: "header" (buffering up to <|message|>), "body" (a message's text, streamed as
    reasoning or content), "call" (a tool call's arguments, buffered until <|call|>), "raw" (a
    header that did not reach <|message|> within `max_header_chars`: not harmony, the rest is
    text as written)."""

    STEPS = {"header": "_step_header", "body": "_step_body", "call": "_step_call", "raw": "_step_raw"}

    def __init__(self, tools_enabled: bool = False, syntax: HarmonySyntax = HARMONY):
        self.syntax = syntax
        self._tools = tools_enabled
        self._state, self._kind = "header", TextDelta
        self._buf = ""
        self._name = ""
        self._raw_header = ""
        self._index = 0
        self._finished = False


    def _step_header(self, events: list, final: bool) -> bool:
        syn = self.syntax
        pos = self._buf.find(syn.message)
        limit = syn.max_header_chars
        if pos > limit or (pos < 0 and (len(self._buf) >= limit + len(syn.message) or final)):
            if pos < 0 and final and self._buf.replace(syn.start, "").strip() in ("", syn.role):
                self._buf = ""   # only the start of a message that never came
                return False
            self._state = "raw"   # not harmony after all: the rest is the model's text as written
            return True
        if pos < 0:
            return False
        head, self._buf = self._buf[:pos], self._buf[pos + len(syn.message):]
        self._raw_header = head + syn.message
        header = parse_header(head, syn)
        if header.recipient.startswith(syn.namespace) and self._tools:
            self._name, self._state = header.recipient[len(syn.namespace):], "call"
        else:
            self._kind = ReasoningDelta if header.channel == syn.reasoning_channel else TextDelta
            self._state = "body"
        return True

    def _step_raw(self, events: list, final: bool) -> bool:
        events.append(TextDelta(self._buf))
        self._buf = ""
        return False

    def _step_body(self, events: list, final: bool) -> bool:
        pos, tag = _first(self._buf, self.syntax.ends)
        if tag is None:
            pos = len(self._buf) - (0 if final else _partial_suffix(self._buf, self.syntax.ends))
        events.append(self._kind(self._buf[:pos]))
        self._buf = self._buf[pos:]
        if tag is None:
            return False
        if tag != self.syntax.start:
            self._buf = self._buf[len(tag):]
        self._state = "header"
        return True

    def _step_call(self, events: list, final: bool) -> bool:
        pos, tag, args = self._closing(final)
        if tag is None and not final:
            return False
        body = self._buf if tag is None else self._buf[:pos]
        self._buf = "" if tag is None else self._buf[pos + (0 if tag == self.syntax.start else len(tag)):]
        if args is None or not self._name:   # not a call we can hand over: show what the model wrote
            events.append(TextDelta(self._raw_header + body + (tag if tag and tag != self.syntax.start else "")))
        else:
            events += [ToolCallStart(self._index, new_call_id(), self._name),
                       ToolCallArgs(self._index, json.dumps(args, ensure_ascii=False)), ToolCallEnd(self._index)]
            self._index += 1
        self._state = "header"
        return True

    def _closing(self, final: bool) -> tuple[int, str | None, dict | None]:
        """(where the call's body ends, the tag there, its arguments or None): the first end tag
        whose body is a JSON object (a string in it may spell a tag); while none is, wait for
        more; at the end, the first tag, or the whole buffer when there is none."""
        first: tuple[int, str | None] = (-1, None)
        hits = sorted((m.start(), tag) for tag in self.syntax.ends for m in re.finditer(re.escape(tag), self._buf))
        for pos, tag in hits:
            args = _json_object(self._buf[:pos])
            if args is not None:
                return pos, tag, args
            first = first if first[1] else (pos, tag)
        if not final:
            return -1, None, None
        if first[1] is None:
            return len(self._buf), None, _json_object(self._buf)
        return first[0], first[1], None
