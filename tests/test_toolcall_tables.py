"""Each tool-call format is one table (toolcalls/formats.FORMATS, gpt-oss's toolcalls/harmony.HARMONY)
from which both its streaming parser and its grammar are made. For every registered format: calls
rendered with the table are accepted by the grammar made from it (llguidance's own matcher, on a
vocabulary where the tags are spelled and on one where they are single tokens), and the parser made
from the same table, fed the text split at every character (and one character at a time), reads the
same calls back; the grammar refuses an undeclared tool or a schema-invalid argument."""
from __future__ import annotations

import json

import llguidance
import pytest

import harmony_util
from freetoken_py.cli import DEMO_MODEL
from freetoken_py.server.constraints import Shape, ToolChoice, free_tokens, marker_tokens, request_grammar
from freetoken_py.server.toolcalls import FORMATS, HARMONY, collect, detect_tool_format, make_parser, markup_tokens
from freetoken_py.tokenizer import Tokenizer

EDIT = {"type": "object", "required": ["path", "line"],
        "properties": {"path": {"type": "string"}, "line": {"type": "integer", "minimum": 1},
                       "force": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}},
                       "opts": {"type": "object", "properties": {"depth": {"type": "number"}}}}}
WEATHER = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": EDIT}},
         {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
# arguments in the schema's property order (the parameter styles' grammars write them in that order)
EDIT_CALL = ("edit", {"path": "src/a b.py", "line": 12, "force": True, "tags": ["x", "y z"], "opts": {"depth": 1.5}})
WEATHER_CALL = ("get_weather", {"city": "São Paulo"})
REGISTERED = [*FORMATS, "harmony"]


def _vocab(tmp_path, fmt: str, special: bool):
    """The demo vocabulary, or the same with the format's tags as special tokens (as releases hold them)."""
    if fmt == "harmony":
        d = harmony_util.template_dir(tmp_path / fmt, special_tokens=special)
    else:
        import tokenizers

        d = tmp_path / fmt
        d.mkdir()
        raw = tokenizers.Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))
        if special:
            raw.add_special_tokens([t for t in FORMATS[fmt].markers + ("<think>", "</think>")
                                    if raw.token_to_id(t) is None])
        raw.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    tok = Tokenizer(d)
    tok.keep_in_text(markup_tokens(fmt))
    lltok = llguidance.LLTokenizer((d / "tokenizer.json").read_text(), n_vocab=tok.vocab_size, eos_token=[2])
    single = marker_tokens(tok, fmt)
    return tok, lltok, Shape(fmt, False, single, free_tokens(tok, single, fmt))


def _render(fmt: str, calls: list[tuple[str, dict]]) -> str:
    if fmt == "harmony":   # one call per turn: <|call|> ends it
        return "".join(HARMONY.render_call(name, args) for name, args in calls)
    return FORMATS[fmt].render(calls)


def _accepts(lltok, tok, grammar, text: str) -> bool:
    m = llguidance.LLMatcher(lltok, grammar.lark, log_level=0)
    assert not m.is_error(), m.get_error()
    ids = tok.encode(text)
    return m.consume_tokens(ids) and not m.is_error() and m.is_accepting()


def _parsed(fmt: str, pieces: list[str]) -> list[tuple[str, dict]]:
    parser = make_parser(fmt, False, True, TOOLS)
    out = collect([e for p in pieces for e in parser.feed(p)] + parser.finish())
    assert out.content.strip() == "" and out.reasoning == "", (fmt, pieces, out)
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


@pytest.mark.parametrize("special", [False, True], ids=["spelled", "special"])
@pytest.mark.parametrize("fmt", REGISTERED)
def test_a_call_rendered_by_the_table_is_accepted_by_its_grammar_and_parsed_back_by_its_parser(fmt, special, tmp_path):
    tok, lltok, shape = _vocab(tmp_path, fmt, special)
    assert set(FORMATS) | {"harmony"} == set(REGISTERED)
    required = request_grammar(TOOLS, ToolChoice("required"), None, shape)
    for calls in ([EDIT_CALL], [WEATHER_CALL], [EDIT_CALL, WEATHER_CALL]):
        if fmt == "harmony" and len(calls) > 1:
            continue
        text = _render(fmt, calls)
        assert _accepts(lltok, tok, required, text), (fmt, text, required.lark)
        assert _parsed(fmt, [text]) == calls, text
        assert _parsed(fmt, list(text)) == calls, text    # one character at a time
        for i in range(1, len(text)):                     # every split in two
            assert _parsed(fmt, [text[:i], text[i:]]) == calls, (fmt, i, text)
    one = _render(fmt, [WEATHER_CALL])
    assert _accepts(lltok, tok, request_grammar(TOOLS, ToolChoice("named", "get_weather"), None, shape), one)
    assert not _accepts(lltok, tok, request_grammar(TOOLS, ToolChoice("named", "edit"), None, shape), one)
    assert not _accepts(lltok, tok, required, _render(fmt, [("delete", {"city": "x"})]))     # undeclared tool
    assert not _accepts(lltok, tok, required, _render(fmt, [("edit", {"path": "a", "line": 0})]))  # below minimum
    if fmt != "harmony":   # free text before a call, under auto
        auto = request_grammar(TOOLS, ToolChoice("auto"), None, shape)
        text = "Let me check.\n" + one
        assert _accepts(lltok, tok, auto, text), (fmt, text)
        parser = make_parser(fmt, False, True, TOOLS)
        out = collect(parser.feed(text) + parser.finish())
        assert out.content.strip() == "Let me check." and [(c.name, json.loads(c.arguments)) for c in out.tool_calls] \
            == [WEATHER_CALL]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_table_names_the_templates_and_model_types_that_use_it(fmt):
    """A template holding the format's `detect` markers (with plain `<tool_call>` in it too, which
    several formats' markup contains) is that format; its `model_types` take it when the template
    teaches tools in no way we can name."""
    table = FORMATS[fmt]
    assert table.detect and table.model_types
    for marker in table.detect:
        assert detect_tool_format(f"{{% if tools %}}<tool_call>{marker}{{% endif %}}") == fmt, marker
    for model_type in table.model_types:
        assert detect_tool_format("{% for t in tools %}{{ t }}{% endfor %}", model_type) == fmt
