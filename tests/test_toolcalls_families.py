"""Each family's tool calls round-trip through its own published chat template (tests/data/templates,
each naming its source) and the streaming parser: a history converted from an OpenAI and an
Anthropic request by the server's own chat code renders through the project's Tokenizer (Jinja
sandbox); the text the template writes for a new assistant turn (reasoning, text, two calls with
typed arguments) is what the model would generate; fed to the parser whole and split at every
character it gives the same events, and those events are the original calls, text and reasoning —
also after the OpenAI delta and Anthropic block mappings."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from freetoken_py.server.anthropic_api import _Blocks
from freetoken_py.server.chat import anthropic_messages, anthropic_tools, openai_messages, openai_tools
from freetoken_py.server.generation import render_chat
from freetoken_py.server.openai_api import chat_delta
from freetoken_py.server.protocol import ServerLimits
from freetoken_py.server.toolcalls import (OutputParser, ReasoningDelta, TextDelta, ToolCallStart, collect,
                                           detect_reasoning, detect_tool_format, parse_output)
from freetoken_py.tokenizer import Tokenizer
import server_util

ROOT = Path(__file__).resolve().parent
TEMPLATES = ROOT / "data" / "templates"
DEMO = ROOT.parent / "freetoken_py" / "data" / "demo_model"
LIMITS = ServerLimits()

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}
EDIT = {"type": "function", "function": {"name": "edit", "description": "Edit a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"},
                                     "force": {"type": "boolean"}, "opts": {"type": "object"},
                                     "tags": {"type": "array"}, "code": {"type": "string"}}}}}
TOOLS = [WEATHER, EDIT]
NEW_CALLS = [("get_weather", {"city": "Zürich", "days": 3}),
             ("edit", {"path": "007", "line": 42, "force": True, "opts": {"a": [1, 2]}, "tags": ["x", "y"],
                       "code": "if a < b:\n    return '<tag>'\n"})]
REASONING, CONTENT = "The user wants the weather, then an edit.", "Checking both."


@dataclass(frozen=True)
class Family:
    template: str
    fmt: str
    end: str  # what the template writes after the assistant turn (the model's stop)
    reasoning: bool = True  # the template writes the turn's reasoning_content
    kimi_ids: bool = False  # call ids are the model's own functions.NAME:IDX


FAMILIES = [
    Family("deepseek-v3.1.jinja", "deepseek_v31", "<｜end▁of▁sentence｜>", reasoning=False),
    Family("kimi-k2-thinking.jinja", "kimi_k2", "<|im_end|>", kimi_ids=True),
    Family("glm-4.5.jinja", "glm45", ""),
    Family("glm-4.6.jinja", "glm45", ""),
    Family("glm-4.7-flash.jinja", "glm47", ""),
    Family("glm-5.2.jinja", "glm47", ""),
    Family("minimax-m2.jinja", "minimax_m2", "[e~["),
    Family("qwen3.5.jinja", "qwen3_coder_xml", "<|im_end|>"),
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """name -> the project's Tokenizer over the demo vocabulary with that family's template."""
    return server_util.family_tokenizers(tmp_path_factory)


def _call_id(fam: Family, name: str, n: int) -> str:
    return f"functions.{name}:{n}" if fam.kimi_ids else f"call_{n}"


def _openai_history(fam: Family) -> dict:
    call = {"id": _call_id(fam, "get_weather", 0), "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 1})}}
    return {"tools": TOOLS, "messages": [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"},
        {"role": "user", "content": "Now Zürich, and fix line 42 of 007."}]}


def _anthropic_history(fam: Family) -> dict:
    cid = _call_id(fam, "get_weather", 0)
    return {"system": "You are a coding agent.",
            "tools": [{"name": t["function"]["name"], "description": t["function"]["description"],
                       "input_schema": t["function"]["parameters"]} for t in TOOLS],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": cid, "name": "get_weather",
                                                   "input": {"city": "Paris", "days": 1}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": cid, "content": "sunny, 21 C"},
                                             {"type": "text", "text": "Now Zürich, and fix line 42 of 007."}]}]}


def _new_turn(fam: Family) -> dict:
    calls = [{"id": _call_id(fam, name, 1 + i), "type": "function", "function": {"name": name, "arguments": args}}
             for i, (name, args) in enumerate(NEW_CALLS)]
    turn = {"role": "assistant", "content": CONTENT, "tool_calls": calls}
    return dict(turn, reasoning_content=REASONING) if fam.reasoning else turn


def _generated(tok: Tokenizer, fam: Family, messages: list[dict], prompt: str) -> str:
    """The model's side of the new turn: what the template writes after the generation prompt."""
    full = tok.apply_chat_template(messages + [_new_turn(fam)], tools=TOOLS, add_generation_prompt=False)
    assert full.startswith(prompt), "the template renders the history the same with and without the new turn"
    text = full[len(prompt):]
    return text.rsplit(fam.end, 1)[0] if fam.end else text


