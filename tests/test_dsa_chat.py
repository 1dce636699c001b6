"""Chat and tool-call formats of DeepSeek-V3.2 (`deepseek_v32`, DSML calls) and GLM-5.x (`glm_moe_dsa`,
GLM-4.5-style XML calls without newlines, `glm47`) — issue 42 item 4.

References, none of them ours:
- DeepSeek-V3.2 ships no Jinja template, only the Python encoder `encoding/encoding_dsv32.py`. The
  project's template (freetoken_py/data/chat_templates/deepseek_v32.jinja) is checked against the
  encoder's published test pair (tests/data/deepseek_v32/test_input.json / test_output.txt, DeepSeek's
  own files) and against the encoder's outputs for more conversations (encoder_cases.json: chat and
  thinking modes, typed arguments, no system message), recorded outside this repository.
- GLM-5.2's published chat template (tests/data/templates/glm-5.2.jinja) renders the history and the
  new turn; tests/test_toolcalls_families.py runs it through both APIs' conversions and the parser.
- Served end to end: tiny `DeepseekV32ForCausalLM` / `GlmMoeDsaForCausalLM` checkpoints (tests/dsa_util.py)
  with a tokenizer holding each family's special tokens, on a real server on loopback; tool calls forced
  by the grammar come back in each API's own shape and validate against the tool's schema (jsonschema).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx
import jsonschema
import pytest

import dsa_util
import server_util
from freetoken_py.cli import DEMO_MODEL
from freetoken_py.server.chat import (anthropic_messages, anthropic_template_kwargs, anthropic_tools,
                                      openai_messages, openai_template_kwargs, openai_tools)
from freetoken_py.server.generation import render_chat
from freetoken_py.server.protocol import ServerLimits
from freetoken_py.server.toolcalls import collect, detect_reasoning, detect_tool_format, parse_output
from freetoken_py.tokenizer import Tokenizer, bundled_chat_template
from test_toolcalls_families import (CONTENT, NEW_CALLS, REASONING, TOOLS, _anthropic_content, _anthropic_history,
                                     _check_every_split, _openai_history, _openai_message, Family)

DATA = Path(__file__).parent / "data" / "deepseek_v32"
LIMITS = ServerLimits()
V32 = bundled_chat_template("deepseek_v32")
DSML_FAMILY = Family("deepseek_v32", "deepseek_dsml", "<｜end▁of▁sentence｜>")


def _tokenizer(tmp: Path, template: str) -> Tokenizer:
    shutil.copy(DEMO_MODEL / "tokenizer.json", tmp / "tokenizer.json")
    (tmp / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (tmp / "chat_template.jinja").write_text(template, encoding="utf-8")
    return Tokenizer(tmp)


@pytest.fixture(scope="module")
def v32(tmp_path_factory) -> Tokenizer:
    return _tokenizer(tmp_path_factory.mktemp("v32"), V32)


def _template_messages(messages: list[dict]) -> list[dict]:
    """The encoder's messages (arguments as JSON text) as the server hands them to templates (dicts)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = dict(m, tool_calls=[dict(c, function=dict(c["function"], arguments=json.loads(c["function"]["arguments"])))
                                    for c in calls])
        out.append(m)
    return out


# ---- the template against the published encoder ---------------------------------------------------
def test_template_renders_the_published_encoder_test_output(v32):
    """DeepSeek's own test pair: tools on the system message, thinking mode, reasoning kept after the
    last user message only, three rounds of calls and results (the file ends with a newline)."""
    case = json.loads((DATA / "test_input.json").read_text(encoding="utf-8"))
    got = v32.apply_chat_template(_template_messages(case["messages"]), tools=case["tools"], enable_thinking=True)
    assert got + "\n" == (DATA / "test_output.txt").read_text(encoding="utf-8")


@pytest.mark.parametrize("case", json.loads((DATA / "encoder_cases.json").read_text(encoding="utf-8"))["cases"],
                         ids=lambda c: c["name"])
def test_template_matches_the_encoder_on_recorded_conversations(case, v32):
    thinking = case["thinking_mode"] == "thinking"
    got = v32.apply_chat_template(_template_messages(case["messages"]), tools=case["tools"], enable_thinking=thinking)
    assert got == case["expected"]
    # `thinking` (vLLM's chat_template_kwargs name for this family) is the same switch
    assert v32.apply_chat_template(_template_messages(case["messages"]), tools=case["tools"], thinking=thinking) == got


