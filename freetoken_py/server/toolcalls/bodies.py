"""One tool call's body (the text between its opening and closing tags) -> (name, arguments as JSON
object text, the model's own call id or None), or None when the body is malformed: one reader per
argument encoding, each set by a format's table (formats.CallFormat.parse picks and configures it).

`schemas` is name -> the tool's JSON schema, used to type argument values that a format writes as
bare text (XML parameters, GLM's <arg_value>).
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


def json_object_call(body: str) -> Parsed | None:
    """`{"name": ..., "arguments": {...}}` (Qwen3 / Hermes); `parameters` is read as `arguments`."""
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


_FENCED = re.compile(r"\s*([^\s`]+)\s*\n```(?:json)?\n(.*)\n```\s*\Z", re.DOTALL)


def name_then_json(body: str, sep: str, id_prefix: str | None, fenced: str) -> Parsed | None:
    """`NAME<sep>{json}`. With `id_prefix` (Kimi's `functions.`) the text before `sep` is the
    model's call id, `[...]PREFIX NAME[:IDX]`, kept (a template may write it back verbatim); with
    `fenced`, that word as the name means `NAME\n```json\n{...}\n```` after `sep` (DeepSeek V3 / R1)."""
    head, found, args = body.partition(sep)
    if not found:
        return None
    if id_prefix is not None:
        call_id = head.strip()
        match = re.fullmatch(rf"(?:.*?{re.escape(id_prefix)})?(.+?)(?::\d+)?", call_id)
        return None if match is None else _named(match.group(1), _json_object(args), call_id)
    old = _FENCED.match(args) if fenced and head.strip() == fenced else None
    if old:
        head, args = old.group(1), old.group(2)
    return _named(head.strip(), _json_object(args))


def params(name: str, rest: str, param: re.Pattern, schemas: dict, fmt) -> Parsed | None:
    """A parameter-style call (XML-like tags): the name, and `rest` holding `param` matches (groups
    `key`, `value`, and `string` where the format marks text values: "true" is text, else JSON, a
    value that is not JSON then typed as below). Values are typed by the schema (`typed`, with
    `fmt.json_untyped`); `fmt.strict`: anything else in `rest` makes the call malformed;
    `fmt.trim_newline`: one newline either side of a value is the template's; `fmt.unique_keys`:
    a repeated parameter makes it malformed."""
    name = name.strip()
    if fmt.strict and param.sub("", rest).strip():
        return None
    props = _properties(schemas, name)
    args = {}
    for match in param.finditer(rest):
        key, value = match.group("key").strip(), match.group("value")
        if fmt.unique_keys and key in args:
            return None
        if fmt.trim_newline:
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
        string = match.groupdict().get("string")
        if string is not None:
            args[key] = value if string == "true" else _json_value(value, props.get(key))
        else:
            args[key] = typed(value, props.get(key), json_untyped=fmt.json_untyped)
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
