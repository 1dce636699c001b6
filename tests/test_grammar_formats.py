"""Grammar-constrained tool calls for every tool-call format (server/constraints.SYNTAX): random
walks through llguidance's own matcher of each format's grammar, on the demo vocabulary (the
format's tags spelled out of smaller tokens) and on the same vocabulary with the tags added as
special tokens (as the real releases hold them), decoded as the engine does and parsed by the
family's own parser (server/toolcalls); every call names a declared tool and its arguments are
valid against that tool's schema (jsonschema as the judge). The walker picks tokens uniformly at
random from what the grammar allows for a while, then tries closers (tags, quotes, brackets) so
that values end; it knows nothing of the formats beyond those strings."""
from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import llguidance
import numpy as np
import pytest

from freetoken_py.cli import DEMO_MODEL
from freetoken_py.evals.tool_schemas import CLAUDE_CODE_TOOLS
from freetoken_py.server.constraints import SYNTAX, Shape, ToolChoice, free_tokens, marker_tokens, request_grammar
from freetoken_py.server.toolcalls import markup_tokens, parse_output
from freetoken_py.tokenizer import Tokenizer

FORMATS = ["qwen3_json", "deepseek_v31", "kimi_k2", "glm45", "minimax_m2", "qwen3_coder_xml", "deepseek_dsml", "glm47"]
TYPED = {"type": "function", "function": {"name": "edit", "description": "Edit", "parameters": {
    "type": "object", "required": ["path", "line", "mode"],
    "properties": {"path": {"type": "string"}, "line": {"type": "integer", "minimum": 1},
                   "force": {"type": "boolean"}, "ratio": {"type": "number"},
                   "opts": {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}},
                            "required": ["a"]},
                   "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                   "mode": {"type": "string", "enum": ["fast", "safe mode"]},
                   "level": {"enum": [1, "two", None]}, "note": {"type": ["string", "null"]},
                   "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOARGS = {"type": "function", "function": {"name": "list_files", "parameters": {"type": "object"}}}
TOOLS = [TYPED, WEATHER, NOARGS] + [{"type": "function", "function": {
    "name": t["function"]["name"], "parameters": t["function"]["parameters"]}} for t in CLAUDE_CODE_TOOLS[:3]]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ENDINGS = ['"', "}", "]", "\n", "1", "true", ", ", "null", '"}']


def _vocab(tmp: Path, fmt: str, special: bool) -> tuple[Tokenizer, llguidance.LLTokenizer, int]:
    """The demo tokenizer, or (special) the same with the format's tags as added special tokens."""
    import tokenizers

    if not special:
        tok = Tokenizer(DEMO_MODEL)
        return tok, llguidance.LLTokenizer((DEMO_MODEL / "tokenizer.json").read_text(), n_vocab=4096,
                                           eos_token=[2]), 4096
    raw = tokenizers.Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))
    raw.add_special_tokens([t for t in SYNTAX[fmt].markers + ("<think>", "</think>") if raw.token_to_id(t) is None])
    d = tmp / f"{fmt}-special"
    d.mkdir(exist_ok=True)
    raw.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    n = raw.get_vocab_size(with_added_tokens=True)
    return Tokenizer(d), llguidance.LLTokenizer((d / "tokenizer.json").read_text(), n_vocab=n, eos_token=[2]), n


def _walk(lark: str, lltok, n_vocab: int, endings: list[list[int]], rng: random.Random, eos: int = 2,
          max_steps: int = 1500) -> tuple[list[int], bool]:
    """(token ids, ended by the grammar): random allowed tokens, then closers once past a random length."""
    m = llguidance.LLMatcher(lltok, lark, log_level=0)
    assert not m.is_error(), m.get_error()
    ids, wander = [], rng.randrange(0, 60)
    for _ in range(max_steps):
        if m.is_stopped():
            return ids, True
        allowed = np.flatnonzero(np.frombuffer(m.compute_logit_bias(), np.uint8)[:n_vocab])
        assert len(allowed) and not m.is_error()
        if len(ids) >= wander:
            fits = [e for e in endings if m.validate_tokens(e) == len(e)]
            if endings[0] in fits and rng.random() < 0.5:   # the call opener, where free text may end
                fits = [endings[0]]
            elif eos in allowed and (not fits or rng.random() < 0.5):
                return ids, True
            if fits:
                choice = rng.choice(fits)
                assert m.consume_tokens(choice), (ids, choice, m.get_error())
                ids += choice
                continue
        pick = int(rng.choice(list(allowed[allowed != eos]) or [eos]))
        if pick == eos:
            return ids, True
        assert m.consume_token(pick), (pick, ids)
        ids.append(pick)
    return ids, False


def _check_calls(text: str, fmt: str, reasoning) -> list:
    out = parse_output(text, fmt, reasoning=reasoning, tools_enabled=True, tools=TOOLS)
    for call in out.tool_calls:
        assert call.name in SCHEMAS, (call.name, text)
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return out