def _norm(events: list) -> list:
    """Merge adjacent text/reasoning pieces (chunkings differ only there)."""
    out: list = []
    for ev in events:
        if out and type(ev) is type(out[-1]) and isinstance(ev, (TextDelta, ReasoningDelta)):
            out[-1] = type(ev)(out[-1].text + ev.text)
        else:
            out.append(ev)
    return out


def _parse(text: str, cuts: list[int], **kw) -> list:
    parser = OutputParser(**kw)
    bounds = [0] + cuts + [len(text)]
    events = []
    for a, b in zip(bounds, bounds[1:]):
        events += parser.feed(text[a:b])
    return events + parser.finish()


def _stable(events: list) -> list:
    """Events with the random call ids of families that make their own replaced by the index."""
    return [ToolCallStart(e.index, e.id if e.id.startswith("functions.") else str(e.index), e.name)
            if isinstance(e, ToolCallStart) else e for e in _norm(events)]


def _check_every_split(text: str, **kw) -> list:
    whole = _parse(text, [], **kw)
    for i in range(1, len(text)):
        assert _stable(_parse(text, [i], **kw)) == _stable(whole), f"split at {i}: {text[:i]!r} | {text[i:]!r}"
    assert _stable(_parse(text, list(range(1, len(text))), **kw)) == _stable(whole)  # one character at a time
    return whole


def _openai_message(events: list) -> dict:
    """Accumulate chat.completion.chunk deltas the way the openai SDK's stream helper does."""
    msg = {"content": "", "reasoning_content": "", "tool_calls": []}
    for ev in events:
        delta = chat_delta(ev) or {}
        msg["content"] += delta.get("content", "")
        msg["reasoning_content"] += delta.get("reasoning_content", "")
        for tc in delta.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] == len(msg["tool_calls"])
                msg["tool_calls"].append({"id": tc["id"], "name": tc["function"]["name"], "arguments": ""})
            msg["tool_calls"][tc["index"]]["arguments"] += tc["function"]["arguments"]
    return msg


def _anthropic_content(events: list) -> list[dict]:
    """The content blocks a client rebuilds from the Anthropic stream (_Blocks' SSE lines)."""
    blocks, lines = _Blocks(), []
    for ev in events:
        lines += blocks.feed(ev)
    lines += blocks.close()
    content: list[dict] = []
    for frame in "".join(lines).strip().split("\n\n"):
        data = json.loads(dict(line.split(": ", 1) for line in frame.splitlines())["data"])
        if data["type"] == "content_block_start":
            content.append(dict(data["content_block"], _json=""))
        elif data["type"] == "content_block_delta":
            d, block = data["delta"], content[data["index"]]
            block["text" if d["type"] == "text_delta" else "thinking" if d["type"] == "thinking_delta"
                  else "_json" if d["type"] == "input_json_delta" else "signature"] += \
                d.get("text", d.get("thinking", d.get("partial_json", d.get("signature"))))
    for block in content:
        raw = block.pop("_json")
        if block["type"] == "tool_use":
            block["input"] = json.loads(raw)
    return content


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.template)
def test_family_round_trip_over_both_apis(fam, tokenizers):
    tok = tokenizers[fam.template]
    assert detect_tool_format(tok.chat_template) == fam.fmt and detect_reasoning(tok.chat_template)
    messages = openai_messages(_openai_history(fam), LIMITS)
    tools = openai_tools(_openai_history(fam), LIMITS)
    ids, reasoning = render_chat(SimpleNamespace(tokenizer=tok), messages, tools)
    prompt = tok.apply_chat_template(messages, tools=tools)
    assert ids == tok.encode(prompt)
    # the Anthropic request renders the very same prompt (same ids, schemas, results)
    a_body = _anthropic_history(fam)
    assert tok.apply_chat_template(anthropic_messages(a_body, LIMITS), tools=anthropic_tools(a_body, LIMITS)) == prompt
    # the history's call reads back from the prompt as the call the client sent
    history = parse_output(prompt.split("Weather in Paris?", 1)[1], fam.fmt, reasoning=True, tools_enabled=True,
                           tools=TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in history.tool_calls] == [("get_weather", {"city": "Paris",
                                                                                                "days": 1})]

    before = json.dumps(messages)
    text = _generated(tok, fam, messages, prompt)
    assert json.dumps(messages) == before  # rendering does not touch the request's messages
    assert all(type(c["function"]["arguments"]) is dict for m in messages for c in m.get("tool_calls", []))
    events = _check_every_split(text, tool_format=fam.fmt, reasoning=reasoning, tools_enabled=True, tools=tools)
    out = collect(events)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == NEW_CALLS
    assert out.content.strip() == CONTENT and out.reasoning.strip() == (REASONING if fam.reasoning else "")
    if fam.kimi_ids:  # the model's own ids, which its template writes back into the next prompt
        assert [c.id for c in out.tool_calls] == ["functions.get_weather:1", "functions.edit:2"]

    wire = _openai_message(events)
    assert (wire["content"], wire["reasoning_content"]) == (out.content, out.reasoning)
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in wire["tool_calls"]] == \
        [(c.id, c.name, json.loads(c.arguments)) for c in out.tool_calls]
    blocks = _anthropic_content(events)
    uses = [b for b in blocks if b["type"] == "tool_use"]
    assert [(b["name"], b["input"]) for b in uses] == NEW_CALLS
    assert "".join(b.get("text", "") for b in blocks).strip() == CONTENT
    assert "".join(b.get("thinking", "") for b in blocks).strip() == (REASONING if fam.reasoning else "")


