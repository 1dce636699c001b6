"""server/constraints.py's grammars walked token by token by llguidance's own matcher on the demo
vocabulary (no model): what each tool_choice lets through and what it refuses."""
from __future__ import annotations

import json

import llguidance
import pytest

from freetoken_py.cli import DEMO_MODEL
from freetoken_py.evals.tool_schemas import CLAUDE_CODE_TOOLS
from freetoken_py.server.constraints import (
    Shape,
    ToolChoice,
    anthropic_choice,
    json_grammar,
    free_tokens,
    marker_tokens,
    openai_choice,
    openai_response_schema,
    request_grammar,
)
from freetoken_py.server.protocol import ApiError
from freetoken_py.tokenizer import Tokenizer

TOK = Tokenizer(DEMO_MODEL)
LLTOK = llguidance.LLTokenizer((DEMO_MODEL / "tokenizer.json").read_text(), n_vocab=4096, eos_token=[2])
OPEN, CLOSE = TOK.token_to_id("<tool_call>"), TOK.token_to_id("</tool_call>")
TOKENS = Shape("qwen3_json", False, marker_tokens(TOK))    # the demo vocabulary: markers are tokens
SPELLED = Shape("qwen3_json", False, ())                    # a vocabulary where they are not


def _ids(*parts) -> list[int]:
    """Text parts tokenized as the model would; ints are token ids as they are."""
    return [i for p in parts for i in ([p] if isinstance(p, int) else TOK.encode(p))]


def _accepts(grammar, ids, complete=True) -> bool:
    m = llguidance.LLMatcher(LLTOK, grammar.lark, log_level=0)
    ok = m.consume_tokens(ids) and not m.is_error()
    return ok and (m.is_accepting() if complete else True)


def _body(name, args) -> str:
    return "\n" + json.dumps({"name": name, "arguments": args}) + "\n"


def _grammar(mode="auto", shape=TOKENS, name=None, parallel=True):
    return request_grammar(CLAUDE_CODE_TOOLS, ToolChoice(mode, name, parallel), None, shape)


def test_auto_free_text_may_use_the_vocabularys_other_added_tokens():
    """Free text is unconstrained apart from the call markers: llguidance keeps added tokens
    (<|im_start|>, <tool_response>, <think>, ...) out of a text lexeme, so the grammar lists them
    (without that, a model that writes one after a tool result is forced into other text)."""
    shape = Shape("qwen3_json", False, marker_tokens(TOK), free_tokens(TOK, marker_tokens(TOK)))
    assert OPEN not in shape.free_tokens and CLOSE not in shape.free_tokens
    g = request_grammar(CLAUDE_CODE_TOOLS, ToolChoice(), None, shape)
    others = [TOK.token_to_id(t) for t in ("<|im_start|>", "<tool_response>", "</tool_response>", "<think>")]
    assert _accepts(g, _ids("Result:", others[0], " then ", *others[1:], "end"))
    assert _accepts(g, _ids(others[1], "x", OPEN, _body("Read", {"file_path": "/a.py"}), CLOSE, others[3]))
    assert not _accepts(g, _ids("text", CLOSE))                 # a stray close marker stays refused
    assert not _accepts(_grammar(), _ids("Result:", others[0]))  # the shape without them refuses it


def test_auto_free_text_then_a_valid_call():
    g = _grammar()
    assert _accepts(g, _ids("Just text, no call."))
    assert _accepts(g, _ids("Let me look.\n", OPEN, _body("Read", {"file_path": "/a.py"}), CLOSE, " done"))


@pytest.mark.parametrize("name, args", [
    ("Shell", {"command": "ls"}),                 # undeclared tool
    ("Bash", {"cmd": "ls"}),                      # property not in the schema
    ("Bash", {"command": 3}),                     # wrong type
    ("Read", {"file_path": "a", "offset": -1}),   # below the minimum
    ("Grep", {"pattern": "x", "output_mode": "lines"}),   # not in the enum
])
def test_auto_refuses_what_the_schema_refuses(name, args):
    assert not _accepts(_grammar(), _ids(OPEN, _body(name, args), CLOSE), complete=False)


def test_a_required_field_cannot_be_skipped():
    assert not _accepts(_grammar(), _ids(OPEN, _body("Edit", {"file_path": "a"}), CLOSE), complete=False)


def test_the_opener_cannot_be_spelled_in_free_text():
    assert not _accepts(_grammar(), _ids("ok <", "tool", "_call", ">"), complete=False)
    # where the vocabulary has no such token the spelled opener is the call's start
    assert _accepts(_grammar(shape=SPELLED), _ids("ok <", "tool", "_call", ">", _body("Bash", {"command": "ls"}),
                                                  "</", "tool", "_call", ">"))


def test_required_named_and_parallel():
    call = (OPEN, _body("Bash", {"command": "ls"}), CLOSE)
    assert not _accepts(_grammar("required"), _ids("Sure."), complete=False)
    assert _accepts(_grammar("required"), _ids(*call, "\n", *call))
    assert not _accepts(_grammar("required", parallel=False), _ids(*call, "\n", *call), complete=False)
    assert not _accepts(_grammar("named", name="Read"), _ids(*call), complete=False)
    assert _accepts(_grammar("named", name="Bash"), _ids(*call))


def test_reasoning_block_first():
    shape = Shape("qwen3_json", "open", marker_tokens(TOK))
    think_close = TOK.token_to_id("</think>")
    g = _grammar("required", shape=shape)
    assert _accepts(g, _ids("I should list files.", think_close, "\n\n", OPEN, _body("Glob", {"pattern": "*"}), CLOSE))


def test_json_schema_output():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    g = json_grammar(schema, TOKENS)
    assert _accepts(g, _ids('{"n": 3}'))
    assert not _accepts(g, _ids('{"n": "3"}'), complete=False)


def test_request_fields():
    tools = CLAUDE_CODE_TOOLS
    assert openai_choice({"tool_choice": "required", "parallel_tool_calls": False}, tools) == \
        ToolChoice("required", None, False)
    assert openai_choice({"tool_choice": {"type": "function", "function": {"name": "Bash"}}}, tools).name == "Bash"
    assert anthropic_choice({"tool_choice": {"type": "any", "disable_parallel_tool_use": True}}, tools) == \
        ToolChoice("required", None, False)
    assert openai_response_schema({"response_format": {"type": "json_object"}}) == {"type": "object"}
    with pytest.raises(ApiError):
        anthropic_choice({"tool_choice": {"type": "tool", "name": "Nope"}}, tools)
    with pytest.raises(ApiError):   # a format without a grammar: a forced call is refused, not ignored
        request_grammar(tools, ToolChoice("required"), None, Shape("unsupported:mistral"))
    assert request_grammar(tools, ToolChoice("none"), None, TOKENS) is None
