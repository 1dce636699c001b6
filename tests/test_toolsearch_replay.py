"""A real Claude Code ToolSearch conversation, replayed over HTTP, keeps its prompt in the prefix cache.

tests/data/claude_code_toolsearch/recording.json holds the requests Claude Code 2.1.332 really sent
(default system prompt and tools, `ENABLE_TOOL_SEARCH=true`, three MCP tools it deferred behind
ToolSearch); record.py next to it made it and says what was scripted: the model's first two
answers (a ToolSearch call, then a call of the tool it loaded). Turn 2 carries the ToolSearch
tool_result with a `tool_reference` block and lists the loaded tool in `tools` (Claude Code also
moved a deferred placeholder tool within the list); turn 3 the loaded tool's result.

Replayed in order to `/v1/messages` (streamed, as recorded) on tests/agent_model.py's scripted
model (the demo tokenizer and template, 1 x 16-wide layer: a 17K-token prefill in seconds), the
usage each answer reports must show >= 95 % of turns 2 and 3 read from the cache, and more: all
of the previous turn's prompt (to the page: the cache shares whole 16-token KV pages).

The 95 % alone would not tell the placements apart on this recording: its ~16.6K-token prompt is
mostly the system block (~60K characters of tool schemas), so the old placement (the loaded tool
appended to the system block's tool list, late system messages merged into the leading one)
still shares 97 % of turn 2 with turn 1 — it diverges at the end of the tool list, 275 tokens
before the end of turn 1's prompt (with late system messages kept in place but the loaded tool
in the list: 78 %). The control test checks that, so the whole-prompt check can fail."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from agent_model import build_agent_model
from freetoken_py.server.chat import anthropic_messages, anthropic_tools
from freetoken_py.server.generation import place_late_system, render_text
from freetoken_py.server.protocol import ServerLimits
from freetoken_py.tokenizer import Tokenizer
from server_util import ServerThread

PAGE = 16  # EngineConfig.page_size: the cache shares whole pages
RECORDING = Path(__file__).resolve().parent / "data" / "claude_code_toolsearch" / "recording.json"


def turns() -> list[dict]:
    return [r["request"] for r in json.loads(RECORDING.read_text())["requests"]]


def sse_usage(text: str) -> dict:
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    (delta,) = [e for e in events if e["type"] == "message_delta"]
    return delta["usage"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_agent_model(tmp_path_factory.mktemp("agent") / "model")


def test_recording_is_a_toolsearch_conversation():
    first, second, *rest = turns()
    deferred = {t["name"] for t in first["tools"] if t.get("defer_loading")}
    assert "ToolSearch" in [t["name"] for t in first["tools"]] and deferred
    refs = [b for m in second["messages"] if isinstance(m["content"], list) for b in m["content"]
            if b.get("type") == "tool_result" for b in b["content"] if isinstance(b, dict)
            and b.get("type") == "tool_reference"]
    loaded = {b["tool_name"] for b in refs}
    assert loaded and loaded <= {t["name"] for t in second["tools"] if t.get("defer_loading")}
    assert loaded.isdisjoint(t["name"] for t in first["tools"])  # listed only once loaded
    assert any(m["role"] == "system" for m in first["messages"])  # a system message inside messages


def test_turns_read_their_prefix_from_the_cache(model):
    with ServerThread(model_dir=model, max_model_len=65536) as srv:
        usages = []
        for body in turns():
            r = httpx.post(srv.url + "/v1/messages?beta=true", json=body, timeout=600,
                           headers={"x-api-key": "k", "anthropic-version": "2023-06-01"})
            assert r.status_code == 200, r.text[:500]
            usages.append(sse_usage(r.text))
    assert usages[0]["cache_read_input_tokens"] == 0
    for n in range(1, len(usages)):
        u, before = usages[n], usages[n - 1]
        total, previous = (x["input_tokens"] + x["cache_read_input_tokens"] for x in (u, before))
        assert u["cache_read_input_tokens"] >= 0.95 * total, f"turn {n + 1}: {u}"
        assert u["cache_read_input_tokens"] >= previous - PAGE, f"turn {n + 1} re-read part of turn {n}: {u}"


def test_old_placement_would_have_missed_the_cache(model):
    """The control: rendered the old way, turn 2 leaves turn 1's prompt before its end."""
    tok, limits = Tokenizer(model), ServerLimits()
    first, second = turns()[:2]

    def old(body):
        messages = place_late_system(anthropic_messages(body, limits), "merge")
        return tok.encode(render_text(tok, messages, anthropic_tools(body, limits)))

    def new(body):
        return tok.encode(render_text(tok, anthropic_messages(body, limits),
                                      anthropic_tools(body, limits, for_template=True)))

    def shared(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    a, b = old(first), old(second)
    assert shared(a, b) < len(a) - PAGE
    a, b = new(first), new(second)
    assert shared(a, b) == len(a) >= 0.95 * len(b)