def test_thinking_switch_from_each_api(v32, tmp_path):
    """Each API's reasoning field reaches the template as enable_thinking (chat.py), as for the other
    families: off by default (the encoder's chat mode, `</think>` after the assistant tag), on by
    reasoning_effort / Anthropic thinking (`<think>` left open: the parser starts in the thought)."""
    msgs = [{"role": "user", "content": "hi"}]
    llm = SimpleNamespace(tokenizer=v32)
    cases = [({}, "</think>"), (openai_template_kwargs({}, "high"), "<think>"),
             (openai_template_kwargs({}, "none"), "</think>"),
             (openai_template_kwargs({"chat_template_kwargs": {"thinking": True}}), "<think>"),
             (anthropic_template_kwargs({"thinking": {"type": "enabled", "budget_tokens": 64}}), "<think>"),
             (anthropic_template_kwargs({"thinking": {"type": "disabled"}}), "</think>")]
    for kwargs, end in cases:
        ids, reasoning = render_chat(llm, msgs, None, kwargs)
        text = v32.apply_chat_template(msgs, **kwargs)
        assert text == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>" + end and ids == v32.encode(text)
        assert reasoning == ("open" if end == "<think>" else False)
    glm = _tokenizer(tmp_path, (server_util.TEMPLATES / "glm-5.2.jinja").read_text(encoding="utf-8"))
    assert glm.apply_chat_template(msgs, **openai_template_kwargs({}, "none")).endswith("<|assistant|><think></think>")
    assert render_chat(SimpleNamespace(tokenizer=glm), msgs, None, openai_template_kwargs({}, "high"))[1] == "open"
    # GLM-5.2's template also reads reasoning_effort: "high" is High, anything else (or none) Max
    assert glm.apply_chat_template(msgs, **openai_template_kwargs({}, "high")).startswith(
        "[gMASK]<sop><|system|>Reasoning Effort: High<|user|>hi")
    assert "Reasoning Effort: Max" in glm.apply_chat_template(msgs, **openai_template_kwargs({}, "medium"))
    assert "Reasoning Effort" not in glm.apply_chat_template(msgs, **anthropic_template_kwargs({"thinking": {"type": "disabled"}}))


# ---- the DSML parser ---------------------------------------------------------------------------
def test_published_assistant_turns_parse_back_into_their_calls():
    """Every assistant turn of DeepSeek's test output, fed as generated text (split at every
    character), gives the calls, text and reasoning of the test input. A turn's text starts after the
    prompt's `<think>` (thought open: reasoning first) or `</think>` (thought closed) and ends at the
    end-of-sentence token."""
    import re

    case = json.loads((DATA / "test_input.json").read_text(encoding="utf-8"))
    text = (DATA / "test_output.txt").read_text(encoding="utf-8")
    turns = [m for m in case["messages"] if m["role"] == "assistant"]
    body = text.index("</functions>\n")   # (the tool instructions hold an example of the markup)
    starts = [m for m in re.finditer(r"(?:<｜Assistant｜>|</function_results>\n\n)(</?think>)", text) if m.start() > body]
    assert len(starts) == len(turns) == 5
    for match, want in zip(starts, turns):
        gen = text[match.end():text.index("<｜end▁of▁sentence｜>", match.end())]
        thought_open = match.group(1) == "<think>"
        events = _check_every_split(gen, tool_format="deepseek_dsml", reasoning="open" if thought_open else False,
                                    tools_enabled=True, tools=case["tools"])
        out = collect(events)
        assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == \
            [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want.get("tool_calls", [])]
        assert out.content.strip() == want.get("content", "")
        assert out.reasoning == (want["reasoning_content"] if thought_open else "")
    assert [m.group(1) for m in starts] == ["</think>"] * 3 + ["<think>"] * 2  # reasoning after the last user only


