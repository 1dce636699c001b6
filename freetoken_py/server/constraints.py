"""`tools` + `tool_choice` and `response_format` -> a `core.Grammar` the engine decodes under.

The grammar is plain data (llguidance's Lark dialect, see engine/grammar.py); this module never
touches the engine. For the Qwen3 / Hermes JSON format (`<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>`):

- `auto`: free text, unconstrained except that it cannot spell the opener; once the model emits
  `<tool_call>` the call must name a declared tool and its arguments must match that tool's JSON
  schema; then free text again (more calls unless `parallel_tool_calls` is false).
- `required` / Anthropic `any`: the output is one call or more (one when parallel is off); a
  named tool: calls of that tool only. `none`: the tools are not rendered and nothing is
  constrained (the parser then treats any markup as text).
- `response_format` `json_object` / `json_schema` (Anthropic `output_format`): the output is one
  JSON value of that schema; with tools on `auto`, that value or calls.

A template that knows `<think>` gets its reasoning block first, unconstrained. JSON is written
compactly, `, ` and `: ` as `json.dumps` does (and as the template renders the call example).
Markers that are one token in the model's vocabulary (`single_tokens`) are matched as that token;
the free text may not spell them out of smaller pieces, so the parser never sees an unchecked call.
Qwen3-Coder's XML call format has no grammar yet: requests that force a call are refused on it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass

from freetoken_py.core import Grammar
from freetoken_py.server.protocol import bad

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
MARKERS = (CALL_OPEN, CALL_CLOSE, THINK_OPEN, THINK_CLOSE)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"          # auto | required | named | none
    name: str | None = None     # the tool, when mode is "named"
    parallel: bool = True       # more than one call allowed


@dataclass(frozen=True)
class Shape:
    """What the grammar needs to know about the model's output format."""
    tool_format: str = "qwen3_json"
    reasoning: bool | str = False        # True: may open <think>; "open": the prompt opened it
    single_tokens: tuple[tuple[str, int], ...] = ()   # (marker, its token id) where it is one token
    free_tokens: tuple[int, ...] = ()    # the vocabulary's other added tokens: free text may use them

    def token_of(self, marker: str) -> int | None:
        return dict(self.single_tokens).get(marker)


def marker_tokens(tokenizer) -> tuple[tuple[str, int], ...]:
    """The markers that are one token of this vocabulary, with their ids."""
    out = []
    for m in MARKERS:
        ids = tokenizer.encode(m) if tokenizer is not None else []
        if len(ids) == 1 and tokenizer.token_to_id(m) == ids[0]:
            out.append((m, ids[0]))
    return tuple(out)


def free_tokens(tokenizer, single: tuple[tuple[str, int], ...]) -> tuple[int, ...]:
    """Added tokens (`<|im_start|>`, `<tool_response>`, `<think>`, ...) other than the call markers:
    llguidance keeps them out of a text lexeme, so free text lists them or it is not free."""
    if tokenizer is None or not hasattr(tokenizer, "added_token_ids"):
        return ()
    calls = {i for m, i in single if m in (CALL_OPEN, CALL_CLOSE)}
    return tuple(i for i in tokenizer.added_token_ids() if i not in calls)


def shape_of(prep, tokenizer) -> Shape:
    """The Shape of a prepared chat request (server.generation.Prepared) on this tokenizer."""
    single = marker_tokens(tokenizer)
    return Shape(prep.tool_format, prep.reasoning, single, free_tokens(tokenizer, single))


async def constrain(prep, grammar: Grammar | None, tools: list[dict] | None, response_schema: dict | None,
                    schema_field: str = "response_format"):
    """The prepared request with its SamplingParams carrying `grammar` (None: unchanged), once
    the grammar library has accepted it (off the event loop: JSON schemas take milliseconds);
    a schema it cannot enforce is a 400 naming the tool or field."""
    if grammar is None:
        return prep
    error = await asyncio.to_thread(_grammar_error, grammar.lark)
    if error is not None:
        raise bad(await asyncio.to_thread(_culprit, tools, response_schema, schema_field, error))
    prep.params = dataclasses.replace(prep.params, grammar=grammar)
    return prep


