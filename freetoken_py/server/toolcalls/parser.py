"""The streaming output parser: generated text -> text, reasoning and tool-call events.

`OutputParser.feed` may be called with any split of the text (one token, one byte of a tag): it
holds back a suffix that could still become a tag, so every split yields the same events, in
concatenation, as one `feed` of the whole text. Tool calls are emitted whole (start, arguments,
end) once the call's closing tag arrives: clients only act on complete calls, and a half-formed
call that never closes or does not parse becomes plain text rather than a broken call.
"""
from __future__ import annotations

from freetoken_py.errors import FreetokenError
from freetoken_py.server.toolcalls.events import (
    StreamParser,
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
    new_call_id,
)
from freetoken_py.server.toolcalls.formats import FORMATS, THINK_CLOSE, THINK_OPEN


class UnsupportedToolFormat(FreetokenError):
    """Tools were requested but the model's tool-call format is not implemented."""


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (to hold back)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _first(text: str, tags: list[str]) -> tuple[int, str | None]:
    """The earliest complete tag in `text`: (position, tag), or (-1, None)."""
    hits = [(pos, tag) for tag in tags if (pos := text.find(tag)) >= 0]
    return min(hits) if hits else (-1, None)


class OutputParser(StreamParser):
    """Streaming parser: `feed(delta) -> events`, then `finish() -> events`.

    States: "start" (reasoning=True: does the text open with <think>?), "think" (reasoning until
    </think>; with a format whose calls may come inside the thought, also watching for them),
    "text" (content, watching for the format's opening tag), "section" (between the calls of a
    sectioned format), "call" (buffering one call's body). A call returns to where it began.
    """

    STEPS = {"start": "_step_start", "think": "_step_think", "text": "_step_text",
             "section": "_step_section", "call": "_step_call"}

    def __init__(self, tool_format: str = "none", reasoning: bool | str = False, tools_enabled: bool = False,
                 tools: list[dict] | None = None):
        if tool_format.startswith("unsupported:"):
            if tools_enabled:
                raise UnsupportedToolFormat(
                    f"this model's tool-call format ({tool_format.split(':', 1)[1]}) is not supported yet; "
                    "send the request without tools")
        elif tool_format != "none" and tool_format not in FORMATS:
            raise ValueError(f"unknown tool format {tool_format!r}")
        if reasoning not in (True, False, "open"):
            raise ValueError(f"reasoning must be True, False or 'open', not {reasoning!r}")
        self.tool_format = tool_format
        self._fmt = FORMATS.get(tool_format) if tools_enabled else None
        self._schemas = _schemas_by_name(tools)
        self._state = "think" if reasoning == "open" else ("start" if reasoning else "text")
        self._strip_ws = reasoning == "open"  # drop whitespace right after a tag / a call
        self._resume = "text"  # the state a call region returns to
        self._shown = False  # this section's markup has been shown as text (it held a malformed call)
        self._buf = ""
        self._index = 0
        self._finished = False


    def _take_leading_ws(self) -> bool:
        """After a tag, skip whitespace; False while only whitespace has arrived."""
        if self._strip_ws:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._strip_ws = False
        return True

    def _emit(self, events: list, text: str) -> None:
        """Text inside a call region that is not a call: content, or reasoning when it sits inside a
        thought. The first such text of a section brings the section's opening tag with it (and
        its end then shows the closing one), so a section of malformed calls reads as written."""
        if text and self._fmt.call_open and not self._shown:
            text, self._shown = self._fmt.open + text, True
        events.append(ReasoningDelta(text) if self._resume == "think" else TextDelta(text))

    def _scan(self, events: list, final: bool, tags: list[str], kind) -> tuple[int, str | None]:
        """Emit (as `kind`) the text before the first of `tags`, holding back a possible partial
        tag; returns the found tag's position in the remaining buffer (0) or (-1, None)."""
        pos, tag = _first(self._buf, tags)
        if tag is None:
            keep = 0 if final else max(_partial_suffix(self._buf, t) for t in tags)
            pos = len(self._buf) - keep
        events.append(kind(self._buf[:pos]))
        self._buf = self._buf[pos:]
        return (0, tag) if tag else (-1, None)

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
        calls_here = self._fmt is not None and self._fmt.in_reasoning
        _, tag = self._scan(events, final, [THINK_CLOSE, self._fmt.open] if calls_here else [THINK_CLOSE],
                            ReasoningDelta)  # an unclosed thought stays reasoning
        if tag == THINK_CLOSE:
            self._buf, self._state, self._strip_ws = self._buf[len(THINK_CLOSE):], "text", True
            return True
        if tag is not None:
            self._enter("think")
            return True
        return False

    def _step_text(self, events: list, final: bool) -> bool:
        if not self._take_leading_ws():
            return False
        if self._fmt is None:
            events.append(TextDelta(self._buf))
            self._buf = ""
            return False
        if self._scan(events, final, [self._fmt.open], TextDelta)[1] is None:
            return False
        self._enter("text")
        return True

    def _enter(self, resume: str) -> None:
        """The buffer starts with the format's opening tag: go into the call region."""
        self._buf = self._buf[len(self._fmt.open):]
        self._resume, self._shown = resume, False
        self._state = "section" if self._fmt.call_open else "call"

    def _leave(self, strip: bool = True) -> None:
        self._state, self._resume = self._resume, "text"
        self._strip_ws = strip  # the template puts newlines after calls; not after text shown as is

    def _step_section(self, events: list, final: bool) -> bool:
        fmt = self._fmt
        tags = [fmt.call_open, fmt.close]
        rest = self._buf.lstrip()  # whitespace between a section's calls means nothing
        for tag in tags:
            if rest.startswith(tag):
                self._buf = rest[len(tag):]
                if tag == fmt.close:
                    if self._shown:
                        self._emit(events, tag)
                    self._leave(strip=not self._shown)
                else:
                    self._state = "call"
                return True
        if not rest:
            if final:  # never closed, nothing but whitespace after its last call
                self._buf = ""
                self._leave(strip=False)
            return False
        if not final and any(tag.startswith(rest) for tag in tags):
            return False  # still could become one of them
        # anything else inside a section is the model's own text, shown as it wrote it; whitespace
        # at its end waits for what follows (dropped before a tag or at the end, as between calls)
        pos, tag = _first(self._buf, tags)
        if tag is None:
            pos = len(self._buf) - (0 if final else max(_partial_suffix(self._buf, t) for t in tags))
        pos = len(self._buf[:pos].rstrip())
        self._emit(events, self._buf[:pos])
        self._buf = self._buf[pos:]
        return True

    def _step_call(self, events: list, final: bool) -> bool:
        fmt = self._fmt
        opener, closer = fmt.call_open or fmt.open, fmt.call_end or fmt.close
        end, parsed = self._closing(closer, final)
        if end < 0:
            if final:  # never closed: show what the model wrote rather than invent a call
                self._emit(events, opener + self._buf)
                self._buf = ""
                self._leave(strip=False)
            return False
        body, self._buf = self._buf[:end], self._buf[end + len(closer):]
        if parsed is None:
            self._emit(events, opener + body + closer)
        else:
            name, arguments, call_id = parsed
            events += [ToolCallStart(self._index, call_id or new_call_id(), name),
                       ToolCallArgs(self._index, arguments), ToolCallEnd(self._index)]
            self._index += 1
        if fmt.call_open:
            self._state = "section"
        else:
            self._leave(strip=parsed is not None)
        return True


    def _closing(self, closer: str, final: bool) -> tuple[int, object]:
        """(where the call's closing tag is, the parsed call or None): the first closing tag whose
        body parses (a JSON string may hold the tag itself, `{"code": "</tool_call>"}`); while none
        does, wait for more text; at the end, the first tag (the malformed call shows as text)."""
        first, pos = -1, self._buf.find(closer)
        while pos >= 0:
            parsed = self._fmt.parse(self._buf[:pos], self._schemas)
            if parsed is not None:
                return pos, parsed
            first = pos if first < 0 else first
            pos = self._buf.find(closer, pos + 1)
        return (first, None) if final else (-1, None)


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
