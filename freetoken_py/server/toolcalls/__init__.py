"""Tool calls and reasoning parsed out of a model's generated text, one-shot or streaming.

The format is taken from the chat template (`detect_tool_format`, falling back on the config's
model_type): Qwen3 / Hermes JSON in `<tool_call>`, Qwen3-Coder / Qwen3.5 XML
(`<function=NAME><parameter=K>V</parameter>`, also inside reasoning), GLM-4.5+
(`<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>`), DeepSeek V3.x
(`<｜tool▁calls▁begin｜>` sections), DeepSeek-V3.2 DSML (`<｜DSML｜function_calls>` with
`<｜DSML｜invoke name=...>`), Kimi K2 (`<|tool_calls_section_begin|>` with
`functions.NAME:IDX` ids) and MiniMax-M2 (`<minimax:tool_call><invoke name=...>`). Other families
are recognised and refused with `UnsupportedToolFormat` when tools are requested, instead of
leaking raw markup to the client as text.

Each format is one table (`formats.CallFormat` in `FORMATS`; gpt-oss's `harmony.HARMONY`) from
which both this parser and the format's grammar (server/constraints.py, server/harmony_grammar.py)
are made.

Pure Python, no model or tokenizer: the server owns when to feed and what to send.
"""
from __future__ import annotations

from freetoken_py.server.toolcalls.events import (
    ParsedOutput,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
    collect,
    new_call_id,
)
from freetoken_py.server.toolcalls.formats import (
    FORMATS,
    SUPPORTED,
    THINK_CLOSE,
    THINK_OPEN,
    CallFormat,
    ToolFormat,
    detect_reasoning,
    detect_tool_format,
    markup_tokens,
)
from freetoken_py.server.toolcalls.harmony import HARMONY, HarmonyParser
from freetoken_py.server.toolcalls.parser import OutputParser, UnsupportedToolFormat

__all__ = ["FORMATS", "HARMONY", "SUPPORTED", "THINK_CLOSE", "THINK_OPEN", "CallFormat", "HarmonyParser", "OutputParser",
           "ParsedOutput", "ReasoningDelta", "TextDelta", "ToolCall", "ToolCallArgs", "ToolCallEnd", "ToolCallStart", "ToolFormat",
           "UnsupportedToolFormat", "collect", "detect_reasoning", "detect_tool_format", "make_parser", "markup_tokens",
           "new_call_id", "parse_output"]


def parse_output(text: str, tool_format: str = "none", reasoning: bool | str = False,
                 tools_enabled: bool = False, tools: list[dict] | None = None) -> ParsedOutput:
    """One-shot parse of a whole generation (the same parser as streaming, fed once)."""
    parser = make_parser(tool_format, reasoning, tools_enabled, tools)
    return collect(parser.feed(text) + parser.finish())


def make_parser(tool_format: str = "none", reasoning: bool | str = False, tools_enabled: bool = False,
                tools: list[dict] | None = None) -> OutputParser | HarmonyParser:
    """The streaming parser of a format: gpt-oss's harmony channels (its own parser, reasoning
    always possible), else the tag-based OutputParser."""
    if tool_format == "harmony":
        return HarmonyParser(tools_enabled)
    return OutputParser(tool_format, reasoning, tools_enabled, tools=tools)
