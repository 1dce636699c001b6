"""The OpenAI API of `freetoken serve`, driven by the official `openai` SDK against a real server on
127.0.0.1 serving the demo model. References: `LLM.generate` on an independent LLM instance (same
ids, same greedy params), the tokenizer's own count of a hand-built conversation, and round trips
(non-streamed == streamed)."""
from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from freetoken_py.core import SamplingParams

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)


def _greedy(ref, ids, n):
    return ref.generate([ids], SamplingParams(max_tokens=n, temperature=0))[0]


def test_chat_greedy_matches_llm_generate_streamed_and_not(client, ref, srv):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a list?"}]
    expected = _greedy(ref, ref.chat_prompt_ids(messages), 24)
    full = client.chat.completions.create(model="any-name", messages=messages, max_tokens=24, temperature=0)
    assert full.choices[0].message.content == expected.text
    assert full.choices[0].finish_reason == expected.finish_reason
    assert full.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert full.usage.completion_tokens == len(expected.token_ids)
    assert full.model == "any-name"  # any requested name maps to the loaded model
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    # the same prompt again: the prefix cache holds the first request's pages, so every whole page
    # short of the last prompt token (whose logits must be computed) is read, not recomputed
    page = srv.stats()["page_size"]
    cached = (len(expected.prompt_token_ids) - 1) // page * page
    assert cached >= page  # the prompt spans > 1 page, so a cache that publishes nothing fails here
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_tool_call_streamed_and_not(client, ref):
    expected = _greedy(ref, ref.chat_prompt_ids(ASK, tools=[WEATHER]), 60)
    assert expected.text.startswith("<tool_call>")  # the demo model was trained to call tools
    body = json.loads(expected.text.split("<tool_call>")[1].split("</tool_call>")[0])
    full = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], max_tokens=60, temperature=0)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == body["name"] == "get_weather"
    assert json.loads(call.function.arguments) == body["arguments"]

    chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], max_tokens=60,
                                                 temperature=0, stream=True))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"  # id + name first
    assert {d.index for d in deltas} == {0}
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == body["arguments"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_results_render_like_the_template_convention(client, ref):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "system", "content": "Answer briefly."},  # mid-conversation system: stays in place
    ]
    reference = [*ASK,
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                       "arguments": {"city": "Paris"}}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
                 {"role": "system", "content": "Answer briefly."}]
    out = client.chat.completions.create(model="m", messages=history, tools=[WEATHER], max_tokens=4, temperature=0)
    assert out.usage.prompt_tokens == len(ref.chat_prompt_ids(reference, tools=[WEATHER]))


def test_completions_match_llm_generate(client, ref):
    expected = ref.generate(["import os\n"], SamplingParams(max_tokens=16, temperature=0))[0]
    full = client.completions.create(model="m", prompt="import os\n", max_tokens=16, temperature=0)
    assert full.choices[0].text == expected.text and full.usage.completion_tokens == len(expected.token_ids)
    streamed = client.completions.create(model="m", prompt="import os\n", max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected.text


def test_stop_strings_and_seeded_sampling(client, ref):
    ids = ref.encode_prompt("def main(")
    expected = ref.generate([ids], SamplingParams(max_tokens=40, temperature=0, stop=("\n",)))[0]
    out = client.completions.create(model="m", prompt=ids, max_tokens=40, temperature=0, stop=["\n"])
    assert out.choices[0].text == expected.text and "\n" not in out.choices[0].text
    seeded = [client.completions.create(model="m", prompt="def main(", max_tokens=12, temperature=1.0, seed=7)
              .choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_models_lists_the_context_length(client, srv):
    (model,) = client.models.list().data
    assert model.id == "demo_model"
    assert model.model_extra["context_length"] == 4096  # the demo model's max_position_embeddings
    assert httpx.get(srv.base_url + "/models/claude-whatever").json()["id"] == "demo_model"


@pytest.mark.parametrize("kwargs,needle", [
    (dict(n=17), "max-num-seqs"),
    (dict(temperature=-1), "temperature"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=1.5), "top_p"),
    (dict(stop=[1, 2]), "stop"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "role"),
    (dict(messages=[]), "at least one"),
    (dict(tools=[{"type": "function"}]), "tools[0]"),
])
def test_bad_parameters_raise_bad_request_with_our_message(client, kwargs, needle):
    args = dict(model="m", messages=ASK, max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**args)
    err = info.value.body
    assert needle in err["message"] and err["type"] == "invalid_request_error" and "param" in err


def test_prompt_over_the_context_is_a_400_with_both_counts_and_allocates_nothing(client, srv, ref):
    before = srv.stats()
    long = [{"role": "user", "content": "import os\n" * 3000}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=long, max_tokens=4)
    msg = info.value.body["message"]
    assert info.value.body["code"] == "context_length_exceeded"
    # OpenAI's own wording (OpenCode and other clients match "maximum context length"; OpenCode compacts)
    got = re.match(r"This model's maximum context length is (\d+) tokens\. However, your messages resulted in "
                   r"(\d+) tokens\. Please reduce the length of the messages\.", msg)
    assert got and int(got[1]) == 4096 and int(got[2]) == len(ref.chat_prompt_ids(long)), msg
    after = srv.stats()
    assert after["free_pages"] == before["free_pages"] and after["num_requests"] == before["num_requests"]


def test_unknown_fields_and_parts_are_ignored(client):
    """Unknown fields and extra text parts are tolerated (media parts are a 400: test_server_media)."""
    out = client.chat.completions.create(
        model="m", max_tokens=4, temperature=0,
        messages=[{"role": "developer", "content": "hi"},
                  {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}],
                   "name": "bob", "weird": 1}],
        extra_body={"foo": {"bar": 1}, "chat_template_kwargs": {"enable_thinking": False}, "top_k": 5})
    assert out.choices[0].finish_reason in ("stop", "length")


def test_malformed_bodies_get_openai_shaped_400s(srv):
    url = srv.base_url + "/chat/completions"
    for raw in (b"", b"{", b"[1, 2]", b'{"messages": "hi"}', b'{"messages": [{"role": "user", "content": 5}]}'):
        r = httpx.post(url, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, raw
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(srv.base_url + "/nope")
    assert r.status_code == 404 and "error" in r.json()


def test_repeated_prefix_reports_cached_tokens(client):
    messages = [{"role": "system", "content": "You are a careful Python expert. " * 8}, *ASK]
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=2, temperature=0)
    second = list(client.chat.completions.create(model="m", messages=messages, max_tokens=2, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))[-1].usage
    assert second.prompt_tokens == first.usage.prompt_tokens > 64
    cached = second.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.prompt_tokens and cached % 16 == 0  # whole 16-token pages, never the last token
