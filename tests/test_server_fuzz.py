"""Property-based fuzzing of both APIs against a real server on 127.0.0.1 (demo model).

Bodies are valid requests with fields replaced, dropped or added (so most get past parsing and
into validation or generation), arbitrary JSON, and raw bytes; headers are varied too. For every
request: no 5xx, a 4xx carries the API's own error shape, a 200 stream ends the way the protocol
says, and nothing hangs (a client timeout fails the test). Afterwards the server is idle again
with every KV page free or cached, and still answers a normal request."""
from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_util import ServerThread

N = int(os.environ.get("FREETOKEN_FUZZ_EXAMPLES", 100))  # per structured test; ~2,300 requests in all
SETTINGS = settings(max_examples=N, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                    database=None)
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens", "/v1/messages?beta=true")


@pytest.fixture(scope="module")
def server():
    from freetoken_py.server.protocol import ServerLimits

    limits = ServerLimits(max_body_bytes=16_384, max_messages=16, max_tools=8, max_stop=4)
    with ServerThread(max_model_len=256, limits=limits, max_queue=4) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            srv.client = client
            yield srv


# -- strategies -------------------------------------------------------------------------------

ascii_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=12)
header_value = ascii_text.map(str.strip)  # HTTP forbids surrounding whitespace; the client would refuse
leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False, allow_infinity=False),
                 st.text(max_size=16))
json_any = st.recursive(leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                        max_leaves=8)
small_tokens = st.one_of(st.integers(-2, 3), st.sampled_from([0, 2**31, 2**63, 1.5, "2", None, True, [], {}]))
number = st.one_of(st.floats(-5, 5), st.integers(-3, 100), st.sampled_from([1e308, -1e308, "0.5", None, [], True]))

block = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image", "image_url", "tool_use", "tool_result", "thinking", "document",
                              "tool_reference", "server_tool_use", "nonsense", 3, None])},
    optional={"text": st.one_of(st.text(max_size=30), json_any), "id": st.one_of(ascii_text, json_any),
              "name": st.one_of(ascii_text, json_any), "input": json_any, "tool_use_id": st.one_of(ascii_text, json_any),
              "content": st.one_of(st.text(max_size=20), st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                          "text": st.text(max_size=10)}), max_size=2), json_any),
              "is_error": json_any, "thinking": json_any, "signature": json_any, "cache_control": json_any,
              "image_url": json_any, "source": json_any})
content = st.one_of(st.text(max_size=40), st.lists(block, max_size=3), json_any)
tool_call = st.fixed_dictionaries({"id": st.one_of(ascii_text, json_any), "type": st.sampled_from(["function", "x"]),
                                   "function": st.one_of(json_any, st.fixed_dictionaries({
                                       "name": st.one_of(ascii_text, json_any),
                                       "arguments": st.one_of(st.sampled_from(['{"a": 1}', "{bad", "", "[]"]), json_any)}))})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "function", "", 7, None])},
    optional={"content": content, "tool_calls": st.one_of(st.lists(tool_call, max_size=2), json_any),
              "tool_call_id": st.one_of(ascii_text, json_any), "name": json_any, "reasoning_content": json_any})
messages = st.one_of(st.lists(message, max_size=4), st.lists(message, min_size=17, max_size=18), json_any)
schema = st.one_of(st.just({"type": "object", "properties": {"city": {"type": "string"}}}), json_any)
openai_tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search", 1])}, optional={
    "function": st.one_of(json_any, st.fixed_dictionaries({"name": st.one_of(ascii_text, json_any)},
                                                          optional={"parameters": schema, "description": json_any}))})
anthropic_tool = st.fixed_dictionaries({"name": st.one_of(ascii_text, json_any)}, optional={
    "input_schema": schema, "description": json_any, "type": json_any, "defer_loading": json_any,
    "cache_control": json_any})

COMMON = {"model": st.one_of(ascii_text, json_any), "stream": st.one_of(st.booleans(), json_any),
          "temperature": number, "top_p": number, "top_k": number, "seed": st.one_of(st.integers(-2**64, 2**64), json_any),
          "metadata": json_any, "unknown_field": json_any, "messages": messages}
OPENAI_FIELDS = dict(COMMON, max_tokens=small_tokens, max_completion_tokens=small_tokens,
                     tools=st.one_of(st.lists(openai_tool, max_size=3), st.lists(openai_tool, min_size=9, max_size=9), json_any),
                     tool_choice=st.one_of(st.sampled_from(["auto", "none", "required"]), json_any),
                     stop=st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=6), json_any),
                     n=st.one_of(st.integers(-1, 3), json_any), stream_options=st.one_of(
                         st.fixed_dictionaries({"include_usage": json_any}), json_any),
                     prompt=st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 5000), max_size=5), json_any),
                     frequency_penalty=number, presence_penalty=number, min_p=number, logprobs=json_any,
                     response_format=json_any, reasoning_effort=json_any)
