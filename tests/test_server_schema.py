"""Responses of a real `freetoken serve` (demo model, 127.0.0.1) validated with `jsonschema` against
OpenAI's own published schemas (tests/data/openai_schema_subset.json: its source and commit are in
the file; tests/openai_schema.py), streamed chunks and events one by one, with and without
logprobs, tools and n > 1."""
from __future__ import annotations

import json

import httpx
import pytest
from openai_schema import validate, validate_event

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HI = [{"role": "user", "content": "hi"}]


def post(srv, path: str, body: dict) -> dict:
    r = httpx.post(srv.base_url + path, json={"model": "m", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(srv, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", srv.base_url + path, json={"model": "m", "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


CHAT = [
    dict(messages=HI, max_tokens=4),
    dict(messages=HI, max_tokens=4, logprobs=True, top_logprobs=3, n=2, seed=1, temperature=1.0),
    dict(messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=40, tools=[WEATHER],
         tool_choice="required"),
]


@pytest.mark.parametrize("body", CHAT)
def test_chat_completions_match_the_published_schema(srv, body):
    validate(post(srv, "/chat/completions", body), "CreateChatCompletionResponse")
    chunks = stream(srv, "/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert chunks
    for chunk in chunks:
        validate(chunk, "CreateChatCompletionStreamResponse")


@pytest.mark.parametrize("body", [
    dict(prompt="def f(x):", max_tokens=4),
    dict(prompt="def f(x):", max_tokens=3, logprobs=2, echo=True, n=2, temperature=1.0, seed=3),
    dict(prompt="def f(x):", max_tokens=0, logprobs=1, echo=True),
])
def test_completions_match_the_published_schema(srv, body):
    validate(as_published(post(srv, "/completions", body)), "CreateCompletionResponse")
    for chunk in stream(srv, "/completions", body):
        if chunk["choices"]:   # the usage-only chunk has none (the schema wants one at least)
            validate(as_published(chunk), "CreateCompletionResponse")


def as_published(body: dict) -> dict:
    """Two documented departures, undone before validating (both are what OpenAI's own service
    sends and what vLLM sends; the document describes only the non-streamed object and leaves
    echo out): streamed chunks carry `finish_reason` null until the last, and an echoed prompt's
    first token has `null` logprobs (nothing precedes it); everything else must match as is."""
    body = json.loads(json.dumps(body))
    for choice in body["choices"]:
        if choice["finish_reason"] is None:
            choice["finish_reason"] = "length"
        lps = choice["logprobs"]
        if lps and lps["token_logprobs"] and lps["token_logprobs"][0] is None:
            assert lps["top_logprobs"][0] is None and lps["text_offset"][0] == 0   # only the first token
            for key in lps:
                lps[key] = lps[key][1:]
    return body


def test_models_match_the_published_schema(srv):
    validate(httpx.get(srv.base_url + "/models").json(), "ListModelsResponse")
    validate(httpx.get(srv.base_url + "/models/anything").json(), "Model")


@pytest.mark.parametrize("body", [
    dict(input="hi", max_output_tokens=4),
    dict(input="hi", max_output_tokens=4, include=["message.output_text.logprobs"], top_logprobs=2),
    dict(input="Weather in Paris?", max_output_tokens=40, tool_choice="required",
         tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]),
])
def test_responses_match_the_published_schema(srv, body):
    validate(post(srv, "/responses", body), "Response")
    events = stream(srv, "/responses", body)
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    for event in events:
        validate_event(event)


def test_the_validator_can_fail(srv):
    """The schema is not vacuous: what the server sent before (no refusal, null fingerprint) fails."""
    import jsonschema

    body = post(srv, "/chat/completions", dict(messages=HI, max_tokens=2))
    del body["choices"][0]["message"]["refusal"]
    with pytest.raises(jsonschema.ValidationError):
        validate(body, "CreateChatCompletionResponse")
    body = post(srv, "/chat/completions", dict(messages=HI, max_tokens=2))
    body["system_fingerprint"] = None
    with pytest.raises(jsonschema.ValidationError):
        validate(body, "CreateChatCompletionResponse")


@pytest.mark.parametrize("path,body", [
    ("/chat/completions", dict(messages=HI, n=10_000)),
    ("/completions", dict(prompt="x", logprobs=99)),
    ("/completions", dict(prompt=[1] * 5000, echo=True, max_tokens=0)),   # over the context
    ("/responses", dict(input="hi", top_logprobs=-1)),
])
def test_errors_match_the_published_schema(srv, path, body):
    r = httpx.post(srv.base_url + path, json={"model": "m", **body}, timeout=60)
    assert r.status_code == 400
    validate(r.json(), "ErrorResponse")
