"""One tool call's body (the text between its opening and closing tags) -> (name, arguments as JSON
object text, the model's own call id or None), or None when the body is malformed.

Each function takes `(body, schemas)`, schemas being name -> the tool's JSON schema, used to type
argument values that a format writes as bare text (XML parameters, GLM's <arg_value>).
"""
from __future__ import annotations

import json
import re

Parsed = tuple[str, str, str | None]


def _json_object(text: str):
    """A JSON object (or a JSON string holding one: some models double-encode), else None."""
    try:
        obj = json.loads(text) if text.strip() else {}
        if isinstance(obj, str):
            obj = json.loads(obj) if obj.strip() else {}
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _named(name: str, args: dict | None, call_id: str | None = None) -> Parsed | None:
    if not name or args is None:
        return None
    return name, json.dumps(args, ensure_ascii=False), call_id


def qwen3_json(body: str, schemas: dict) -> Parsed | None:
    """Qwen3 / Hermes: `{"name": ..., "arguments": {...}}`."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models double-encode the arguments
        args = _json_object(args)
    return _named(obj["name"], args if isinstance(args, dict) else None)


_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


def qwen3_coder_xml(body: str, schemas: dict) -> Parsed | None:
    """Qwen3-Coder / Qwen3.5: `<function=NAME><parameter=K>\\nV\\n</parameter>...</function>`; a value
    is typed by the schema, text when the schema does not say (the reference parser's rule)."""
    match = _FUNCTION.match(body)
    if match is None:
        return None
    name = match.group(1).strip()
    props = _properties(schemas, name)
    args = {}
    for key, raw in _PARAMETER.findall(match.group(2)):
        value = raw[1:] if raw.startswith("\n") else raw  # the template wraps values in newlines
        value = value[:-1] if value.endswith("\n") else value
        args[key.strip()] = typed(value, props.get(key.strip()))
    return _named(name, args)


_GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def glm45(body: str, schemas: dict) -> Parsed | None:
    """GLM-4.5/4.6: `NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...`; GLM-4.7 the same
    without newlines. Values: typed by the schema; untyped ones JSON when they parse as a
    non-string JSON value (the template writes non-strings with tojson), else text."""
    name, sep, rest = body.partition("<arg_key>")
    name, rest = name.strip(), sep + rest
    if not name or any(c.isspace() for c in name) or _GLM_PAIR.sub("", rest).strip():
        return None
    props = _properties(schemas, name)
    return _named(name, {k.strip(): typed(v, props.get(k.strip()), json_untyped=True)
                         for k, v in _GLM_PAIR.findall(rest)})


DEEPSEEK_SEP = "<｜tool▁sep｜>"
_DEEPSEEK_V3 = re.compile(r"\s*([^\s`]+)\s*\n```(?:json)?\n(.*)\n```\s*\Z", re.DOTALL)


def deepseek(body: str, schemas: dict) -> Parsed | None:
    """DeepSeek V3.1: `NAME<｜tool▁sep｜>{json}`; V3 / R1: `function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n````."""
    name, sep, args = body.partition(DEEPSEEK_SEP)
    if not sep:
        return None
    old = _DEEPSEEK_V3.match(args) if name.strip() == "function" else None
    if old:
        name, args = old.group(1), old.group(2)
    return _named(name.strip(), _json_object(args))


KIMI_ARGS = "<|tool_call_argument_begin|>"
_KIMI_ID = re.compile(r"(?:.*?functions\.)?(.+?)(?::\d+)?")  # a prefix before functions. (toolu_) is not the name


def kimi_k2(body: str, schemas: dict) -> Parsed | None:
    """Kimi K2: `functions.NAME:IDX<|tool_call_argument_begin|>{json}`; the id is kept (the
    template writes it back into the history verbatim, so it must be the model's own)."""
    call_id, sep, args = body.partition(KIMI_ARGS)
    call_id = call_id.strip()
    match = _KIMI_ID.fullmatch(call_id)
    if not sep or match is None:
        return None
    return _named(match.group(1), _json_object(args), call_id)


_INVOKE = re.compile(r"""\s+name=(["']?)([^"'>\n]+)\1\s*>(.*)\Z""", re.DOTALL)
_MINIMAX_PARAM = re.compile(r"""<parameter\s+name=(["']?)([^"'>\n]+)\1\s*>(.*?)</parameter>""", re.DOTALL)


def minimax_m2(body: str, schemas: dict) -> Parsed | None:
    """MiniMax-M2, the body after `<invoke`: ` name="NAME">` then `<parameter name="K">V</parameter>`
    pieces. Values typed as for GLM (the template also writes non-strings with tojson)."""
    match = _INVOKE.match(body)
    if match is None or _MINIMAX_PARAM.sub("", match.group(3)).strip():
        return None
    name = match.group(2).strip()
    props = _properties(schemas, name)
    return _named(name, {k.strip(): typed(v, props.get(k.strip()), json_untyped=True)
                         for _, k, v in _MINIMAX_PARAM.findall(match.group(3))})


DSML = "｜DSML｜"
DSML_PARAM_CLOSE = f"</{DSML}parameter>"
_DSML_INVOKE = re.compile(r"""\s+name="([^"\n]+)"\s*>(.*)\Z""", re.DOTALL)
_DSML_PARAM = re.compile(rf"""<{DSML}parameter\s+name="([^"\n]+)"\s+string="(true|false)"\s*>(.*?){DSML_PARAM_CLOSE}""",
                         re.DOTALL)


def deepseek_dsml(body: str, schemas: dict) -> Parsed | None:
    """DeepSeek-V3.2 DSML, the body after `<｜DSML｜invoke`: ` name="NAME">` then
    `<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>` pieces. string="true":
    V is the text itself; "false": V is JSON (the published encoding's rule); a "false" value
    that is not JSON is read as the schema types it (text at worst) rather than dropping the call."""
    match = _DSML_INVOKE.match(body)
    if match is None or _DSML_PARAM.sub("", match.group(2)).strip():
        return None
    name = match.group(1).strip()
    props = _properties(schemas, name)
    args = {}
    for key, string, value in _DSML_PARAM.findall(match.group(2)):
        key = key.strip()
        if key in args:
            return None  # the encoding's parser refuses a repeated parameter
        args[key] = value if string == "true" else _json_value(value, props.get(key))
    return _named(name, args)


def _json_value(text: str, schema) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return typed(text, schema, json_untyped=True)


def _properties(schemas: dict, name: str) -> dict:
    props = schemas.get(name, {}).get("properties", {})
    return props if isinstance(props, dict) else {}


def typed(value: str, schema, json_untyped: bool = False) -> object:
    """A textual argument value as its schema's JSON type; text when it does not fit. Untyped:
    text, or (json_untyped) a non-string JSON value when it parses as one."""
    types = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(schema, dict) and not types:
        types = [s.get("type") for s in schema.get("anyOf", []) if isinstance(s, dict)]
    for typ in types if isinstance(types, list) else [types]:
        converted = _convert(value, typ)
        if converted is not _NO:
            return converted
    if json_untyped and not types:
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return value if isinstance(parsed, str) else parsed
    return value


_NO = object()


def _convert(value: str, typ) -> object:
    text = value.strip()
    if typ == "string":
        return value
    if typ == "null":
        return None if text.lower() in ("null", "none") else _NO
    if typ == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _NO)
    try:
        if typ == "integer":
            return int(text)
        if typ == "number":
            num = float(text)
            return int(num) if num.is_integer() and re.fullmatch(r"-?\d+", text) else num
        if typ in ("object", "array"):
            obj = json.loads(text)
            return obj if isinstance(obj, dict if typ == "object" else list) else _NO
    except ValueError:
        return _NO
    return _NO
