"""The tool-call formats: one table each (`CallFormat`), from which both the streaming parser
(toolcalls/parser.py reads `open` / `close` / `call_open` / `call_end` and calls `parse`) and the
grammar (server/constraints.py writes calls from the same fields) are made, and which format a model
uses (from its chat template, else its config's `model_type`). gpt-oss's harmony has its own table
(toolcalls/harmony.HARMONY: channels, not tags) on the same pattern.

Adding a format is one `CallFormat` in `FORMATS` (its template markers and model_types included)
and its name in `_DETECT_ORDER`; tests/test_toolcall_tables.py then renders calls with the table,
checks that the grammar accepts them and that the parser, fed the text split at every character,
reads the same calls back."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

from freetoken_py.server.toolcalls import bodies

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"   # the reasoning markers of every tag-based format
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class CallFormat:
    """How one format writes tool calls, as its chat template renders them.

    Region: `open` `after_open` ... `before_close` `close` is one call, or with `call_open` a section
    of any number of `call_open` BODY `call_close` calls (`call_close` as written, trailing
    whitespace included; the parser looks for `call_end`, the tag itself).

    BODY, one of three argument encodings:
    - JSON object (`args_sep` and `key_open` unset): `{"name": NAME, "arguments": {...}}`;
    - name then JSON (`args_sep` set): `name_prefix` NAME [`:IDX` where `call_id`: the text before
      the separator is the model's own call id, kept] `args_sep` {json}; `fenced` as the name means
      the older `NAME\\n```json\\n{...}\\n```` after the separator (DeepSeek V3 / R1);
    - parameters (`key_open` set): `name_open` with {name}, then per argument `key_open` (with {key},
      and {string}: "true" before a text value, "false" before JSON, DSML's attribute) + value +
      `value_close`, then `body_end`. `value_tag` is the tag that ends a value; a text value may not
      spell any of `stops`. The parser reads the call with the regexes `read_call` (groups `name`,
      `rest`) and `read_param` (groups `key`, `value`, and `string` where the format marks text
      values), which accept what the grammar writes and the variants models write; `strict`: nothing
      but parameters may follow the name; values typed by the tool's schema, untyped ones JSON when
      they parse as a non-string (`json_untyped`), else text; `trim_newline`: one newline either side
      of a value is the template's; `unique_keys`: a repeated parameter makes the call malformed.

    `in_reasoning`: calls may come inside a <think> block (and are then calls, not reasoning);
    `tags`: other tags of a call that a vocabulary may hold as single tokens. Which models write it:
    `detect`, strings whose presence in a chat template names the format (`_DETECT_ORDER` says
    which format's are tried first), and `model_types`, config.json's `model_type`s that take it
    when the template teaches tools in no way we can name."""
    name: str
    open: str
    close: str
    after_open: str = ""
    before_close: str = ""
    call_open: str | None = None
    call_close: str = ""
    name_prefix: str = ""
    args_sep: str = ""
    call_id: bool = False
    fenced: str = ""
    name_open: str = ""
    key_open: str = ""
    value_close: str = ""
    value_tag: str = ""
    body_end: str = ""
    stops: tuple[str, ...] = ()
    read_call: str = ""
    read_param: str = ""
    strict: bool = True
    json_untyped: bool = True
    trim_newline: bool = False
    unique_keys: bool = False
    in_reasoning: bool = False
    tags: tuple[str, ...] = ()
    detect: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()

    @property
    def call_end(self) -> str:
        """The tag that ends one call of a section (`call_close` without its whitespace)."""
        return self.call_close.strip()

    @property
    def markup(self) -> tuple[str, ...]:
        """The tags the parser reads: what the detokenizer must keep in the text."""
        inner = (self.args_sep, *self.tags, self.value_tag)
        return tuple(t for t in (self.open, self.close, self.call_open, self.call_end, *inner) if t)

    @property
    def markers(self) -> tuple[str, ...]:
        """The tags the grammar matches as one token where the vocabulary has them."""
        tags = (self.open, self.close, self.call_open, self.call_end, self.args_sep, self.value_tag,
                *self.stops, *self.tags)
        return tuple(dict.fromkeys(t for t in tags if t and t.startswith("<") and t.endswith((">", "|>"))))

    def parse(self, body: str, schemas: dict) -> bodies.Parsed | None:
        """One call's body (between its tags) -> (name, arguments JSON text, the model's call id or
        None), or None when it is malformed; `schemas` (name -> JSON schema) types textual values."""
        if self.key_open:
            match = _regex(self.read_call).match(body)
            if match is None:
                return None
            return bodies.params(match.group("name"), match.group("rest") or "", _regex(self.read_param),
                                 schemas, self)
        if self.args_sep:
            return bodies.name_then_json(body, self.args_sep, self.name_prefix if self.call_id else None,
                                         self.fenced)
        return bodies.json_object_call(body)

    def render(self, calls: list[tuple[str, dict]]) -> str:
        """Calls as the format writes them (and its grammar accepts: compact JSON, a string value
        as text in the parameter styles): one section, or one region per call."""
        bodies_ = [self._render_body(name, args) for name, args in calls]
        if self.call_open:
            inner = "".join(f"{self.call_open}{b}{self.call_close}" for b in bodies_)
            return f"{self.open}{self.after_open}{inner}{self.close}"
        return "\n".join(f"{self.open}{self.after_open}{b}{self.before_close}{self.close}" for b in bodies_)

    def _render_body(self, name: str, args: dict) -> str:
        if self.key_open:
            pieces = "".join(self.key_open.format(key=k, string="true" if isinstance(v, str) else "false")
                             + (v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)) + self.value_close
                             for k, v in args.items())
            return self.name_open.format(name=name) + pieces + self.body_end
        if self.args_sep:
            index = ":0" if self.call_id else ""
            return f"{self.name_prefix}{name}{index}{self.args_sep}{json.dumps(args, ensure_ascii=False)}"
        return json.dumps({"name": name, "arguments": args}, ensure_ascii=False)


@lru_cache(maxsize=64)
def _regex(pattern: str) -> re.Pattern:
    return re.compile(pattern, re.DOTALL)


ToolFormat = CallFormat   # (the parser's former name for it, still exported)
_DSML = "｜DSML｜"
_GLM_TAGS = ("<arg_key>", "</arg_key>", "<arg_value>")
_GLM_CALL = r"\s*(?P<name>(?:(?!<arg_key>)\S)+)\s*(?P<rest>(?:<arg_key>.*)?)\Z"   # a name without spaces, then pairs
_GLM_PARAM = r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>"

FORMATS = {f.name: f for f in (
    # Qwen3 / Hermes: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
    CallFormat("qwen3_json", CALL_OPEN, CALL_CLOSE, "\n", "\n", detect=("<tool_call>",), model_types=("qwen3_moe",)),
    # Qwen3-Coder / Qwen3.5: `<function=NAME>\n<parameter=K>\nV\n</parameter>\n</function>`, also
    # inside reasoning; a parameter's closing tag may be missing; values text unless typed
    CallFormat("qwen3_coder_xml", CALL_OPEN, CALL_CLOSE, "\n", name_open="<function={name}>\n",
               key_open="<parameter={key}>\n", value_close="\n</parameter>\n", value_tag="</parameter>",
               body_end="</function>\n", stops=("</parameter>", "<parameter="), in_reasoning=True,
               read_call=r"^\s*<function=(?P<name>[^>\n]+)>(?P<rest>.*?)(?:</function>\s*)?\Z",
               read_param=r"<parameter=(?P<key>[^>\n]+)>(?P<value>.*?)(?:</parameter>|(?=<parameter=)|\Z)",
               strict=False, json_untyped=False, trim_newline=True, detect=("<function=", "<parameter="),
               model_types=("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")),
    # GLM-4.5/4.6: `NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...`
    CallFormat("glm45", CALL_OPEN, CALL_CLOSE, name_open="{name}\n", key_open="<arg_key>{key}</arg_key>\n<arg_value>",
               value_close="</arg_value>\n", value_tag="</arg_value>", stops=("</arg_value>",), tags=_GLM_TAGS,
               read_call=_GLM_CALL, read_param=_GLM_PARAM, detect=("<arg_key>", "<arg_value>"),
               model_types=("glm4_moe", "glm4_moe_lite")),
    # GLM-4.7 / GLM-5.x: the same calls without the newlines
    CallFormat("glm47", CALL_OPEN, CALL_CLOSE, name_open="{name}", key_open="<arg_key>{key}</arg_key><arg_value>",
               value_close="</arg_value>", value_tag="</arg_value>", stops=("</arg_value>",), tags=_GLM_TAGS,
               read_call=_GLM_CALL, read_param=_GLM_PARAM,
               detect=("{function-name}<arg_key>",),   # the instructions of GLM-4.7's and GLM-5.x's templates
               model_types=("glm_moe_dsa",)),
    # DeepSeek V3.1: `NAME<｜tool▁sep｜>{json}` calls in a section; V3 / R1's fenced form read too
    CallFormat("deepseek_v31", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", call_open="<｜tool▁call▁begin｜>",
               call_close="<｜tool▁call▁end｜>", args_sep="<｜tool▁sep｜>", fenced="function",
               detect=("tool▁calls▁begin", "tool▁call▁begin"), model_types=("deepseek_v3",)),
    # Kimi K2: `functions.NAME:IDX<|tool_call_argument_begin|>{json}`, the id the model's own (the
    # template writes it back into the history verbatim); a prefix before functions. is not the name
    CallFormat("kimi_k2", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
               call_open="<|tool_call_begin|>", call_close="<|tool_call_end|>", name_prefix="functions.",
               args_sep="<|tool_call_argument_begin|>", call_id=True,
               detect=("<|tool_calls_section_begin|>", "<|im_system|>tool_declare"),
               model_types=("kimi_k2", "kimi_k25")),
    # MiniMax-M2: `<invoke name="NAME">` then `<parameter name="K">V</parameter>` (any quotes or none)
    CallFormat("minimax_m2", "<minimax:tool_call>", "</minimax:tool_call>", "\n", call_open="<invoke",
               call_close="</invoke>\n", name_open=' name="{name}">\n', key_open='<parameter name="{key}">',
               value_close="</parameter>\n", value_tag="</parameter>", stops=("</parameter>",),
               read_call=r"""\s+name=(?P<q>["']?)(?P<name>[^"'>\n]+)(?P=q)\s*>(?P<rest>.*)\Z""",
               read_param=r"""<parameter\s+name=(?P<q>["']?)(?P<key>[^"'>\n]+)(?P=q)\s*>(?P<value>.*?)</parameter>""",
               detect=("<minimax:tool_call>",), model_types=("minimax_m2",)),
    # DeepSeek-V3.2 DSML: `string="true"` before a text value, "false" before a JSON one (a "false"
    # value that is not JSON is read as the schema types it rather than dropping the call)
    CallFormat("deepseek_dsml", f"<{_DSML}function_calls>", f"</{_DSML}function_calls>", "\n",
               call_open=f"<{_DSML}invoke", call_close=f"</{_DSML}invoke>\n", name_open=' name="{name}">\n',
               key_open=f'<{_DSML}parameter name="{{key}}" string="{{string}}">', value_close=f"</{_DSML}parameter>\n",
               value_tag=f"</{_DSML}parameter>", stops=(f"</{_DSML}parameter>",), tags=(f"<{_DSML}parameter",),
               read_call=r"""\s+name="(?P<name>[^"\n]+)"\s*>(?P<rest>.*)\Z""",
               read_param=rf"""<{_DSML}parameter\s+name="(?P<key>[^"\n]+)"\s+string="(?P<string>true|false)"\s*>"""
                          rf"""(?P<value>.*?)</{_DSML}parameter>""", unique_keys=True,
               detect=(f"{_DSML}function_calls", "dsml_token }}function_calls"), model_types=("deepseek_v32",)),
)}
SUPPORTED = (*FORMATS, "none")  # (and "harmony", gpt-oss's, with its own parser: toolcalls/harmony.py)

# the formats that are no CallFormat: gpt-oss's harmony (its own table) and families recognised but
# refused (DSML in dialects other than DeepSeek-V3.2's too), with the markers that name them
_OTHER_MARKERS = {"harmony": ("<|channel|>", "<|call|>"), "unsupported:deepseek_dsml": ("｜DSML｜",),
                  "unsupported:mistral": ("[TOOL_CALLS]",), "unsupported:llama3": ("<|python_tag|>",)}
# the order templates are checked in, first match wins: a format whose templates also hold another's
# markers comes first (MiniMax's, GLM's and Qwen3-Coder's markup contain "<tool_call>": plain Qwen3 is last)
_DETECT_ORDER = ("harmony", "deepseek_dsml", "unsupported:deepseek_dsml", "minimax_m2", "kimi_k2", "glm47", "glm45",
                 "deepseek_v31", "unsupported:mistral", "unsupported:llama3", "qwen3_coder_xml", "qwen3_json")
_TEMPLATE_MARKERS = tuple((n, FORMATS[n].detect if n in FORMATS else _OTHER_MARKERS[n]) for n in _DETECT_ORDER)
# config.json model_type -> format, for a template that renders tools in no way we can name
_MODEL_TYPES = {"gpt_oss": "harmony", **{t: f.name for f in FORMATS.values() for t in f.model_types}}


def detect_tool_format(chat_template: str | None, model_type: str | None = None) -> str:
    """The tool-call format a chat template teaches: a key of FORMATS, "none" (the template has no
    tool support), or "unsupported:<family>" (recognised, not implemented). A template that
    mentions tools in no known way takes its model_type's format, else is "unsupported:unknown"."""
    if not chat_template:
        return "none"
    for family, markers in _TEMPLATE_MARKERS:
        if any(m in chat_template for m in markers):
            return family
    if not re.search(r"\btools\b", chat_template):
        return "none"
    return _MODEL_TYPES.get(model_type or "", "unsupported:unknown")  # refuse rather than guess


def markup_tokens(tool_format: str) -> tuple[str, ...]:
    """The tags the parser reads for a format, <think> and </think> included: what the
    detokenizer must not drop as special tokens (Tokenizer.keep_in_text)."""
    if tool_format == "harmony":
        from freetoken_py.server.toolcalls.harmony import HARMONY
        return HARMONY.tags
    fmt = FORMATS.get(tool_format)
    return (THINK_OPEN, THINK_CLOSE) + (fmt.markup if fmt else ())


def detect_reasoning(chat_template: str | None) -> bool:
    """True when the template knows `<think>` blocks (Qwen3, DeepSeek, GLM, Kimi, MiniMax)."""
    return bool(chat_template) and THINK_OPEN in chat_template