ANTHROPIC_FIELDS = dict(COMMON, max_tokens=small_tokens,
                        system=st.one_of(st.text(max_size=30), st.lists(block, max_size=2), json_any),
                        tools=st.one_of(st.lists(anthropic_tool, max_size=3), json_any),
                        tool_choice=json_any, stop_sequences=st.one_of(st.lists(st.text(max_size=5), max_size=6), json_any),
                        thinking=st.one_of(st.sampled_from([{"type": "adaptive"}, {"type": "enabled", "budget_tokens": 8}]), json_any),
                        context_management=json_any, output_config=json_any)
item = st.one_of(message, st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "item_reference",
                              "local_shell_call", 5, None])},
    optional={"role": st.sampled_from(["user", "assistant", "developer", "system", "tool", 3]), "content": content,
              "call_id": st.one_of(ascii_text, json_any), "name": st.one_of(ascii_text, json_any),
              "arguments": st.one_of(st.sampled_from(['{"a": 1}', "{bad", "", "[]"]), json_any),
              "output": st.one_of(st.text(max_size=20), content, json_any), "summary": json_any,
              "encrypted_content": json_any, "id": json_any}))
responses_tool = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["function", "namespace", "web_search",
                                                                            "local_shell", "custom", 2])},
                                                 optional={"name": st.one_of(ascii_text, json_any), "parameters": schema,
                                                           "strict": json_any, "tools": json_any}), json_any)
RESPONSES_FIELDS = dict(COMMON, max_output_tokens=small_tokens, instructions=st.one_of(st.text(max_size=20), content),
                        input=st.one_of(st.text(max_size=30), st.lists(item, max_size=4), json_any),
                        tools=st.one_of(st.lists(responses_tool, max_size=3), json_any),
                        tool_choice=st.one_of(st.sampled_from(["auto", "none", "required"]), json_any),
                        reasoning=st.one_of(st.fixed_dictionaries({}, optional={"effort": json_any, "summary": json_any}),
                                            json_any),
                        previous_response_id=st.one_of(st.none(), json_any), store=json_any, include=json_any,
                        parallel_tool_calls=json_any, prompt_cache_key=json_any, text=json_any)
RESPONSES_BASE = {"model": "demo", "input": "hi", "max_output_tokens": 2}
OPENAI_BASE = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION_BASE = {"model": "demo", "prompt": "def f(x):", "max_tokens": 2}
ANTHROPIC_BASE = {"model": "claude-x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@st.composite
def mutated(draw, base: dict, fields: dict) -> dict:
    """The base request with a few fields replaced, removed or added."""
    body = dict(base)
    for _ in range(draw(st.integers(0, 4))):
        key = draw(st.sampled_from(sorted(fields)))
        if draw(st.integers(0, 5)) == 0:
            body.pop(key, None)
        else:
            body[key] = draw(fields[key])
    # keep generations short (a full-context generation costs seconds on a busy 2-core box); the
    # invalid values of these fields are still sent as drawn
    if all(body.get(k) is None for k in ("max_tokens", "max_completion_tokens", "max_output_tokens")):
        body["max_tokens"] = 3
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if type(body.get(key)) is int and body[key] > 4:
            body[key] = 4
    return body


headers = st.fixed_dictionaries({}, optional={
    "content-type": st.sampled_from(["application/json", "text/plain", "", "application/x-www-form-urlencoded",
                                     "multipart/form-data; boundary=x", "application/json; charset=latin-1"]),
    "anthropic-version": header_value, "anthropic-beta": header_value, "x-api-key": header_value,
    "authorization": header_value, "accept": header_value, "x-stainless-retry-count": header_value})


# -- checking one exchange --------------------------------------------------------------------

def _is_openai_error(body) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)


def _is_anthropic_error(body) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (body.get("type") == "error" and isinstance(err, dict) and isinstance(err.get("type"), str)
            and isinstance(err.get("message"), str))


def _check_stream(path: str, text: str) -> None:
    if path.startswith("/v1/messages"):
        events = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
        assert events and events[0] in ("message_start", "error") and events[-1] in ("message_stop", "error"), text[-500:]
        if events[-1] == "error":
            payload = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")][-1]
            assert _is_anthropic_error(payload), payload
    elif path.startswith("/v1/responses"):
        events = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
        assert events and events[0] == "response.created", text[-500:]
        assert events[-1] in ("response.completed", "response.incomplete", "response.failed"), text[-500:]
    else:
        data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert data and data[-1] == "[DONE]", text[-500:]


