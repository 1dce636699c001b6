"""The grammar of gpt-oss's harmony output, made from the same table as its parser
(toolcalls/harmony.HARMONY), in llguidance's Lark dialect (see constraints.py for the others).

A turn continues the prompt's `<|start|>assistant`: any number of analysis messages (and, with
tools, recipient-less commentary preambles), each closed by `<|end|><|start|>assistant`, then the
turn's last message:

- tools, `auto`: the final answer (`<|channel|>final<|message|>...<|return|>`) or one call;
- tools, `required` / Anthropic `any`, or a named tool: one call (of that tool), written as gpt-oss
  writes calls: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}<|call|>`,
  the arguments JSON valid against the tool's schema. `<|call|>` ends the turn (it is one of
  gpt-oss's stop tokens), so a turn holds one call whatever `parallel_tool_calls` says;
- `response_format` / Anthropic `output_format`: the final answer is one JSON value of the schema;
- Anthropic `thinking.budget_tokens`: every analysis message is cut at that many tokens (its
  `<|end|>` is then the only way on).

Message text may not hold harmony's tags (as tokens they are special tokens, which a text lexeme
never matches; spelled out they are refused), so every tag the parser sees came from the grammar.
"""
from __future__ import annotations

import json

from freetoken_py.core import Grammar
from freetoken_py.server.toolcalls.harmony import HARMONY, HarmonySyntax

# gpt-oss writes call arguments compactly ({"location":"San Francisco"}): the format's own examples
HARMONY_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":", "lenient": True}


def harmony_grammar(tools: list[dict] | None, choice, shape, response_schema: dict | None,
                    syntax: HarmonySyntax = HARMONY) -> Grammar | None:
    """The grammar of a harmony turn for this request; None when nothing constrains it.
    `choice` is a constraints.ToolChoice, `shape` a constraints.Shape."""
    from freetoken_py.server.constraints import _as_object, _schemas

    calls = tools and choice.mode != "none"
    if not calls and response_schema is None and not shape.think_budget:
        return None
    schemas = _schemas(tools) if calls else {}
    if choice.mode == "named" and calls:
        schemas = {choice.name: schemas[choice.name]}
    rules = [_message_rule("analysis", syntax.reasoning_channel, shape, syntax, shape.think_budget)]
    pre = ["analysis"]
    if calls:   # a preamble for the user before calling
        rules.append(_message_rule("preamble", syntax.tool_channel, shape, syntax))
        pre.append("preamble")
    final = _final_rule(shape, syntax, response_schema)
    call_names = []
    for i, (name, schema) in enumerate(schemas.items()):
        head = _seq(syntax.call_header(name), shape)
        rules.append(f"call_{i}: {head} {_json(_as_object(schema))} {_marker(syntax.call, shape)}")
        call_names.append(f"call_{i}")
    endings = call_names if calls and choice.mode in ("required", "named") else ["final", *call_names]
    lark = (f"%llguidance {{}}\nstart: ({' | '.join(pre)})* ({' | '.join(endings)})\n" + "\n".join(rules) + "\n"
            + final + _body_lexeme(syntax))
    return Grammar(lark, f"harmony:{choice.mode if calls else 'answer'}")


def _message_rule(rule: str, channel: str, shape, syntax: HarmonySyntax, budget: int | None = None) -> str:
    """A message that the turn goes on after: header, text, `<|end|><|start|>assistant`."""
    text = f"{rule}_text" if budget else "BODY"
    limit = f"\n{rule}_text[max_tokens={budget}]: BODY" if budget else ""
    return f"{rule}: {_seq(syntax.header(channel), shape)} {_upto(text, syntax.next_message(), shape)}{limit}"


def _final_rule(shape, syntax: HarmonySyntax, response_schema: dict | None) -> str:
    head = _seq(syntax.header(syntax.final_channel), shape)
    end = _marker(syntax.ret, shape)
    if response_schema is not None:
        return f"final: {head} {_json(response_schema)} {end}\n"
    return f"final: {head} {_upto('BODY', syntax.ret, shape)}\n"


_LAZY = {"<|end|>": "body_end", "<|return|>": "body_ret"}


def _upto(text_rule: str, closing: str, shape) -> str:
    """Message text then `closing`, whose first tag is matched as its token where it is one;
    spelled, the text and the tag are one lazy lexeme (it ends at the tag's end, as constraints
    does for spelled openers; a thinking budget then does not apply)."""
    tag = next(t for t in HARMONY.tags if closing.startswith(t))
    if shape.token_of(tag) is not None:
        return f"{text_rule} {_seq(closing, shape)}"
    rest = closing[len(tag):]
    return f"{_LAZY[tag]} {_seq(rest, shape)}" if rest else _LAZY[tag]


def _body_lexeme(syntax: HarmonySyntax) -> str:
    """BODY: text holding none of the tags (one negated alternation: seven negations make the
    lazy lexemes below too complex for llguidance's lexer); body_end / body_ret: such text and
    the tag spelled."""
    from freetoken_py.server.constraints import _regex

    tags = "|".join(_regex(t) for t in syntax.tags)
    out = f"BODY: /(?s:.*)/ & ~/(?s:.*)({tags})(?s:.*)/\n"
    for tag, name in _LAZY.items():
        out += f"{name}[lazy]: BODY {json.dumps(tag)}\n"
    return out


def _seq(text: str, shape) -> str:
    from freetoken_py.server.constraints import _seq as seq

    return seq(text, shape)


def _marker(text: str, shape) -> str:
    from freetoken_py.server.constraints import _marker as marker

    return marker(text, shape)


def _json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": HARMONY_JSON_STYLE}, ensure_ascii=False)