def test_deepseek_thinking_mode_and_v3_call_style(tokenizers):
    """DeepSeek V3.1 with thinking on: the prompt opens <think>, the model closes it before answering.
    V3 / R1 wrote `function<｜tool▁sep｜>NAME` and fenced JSON; both read as the same call."""
    fam, tok = FAMILIES[0], tokenizers["deepseek-v3.1.jinja"]
    messages = openai_messages(_openai_history(fam), LIMITS)
    assert tok.apply_chat_template(messages, tools=TOOLS, enable_thinking=True).endswith("<｜Assistant｜><think>")
    answer = _generated(tok, fam, messages, tok.apply_chat_template(messages, tools=TOOLS))
    text = REASONING + "</think>" + answer
    out = collect(_check_every_split(text, tool_format="deepseek_v31", reasoning="open", tools_enabled=True))
    assert out.reasoning == REASONING and out.content == CONTENT
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == NEW_CALLS
    v3 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
          '{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    (call,) = collect(_check_every_split(v3, tool_format="deepseek_v31", tools_enabled=True)).tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})


def test_qwen35_call_inside_reasoning(tokenizers):
    """Qwen3.5/3.6 sometimes write the call before closing </think>: it is a call, the rest reasoning."""
    fam, tok = FAMILIES[-1], tokenizers["qwen3.5.jinja"]
    messages = openai_messages(_openai_history(fam), LIMITS)
    prompt = tok.apply_chat_template(messages, tools=TOOLS)
    gen = _generated(tok, fam, messages, prompt)
    calls = gen[gen.index("<tool_call>"):]  # both calls, exactly as the template writes them
    text = "I will look it up.\n" + calls + "\nThen answer.\n</think>\n\nDone."
    out = collect(_check_every_split(text, tool_format="qwen3_coder_xml", reasoning="open", tools_enabled=True,
                                     tools=TOOLS))
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == NEW_CALLS
    assert out.reasoning == "I will look it up.\nThen answer.\n" and out.content == "Done."
    # a malformed call inside the thought stays reasoning, not content
    bad = parse_output("x <tool_call><function=f>\n</tool_call></think>y", "qwen3_coder_xml", reasoning="open",
                       tools_enabled=True)
    assert bad.tool_calls[0].name == "f"  # a call with no parameters is still a call
    worse = parse_output("x <tool_call>no function</tool_call></think>y", "qwen3_coder_xml", reasoning="open",
                         tools_enabled=True)
    assert (worse.reasoning, worse.content, worse.tool_calls) == ("x <tool_call>no function</tool_call>", "y", [])