def _grammar_error(lark: str) -> str | None:
    """llguidance's reason for refusing a grammar (its first line), or None."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(lark)
    if not is_error:
        return None
    text = messages[0] if messages else "invalid grammar"
    return text.splitlines()[0].split(": ", 1)[-1]


def _culprit(tools, response_schema, schema_field: str, error: str) -> str:
    for name, schema in _schemas(tools).items():
        reason = _grammar_error(json_grammar(_as_object(schema), Shape()).lark)
        if reason is not None:
            return f"tool {name!r}: its parameters schema cannot be enforced ({reason})"
    return f"{schema_field}: the schema cannot be enforced ({error})"


async def openai_constrained(prep, body: dict, tools: list[dict] | None, tokenizer):
    """/v1/chat/completions: tool_choice, parallel_tool_calls and response_format enforced."""
    schema = openai_response_schema(body)
    grammar = request_grammar(tools, openai_choice(body, tools), schema, shape_of(prep, tokenizer))
    return await constrain(prep, grammar, tools, schema)


async def anthropic_constrained(prep, body: dict, tools: list[dict] | None, tokenizer):
    """/v1/messages: tool_choice (auto / any / tool / none, disable_parallel_tool_use) and
    output_format enforced."""
    schema = anthropic_response_schema(body)
    grammar = request_grammar(tools, anthropic_choice(body, tools), schema, shape_of(prep, tokenizer))
    return await constrain(prep, grammar, tools, schema, "output_format")


# ---- request fields -> choices --------------------------------------------------------------
def openai_choice(body: dict, tools: list[dict] | None) -> ToolChoice:
    raw = body.get("tool_choice", "auto")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if raw in ("auto", "required", "none", None):
        return ToolChoice(raw or "auto", None, parallel)
    name = None
    if isinstance(raw, dict):
        fn = raw.get("function") if isinstance(raw.get("function"), dict) else raw
        name = fn.get("name")
    if not isinstance(name, str):
        raise bad("'tool_choice' must be \"auto\", \"required\", \"none\" or "
                  "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    _check_declared(name, tools, "tool_choice")
    return ToolChoice("named", name, parallel)


def anthropic_choice(body: dict, tools: list[dict] | None) -> ToolChoice:
    raw = body.get("tool_choice")
    if raw is None:
        return ToolChoice()
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice.type: must be one of 'auto', 'any', 'tool', 'none'")
    parallel = raw.get("disable_parallel_tool_use") is not True
    if kind == "tool":
        if not isinstance(raw.get("name"), str):
            raise bad("tool_choice.name: field required for type 'tool'")
        _check_declared(raw["name"], tools, "tool_choice.name")
        return ToolChoice("named", raw["name"], parallel)
    return ToolChoice({"any": "required"}.get(kind, kind), None, parallel)


def _check_declared(name: str, tools: list[dict] | None, field: str) -> None:
    if name not in _schemas(tools):
        raise bad(f"{field}: tool {name!r} is not among the declared tools", field)


def openai_response_schema(body: dict) -> dict | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad("'response_format.json_schema.schema' must be an object", "response_format")
        return schema
    raise bad("'response_format.type' must be text, json_object or json_schema", "response_format")


def anthropic_response_schema(body: dict) -> dict | None:
    """Anthropic structured outputs: `output_format` (or `output_config.format`) json_schema."""
    fmt = body.get("output_format")
    if fmt is None and isinstance(body.get("output_config"), dict):
        fmt = body["output_config"].get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad("output_format: must be {\"type\": \"json_schema\", \"schema\": {...}}")
    return fmt["schema"]


def request_grammar(tools: list[dict] | None, choice: ToolChoice, response_schema: dict | None,
                    shape: Shape) -> Grammar | None:
    """The grammar a request decodes under; None when nothing constrains it."""
    if tools and choice.mode != "none":
        return tool_grammar(tools, choice, shape, response_schema)
    if response_schema is not None:
        return json_grammar(response_schema, shape)
    return None


# ---- grammars -------------------------------------------------------------------------------
def _lit(text: str) -> str:
    return json.dumps(text)


def _json(schema: dict) -> str:
    """`%json {...}` of the schema with the compact style (a copy: the client's dict is kept)."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE}, ensure_ascii=False)


def _marker(text: str, shape: Shape) -> str:
    """The marker as its token (`<[id]>`: any token, special or not) or as a spelled string."""
    tok = shape.token_of(text)
    return f"<[{tok}]>" if tok is not None else _lit(text)


def _no_spelling(name: str, markers: tuple[str, ...]) -> str:
    """A lexeme of any text that does not contain the markers spelled out."""
    pieces = " & ".join(f"~/(?s:.*){_regex(m)}(?s:.*)/" for m in markers)
    return f"{name}: /(?s:.*)/ & {pieces}\n"


def _regex(text: str) -> str:
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c for c in text)  # (\\< would be a word edge)