def test_round_trip_over_both_apis(v32):
    """An OpenAI and an Anthropic request render the same V3.2 prompt; the new turn the template writes
    (thinking on: reasoning, text, two calls with typed arguments: string="false" values are JSON)
    parses back, split at every character, into the same calls in each API's shape."""
    fam = DSML_FAMILY
    messages, tools = openai_messages(_openai_history(fam), LIMITS), openai_tools(_openai_history(fam), LIMITS)
    prompt = v32.apply_chat_template(messages, tools=tools, enable_thinking=True)
    a_body = _anthropic_history(fam)
    assert v32.apply_chat_template(anthropic_messages(a_body, LIMITS), tools=anthropic_tools(a_body, LIMITS),
                                   enable_thinking=True) == prompt
    assert detect_tool_format(v32.chat_template) == "deepseek_dsml" and detect_reasoning(v32.chat_template)
    assert prompt.endswith("<｜Assistant｜><think>")
    turn = {"role": "assistant", "content": CONTENT, "reasoning_content": REASONING,
            "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                           for i, (n, a) in enumerate(NEW_CALLS)]}
    full = v32.apply_chat_template(messages + [turn], tools=tools, enable_thinking=True)
    assert full.startswith(prompt)
    text = full[len(prompt):].rsplit(fam.end, 1)[0]
    assert '<｜DSML｜parameter name="line" string="false">42</｜DSML｜parameter>' in text
    events = _check_every_split(text, tool_format="deepseek_dsml", reasoning="open", tools_enabled=True, tools=tools)
    out = collect(events)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == NEW_CALLS
    assert (out.reasoning, out.content.strip()) == (REASONING, CONTENT)
    wire = _openai_message(events)
    assert [(c["name"], json.loads(c["arguments"])) for c in wire["tool_calls"]] == NEW_CALLS
    assert wire["reasoning_content"] == REASONING
    blocks = _anthropic_content(events)
    assert [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"] == NEW_CALLS
    # the history's call (arguments written back as the client sent them) reads back too
    history = parse_output(prompt.split("Weather in Paris?", 1)[1], "deepseek_dsml", reasoning=True,
                           tools_enabled=True, tools=TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in history.tool_calls] == [("get_weather", {"city": "Paris",
                                                                                                "days": 1})]


@pytest.mark.parametrize("text", [
    '<｜DSML｜function_calls>\n<｜DSML｜invoke>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',  # no name
    '<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a">1</｜DSML｜parameter>\n'
    '</｜DSML｜invoke>\n</｜DSML｜function_calls>',  # no string attribute
    '<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\njunk\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
    '<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="true">1'
    '</｜DSML｜parameter>\n<｜DSML｜parameter name="a" string="true">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    '</｜DSML｜function_calls>',  # a repeated parameter (the encoder's parser refuses it)
    '<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n',  # cut
])
def test_malformed_dsml_shows_as_written(text):
    out = parse_output("Hi " + text, "deepseek_dsml", tools_enabled=True)
    assert out.tool_calls == [] and "".join(out.content.split()) == "".join(("Hi " + text).split())


def test_dsml_values_json_by_attribute_and_lenient_on_bad_json():
    text = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n'
            '<｜DSML｜parameter name="s" string="true">42</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="n" string="false">42</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="o" string="false">{"a": [1, null]}</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="t" string="false">fast</｜DSML｜parameter>\n'
            '</｜DSML｜invoke>\n</｜DSML｜function_calls>')
    (call,) = parse_output(text, "deepseek_dsml", tools_enabled=True).tool_calls
    assert json.loads(call.arguments) == {"s": "42", "n": 42, "o": {"a": [1, None]}, "t": "fast"}


