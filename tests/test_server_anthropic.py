"""The Anthropic Messages API of `freetoken serve`, driven by the official `anthropic` SDK (and raw
SSE for event order) against a real server on 127.0.0.1 serving the demo model. References:
`LLM.generate` on an independent LLM instance, the tokenizer's count of the equivalent
OpenAI-convention conversation, and non-streamed == streamed."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from freetoken_py.core import SamplingParams
from freetoken_py.server.anthropic_api import _Blocks
from freetoken_py.server.toolcalls import (
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
)

WEATHER = {"name": "get_weather", "description": "Get the current weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
WEATHER_OPENAI = {"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                   "parameters": WEATHER["input_schema"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # the 2.14 SDK has no temperature argument; the server still reads it


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)


def _sse(raw: str) -> list[tuple[str, dict]]:
    """(event name, data) pairs; asserts every data line has its event line with the same type."""
    out = []
    for frame in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines())
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        out.append((lines["event"], data))
    return out


def test_text_greedy_matches_llm_generate_streamed_and_not(client, srv, ref):
    system = "You are terse."
    ids = ref.chat_prompt_ids([{"role": "system", "content": system}, {"role": "user", "content": "What is a list?"}])
    expected = ref.generate([ids], SamplingParams(max_tokens=24, temperature=0))[0]
    msg = client.messages.create(model="claude-haiku-x", max_tokens=24, system=system, extra_body=GREEDY,
                                 messages=[{"role": "user", "content": "What is a list?"}])
    assert msg.model == "claude-haiku-x" and msg.content[0].text == expected.text
    assert msg.stop_reason == ("max_tokens" if expected.finish_reason == "length" else "end_turn")
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == len(ids)
    assert msg.usage.output_tokens == len(expected.token_ids)
    with client.messages.stream(model="m", max_tokens=24, system=[{"type": "text", "text": system}],
                                messages=[{"role": "user", "content": "What is a list?"}], extra_body=GREEDY) as st:
        text = "".join(st.text_stream)
        final = st.get_final_message()
    assert text == expected.text and final.content[0].text == expected.text
    assert final.usage.output_tokens == len(expected.token_ids)


def test_stream_event_order_and_message_start_usage(srv, ref):
    body = {"model": "m", "max_tokens": 8, "stream": True, "temperature": 0, "messages": ASK}
    r = httpx.post(srv.url + "/v1/messages?beta=true", json=body, timeout=120)  # query string ignored
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [(name, data) for name, data in _sse(r.text) if name != "ping"]
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert events[0][1]["message"]["usage"]["input_tokens"] == len(ref.chat_prompt_ids(ASK))
    middle = names[1:-2]
    assert middle[0] == "content_block_start" and middle[-1] == "content_block_stop"
    assert set(middle[1:-1]) == {"content_block_delta"}
    assert events[-2][1]["usage"]["output_tokens"] == 8 and events[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_tool_use_streamed_and_not(client, ref):
    expected = ref.generate([ref.chat_prompt_ids(ASK, tools=[WEATHER_OPENAI])],
                            SamplingParams(max_tokens=60, temperature=0))[0]
    call = json.loads(expected.text.split("<tool_call>")[1].split("</tool_call>")[0])
    msg = client.messages.create(model="m", max_tokens=60, messages=ASK, tools=[WEATHER], extra_body=GREEDY)
    assert msg.stop_reason == "tool_use"
    (block,) = [b for b in msg.content if b.type == "tool_use"]
    assert block.id.startswith("toolu_") and block.name == "get_weather" and block.input == call["arguments"]
    with client.messages.stream(model="m", max_tokens=60, messages=ASK, tools=[WEATHER], extra_body=GREEDY) as st:
        final = st.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [("get_weather", call["arguments"])]


def test_tool_results_thinking_and_system_messages_convert(client, ref):
    conversation = ASK + [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "the user wants weather", "signature": "x"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
            {"type": "some_future_block", "x": 1},
            {"type": "text", "text": "Thanks!"}]},
        {"role": "system", "content": "Be brief."},
    ]
    # the late system message stays where it was sent (the demo template writes it in place), so
    # the earlier turns' tokens are unchanged and stay cached (tests/test_prefix_stability.py)
    reference = [{"role": "system", "content": "Base."}, *ASK,
                 {"role": "assistant", "content": "Let me check.", "tool_calls": [
                     {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                                        "arguments": {"city": "Paris"}}}]},
                 {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
                 {"role": "user", "content": "Thanks!"}, {"role": "system", "content": "Be brief."}]
    count = client.messages.count_tokens(model="m", system="Base.", messages=conversation, tools=[WEATHER])
    assert count.input_tokens == len(ref.chat_prompt_ids(reference, tools=[WEATHER_OPENAI]))
    msg = client.messages.create(model="m", max_tokens=4, system="Base.", messages=conversation, tools=[WEATHER],
                                 extra_body=GREEDY | {"metadata": {"user_id": "u"}, "context_management": {}})
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == count.input_tokens


def test_billing_header_is_stripped_and_system_forms_agree(client, ref):
    plain = client.messages.count_tokens(model="m", system="You are Claude Code.", messages=ASK)
    blocks = client.messages.count_tokens(model="m", messages=ASK, system=[
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332; cch=a1b2c3;"},
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}])
    expected = ref.chat_prompt_ids([{"role": "system", "content": "You are Claude Code."}, *ASK])
    assert plain.input_tokens == blocks.input_tokens == len(expected)


def test_deferred_tools_join_once_referenced(client):
    deferred = WEATHER | {"defer_loading": True}
    without = client.messages.count_tokens(model="m", messages=ASK, tools=[deferred]).input_tokens
    loaded = ASK + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch",
                                                       "input": {}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                        {"type": "tool_reference", "tool_name": "get_weather"}]}]}]
    base = client.messages.count_tokens(model="m", messages=loaded).input_tokens
    with_tool = client.messages.count_tokens(model="m", messages=loaded, tools=[deferred]).input_tokens
    assert without == client.messages.count_tokens(model="m", messages=ASK).input_tokens
    assert with_tool > base


@pytest.mark.parametrize("body,needle", [
    ({"max_tokens": 4}, "messages"),
    ({"max_tokens": 0, "messages": ASK}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]}, "role"),
    ({"max_tokens": 4, "messages": ASK, "stop_sequences": 5}, "stop_sequences"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [1]}]}, "messages.0.content.0"),
])
def test_bad_requests_are_anthropic_shaped(client, srv, body, needle):
    r = httpx.post(srv.url + "/v1/messages", json={"model": "m", **body})
    assert r.status_code == 400
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert needle in err["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="m", **{k: v for k, v in body.items() if k != "model"} | {"max_tokens": body.get(
            "max_tokens", 4), "messages": body.get("messages", [])})
    assert info.value.status_code == 400


def test_context_overflow_is_anthropic_400_with_counts(srv):
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "import os\n" * 3000}]}
    r = httpx.post(srv.url + "/v1/messages", json=body)
    assert r.status_code == 400 and "4096" in r.json()["error"]["message"] and "tokens" in r.json()["error"]["message"]


def test_blocks_emit_thinking_with_signature_then_text_then_tool_use():
    """The streaming block machine on parser events (the demo model does not think)."""
    blocks, lines = _Blocks(), []
    for ev in [ReasoningDelta("hmm"), ReasoningDelta(" ok"), TextDelta("Hi"), ToolCallStart(0, "call_ab", "f"),
               ToolCallArgs(0, '{"a": 1}'), ToolCallEnd(0), TextDelta("bye")]:
        lines += blocks.feed(ev)
    lines += blocks.close()
    events = _sse("".join(lines))
    kinds = [(d["type"], d.get("index"), (d.get("delta") or d.get("content_block") or {}).get("type"))
             for _, d in events]
    assert kinds == [
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("content_block_start", 3, "text"), ("content_block_delta", 3, "text_delta"), ("content_block_stop", 3, None)]
    assert events[8][1]["content_block"]["id"] == "toolu_ab" and blocks.has_tools


def test_repeated_prefix_reports_cache_reads(client):
    system = "You are a careful Python expert. " * 8
    first = client.messages.create(model="m", max_tokens=2, system=system, messages=ASK, extra_body=GREEDY)
    with client.messages.stream(model="m", max_tokens=2, system=system, messages=ASK, extra_body=GREEDY) as st:
        second = st.get_final_message()
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == total
    assert 0 < second.usage.cache_read_input_tokens < total


def test_missing_max_tokens_is_the_real_apis_400(srv):
    r = httpx.post(srv.url + "/v1/messages", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "max_tokens: Field required"}}
