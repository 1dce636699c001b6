"""Tool calls and JSON output valid by construction, on the demo model (issue 24 part 2).

The grammars are the server's own (server/constraints.py) rendered through the server's own
chat template and parsed by its own parser (server/toolcalls.py); the independent judge is the
`jsonschema` package. Sampled at temperature 1 in batches through LLM.generate; short schemas
(bounded strings and integers) so every call can finish within max_tokens."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from freetoken_py.cli import DEMO_MODEL
from freetoken_py.core import SamplingParams
from freetoken_py.llm import LLM
from freetoken_py.server.constraints import Shape, ToolChoice, json_grammar, marker_tokens, request_grammar
from freetoken_py.server.toolcalls import parse_output


def _tool(name, props, required):
    return {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": {
        "type": "object", "properties": props, "required": required, "additionalProperties": False}}}


TOOLS = [
    _tool("get_weather", {"city": {"type": "string", "maxLength": 12},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city", "unit"]),
    _tool("read_file", {"path": {"type": "string", "maxLength": 16},
                        "limit": {"type": "integer", "minimum": 1, "maximum": 500}}, ["path"]),
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 16},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 10},
                                           "ok": {"type": "boolean"}},
          "required": ["answer", "score", "ok"], "additionalProperties": False}
CALL_OPEN = "<tool_call>"
PROMPTS = ["What is the weather in Paris?", "Show me the first lines of setup.py.",
           "Check the weather in Oslo, then read notes.txt."]


@pytest.fixture(scope="module")
def llm():
    return LLM(DEMO_MODEL, show_progress=False, max_num_seqs=64)


def _prompt(llm, text, tools=TOOLS):
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], tools=tools))


def _shape(llm):
    return Shape("qwen3_json", False, marker_tokens(llm.tokenizer))


def _run(llm, grammar, n, max_tokens=64, tools=TOOLS):
    prompts = [_prompt(llm, PROMPTS[i % len(PROMPTS)], tools) for i in range(n)]
    llm.generate(prompts[:len(PROMPTS)], SamplingParams(max_tokens=1))   # into the prefix cache: prefilled once
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=0, seed=i, grammar=grammar)
              for i in range(n)]
    return llm.generate(prompts, params)


def _calls(out):
    return parse_output(out.text, "qwen3_json", False, True, TOOLS)


def _valid(call) -> bool:
    try:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    except (KeyError, jsonschema.ValidationError):
        return False
    return True


def test_200_required_generations_are_all_declared_valid_calls(llm):
    outs = _run(llm, request_grammar(TOOLS, ToolChoice("required"), None, _shape(llm)), 200)
    parsed = [_calls(o) for o in outs]
    assert all(o.finish_reason == "stop" for o in outs)          # every call closed, then EOS
    assert all(p.tool_calls and not p.content.strip() for p in parsed)
    calls = [c for p in parsed for c in p.tool_calls]
    assert all(c.name in SCHEMAS and _valid(c) for c in calls), [c for c in calls if not _valid(c)][:3]


def test_auto_calls_are_valid_and_text_never_spells_an_unchecked_call(llm):
    outs = _run(llm, request_grammar(TOOLS, ToolChoice("auto"), None, _shape(llm)), 40)
    parsed = [_calls(o) for o in outs]
    calls = [c for p in parsed for c in p.tool_calls]
    assert calls and all(c.name in SCHEMAS and _valid(c) for c in calls)
    for o, p in zip(outs, parsed):   # an opener left in the text is only ever a call cut by max_tokens
        assert CALL_OPEN not in p.content or (o.finish_reason == "length" and p.content.count(CALL_OPEN) == 1)


def test_named_tool_and_no_parallel_calls(llm):
    choice = ToolChoice("named", "read_file", parallel=False)
    outs = _run(llm, request_grammar(TOOLS, choice, None, _shape(llm)), 20)
    for o in outs:
        p = _calls(o)
        assert [c.name for c in p.tool_calls] == ["read_file"] and _valid(p.tool_calls[0])


def test_json_schema_output_always_validates(llm):
    outs = _run(llm, json_grammar(ANSWER, _shape(llm)), 60, tools=None)
    for o in outs:
        jsonschema.validate(json.loads(o.text), ANSWER)


def test_unconstrained_differs(llm):
    """The same prompts without the grammar: the model's own calls are not all valid (reported
    by `freetoken eval tools`; here only that the grammar is what makes the difference)."""
    outs = _run(llm, None, 24, max_tokens=48)
    calls = [c for o in outs for c in _calls(o).tool_calls]
    bad = [o for o in outs if CALL_OPEN in _calls(o).content] + [c for c in calls if not _valid(c)]
    assert bad


# ---- through the server ---------------------------------------------------------------------
def _chat(srv, **body):
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": "m", "max_tokens": 64, **body}, timeout=120)
    return r.status_code, r.json()


def test_openai_forced_tool_and_response_format(srv):
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    for seed in range(3):
        code, body = _chat(srv, messages=msgs, tools=TOOLS, seed=seed, temperature=1.0,
                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert code == 200, body
        calls = body["choices"][0]["message"]["tool_calls"]
        assert calls and all(c["function"]["name"] == "get_weather" for c in calls)
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), SCHEMAS["get_weather"])
        assert body["choices"][0]["finish_reason"] == "tool_calls"
    code, body = _chat(srv, messages=msgs, seed=1, temperature=1.0,
                       response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}})
    assert code == 200, body
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), ANSWER)


def test_anthropic_tool_choice_any(srv):
    tools = [{"name": t["function"]["name"], "description": "d", "input_schema": t["function"]["parameters"]}
             for t in TOOLS]
    r = httpx.post(f"{srv.url}/v1/messages", timeout=120, json={
        "model": "m", "max_tokens": 64, "temperature": 1.0, "tools": tools, "tool_choice": {"type": "any"},
        "messages": [{"role": "user", "content": PROMPTS[1]}]})
    assert r.status_code == 200, r.text
    uses = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    assert uses and r.json()["stop_reason"] == "tool_use"
    for u in uses:
        jsonschema.validate(u["input"], SCHEMAS[u["name"]])


@pytest.mark.parametrize("body, field", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": 7}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_choices_are_400s_naming_the_field(srv, body, field):
    code, got = _chat(srv, messages=[{"role": "user", "content": "hi"}], tools=TOOLS, **body)
    assert code == 400 and got["error"]["type"] == "invalid_request_error" and field in got["error"]["message"]


def test_a_schema_the_grammar_cannot_enforce_is_a_400_naming_the_tool(srv):
    bad = [_tool("broken", {"a": {"$ref": "#/definitions/missing"}}, ["a"])]
    code, got = _chat(srv, messages=[{"role": "user", "content": "hi"}], tools=bad, tool_choice="required")
    assert code == 400 and "broken" in got["error"]["message"], got