@pytest.mark.parametrize("special", [False, True], ids=["spelled", "special"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_random_walks_parse_into_declared_valid_calls(fmt, special, tmp_path):
    tok, lltok, n_vocab = _vocab(tmp_path, fmt, special)
    tok.keep_in_text(markup_tokens(fmt))
    single = marker_tokens(tok, fmt)
    syntax = SYNTAX[fmt]
    assert (dict(single).get(syntax.open) is not None) == (special or syntax.open == "<tool_call>")
    shape = Shape(fmt, False, single, free_tokens(tok, single, fmt))
    closers = {syntax.value_tag, syntax.value_close, syntax.call_close, syntax.close, syntax.before_close + syntax.close,
               syntax.body_end, syntax.open}
    endings = [tok.encode(e) for e in [syntax.open] + sorted(c for c in closers if c) + ENDINGS]
    rng = random.Random(f"{fmt}{special}")
    calls = {"required": 0, "auto": 0, "named": 0}
    for mode, name, parallel, runs in (("required", None, True, 14), ("named", "edit", False, 8), ("auto", None, True, 10)):
        grammar = request_grammar(TOOLS, ToolChoice(mode, name, parallel), None, shape)
        for _ in range(runs):
            ids, ended = _walk(grammar.lark, lltok, n_vocab, endings, rng)
            text = tok.decode(ids)
            out = _check_calls(text, fmt, False)
            calls[mode] += len(out.tool_calls)
            if mode != "auto" and ended:   # forced: nothing but calls
                assert out.tool_calls and not out.content.strip(), text
                assert out.content == "" or out.content.isspace()
            if mode == "named":
                assert {c.name for c in out.tool_calls} <= {"edit"} and len(out.tool_calls) <= 1
    assert calls["required"] >= 14 and calls["named"] >= 6 and calls["auto"] >= 1, calls


# ---- the engine decoding under each format's grammar ---------------------------------------------
TEMPLATES = {"kimi_k2": "kimi-k2-thinking.jinja", "glm45": "glm-4.5.jinja", "glm47": "glm-5.2.jinja",
             "minimax_m2": "minimax-m2.jinja", "qwen3_coder_xml": "qwen3.5.jinja"}


@pytest.fixture(scope="module")
def demo_llm():
    from freetoken_py.llm import LLM

    return LLM(DEMO_MODEL, dtype="float32", show_progress=False, enable_prefix_cache=False)


# DeepSeek's tags, spelled on the demo vocabulary, take ~10 byte tokens each: the random walks cover it
@pytest.mark.parametrize("fmt", ["kimi_k2", "glm45", "glm47", "qwen3_coder_xml"])
def test_engine_samples_valid_calls_in_each_format(fmt, demo_llm, tmp_path):
    """The demo weights prompted through each family's real template (same vocabulary), the grammar
    built by the server's own openai_constrained for tool_choice required, sampled by the engine at
    temperature 1: every output parses, with the server's parser, into declared, schema-valid calls."""
    import asyncio
    import shutil

    from freetoken_py.server.chat import openai_messages, openai_tools
    from freetoken_py.server.constraints import openai_constrained
    from freetoken_py.server.generation import Prepared, render_chat
    from freetoken_py.server.protocol import ServerLimits

    (tmp_path / "tokenizer.json").symlink_to(DEMO_MODEL / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    shutil.copy(Path(__file__).parent / "data" / "templates" / TEMPLATES[fmt], tmp_path / "chat_template.jinja")
    tok = Tokenizer(tmp_path)
    short = [{"type": "function", "function": {"name": "get_weather", "parameters": {  # values that end soon
        "type": "object", "additionalProperties": False, "required": ["city"], "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}}}}},
             {"type": "function", "function": {"name": "goto_line", "parameters": {
                 "type": "object", "additionalProperties": False, "required": ["line", "force"],
                 "properties": {"line": {"type": "integer", "minimum": 1, "maximum": 99},
                                "force": {"type": "boolean"}}}}}]
    body = {"messages": [{"role": "user", "content": "Go to line 3, then get the weather."}], "tools": short,
            "tool_choice": "required", "parallel_tool_calls": False}
    messages, tools = openai_messages(body, ServerLimits()), openai_tools(body, ServerLimits())
    ids, reasoning = render_chat(type("L", (), {"tokenizer": tok})(), messages, tools, {"enable_thinking": False})
    demo_llm.tokenizer.keep_in_text(markup_tokens(fmt))
    outs = []
    for seed in range(3):
        params = demo_llm.default_sampling(max_tokens=128, temperature=1.0, seed=seed)
        prep = asyncio.run(openai_constrained(Prepared(ids, params, fmt, reasoning, tools), body, tools, tok))
        assert prep.params.grammar is not None
        outs.append(demo_llm.generate([ids], prep.params)[0])
    complete = [o for o in outs if o.finish_reason == "stop"]
    for out in complete:   # a call cut by max_tokens cannot parse; every finished one must
        parsed = parse_output(out.text, fmt, reasoning=reasoning, tools_enabled=True, tools=short)
        (call,) = parsed.tool_calls
        assert not parsed.content.strip(), out.text
        jsonschema.validate(json.loads(call.arguments), {t["function"]["name"]: t["function"]["parameters"]
                                                         for t in short}[call.name])
    assert len(complete) >= 2, [o.text for o in outs]