def exchange(srv, method: str, path: str, content: bytes, hdrs: dict) -> None:
    req = srv.client.build_request(method, path, content=content, headers=hdrs)
    resp = srv.client.send(req, stream=True)
    try:
        text = resp.read().decode("utf-8", "replace")
    finally:
        resp.close()
    assert resp.status_code < 500, (resp.status_code, path, content[:300], text[:500])
    if resp.status_code >= 400:
        body = json.loads(text)
        shape_ok = _is_anthropic_error(body) if path.startswith("/v1/messages") else _is_openai_error(body)
        assert shape_ok, (path, resp.status_code, body)
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        _check_stream(path, text)
    else:
        json.loads(text)


def _encode(body) -> bytes:
    return json.dumps(body).encode()  # floats like 1e308 stay finite; NaN is covered by the raw tests


# -- the properties ---------------------------------------------------------------------------

@SETTINGS
@given(body=mutated(OPENAI_BASE, OPENAI_FIELDS), hdrs=headers)
def test_fuzz_chat_completions(server, body, hdrs):
    exchange(server, "POST", "/v1/chat/completions", _encode(body), hdrs)


@SETTINGS
@given(body=mutated(COMPLETION_BASE, OPENAI_FIELDS), hdrs=headers)
def test_fuzz_completions(server, body, hdrs):
    exchange(server, "POST", "/v1/completions", _encode(body), hdrs)


@SETTINGS
@given(body=mutated(RESPONSES_BASE, RESPONSES_FIELDS), hdrs=headers)
def test_fuzz_responses(server, body, hdrs):
    exchange(server, "POST", "/v1/responses", _encode(body), hdrs)


@SETTINGS
@given(body=mutated(ANTHROPIC_BASE, ANTHROPIC_FIELDS), hdrs=headers, path=st.sampled_from(ANTHROPIC_PATHS))
def test_fuzz_messages(server, body, hdrs, path):
    exchange(server, "POST", path, _encode(body), hdrs)


raw_bodies = st.one_of(
    st.binary(max_size=64), json_any.map(lambda v: json.dumps(v).encode()),
    st.just(b'{"max_tokens": NaN, "messages": []}'), st.just(b'{"a": 1e999999}'), st.just(b"\xff\xfe{}"),
    st.integers(1, 200_000).map(lambda n: b"[" * n + b"]" * n),  # nesting far past Python's recursion limit
    st.integers(16_000, 40_000).map(lambda n: b'{"x": "' + b"a" * n + b'"}'),  # around the 16 KB body cap
    st.sampled_from([json.dumps(OPENAI_BASE), json.dumps(ANTHROPIC_BASE), json.dumps(RESPONSES_BASE)]).flatmap(
        lambda s: st.integers(0, len(s)).map(lambda i: s[:i].encode())))  # truncated valid requests


@settings(SETTINGS, max_examples=20 * N)  # cheap: almost all are rejected before any generation
@given(content=raw_bodies, hdrs=headers,
       target=st.sampled_from([("POST", p) for p in OPENAI_PATHS + ANTHROPIC_PATHS] +
                              [("GET", "/v1/chat/completions"), ("PUT", "/v1/messages"), ("POST", "/v1/models"),
                               ("GET", "/v1/models/anything/at/all"), ("POST", "/v1/nope"), ("DELETE", "/v1/messages/x")]))
def test_fuzz_raw_bodies_and_methods(server, content, hdrs, target):
    exchange(server, *target, content, hdrs)


def test_chunked_upload_over_the_cap(server):
    """A body without Content-Length (chunked) is capped while it streams in."""
    def chunks():
        yield b'{"model": "x", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"a" * 1024
        yield b'"}], "max_tokens": 2}'
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
        resp = server.client.post(path, content=chunks())
        assert resp.status_code == 413, resp.text
        assert (_is_anthropic_error if path == "/v1/messages" else _is_openai_error)(resp.json())


@pytest.mark.parametrize("sampling", [{"temperature": 1e-300}, {"top_p": 1e-300}, {"min_p": 1e-300, "top_p": 1e-300}])
def test_extreme_sampling_values(server, sampling):
    """Found by the fuzzer: a positive temperature or top_p below fp32's smallest value used to
    make the sampler's distribution NaN / empty, kill the engine thread, and turn every later
    request into a 503. Tiny values must behave as their limit (greedy / the top token)."""
    for path, base in (("/v1/chat/completions", OPENAI_BASE), ("/v1/messages", ANTHROPIC_BASE),
                       ("/v1/responses", RESPONSES_BASE)):
        resp = server.client.post(path, json=dict(base, **sampling))
        assert resp.status_code == 200, resp.text
    assert server.client.get("/ready").status_code == 200


def test_server_is_idle_and_healthy_afterwards(server):
    """Runs last in this file: nothing left running, no KV page leaked, still answers."""
    stats = server.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["live_requests"] == 0
    assert stats["free_pages"] + stats["cached_pages"] == stats["num_pages"]
    resp = server.client.post("/v1/chat/completions", json=OPENAI_BASE)
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["role"] == "assistant"
