"""`tools` + `tool_choice`, `response_format` and a thinking budget -> a `core.Grammar` the engine
decodes under.

The grammar is plain data (llguidance's Lark dialect, see engine/grammar.py); this module never
touches the engine. Every tool-call format the parser knows has its grammar, written from the same
table its parser is made from (`SYNTAX`, toolcalls/formats.FORMATS): Qwen3 /
Hermes JSON (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`), DeepSeek V3.1
(`<｜tool▁calls▁begin｜>` sections, `NAME<｜tool▁sep｜>{json}`), DeepSeek-V3.2 DSML (`<｜DSML｜invoke
name=...>` with `<｜DSML｜parameter name=... string="true|false">`), Kimi K2 (`functions.NAME:IDX` and
JSON), GLM-4.5+ (`<arg_key>` / `<arg_value>` pairs; GLM-4.7 / 5.x without newlines), MiniMax-M2 (`<invoke name=...>` with
`<parameter name=...>`) and Qwen3-Coder / Qwen3.5 XML (`<function=NAME><parameter=K>`):

- `auto`: free text, unconstrained except that it cannot spell the opener; once the model emits
  the opener the call must name a declared tool and its arguments must match that tool's JSON
  schema; then free text again (more calls unless `parallel_tool_calls` is false).
- `required` / Anthropic `any`: the output is one call or more (one when parallel is off); a
  named tool: calls of that tool only. `none`: the tools are not rendered and nothing is
  constrained (the parser then treats any markup as text).
- `response_format` `json_object` / `json_schema` (Anthropic `output_format`): the output is one
  JSON value of that schema; with tools on `auto`, that value or calls.
- Anthropic `thinking.budget_tokens`: the thought is cut at that many tokens and closed with
  `</think>` (llguidance's `max_tokens` on the thought), then the output goes on as it would.

A template that knows `<think>` gets its reasoning block first, unconstrained (up to the budget).
JSON is written compactly, `, ` and `: ` as `json.dumps` does (and as the templates render calls).
In the XML styles an argument is text where the parser reads it as text (a string type) and JSON
of its schema otherwise, one piece per declared property (required ones always). Markers that are
one token in the model's vocabulary (`single_tokens`) are matched as that token; the free text may
not spell them out of smaller pieces, so the parser never sees an unchecked call.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass

from freetoken_py.core import Grammar
from freetoken_py.server.protocol import bad, get
from freetoken_py.server.toolcalls.formats import CALL_CLOSE, CALL_OPEN, FORMATS, THINK_CLOSE, THINK_OPEN, CallFormat

# each format's one table (toolcalls/formats.py), which its parser is made from too
SYNTAX: dict[str, CallFormat] = FORMATS
CallSyntax = CallFormat
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
    think_budget: int | None = None      # Anthropic thinking.budget_tokens: the thought's most tokens

    def token_of(self, marker: str) -> int | None:
        return dict(self.single_tokens).get(marker)


def marker_tokens(tokenizer, tool_format: str = "qwen3_json") -> tuple[tuple[str, int], ...]:
    """The markers (the format's tags, <think>, </think>) that are one token of this vocabulary,
    with their ids."""
    out = []
    syntax = SYNTAX.get(tool_format)
    for m in dict.fromkeys(MARKERS + (syntax.markers if syntax else _harmony_tags(tool_format))):
        ids = tokenizer.encode(m) if tokenizer is not None else []
        if len(ids) == 1 and tokenizer.token_to_id(m) == ids[0]:
            out.append((m, ids[0]))
    return tuple(out)


def free_tokens(tokenizer, single: tuple[tuple[str, int], ...], tool_format: str = "qwen3_json") -> tuple[int, ...]:
    """Added tokens (`<|im_start|>`, `<tool_response>`, `<think>`, ...) other than the format's call
    tags: llguidance keeps them out of a text lexeme, so free text lists them or it is not free."""
    if tokenizer is None or not hasattr(tokenizer, "added_token_ids"):
        return ()
    syntax = SYNTAX.get(tool_format)
    tags = set(syntax.markers if syntax else _harmony_tags(tool_format) or (CALL_OPEN, CALL_CLOSE))
    tags -= {THINK_OPEN, THINK_CLOSE}
    calls = {i for m, i in single if m in tags}
    return tuple(i for i in tokenizer.added_token_ids() if i not in calls)


def _harmony_tags(tool_format: str) -> tuple[str, ...]:
    from freetoken_py.server.toolcalls.harmony import HARMONY
    return HARMONY.tags if tool_format == "harmony" else ()


def shape_of(prep, tokenizer) -> Shape:
    """The Shape of a prepared chat request (server.generation.Prepared) on this tokenizer."""
    single = marker_tokens(tokenizer, prep.tool_format)
    return Shape(prep.tool_format, prep.reasoning, single, free_tokens(tokenizer, single, prep.tool_format))


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
    shape = dataclasses.replace(shape_of(prep, tokenizer), think_budget=anthropic_think_budget(body))
    grammar = request_grammar(tools, anthropic_choice(body, tools), schema, shape)
    return await constrain(prep, grammar, tools, schema, "output_format")


# ---- request fields -> choices --------------------------------------------------------------
def openai_choice(body: dict, tools: list[dict] | None) -> ToolChoice:
    raw = body.get("tool_choice", "auto")
    parallel = get(body, "parallel_tool_calls", bool, True)   # null: the default, as OpenAI's schema allows
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


def anthropic_think_budget(body: dict) -> int | None:
    """thinking {"type": "enabled", "budget_tokens": N}: the thought's most tokens (chat.py has
    checked the field); None for disabled / adaptive / absent."""
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled" and type(thinking.get("budget_tokens")) is int:
        return thinking["budget_tokens"]
    return None


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
    if shape.tool_format == "harmony":   # gpt-oss: its own grammar (server/harmony_grammar.py)
        from freetoken_py.server.harmony_grammar import harmony_grammar
        return harmony_grammar(tools, choice, shape, response_schema)
    if tools and choice.mode != "none":
        return tool_grammar(tools, choice, shape, response_schema)
    if response_schema is not None:
        return json_grammar(response_schema, shape)
    return budget_grammar(shape)


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


def _head(shape: Shape, syntax: CallFormat | None = None) -> tuple[str, str]:
    """(the rule that starts the output, its extra rules): the reasoning block when there is one.
    Where the format's calls may sit inside the thought (Qwen3.5), the thought cannot spell the
    call opener either: every call the parser sees went through the grammar."""
    banned = (THINK_CLOSE,) + ((syntax.open,) if syntax is not None and syntax.in_reasoning else ())
    # with a budget the thought ends after that many tokens: then only </think> may follow
    budget = f"thought[max_tokens={shape.think_budget}]: THOUGHT\n" if shape.think_budget else ""
    think = f"{'thought' if budget else 'THOUGHT'} {_marker(THINK_CLOSE, shape)}"
    if shape.reasoning == "open":
        return "head", f"head: {think}\n" + budget + _no_spelling("THOUGHT", banned)
    if shape.reasoning:
        return "head", f"head: ({_marker(THINK_OPEN, shape)} {think})?\n" + budget + _no_spelling("THOUGHT", banned)
    return "", ""


def budget_grammar(shape: Shape) -> Grammar | None:
    """A thinking budget alone: the thought is cut at `think_budget` tokens and closed with
    </think>; the rest is unconstrained (any text, any added token). None where the model does
    not think or there is no budget."""
    if not shape.think_budget or not shape.reasoning:
        return None
    head, rules = _head(shape)
    ids = sorted(set(shape.free_tokens) | {i for _, i in shape.single_tokens})
    rest = f"rest: ANY (<[{','.join(map(str, ids))}]> ANY)*\n" if ids else "rest: ANY\n"
    lark = f"%llguidance {{}}\nstart: {head} rest\n{rest}ANY: /(?s:.*)/\n{rules}"
    return Grammar(lark, f"thinking_budget:{shape.think_budget}")


def json_grammar(schema: dict, shape: Shape, name: str = "json_schema") -> Grammar:
    head, rules = _head(shape)
    lark = f"%llguidance {{}}\nstart: {head} WS value\nvalue: {_json(schema)}\nWS: /[ \\t\\n]{{0,4}}/\n{rules}"
    return Grammar(lark, name)


def tool_grammar(tools: list[dict], choice: ToolChoice, shape: Shape, response_schema: dict | None = None) -> Grammar:
    syntax = SYNTAX.get(shape.tool_format)
    if syntax is None:
        if choice.mode in ("required", "named") or response_schema is not None:
            raise bad(f"tool_choice {choice.mode!r} / response_format are not supported with this model's "
                      f"tool-call format ({shape.tool_format}); use tool_choice auto", "tool_choice")
        return None
    schemas = _schemas(tools)
    if choice.mode == "named":
        schemas = {choice.name: schemas[choice.name]}
    head, rules = _head(shape, syntax)
    opener = _marker(syntax.open, shape)
    # text then the opener: one lazy lexeme when the opener is spelled (it ends at the opener's end)
    text_open = f"text_open: free {opener}\n" if shape.token_of(syntax.open) is not None else \
        f"text_open[lazy]: TEXT {opener}\n"
    if choice.mode == "auto" and response_schema is None:
        top = f"start: {head} (text_open tail)* free\n" if choice.parallel else \
            f"start: {head} (text_open tail)? free\n"
    else:
        calls = "region (SEP region)*" if choice.parallel and not syntax.call_open else "region"
        top = f"start: {head} WS {calls}\n" if response_schema is None else \
            f"start: {head} WS ({calls} | value)\nvalue: {_json(response_schema)}\n"
    close = _marker(syntax.close, shape)
    if syntax.call_open:   # a section of calls: open, one call or more, close
        calls_in = "call+" if choice.parallel else "call"
        tail = (f"tail: {_seq(syntax.after_open, shape)} {calls_in} {close}\n"
                f"call: {_marker(syntax.call_open, shape)} body {_seq(syntax.call_close, shape)}\n")
    else:
        tail = f"tail: {_seq(syntax.after_open, shape)} body {_seq(syntax.before_close, shape)} {close}\n"
    out = _Rules()
    names = [_body(out, f"body_{i}", name, _as_object(schema), shape, syntax)
             for i, (name, schema) in enumerate(schemas.items())]
    lark = ("%llguidance {}\n" + top + text_open + f"region: {opener} tail\n" + tail
            + f"body: {' | '.join(names)}\n" + out.text()
            + "SEP: /\\n{0,2}/\nWS: /[ \\t\\n]{0,4}/\n" + _free(shape)
            + _no_spelling("TEXT", (syntax.open,)) + rules)
    return Grammar(lark, f"tools:{choice.mode}")


class _Rules:
    """Grammar lines collected once each, in order."""

    def __init__(self):
        self.lines: dict[str, None] = {}

    def add(self, line: str) -> None:
        self.lines[line] = None

    def text(self) -> str:
        return "".join(line + "\n" for line in self.lines)


def _seq(text: str, shape: Shape) -> str:
    """Literal text that may hold markers, each matched as its token where it is one."""
    out, rest = [], text
    while rest:
        hits = [(rest.find(m), m) for m, _ in shape.single_tokens if rest.find(m) >= 0]
        if not hits:
            out.append(_lit(rest))
            break
        pos, m = min(hits)
        if pos:
            out.append(_lit(rest[:pos]))
        out.append(_marker(m, shape))
        rest = rest[pos + len(m):]
    return " ".join(out)


# ---- one call's body, per tool-call format ----------------------------------------------------
def _body(out: _Rules, rule: str, name: str, schema: dict, shape: Shape, syntax: CallFormat) -> str:
    if syntax.key_open:
        return _param_body(out, rule, name, schema, shape, syntax)
    if syntax.args_sep:   # DeepSeek V3.1 `NAME<｜tool▁sep｜>{json}`, Kimi `functions.NAME:IDX<|...|>{json}`
        index = " /:[0-9]{1,4}/" if syntax.call_id else ""
        out.add(f"{rule}: {_lit(syntax.name_prefix + name)}{index} {_seq(syntax.args_sep, shape)} {_json(schema)}")
    else:                 # Qwen3 / Hermes `{"name": NAME, "arguments": {...}}`
        out.add(f"{rule}: {_lit(_call_head(name))} {_json(schema)} \"}}\"")
    return rule


def _param_body(out: _Rules, rule: str, name: str, schema: dict, shape: Shape, syntax: CallFormat) -> str:
    """GLM-4.5+, MiniMax-M2, Qwen3-Coder / Qwen3.5: the name, then one key/value piece per declared
    property in the schema's order (required ones always, the others optionally); a value is text
    where the parser reads the property as text, else JSON of its schema."""
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = [k for k in schema.get("required", []) if isinstance(k, str)] \
        if isinstance(schema.get("required"), list) else []
    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}
    pieces = []
    for j, key in enumerate(list(props) + [k for k in required if k not in props]):
        prop = props.get(key) if isinstance(props.get(key), dict) else {}
        piece = f"{rule}_{j}"
        value = _param_value(out, f"{piece}_v", {**prop, **defs} if prop and defs else prop, shape, syntax)
        string = "true" if _reads_as_text(prop) else "false"   # (DSML's attribute; other formats have none)
        out.add(f"{piece}: {_seq(syntax.key_open.format(key=key, string=string), shape)} {value}")
        pieces.append(piece if key in required else f"{piece}?")
    end = _seq(syntax.body_end, shape) if syntax.body_end else ""
    out.add(f"{rule}: {_seq(syntax.name_open.format(name=name), shape)} {' '.join(pieces)} {end}")
    return rule


NO_TAG_PATTERN = "^([^<]|<+[^</])*<*$"   # a string without "</" in it
_SCALARS = [{"type": "string", "pattern": NO_TAG_PATTERN}, {"type": "number"}, {"type": "boolean"}, {"type": "null"}]
ANY_WITHOUT_TAGS = {"anyOf": _SCALARS + [
    {"type": "array", "items": {"anyOf": _SCALARS}},
    {"type": "object", "patternProperties": {NO_TAG_PATTERN: {"anyOf": _SCALARS}}, "additionalProperties": False}]}


def _no_tags(schema):
    """A copy of the schema whose strings and object keys cannot hold `</` (a JSON argument value
    inside XML-style markup would otherwise close the value's tag early: `["</arg_value>"]`); a
    string with its own `pattern` keeps it. Values the schema leaves untyped are not reached."""
    if isinstance(schema, list):
        return [_no_tags(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    if not schema:   # any value: scalars, or flat arrays / objects of them, none holding "</"
        return ANY_WITHOUT_TAGS
    out = {k: (_no_tags(v) if k in ("items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties",
                                    "not", "contains") else
               {n: _no_tags(s) for n, s in v.items()} if k in ("properties", "$defs", "definitions",
                                                              "patternProperties") and isinstance(v, dict) else v)
           for k, v in schema.items()}
    types = schema.get("type")
    if (types == "string" or isinstance(types, list) and "string" in types) and "pattern" not in schema:
        out["pattern"] = NO_TAG_PATTERN
    if (types == "object" or "properties" in schema) and "patternProperties" not in schema and \
            out.get("additionalProperties") is not False:   # keys beyond the declared ones: no "</" either
        extra = out.get("additionalProperties")
        out["patternProperties"] = {NO_TAG_PATTERN: extra if isinstance(extra, dict) else ANY_WITHOUT_TAGS}
        out["additionalProperties"] = False
    if types == "array" and "items" not in schema and "prefixItems" not in schema:
        out["items"] = ANY_WITHOUT_TAGS
    return out


def _reads_as_text(prop: dict) -> bool:
    """True when the parser (toolcalls.bodies.typed) keeps the value as text whatever it holds: a
    union with string (any earlier type it converts to is in the union too), or no type at all."""
    types = prop.get("type")
    if not types and isinstance(prop.get("anyOf"), list):
        types = [s.get("type") for s in prop["anyOf"] if isinstance(s, dict)]
    types = types if isinstance(types, list) else [types] if types else []
    if "string" in types:
        return True
    return not types and not any(k in prop for k in ("$ref", "enum", "const", "oneOf", "allOf", "anyOf"))


def _param_value(out: _Rules, rule: str, prop: dict, shape: Shape, syntax: CallFormat) -> str:
    """The grammar of one argument value and the tag after it."""
    close = syntax.value_close
    enum = prop.get("enum") if isinstance(prop.get("enum"), list) else [prop["const"]] if "const" in prop else None
    if not _reads_as_text(prop):
        if enum is not None and "type" not in prop:   # an untyped enum: its values as the parser reads them
            alts = " | ".join(_lit(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)) for v in enum)
            return f"({alts or _lit('')}) {_seq(close, shape)}"
        return f"{_json(_no_tags(prop))} {_seq(close, shape)}"
    strings = [v for v in enum or [] if isinstance(v, str)]
    if strings:
        return f"({' | '.join(_lit(v) for v in strings)}) {_seq(close, shape)}"
    out.add(_no_spelling("VALUE", syntax.stops).rstrip("\n"))
    tag = syntax.value_tag
    if shape.token_of(tag) is not None:   # the value ends at the tag's token (a newline before it is the parser's)
        return f"VALUE {_seq(close[close.index(tag):], shape)}"
    upto = close[:close.index(tag) + len(tag)]   # spelled: one lazy lexeme up to the tag's end
    out.add(f"{rule}[lazy]: VALUE {_lit(upto)}")
    rest = close[len(upto):]
    return f"{rule} {_seq(rest, shape)}" if rest else rule


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
