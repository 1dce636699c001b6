"""What the output parser emits, and the fold of those events into one response."""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field


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


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)  # 24 hex digits


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


class StreamParser:
    """The feed / finish loop both streaming parsers share: `STEPS` maps each state to the name of
    the method that advances it; a step returns True while it made progress."""

    STEPS: dict[str, str] = {}
    _state: str
    _buf: str
    _finished: bool

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
        while getattr(self, self.STEPS[self._state])(events, final):
            pass
        return [e for e in events if not isinstance(e, (TextDelta, ReasoningDelta)) or e.text]