def test_template_files_name_their_source_and_render_as_published(tokenizers, tmp_path):
    """The added first line (a Jinja comment naming the source) changes nothing the template renders."""
    shutil.copy(DEMO / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    published = [p for p in sorted(TEMPLATES.glob("*.jinja")) if p.read_text(encoding="utf-8").startswith("{# Source:")]
    assert len(published) >= 8  # other files here are the project's own test templates
    for path in published:
        header, body = path.read_text(encoding="utf-8").split("\n", 1)
        assert "github.com/" in header and "commit " in header and header.endswith("#}")
        (tmp_path / "chat_template.jinja").write_text(body, encoding="utf-8")
        bare = Tokenizer(tmp_path)
        fam = next((f for f in FAMILIES if f.template == path.name), Family(path.name, "", ""))
        msgs = openai_messages(_openai_history(fam), LIMITS)
        for gen_prompt in (True, False):
            assert tokenizers[path.name].apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=gen_prompt) \
                == bare.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=gen_prompt), path.name


def test_detection_by_template_and_model_type(tokenizers):
    assert detect_tool_format(tokenizers["kimi-k2-instruct.jinja"].chat_template) == "kimi_k2"  # tool_declare only
    assert not detect_reasoning(tokenizers["kimi-k2-instruct.jinja"].chat_template)
    generic = "{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}"
    assert detect_tool_format(generic) == "unsupported:unknown"
    assert detect_tool_format(generic, "glm4_moe") == "glm45" and detect_tool_format(generic, "kimi_k25") == "kimi_k2"
    assert detect_tool_format(generic, "qwen3_5_moe") == "qwen3_coder_xml"
    assert detect_tool_format("{{ messages }}", "glm4_moe") == "none"  # a template without tools stays without
    assert detect_tool_format("<｜DSML｜function_calls>") == "deepseek_dsml"  # DeepSeek-V3.2
    assert detect_tool_format("<｜DSML｜tool_calls>") == "unsupported:deepseek_dsml"  # another DSML dialect
    assert detect_tool_format(generic, "deepseek_v32") == "deepseek_dsml" and detect_tool_format(generic, "glm_moe_dsa") == "glm47"


@pytest.mark.parametrize("fmt,text", [
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),  # no sep
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>[1]<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{bad"
                "<|tool_call_end|><|tool_calls_section_end|>"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"),  # cut
    ("glm45", "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"),  # no name
    ("glm45", "<tool_call>f\n<arg_key>a</arg_key>junk</tool_call>"),  # a key without a value
    ("minimax_m2", '<minimax:tool_call>\n<invoke>\n<parameter name="a">1</parameter>\n</invoke>\n</minimax:tool_call>'),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="f">\n<parameter name="a">1\n</invoke>\n</minimax:tool_call>'),
])
def test_malformed_calls_show_as_written(fmt, text):
    out = parse_output("Hi " + text, fmt, tools_enabled=True)
    assert out.tool_calls == [] and "".join(out.content.split()) == "".join(("Hi " + text).split())


def test_untyped_values_and_kimi_names():
    # GLM / MiniMax write non-strings as JSON: untyped values parse as JSON unless they are plain text
    text = ("<tool_call>f<arg_key>n</arg_key><arg_value>42</arg_value><arg_key>l</arg_key><arg_value>[1]</arg_value>"
            '<arg_key>s</arg_key><arg_value>hello</arg_value><arg_key>q</arg_key><arg_value>"x"</arg_value></tool_call>')
    (call,) = parse_output(text, "glm45", tools_enabled=True).tool_calls
    assert json.loads(call.arguments) == {"n": 42, "l": [1], "s": "hello", "q": '"x"'}
    kimi = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.mcp__w__get_weather:7<|tool_call_argument_begin|>"
            '{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|>')
    (call,) = parse_output(kimi, "kimi_k2", tools_enabled=True).tool_calls
    assert (call.id, call.name, json.loads(call.arguments)) == ("functions.mcp__w__get_weather:7",
                                                               "mcp__w__get_weather", {"city": "Rome"})
    # ids that came back through the Anthropic API carry its toolu_ prefix into the history; a model
    # that copies the style still names the tool
    (call,) = parse_output(kimi.replace("functions.", "toolu_functions."), "kimi_k2", tools_enabled=True).tool_calls
    assert (call.id, call.name) == ("toolu_functions.mcp__w__get_weather:7", "mcp__w__get_weather")


