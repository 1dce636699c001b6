"""OpenAI's published response schemas (a subset of github.com/openai/openai-openapi's openapi.json,
in tests/data/openai_schema_subset.json) and a jsonschema validator over them.

    validate(body, "CreateChatCompletionResponse")  # raises jsonschema.ValidationError

Regenerate the subset from a checkout of openai/openai-openapi:
    python tests/openai_schema.py path/to/openapi.json <commit>
"""
from __future__ import annotations

import json
import sys
from functools import lru_cache
from pathlib import Path

SUBSET = Path(__file__).parent / "data" / "openai_schema_subset.json"
# the operations we serve (with their request and response schemas), for schemathesis
OPERATIONS = {"/chat/completions": ["post"], "/completions": ["post"], "/models": ["get"],
              "/models/{model}": ["get"], "/responses": ["post"]}
ROOTS = ["CreateChatCompletionResponse", "CreateChatCompletionStreamResponse", "CreateCompletionResponse",
         "ListModelsResponse", "Model", "Response", "ResponseStreamEvent", "ErrorResponse"]
# annotations with no bearing on validity (kept where they name a property)
DROP = {"description", "example", "examples", "title", "deprecated"}


@lru_cache(maxsize=1)
def _document() -> dict:
    return json.loads(SUBSET.read_text())


def validate(body, schema: str) -> None:
    """Validate `body` against components/schemas/<schema> (JSON Schema 2020-12, as OpenAPI 3.1)."""
    from jsonschema import Draft202012Validator

    doc = _document()
    Draft202012Validator({"$ref": f"#/components/schemas/{schema}", "components": doc["components"]}).validate(body)


def validate_event(event: dict) -> None:
    """A Responses stream event against the member of ResponseStreamEvent its `type` names (the
    document's discriminator), so a failure names the field rather than "none of 58 matched"."""
    schemas = _document()["components"]["schemas"]
    for member in schemas["ResponseStreamEvent"]["anyOf"]:
        name = member["$ref"].rsplit("/", 1)[-1]
        if event.get("type") in schemas[name].get("properties", {}).get("type", {}).get("enum", ()):
            return validate(event, name)
    raise AssertionError(f"no published stream event has type {event.get('type')!r}")


def _refs(node, out: set) -> None:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            out.add(node["$ref"].rsplit("/", 1)[-1])
        for v in node.values():
            _refs(v, out)
    elif isinstance(node, list):
        for v in node:
            _refs(v, out)


def _strip(node, properties: bool = False):
    """Drop annotations; under `properties` every key is a property name and stays. OpenAPI 3.0's
    `nullable: true`, which the document still uses in places and JSON Schema ignores, becomes
    what it means: anyOf [the schema, null]."""
    if isinstance(node, dict):
        out = {k: _strip(v, k == "properties" and not properties)
               for k, v in node.items() if properties or not (k in DROP or k.startswith("x-"))}
        if not properties and out.pop("nullable", False) is True:
            out = {"anyOf": [out, {"type": "null"}]}
        return out
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def _operation(op: dict) -> dict:
    """An operation with its parameters, request body and 200 response (the 429's shared
    components/responses entry is left out)."""
    keep = {k: op[k] for k in ("operationId", "parameters", "requestBody") if k in op}
    ok = _strip(op["responses"]["200"])
    return {**_strip(keep), "responses": {"200": {"description": "OK", **ok}}}   # OpenAPI requires one


def build(openapi: dict, commit: str) -> dict:
    schemas = openapi["components"]["schemas"]
    paths = {p: {m: _operation(openapi["paths"][p][m]) for m in methods} for p, methods in OPERATIONS.items()}
    found_ops: set = set()
    _refs(paths, found_ops)
    seen, todo = set(), sorted(set(ROOTS) | found_ops)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            found: set = set()
            _refs(schemas[name], found)
            todo += sorted(found - seen)
    return {"openapi": openapi["openapi"], "info": {"title": "OpenAI API (subset)", "version": openapi["info"]["version"]},
            "servers": [{"url": "/v1"}], "paths": paths, "$comment": (
        "A subset of OpenAI's published OpenAPI document: https://github.com/openai/openai-openapi, openapi.json "
        f"at commit {commit} (info.version {openapi['info']['version']}): the operations {sorted(OPERATIONS)} and the component schemas reachable from "
        f"them and from {', '.join(ROOTS)}, unchanged but for dropped annotations ({', '.join(sorted(DROP))}, x-*) and OpenAPI 3.0's "
        "`nullable: true` written as anyOf [schema, null]; operations keep their parameters, request body and 200 "
        "response. "
        "Regenerate: python tests/openai_schema.py openapi.json <commit>."),
        "components": {"schemas": {n: _strip(schemas[n]) for n in sorted(seen)}}}


if __name__ == "__main__":
    doc = build(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2])
    SUBSET.write_text(json.dumps(doc, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"{SUBSET}: {len(doc['components']['schemas'])} schemas")
