"""The OpenAI Responses API (`POST /v1/responses`) of `freetoken serve`, driven by the official
`openai` SDK (`client.responses.create`, streamed and not) against a real server on 127.0.0.1
serving the demo model. References: `LLM.generate` on an independent LLM instance fed the
hand-converted chat conversation (same ids, greedy), the tokenizer's count of that conversation,
and round trips (streamed == non-streamed, the SDK's own parse of every event)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from freetoken_py.core import SamplingParams
from server_util import REPO, ServerThread
import server_util

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
# tools the server would have to run (hosted tools, free-form custom tools): skipped, never rejected
CODEX_EXTRAS = [{"type": "web_search", "external_web_access": False}, {"type": "local_shell"},
                {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}}, {"type": "file_search"}]
ASK = "What is the weather in Paris?"
THINKING_TEMPLATE = REPO / "tests" / "data" / "templates" / "qwen3-thinking-switch.jinja"


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)


def _greedy(ref, ids, n):
    return ref.generate([ids], SamplingParams(max_tokens=n, temperature=0))[0]


def _stream(client, **kwargs) -> list:
    return list(client.responses.create(stream=True, **kwargs))


def _check_sequence(events) -> None:
    """The documented order: created, in_progress, items opened and closed one at a time, one
    terminal event; sequence numbers count up from 0."""
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete") and types.count(types[-1]) == 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    opened = [e.output_index for e in events if e.type == "response.output_item.added"]
    closed = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert opened == closed == list(range(len(opened)))


def test_text_matches_llm_generate_streamed_and_not(client, ref):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a list?"}]
    expected = _greedy(ref, ref.chat_prompt_ids(messages), 24)
    full = client.responses.create(model="any-name", instructions="You are terse.", input="What is a list?",
                                   max_output_tokens=24, temperature=0)
    assert full.object == "response" and full.model == "any-name" and full.id.startswith("resp_")
    assert full.output_text == expected.text
    (item,) = full.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert full.status == ("incomplete" if expected.finish_reason == "length" else "completed")
    assert full.usage.input_tokens == len(expected.prompt_token_ids)
    assert full.usage.output_tokens == len(expected.token_ids)
    assert full.usage.total_tokens == full.usage.input_tokens + full.usage.output_tokens

    events = _stream(client, model="m", instructions="You are terse.", input="What is a list?",
                     max_output_tokens=24, temperature=0)
    _check_sequence(events)
    types = [e.type for e in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == expected.text == [e for e in events if e.type == "response.output_text.done"][0].text
    last = events[-1].response
    assert last.output_text == expected.text and last.usage.output_tokens == len(expected.token_ids)


def test_function_call_streamed_and_not(client, ref):
    expected = _greedy(ref, ref.chat_prompt_ids([{"role": "user", "content": ASK}], tools=[CHAT_WEATHER]), 60)
    assert expected.text.startswith("<tool_call>")  # the demo model was trained to call tools
    body = json.loads(expected.text.split("<tool_call>")[1].split("</tool_call>")[0])
    full = client.responses.create(model="m", input=ASK, tools=[WEATHER, *CODEX_EXTRAS], max_output_tokens=60,
                                   temperature=0)
    (call,) = full.output
    assert call.type == "function_call" and call.name == body["name"] == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    assert json.loads(call.arguments) == body["arguments"]

    events = _stream(client, model="m", input=ASK, tools=[WEATHER, *CODEX_EXTRAS], max_output_tokens=60,
                     temperature=0)
    _check_sequence(events)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(i.type, i.name, i.arguments) for i in added] == [("function_call", "get_weather", "")]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"][0]
    assert json.loads(args) == json.loads(done.arguments) == body["arguments"]
    assert events[-1].response.output[0].call_id == added[0].call_id


def test_namespaced_tools_are_offered_and_their_calls_name_the_namespace(client, ref):
    """Codex puts each MCP server's tools in a `namespace` entry; the client runs them, so they
    are offered under their own names and a call carries the namespace back."""
    expected = _greedy(ref, ref.chat_prompt_ids([{"role": "user", "content": ASK}], tools=[CHAT_WEATHER]), 60)
    namespaced = {"type": "namespace", "name": "mcp__w", "description": "Tools of w.", "tools": [WEATHER]}
    full = client.responses.create(model="m", input=ASK, tools=[namespaced], max_output_tokens=60, temperature=0)
    assert full.usage.input_tokens == len(expected.prompt_token_ids)
    (call,) = full.output
    assert call.name == "get_weather" and call.namespace == "mcp__w"
    events = _stream(client, model="m", input=ASK, tools=[namespaced], max_output_tokens=60, temperature=0)
    assert [e.item.namespace for e in events if e.type == "response.output_item.done"] == ["mcp__w"]


def test_items_render_like_the_hand_converted_conversation(client, ref):
    """Developer/system messages (the leading ones merged, a late one in place), parts, a
    reasoning item (dropped), a function_call joining the assistant message before it, its
    output as a tool message."""
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "input_text", "text": ASK}]},  # media parts: test_server_media
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "think"}],
         "encrypted_content": "opaque"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
        {"type": "message", "role": "system", "content": "Answer in English."},
    ]
    reference = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK},
                 {"role": "assistant", "content": "Checking.", "tool_calls": [
                     {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                       "arguments": {"city": "Paris"}}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
                 {"role": "system", "content": "Answer in English."}]
    expected = _greedy(ref, ref.chat_prompt_ids(reference, tools=[CHAT_WEATHER]), 12)
    out = client.responses.create(model="m", input=items, tools=[WEATHER, *CODEX_EXTRAS], max_output_tokens=12,
                                  temperature=0)
    assert out.usage.input_tokens == len(expected.prompt_token_ids)
    streamed = "".join(e.delta for e in _stream(client, model="m", input=items, tools=[WEATHER],
                                                max_output_tokens=12, temperature=0)
                       if e.type in ("response.output_text.delta", "response.function_call_arguments.delta"))
    produced = out.output_text or "".join(i.arguments for i in out.output if i.type == "function_call")
    assert streamed == produced


def test_repeated_prefix_reports_cached_tokens(client):
    instructions = "You are a careful Python expert. " * 8
    first = client.responses.create(model="m", instructions=instructions, input=ASK, max_output_tokens=2)
    events = _stream(client, model="m", instructions=instructions, input=ASK, max_output_tokens=2)
    usage = events[-1].response.usage
    assert usage.input_tokens == first.usage.input_tokens > 64
    cached = usage.input_tokens_details.cached_tokens
    assert 0 < cached < usage.input_tokens and cached % 16 == 0


@pytest.mark.parametrize("kwargs,param", [
    (dict(previous_response_id="resp_123"), "previous_response_id"),
    (dict(conversation="conv_1"), "conversation"),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0]"),
    (dict(input=[]), "input"),
    (dict(input=5), "input"),
    (dict(input=[{"role": "wizard", "content": "x"}]), "input[0].role"),
    (dict(input=[{"type": "function_call", "call_id": "c", "arguments": "{}"}]), "input[0].name"),
    (dict(tools=[{"type": "function", "parameters": {}}]), "tools[0].name"),
    (dict(max_output_tokens=0), "max_output_tokens"),
    (dict(temperature=3), "temperature"),
])
def test_bad_input_is_an_openai_shaped_400(client, kwargs, param):
    args = dict(model="m", input="hi", max_output_tokens=2) | kwargs
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**args)
    err = info.value.body
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_malformed_bodies(srv):
    for raw in (b"", b"{", b"[]", b'{"input": {"role": "user"}}'):
        r = httpx.post(srv.base_url + "/responses", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, raw
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# ---- reasoning items: a template that opens a <think> block ---------------------------------------
@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory):
    """The demo model with a Qwen3-style template whose generation prompt opens <think> (its
    thinking switch is exercised in tests of part 3)."""
    return server_util.demo_with_template(tmp_path_factory.mktemp("thinking_demo"), THINKING_TEMPLATE)


@pytest.fixture(scope="module")
def thinking(thinking_dir):
    with ServerThread(model_dir=thinking_dir) as srv:
        yield openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)


def test_reasoning_comes_back_as_a_reasoning_item(thinking, ref):
    messages = [{"role": "user", "content": ASK}]
    ids = ref.tokenizer.encode(ref.tokenizer.apply_chat_template(messages) + "<think>\n")
    expected = _greedy(ref, ids, 8)  # the demo model never writes </think>: all 8 tokens are reasoning
    assert "</think>" not in expected.text
    full = thinking.responses.create(model="m", input=ASK, max_output_tokens=8, temperature=0)
    events = _stream(thinking, model="m", input=ASK, max_output_tokens=8, temperature=0)
    (item,) = full.output
    assert item.type == "reasoning" and item.summary == [] and item.content[0].text == expected.text.lstrip("\n")
    assert full.status == "incomplete" and full.incomplete_details.reason == "max_output_tokens"
    assert 0 < full.usage.output_tokens_details.reasoning_tokens <= full.usage.output_tokens == 8
    _check_sequence(events)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == item.content[0].text
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].type == "reasoning"


@pytest.mark.parametrize("switch", [dict(reasoning={"effort": "none"}), dict(reasoning={"effort": "minimal"}),
                                    dict(extra_body={"chat_template_kwargs": {"enable_thinking": False}}),
                                    dict(extra_body={"enable_thinking": False})])
def test_thinking_off_renders_the_templates_switch_and_yields_no_reasoning(thinking, ref, switch):
    messages = [{"role": "user", "content": ASK}]
    ids = ref.tokenizer.encode(ref.tokenizer.apply_chat_template(messages) + "<think>\n\n</think>\n\n")
    expected = _greedy(ref, ids, 8)
    full = thinking.responses.create(model="m", input=ASK, max_output_tokens=8, temperature=0, **switch)
    assert full.usage.input_tokens == len(ids)
    assert [i.type for i in full.output] == ["message"] and full.output_text == expected.text
    assert full.usage.output_tokens_details.reasoning_tokens == 0


def test_thinking_on_by_effort_and_bad_effort(thinking):
    on = thinking.responses.create(model="m", input=ASK, max_output_tokens=4, temperature=0,
                                   reasoning={"effort": "high"})
    assert on.output[0].type == "reasoning"
    with pytest.raises(openai.BadRequestError) as info:
        thinking.responses.create(model="m", input=ASK, max_output_tokens=2, reasoning={"effort": "max!"})
    assert info.value.body["param"] == "reasoning.effort"
    with pytest.raises(openai.BadRequestError) as info:
        thinking.responses.create(model="m", input=ASK, max_output_tokens=2,
                                  extra_body={"chat_template_kwargs": {"messages": []}})
    assert info.value.body["param"] == "chat_template_kwargs"


def test_forced_tool_choice_and_json_format_are_enforced(client):
    """tool_choice and text.format go through the same grammar as the chat routes: a forced
    tool always yields a call with schema-valid arguments, json_schema output parses."""
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        out = client.responses.create(model="m", input="Tell me a joke.", tools=[WEATHER], tool_choice=choice,
                                      max_output_tokens=100, temperature=0, parallel_tool_calls=False)
        assert out.status == "completed"
        (call,) = out.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert set(json.loads(call.arguments)) == {"city"} and isinstance(json.loads(call.arguments)["city"], str)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = client.responses.create(model="m", input="Is it sunny?", max_output_tokens=40, temperature=1,
                                  text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert out.status == "completed" and isinstance(json.loads(out.output_text)["ok"], bool)


# ---- the same switches on the other two APIs (one thinking server for all) --------------------
def test_chat_and_anthropic_thinking_switches(thinking, ref):
    import anthropic

    messages = [{"role": "user", "content": ASK}]
    off_ids = ref.tokenizer.encode(ref.tokenizer.apply_chat_template(messages) + "<think>\n\n</think>\n\n")
    chat = thinking.chat.completions
    for switch in (dict(reasoning_effort="none"), dict(extra_body={"chat_template_kwargs": {"enable_thinking": False}})):
        off = chat.create(model="m", messages=messages, max_tokens=6, temperature=0, **switch)
        assert off.usage.prompt_tokens == len(off_ids) and off.choices[0].message.model_extra.get("reasoning_content") is None
    on = chat.create(model="m", messages=messages, max_tokens=6, temperature=0, reasoning_effort="high")
    assert on.choices[0].message.model_extra["reasoning_content"] and not on.choices[0].message.content

    client = anthropic.Anthropic(base_url=str(thinking.base_url).removesuffix("/v1/"), api_key="x", max_retries=0)
    # thinking blocks in the history are accepted whatever their signature (and dropped)
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "forged"},
                                                 {"type": "redacted_thinking", "data": "opaque"},
                                                 {"type": "text", "text": "Hello."}]},
               {"role": "user", "content": ASK}]
    ref_history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."},
                   {"role": "user", "content": ASK}]
    off = client.messages.create(model="m", max_tokens=6, extra_body={"temperature": 0}, messages=history,
                                 thinking={"type": "disabled"})
    off_history = ref.tokenizer.encode(ref.tokenizer.apply_chat_template(ref_history) + "<think>\n\n</think>\n\n")
    assert off.usage.input_tokens == len(off_history) and [b.type for b in off.content] == ["text"]
    assert client.messages.count_tokens(model="m", messages=history,
                                        thinking={"type": "disabled"}).input_tokens == len(off_history)
    on = client.messages.create(model="m", max_tokens=6, extra_body={"temperature": 0}, messages=history,
                                thinking={"type": "enabled", "budget_tokens": 1024})
    assert on.content[0].type == "thinking" and on.content[0].thinking
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="m", max_tokens=6, messages=history, thinking={"type": "sometimes"})


# ---- limits each API's clients understand ------------------------------------------------------
def test_prompt_too_long_and_max_tokens_beyond_the_context_in_each_apis_shape(srv):
    long_text = "import os\n" * 3000  # > 4096 demo tokens
    r = httpx.post(srv.url + "/v1/messages", json={"model": "m", "max_tokens": 4,
                                                   "messages": [{"role": "user", "content": long_text}]})
    err = r.json()
    assert r.status_code == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    n = len(srv.state.llm.chat_prompt_ids([{"role": "user", "content": long_text}]))
    assert err["error"]["message"] == f"prompt is too long: {n} tokens > 4096 maximum"  # Anthropic's wording
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]}),
                       ("/v1/responses", {"input": long_text})):
        r = httpx.post(srv.url + path, json={"model": "m", **body})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    for path, body in (("/v1/messages", {"max_tokens": 4096, "messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/chat/completions", {"max_tokens": 5000, "messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/responses", {"max_output_tokens": 4096, "input": "hi"})):
        r = httpx.post(srv.url + path, json={"model": "m", **body})
        assert r.status_code == 400 and "context limit is 4096" in r.text and "4095" in r.text, r.text
    card = httpx.get(srv.base_url + "/models").json()["data"][0]
    assert (card["context_length"], card["max_output_tokens"]) == (4096, 4095)
