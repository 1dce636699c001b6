"""Tool-call / reasoning parser: round trips through real chat templates (the demo model's, and our
own snippets of the Qwen3-Coder / GLM / harmony markers), every chunking of the text gives the same
events as one feed, and malformed output degrades to text."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

from freetoken_py.server.toolcalls import (SUPPORTED, OutputParser, ParsedOutput, ReasoningDelta, TextDelta,
                                           ToolCallArgs, ToolCallEnd, ToolCallStart, UnsupportedToolFormat,
                                           detect_reasoning, detect_tool_format, parse_output)
from freetoken_py.tokenizer import Tokenizer

DEMO = Path(__file__).resolve().parents[1] / "freetoken_py" / "data" / "demo_model"

# Our own minimal snippets carrying each family's markers, modelled on the published templates.
QWEN3_CODER_SNIPPET = """{%- for m in messages %}<|im_start|>{{ m.role }}
{%- if m.tool_calls %}{%- for tc in m.tool_calls %}
<tool_call>
<function={{ tc.function.name }}>
{% for k, v in tc.function.arguments.items() %}<parameter={{ k }}>
{% if v is mapping or (v is sequence and v is not string) %}{{ v | tojson }}{% else %}{{ v | string }}{% endif %}
</parameter>
{% endfor %}</function>
</tool_call>{%- endfor %}{%- else %}
{{ m.content }}{%- endif %}<|im_end|>
{% endfor %}"""
GLM45_SNIPPET = ("{% for tc in m.tool_calls %}<tool_call>{{ tc.name }}{% for k, v in tc.arguments.items() %}"
                 "<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value>{% endfor %}</tool_call>{% endfor %}")
HARMONY_SNIPPET = ("<|start|>assistant<|channel|>commentary to=functions.{{ name }} <|constrain|>json"
                   "<|message|>{{ args }}<|call|>")
DEEPSEEK_SNIPPET = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ name }}"
PLAIN_SNIPPET = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}}}}


def _assistant_text(rendered: str) -> str:
    """The generated part of the last assistant turn, as the model would emit it."""
    body = rendered.rsplit("<|im_start|>assistant", 1)[1]
    return body.split("<|im_end|>", 1)[0].lstrip("\n")


def _norm(events: list) -> list:
    """Merge adjacent text/reasoning pieces and drop the random call ids, to compare chunkings."""
    out: list = []
    for ev in events:
        if isinstance(ev, ToolCallStart):
            ev = ("start", ev.index, ev.name)
        if out and type(ev) is type(out[-1]) and isinstance(ev, (TextDelta, ReasoningDelta)):
            out[-1] = type(ev)(out[-1].text + ev.text)
        else:
            out.append(ev)
    return out


def _chunked(text: str, cuts: list[int], **kw) -> list:
    parser = OutputParser(**kw)
    bounds = [0] + sorted(set(c % (len(text) + 1) for c in cuts)) + [len(text)]
    events = []
    for a, b in zip(bounds, bounds[1:]):
        events += parser.feed(text[a:b])
    return events + parser.finish()


# -- format detection ------------------------------------------------------------------------

def test_detect_on_real_and_snippet_templates():
    assert detect_tool_format(Tokenizer(DEMO).chat_template) == "qwen3_json"
    assert detect_tool_format(QWEN3_CODER_SNIPPET) == "qwen3_coder_xml"
    assert detect_tool_format(GLM45_SNIPPET) == "glm45"  # has <tool_call> too; must not be taken as Qwen3
    assert detect_tool_format(HARMONY_SNIPPET) == "harmony"   # (its own parser: tests/test_harmony.py)
    assert detect_tool_format(DEEPSEEK_SNIPPET) == "deepseek_v31"
    assert detect_tool_format(PLAIN_SNIPPET) == "none"
    assert detect_tool_format(None) == "none"
    assert detect_tool_format("{% if tools %}{{ tools | tojson }}{% endif %}") == "unsupported:unknown"
    assert not detect_reasoning(Tokenizer(DEMO).chat_template) and detect_reasoning("<think>\n\n</think>")


def test_unsupported_format_refused_only_when_tools_requested():
    with pytest.raises(UnsupportedToolFormat, match="mistral"):
        OutputParser("unsupported:mistral", tools_enabled=True)
    # without tools the text passes through untouched, markup and all
    assert parse_output("<tool_call>x</tool_call>", "unsupported:mistral").content == "<tool_call>x</tool_call>"
    assert parse_output("<tool_call>x</tool_call>", "glm45").content == "<tool_call>x</tool_call>"
    with pytest.raises(ValueError):
        OutputParser("qwen4_magic")


# -- round trips through the templates -------------------------------------------------------

@pytest.mark.parametrize("args", [{"city": "Paris"}, {}, {"q": "a \"quoted\" </tool_call-ish> ü", "n": [1, {"x": None}]}])
def test_demo_template_round_trip(args):
    tok = Tokenizer(DEMO)
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": args}},
             {"type": "function", "function": {"name": "search", "arguments": json.dumps({"k": 1})}}]
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Checking.", "tool_calls": calls}]
    text = _assistant_text(tok.apply_chat_template(msgs, tools=[WEATHER], add_generation_prompt=False))
    out = parse_output(text, "qwen3_json", tools_enabled=True)
    assert out.content == "Checking.\n"
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", args), ("search", {"k": 1})]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in out.tool_calls)
    assert len({c.id for c in out.tool_calls}) == 2


SCHEMA_TOOL = {"name": "edit", "input_schema": {"type": "object", "properties": {  # Anthropic-style definition
    "path": {"type": "string"}, "line": {"type": "integer"}, "scale": {"type": "number"},
    "force": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
    "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "code": {"type": "string"}}}}


def test_qwen3_coder_round_trip_types_by_schema():
    args = {"path": "007", "line": 42, "scale": 1.5, "force": True, "opts": {"a": [1, 2]}, "tags": ["x", "y"],
            "maybe": None, "code": "if a < b:\n    return '<tag>'\n", "untyped": 12}
    rendered = ImmutableSandboxedEnvironment().from_string(QWEN3_CODER_SNIPPET).render(messages=[
        {"role": "assistant", "tool_calls": [{"function": {"name": "edit", "arguments": args}}]}])
    text = _assistant_text(rendered)
    out = parse_output(text, "qwen3_coder_xml", tools_enabled=True, tools=[SCHEMA_TOOL])
    (call,) = out.tool_calls
    # "007" stays a string because the schema says so; a parameter without a schema stays text
    assert call.name == "edit" and json.loads(call.arguments) == dict(args, maybe=None, untyped="12")
    assert out.content == ""
    # without schemas every value is the literal text
    plain = json.loads(parse_output(text, "qwen3_coder_xml", tools_enabled=True).tool_calls[0].arguments)
    assert plain["line"] == "42" and plain["force"] == "True"


def test_qwen3_coder_value_that_does_not_fit_schema_stays_text():
    text = "<tool_call>\n<function=edit>\n<parameter=line>\nabout 40\n</parameter>\n</function>\n</tool_call>"
    out = parse_output(text, "qwen3_coder_xml", tools_enabled=True, tools=[SCHEMA_TOOL])
    assert json.loads(out.tool_calls[0].arguments) == {"line": "about 40"}


# -- reasoning -------------------------------------------------------------------------------

def test_reasoning_block_then_answer_and_call():
    text = ("<think>\nThe user wants weather.\n</think>\n\nSure.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    out = parse_output(text, "qwen3_json", reasoning=True, tools_enabled=True)
    assert out.reasoning == "The user wants weather.\n" and out.content == "Sure.\n"
    assert [c.name for c in out.tool_calls] == ["get_weather"]


def test_reasoning_modes():
    # the prompt already opened <think>: everything up to </think> is reasoning
    assert parse_output("a plan</think>answer", reasoning="open") == ParsedOutput("answer", "a plan", [])
    # reasoning allowed but the model did not think
    assert parse_output("  just an answer <think>", reasoning=True) == ParsedOutput("  just an answer <think>", "", [])
    # a thought cut off by max_tokens stays reasoning; reasoning off leaves tags as text
    assert parse_output("<think>still thinking", reasoning=True) == ParsedOutput("", "still thinking", [])
    assert parse_output("<think>x</think>y").content == "<think>x</think>y"
    # a tool call inside the thought is not a call
    inner = '<think><tool_call>{"name": "a", "arguments": {}}</tool_call></think>done'
    assert parse_output(inner, "qwen3_json", reasoning=True, tools_enabled=True).tool_calls == []


# -- malformed and partial output ------------------------------------------------------------

@pytest.mark.parametrize("text", [
    'before <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',     # cut off by max_tokens
    "<tool_call>\nnot json\n</tool_call> after",                                    # not JSON
    '<tool_call>{"arguments": {}}</tool_call>',                                     # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',                       # arguments not an object
])
def test_malformed_calls_become_text(text):
    out = parse_output(text, "qwen3_json", tools_enabled=True)
    assert out.tool_calls == [] and out.content == text


def test_text_around_calls_and_tools_disabled():
    call = '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>'  # double-encoded arguments
    out = parse_output("pre " + call + "\n\n" + call + "\npost", "qwen3_json", tools_enabled=True)
    assert out.content == "pre post" and [json.loads(c.arguments) for c in out.tool_calls] == [{"a": 1}, {"a": 1}]
    assert parse_output(call, "qwen3_json", tools_enabled=False).content == call
    assert parse_output(call, "none", tools_enabled=True).content == call  # no tool format: plain text


def test_streaming_events_shape():
    parser = OutputParser("qwen3_json", tools_enabled=True)
    events = []
    for ch in 'Hi <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>':
        events += parser.feed(ch)
    events += parser.finish()
    assert events[0] == TextDelta("H") and TextDelta("<") not in events  # "<" held back until it can't be a tag
    start, args, end = events[-3:]
    assert isinstance(start, ToolCallStart) and (start.index, start.name) == (0, "f")
    assert args == ToolCallArgs(0, '{"x": 1}') and end == ToolCallEnd(0)
    with pytest.raises(RuntimeError):
        parser.feed("more")


# -- any chunking == one feed (hypothesis) ---------------------------------------------------

_PIECES = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<", "</", "<tool", "<think", "</thi", "\n", " ",
           "hello", "ü€", '{"name": "get_weather", "arguments": {"city": "Paris"}}', '{"name": "f"}', "{bad",
           "<function=f>", "<parameter=a>\n1\n</parameter>", "</function>", "<tool_call>\n<function=g>\n",
           # the other families' markup (GLM, DeepSeek, Kimi, MiniMax), whole and cut
           "f\n<arg_key>a</arg_key>", "<arg_value>[1]</arg_value>", "<arg_", "<｜tool▁calls▁begin｜>",
           "<｜tool▁call▁begin｜>", "f<｜tool▁sep｜>{}", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "<｜tool",
           "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.f:0<|tool_call_argument_begin|>{}",
           "<|tool_call_end|>", "<|tool_calls_section_end|>", "<|tool_", "<minimax:tool_call>", "<invoke",
           ' name="f">', '<parameter name="a">1</parameter>', "</invoke>", "</minimax:tool_call>", "<minimax:"]


@settings(max_examples=500, deadline=None)
@given(pieces=st.lists(st.sampled_from(_PIECES), max_size=14), cuts=st.lists(st.integers(0, 400), max_size=12),
       fmt=st.sampled_from(SUPPORTED), reasoning=st.sampled_from([False, True, "open"]),
       tools=st.booleans())
@example(pieces=["<|tool_calls_section_begin|>", "<tool_call>", "\n"], cuts=[], fmt="kimi_k2", reasoning=False,
         tools=True)  # text inside a section, then whitespace: once lost when the whitespace came alone
def test_any_split_gives_the_same_events(pieces, cuts, fmt, reasoning, tools):
    text = "".join(pieces)
    kw = dict(tool_format=fmt, reasoning=reasoning, tools_enabled=tools)
    whole = _norm(_chunked(text, [], **kw))
    assert _norm(_chunked(text, cuts, **kw)) == whole
    assert _norm(_chunked(text, list(range(len(text))), **kw)) == whole  # one character at a time
    # nothing is lost: without tools or reasoning the text comes back verbatim
    if not tools and reasoning is False:
        assert parse_output(text, fmt).content == text