def _head(shape: Shape) -> tuple[str, str]:
    """(the rule that starts the output, its extra rules): the reasoning block when there is one."""
    think = f"THOUGHT {_marker(THINK_CLOSE, shape)}"
    if shape.reasoning == "open":
        return "head", f"head: {think}\n" + _no_spelling("THOUGHT", (THINK_CLOSE,))
    if shape.reasoning:
        return "head", f"head: ({_marker(THINK_OPEN, shape)} {think})?\n" + _no_spelling("THOUGHT", (THINK_CLOSE,))
    return "", ""


def json_grammar(schema: dict, shape: Shape, name: str = "json_schema") -> Grammar:
    head, rules = _head(shape)
    lark = f"%llguidance {{}}\nstart: {head} WS value\nvalue: {_json(schema)}\nWS: /[ \\t\\n]{{0,4}}/\n{rules}"
    return Grammar(lark, name)


def tool_grammar(tools: list[dict], choice: ToolChoice, shape: Shape, response_schema: dict | None = None) -> Grammar:
    if shape.tool_format != "qwen3_json":
        if choice.mode in ("required", "named") or response_schema is not None:
            raise bad(f"tool_choice {choice.mode!r} / response_format are not supported with this model's "
                      f"tool-call format ({shape.tool_format}); use tool_choice auto", "tool_choice")
        return None
    schemas = _schemas(tools)
    if choice.mode == "named":
        schemas = {choice.name: schemas[choice.name]}
    head, rules = _head(shape)
    opener = _marker(CALL_OPEN, shape)
    # text then the opener: one lazy lexeme when the opener is spelled (it ends at the opener's end)
    text_open = f"text_open: free {opener}\n" if shape.token_of(CALL_OPEN) is not None else \
        f"text_open[lazy]: TEXT {opener}\n"
    if choice.mode == "auto" and response_schema is None:
        top = f"start: {head} (text_open tail)* free\n" if choice.parallel else \
            f"start: {head} (text_open tail)? free\n"
    else:
        calls = "call (\"\\n\" call)*" if choice.parallel else "call"
        top = f"start: {head} WS {calls}\n" if response_schema is None else \
            f"start: {head} WS ({calls} | value)\nvalue: {_json(response_schema)}\n"
    bodies = " | ".join(f"body_{i}" for i in range(len(schemas)))
    lines = [f"body_{i}: {_lit(_call_head(n))} {_json(_as_object(s))} \"}}\"" for i, (n, s) in enumerate(schemas.items())]
    tail = f"tail: \"\\n\" body \"\\n\" {_marker(CALL_CLOSE, shape)}\n"
    lark = ("%llguidance {}\n" + top + text_open + f"call: {opener} tail\n" + tail + f"body: {bodies}\n"
            + "\n".join(lines) + "\n"
            + "WS: /[ \\t\\n]{0,4}/\n" + _free(shape) + _no_spelling("TEXT", (CALL_OPEN,)) + rules)
    return Grammar(lark, f"tools:{choice.mode}")


def _free(shape: Shape) -> str:
    """Free text: text that cannot spell the opener, with the vocabulary's other added tokens
    anywhere in it (unconstrained apart from the call markers)."""
    if not shape.free_tokens:
        return "free: TEXT\n"
    ids = ",".join(map(str, shape.free_tokens))
    return f"free: TEXT (<[{ids}]> TEXT)*\n"


def _call_head(name: str) -> str:
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '


def _as_object(schema: dict) -> dict:
    """Arguments are a JSON object whatever the schema leaves open (the parser needs a dict)."""
    return schema if schema.get("type") == "object" else {**schema, "type": "object"}


def _schemas(tools: list[dict] | None) -> dict[str, dict]:
    """name -> parameters schema of OpenAI-style function tools (server/chat.py's output)."""
    out: dict[str, dict] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(fn.get("name"), str):
            params = fn.get("parameters", fn.get("input_schema"))
            out[fn["name"]] = params if isinstance(params, dict) else {"type": "object"}
    return out