# ---- served end to end ---------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 9}}}}}
GOTO = {"type": "function", "function": {"name": "goto_line", "description": "Go to a line", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["line", "force"],
    "properties": {"line": {"type": "integer", "minimum": 1, "maximum": 99}, "force": {"type": "boolean"},
                   "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 2}}}}}
SERVED_TOOLS = [WEATHER, GOTO]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in SERVED_TOOLS}
V32_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
GLM_SPECIALS = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<arg_key>",
                "</arg_key>", "<arg_value>", "</arg_value>"]


def _served_checkpoint(out: Path, name: str, specials: list[str], eos: list[str], template: Path | None) -> Path:
    """A tiny DSA checkpoint whose vocabulary is the demo tokenizer's plus the family's special tokens
    (DSML's tags stay spelled out of smaller tokens, GLM's tags are single tokens as in its release)."""
    import tokenizers

    raw = tokenizers.Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))
    raw.add_special_tokens([t for t in specials if raw.token_to_id(t) is None])
    eos_ids = [raw.token_to_id(t) for t in eos]
    dsa_util.build(name, out, vocab_size=raw.get_vocab_size(with_added_tokens=True), bos_token_id=eos_ids[0],
                   eos_token_id=eos_ids[0], max_position_embeddings=4096)  # (room for eval tools' long prompts)
    raw.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": specials[0], "eos_token": eos[0]}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    if template is not None:
        shutil.copy(template, out / "chat_template.jinja")
    return out


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def served(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "deepseek_v32":   # no chat template in the checkpoint: the bundled one renders
        path = _served_checkpoint(out, "deepseek_v32", V32_SPECIALS, ["<｜end▁of▁sentence｜>"], None)
    else:
        path = _served_checkpoint(out, "glm_moe_dsa", GLM_SPECIALS, ["<|endoftext|>", "<|user|>", "<|observation|>"],
                                  server_util.TEMPLATES / "glm-5.2.jinja")
    with server_util.ServerThread(model_dir=path, max_model_len=2048) as srv:
        yield request.param, srv


def _valid(name: str, args: dict) -> None:
    jsonschema.validate(args, SCHEMAS[name])


def test_openai_chat_forced_calls(served):
    """Thinking off (GLM-5.2 thinks by default; a random model's thought would not end): required,
    a named tool, and the same streamed."""
    kind, srv = served
    tok = srv.state.llm.tokenizer
    assert tok.chat_template == (V32 if kind == "deepseek_v32" else (server_util.TEMPLATES / "glm-5.2.jinja").read_text())
    assert detect_tool_format(tok.chat_template, kind) == {"deepseek_v32": "deepseek_dsml", "glm_moe_dsa": "glm47"}[kind]
    msgs = [{"role": "user", "content": "Go to line 3, then get the weather."}]
    for seed, choice in enumerate(["required", {"type": "function", "function": {"name": "goto_line"}}]):
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=300, json={
            "model": "m", "messages": msgs, "tools": SERVED_TOOLS, "tool_choice": choice, "seed": seed,
            "temperature": 1.0, "max_tokens": 400, "parallel_tool_calls": False, "reasoning_effort": "none"})
        assert r.status_code == 200, r.text
        choice0 = r.json()["choices"][0]
        assert choice0["finish_reason"] == "tool_calls", choice0
        (call,) = choice0["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        _valid(call["function"]["name"], json.loads(call["function"]["arguments"]))
        if isinstance(choice, dict):
            assert call["function"]["name"] == "goto_line"
    # streamed: id and name first, the arguments after, finish_reason tool_calls
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=300, json={
            "model": "m", "messages": msgs, "tools": SERVED_TOOLS, "tool_choice": "required", "seed": 7,
            "temperature": 1.0, "max_tokens": 400, "stream": True, "parallel_tool_calls": False,
            "reasoning_effort": "none"}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0]["id"] and calls[0]["function"]["name"] in SCHEMAS
    _valid(calls[0]["function"]["name"], json.loads("".join(tc["function"].get("arguments", "") for tc in calls)))
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_anthropic_messages_forced_call_with_a_thought(served):
    """tool_choice any, and thinking enabled with a budget: the thought (cut at 4 tokens, then
    </think>) comes back as a thinking block, the call as a tool_use block."""
    kind, srv = served
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in SERVED_TOOLS]
    body = {"model": "m", "max_tokens": 400, "temperature": 1.0, "tools": tools, "tool_choice": {"type": "any"},
            "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
            "thinking": {"type": "enabled", "budget_tokens": 4}}
    r = httpx.post(srv.url + "/v1/messages", json=body, timeout=300)
    assert r.status_code == 200, r.text
    got = r.json()
    uses = [b for b in got["content"] if b["type"] == "tool_use"]
    assert got["stop_reason"] == "tool_use" and uses, got
    for use in uses:
        assert use["id"] and use["name"] in SCHEMAS
        _valid(use["name"], use["input"])
    assert [b["type"] for b in got["content"]][0] == "thinking"
    named = dict(body, tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                 thinking={"type": "disabled"})
    r = httpx.post(srv.url + "/v1/messages", json=named, timeout=300)
    (use,) = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    assert use["name"] == "get_weather"
    _valid("get_weather", use["input"])


def test_responses_forced_call(served):
    kind, srv = served
    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"]} for t in SERVED_TOOLS]
    r = httpx.post(srv.url + "/v1/responses", timeout=300, json={
        "model": "m", "input": "Go to line 7.", "tools": tools, "tool_choice": "required", "temperature": 1.0,
        "max_output_tokens": 400, "parallel_tool_calls": False, "reasoning": {"effort": "none"}})
    assert r.status_code == 200, r.text
    items = [i for i in r.json()["output"] if i["type"] == "function_call"]
    assert len(items) == 1 and items[0]["call_id"] and items[0]["name"] in SCHEMAS
    _valid(items[0]["name"], json.loads(items[0]["arguments"]))
    # the call goes back as history and renders as the family writes calls
    r = httpx.post(srv.url + "/v1/responses", timeout=300, json={
        "model": "m", "tools": tools, "max_output_tokens": 1, "input": [
            {"type": "message", "role": "user", "content": "Go to line 7."}, items[0],
            {"type": "function_call_output", "call_id": items[0]["call_id"], "output": "done"}]})
    assert r.status_code == 200, r.text


def test_eval_tools_covers_the_dsml_format(tmp_path):
    """`freetoken eval tools` takes the format from the model (here the bundled V3.2 template) and scores
    it with the server's grammar: every forced output starts a call, every complete call is declared
    and schema-valid."""
    from freetoken_py.evals.tools import ToolsEvalOptions, run_tools_eval

    path = _served_checkpoint(tmp_path / "v32", "deepseek_v32", V32_SPECIALS, ["<｜end▁of▁sentence｜>"], None)
    out = run_tools_eval(ToolsEvalOptions(path, samples=1, num_requests=2, max_tokens=200, temperature=1.0,
                                          as_json=True, json_runs=False))
    assert out["tool_format"] == "deepseek_dsml" and out["required"]["outputs"] == 2
    assert out["required"]["attempts"] == 2
    for mode in ("constrained", "required"):
        assert out[mode]["declared"] == out[mode]["parseable"] == out[mode]["valid"], out[mode]