def test_special_markup_tokens_reach_the_parser(tmp_path, tokenizers):
    """Where a vocabulary holds the tags as special tokens (GLM's <tool_call>, Kimi's section tokens),
    skipping special tokens while detokenizing would hide the calls: the format's tags are kept,
    other special tokens still dropped."""
    from freetoken_py.server.toolcalls import markup_tokens
    from freetoken_py.tokenizer import IncrementalDetokenizer
    spec = json.loads((DEMO / "tokenizer.json").read_text(encoding="utf-8"))
    for tok in spec["added_tokens"]:
        tok["special"] = tok["special"] or tok["content"] in ("<tool_call>", "</tool_call>", "<think>", "</think>")
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    shutil.copy(TEMPLATES / "glm-4.6.jinja", tmp_path / "chat_template.jinja")
    tok = Tokenizer(tmp_path)
    fam = FAMILIES[3]
    messages = openai_messages(_openai_history(fam), LIMITS)
    prompt = tok.apply_chat_template(messages, tools=TOOLS)
    text = _generated(tok, fam, messages, prompt)
    ids = tok.encode(text + "<|im_end|>")
    assert tok.token_to_id("<tool_call>") in ids

    def detokenized() -> str:
        detok = IncrementalDetokenizer(tok, tok.encode(prompt))
        return "".join(detok.push(i) for i in ids)

    assert "<tool_call>" not in detokenized()  # what the engine's stream carried before
    tok.keep_in_text(markup_tokens("glm45"))
    assert detokenized() == text  # <|im_end|> (special, not markup) is still dropped
    out = parse_output(detokenized(), "glm45", reasoning=True, tools_enabled=True, tools=TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == NEW_CALLS
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_end|>")


def test_kimi_ids_round_trip_over_both_apis(tokenizers):
    """Kimi's calls carry the model's own ids (`functions.NAME:IDX`); what each API hands the client
    comes back in the next request's history and the template writes it again: the next prompt holds
    the model's turn as it generated it (same ids, same tokens), over OpenAI and over Anthropic.
    (kimi-k2-instruct's first template renders no assistant calls; K2-Thinking's does.)"""
    template = "kimi-k2-thinking.jinja"
    fam, tok = Family(template, "kimi_k2", "<|im_end|>", kimi_ids=True), tokenizers[template]
    messages, tools = openai_messages(_openai_history(fam), LIMITS), openai_tools(_openai_history(fam), LIMITS)
    prompt = tok.apply_chat_template(messages, tools=tools)
    text = _generated(tok, fam, messages, prompt)
    section = text[text.index("<|tool_calls_section_begin|>"):text.index("<|tool_calls_section_end|>")]
    events = OutputParser("kimi_k2", detect_reasoning(tok.chat_template), True, tools=tools).feed(text)
    results = ["sunny", "edited"]

    wire = _openai_message(events)  # OpenAI: the assistant message and tool results the client sends back
    assert [c["id"] for c in wire["tool_calls"]] == ["functions.get_weather:1", "functions.edit:2"]
    o_body = _openai_history(fam)
    o_body["messages"] += [{"role": "assistant", "content": wire["content"],
                            "tool_calls": [{"id": c["id"], "type": "function",
                                            "function": {"name": c["name"], "arguments": c["arguments"]}}
                                           for c in wire["tool_calls"]]}]
    o_body["messages"] += [{"role": "tool", "tool_call_id": c["id"], "content": r}
                           for c, r in zip(wire["tool_calls"], results)]
    o_next = tok.apply_chat_template(openai_messages(o_body, LIMITS), tools=tools)

    blocks = _anthropic_content(events)  # Anthropic: the content blocks, then tool_result blocks
    uses = [b for b in blocks if b["type"] == "tool_use"]
    assert [b["id"] for b in uses] == ["functions.get_weather:1", "functions.edit:2"]
    a_body = _anthropic_history(fam)
    a_body["messages"] += [{"role": "assistant", "content": [b for b in blocks if b["type"] != "thinking"]},
                           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b["id"], "content": r}
                                                        for b, r in zip(uses, results)]}]
    a_next = tok.apply_chat_template(anthropic_messages(a_body, LIMITS), tools=anthropic_tools(a_body, LIMITS))

    for nxt in (o_next, a_next):
        assert nxt.startswith(prompt) and section in nxt[len(prompt):]  # the model's own call tokens again
        assert "toolu_" not in nxt
        again = parse_output(nxt[len(prompt):], "kimi_k2", tools_enabled=True, tools=tools).tool_calls
        assert [(c.id, c.name) for c in again] == [("functions.get_weather:1", "get_weather"),
                                                   ("functions.edit:2", "edit")]
    assert tok.encode(o_next) == tok.encode(a_next)  # both APIs render the same next prompt
