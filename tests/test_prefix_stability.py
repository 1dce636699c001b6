"""A prompt prefix that stays put: when a conversation grows by a late addition — a deferred tool
that Claude Code's ToolSearch loads (`tool_reference` blocks in a tool_result, the tool then
listed in `tools`), or a system message sent after the conversation started — the tokens already
sent render the same, so the prefix cache keeps them. Checked at the token level with every
family's published chat template (tests/data/templates) and the demo model's, through the
server's own request conversion (server/chat.py) and renderer (server/generation.render_chat).
Without the placement these fail: loaded tools joined the system block's tool list and late system
messages were merged into the leading one, which changed the first tokens of the prompt."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from freetoken_py.server.chat import anthropic_messages, anthropic_tools, openai_messages, openai_tools
from freetoken_py.server.generation import late_system_mode, render_chat, render_text
from freetoken_py.server.protocol import ServerLimits
from freetoken_py.tokenizer import Tokenizer
import server_util

ROOT = Path(__file__).resolve().parent
TEMPLATES = ROOT / "data" / "templates"
DEMO = ROOT.parent / "freetoken_py" / "data" / "demo_model"
LIMITS = ServerLimits()
NAMES = ["demo"] + sorted(p.name for p in TEMPLATES.glob("*.jinja"))


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    return {"demo": Tokenizer(DEMO), **server_util.family_tokenizers(tmp_path_factory)}


def schema(*props):
    return {"type": "object", "properties": {p: {"type": "string"} for p in props}, "required": list(props)}


# Claude Code 2.1.332's shape (tests/data/claude_code_toolsearch has a real recording): built-in
# tools and ToolSearch up front, MCP tools deferred
TOOLS = [{"name": "Read", "description": "Read a file", "input_schema": schema("file_path")},
         {"name": "ToolSearch", "description": "Load deferred tools", "input_schema": schema("query")},
         {"name": "mcp__w__get_weather", "description": "Weather for a city", "input_schema": schema("city"),
          "defer_loading": True},
         {"name": "mcp__w__get_time", "description": "Time in a zone", "input_schema": schema("tz"),
          "defer_loading": True}]
SYSTEM = [{"type": "text", "text": "You are Claude Code."}, {"type": "text", "text": "CWD: /tmp/x"}]
TURNS = [
    [{"role": "user", "content": [{"type": "text", "text": "What is the weather in Paris?"}]}],
    [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "ToolSearch",
                                        "input": {"query": "select:mcp__w__get_weather"}}]},
     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
         {"type": "tool_reference", "tool_name": "mcp__w__get_weather"}]}]}],
    [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "mcp__w__get_weather",
                                        "input": {"city": "Paris"}}]},
     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "Sunny, 21 C"},
                                  {"type": "text", "text": "And the time there?"}]}],
    [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_3", "name": "ToolSearch",
                                        "input": {"query": "time"}}]},
     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3", "content": [
         {"type": "text", "text": "Found 1 tool"}, {"type": "tool_reference", "tool_name": "mcp__w__get_time"}]}]},
     # Claude Code injects system messages mid-conversation
     {"role": "system", "content": "The user switched to plan mode."}],
    [{"role": "assistant", "content": "It is noon."}, {"role": "user", "content": "Thanks"}],
]


def anthropic_body(n: int) -> dict:
    return {"model": "m", "max_tokens": 64, "system": SYSTEM, "tools": TOOLS,
            "messages": [m for turn in TURNS[:n] for m in turn]}


def render_anthropic(tok, body: dict, gen: bool = True) -> list[int]:
    """What /v1/messages renders (anthropic_api._prepare): template tools without the loaded ones."""
    messages = anthropic_messages(body, LIMITS)
    return tok.encode(render_text(tok, messages, anthropic_tools(body, LIMITS, for_template=True), None, gen))


def assert_prefix(short: list[int], long: list[int], what: str):
    same = next((i for i, (a, b) in enumerate(zip(short, long)) if a != b), min(len(short), len(long)))
    assert len(short) <= len(long) and same == len(short), \
        f"{what}: the earlier turn's {len(short)} tokens differ from the next turn's at token {same}"


@pytest.mark.parametrize("name", NAMES)
def test_anthropic_toolsearch_and_late_system_keep_the_prefix(toks, name):
    tok = toks[name]
    for n in range(1, len(TURNS)):
        sent = render_anthropic(tok, anthropic_body(n), gen=False)  # turn n's conversation as sent
        assert_prefix(sent, render_anthropic(tok, anthropic_body(n + 1)), f"{name}, turn {n} -> {n + 1}")
    text = tok.decode(render_anthropic(tok, anthropic_body(len(TURNS))))
    # what was loaded is in the prompt where it was loaded (not silently dropped), once
    assert text.count('"name": "mcp__w__get_weather"') + text.count('"name":"mcp__w__get_weather"') >= 1
    assert "Time in a zone" in text and text.count("Weather for a city") == 1
    assert "The user switched to plan mode." in text
    # and the loaded tools are callable: the parser/grammar list has them, the template's not
    assert [t["function"]["name"] for t in anthropic_tools(anthropic_body(len(TURNS)), LIMITS)] == \
        ["Read", "ToolSearch", "mcp__w__get_weather", "mcp__w__get_time"]
    assert [t["function"]["name"] for t in anthropic_tools(anthropic_body(3), LIMITS, for_template=True)] == \
        ["Read", "ToolSearch"]


def test_demo_template_prompt_is_a_prefix_of_the_next_turn(toks):
    """For the demo's (non-thinking) template the stronger property the cache uses: the whole
    prompt of turn n, generation prompt included, starts turn n+1 (which holds the answer)."""
    tok = toks["demo"]
    for n in range(1, len(TURNS)):
        assert_prefix(render_anthropic(tok, anthropic_body(n)), render_anthropic(tok, anthropic_body(n + 1)),
                      f"turn {n} -> {n + 1}")


OPENAI_TURNS = [
    [{"role": "system", "content": "You are OpenCode."}, {"role": "developer", "content": "Be brief."},
     {"role": "user", "content": "List the files."}],
    [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "ls", "arguments": "{\"path\": \".\"}"}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "a.py b.py"},
     {"role": "system", "content": "Reminder: you are in read-only mode."}],
    [{"role": "assistant", "content": "a.py and b.py."}, {"role": "developer", "content": "Now summarise."},
     {"role": "user", "content": "Which is bigger?"}],
    [{"role": "assistant", "content": "b.py."}, {"role": "user", "content": "ok"}],
]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "ls", "description": "List", "parameters": schema("path")}}]


@pytest.mark.parametrize("name", NAMES)
def test_openai_late_system_messages_keep_the_prefix(toks, name):
    tok = toks[name]

    def render(n, gen=True):
        body = {"messages": [m for turn in OPENAI_TURNS[:n] for m in turn], "tools": OPENAI_TOOLS}
        return tok.encode(render_text(tok, openai_messages(body, LIMITS), openai_tools(body, LIMITS), None, gen))

    for n in range(1, len(OPENAI_TURNS)):
        assert_prefix(render(n, gen=False), render(n + 1), f"{name}, turn {n} -> {n + 1}")
    text = tok.decode(render(len(OPENAI_TURNS)))
    for part in ("You are OpenCode.", "Be brief.", "read-only mode", "Now summarise."):
        assert part in text


@pytest.mark.parametrize("name", NAMES)
def test_plain_conversations_render_as_the_template_does(toks, name):
    """No late additions: exactly the template's own rendering (leading system messages merged,
    as before); late ones where the template writes a system message in place stay system
    messages, else user messages — never moved ahead of earlier turns."""
    tok = toks[name]
    body = {"messages": OPENAI_TURNS[0] + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}],
            "tools": OPENAI_TOOLS}
    own = tok.apply_chat_template([{"role": "system", "content": "You are OpenCode.\n\nBe brief."},
                                   *body["messages"][2:]], tools=OPENAI_TOOLS)
    ids, _ = render_chat(SimpleNamespace(tokenizer=tok), openai_messages(body, LIMITS), openai_tools(body, LIMITS))
    assert ids == tok.encode(own)
    assert late_system_mode(tok) in ("system", "user")
