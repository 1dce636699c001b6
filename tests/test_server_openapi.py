"""Our own /openapi.json (server/schemas.py) describes every API route's request and response
bodies, and describes them truly: real responses of a served demo model (127.0.0.1) and the
requests clients send validate against it with `jsonschema`; unknown fields stay accepted."""
from __future__ import annotations

import httpx
import pytest
from jsonschema import Draft202012Validator

HI = [{"role": "user", "content": "hi"}]
POSTS = {"/v1/chat/completions": dict(messages=HI, max_tokens=3, logprobs=True, top_logprobs=2, n=2),
         "/v1/completions": dict(prompt="def f(x):", max_tokens=3, logprobs=1, echo=True),
         "/v1/responses": dict(input="hi", max_output_tokens=3),
         "/v1/messages": dict(messages=HI, max_tokens=3),
         "/v1/messages/count_tokens": dict(messages=HI)}


@pytest.fixture(scope="module")
def doc(srv):
    return httpx.get(srv.url + "/openapi.json").json()


def check(doc: dict, schema: dict, instance) -> None:
    Draft202012Validator({**schema, "components": doc["components"]}).validate(instance)


def body_schema(op: dict, where: str = "requestBody", status: str | None = None) -> dict:
    node = op[where] if status is None else op[where][status]
    return node["content"]["application/json"]["schema"]


@pytest.mark.parametrize("path", sorted(POSTS))
def test_post_routes_describe_and_match_their_bodies(srv, doc, path):
    op = doc["paths"][path]["post"]
    request = {"model": "m", **POSTS[path], "an_unknown_field": {"x": 1}}
    check(doc, body_schema(op), request)          # what we send is what the document describes
    r = httpx.post(srv.url + path, json=request, timeout=120)
    assert r.status_code == 200, r.text           # and the unknown field is still tolerated
    check(doc, body_schema(op, "responses", "200"), r.json())
    assert "text/event-stream" in op["responses"]["200"]["content"] or path.endswith("count_tokens")


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", dict(messages=HI, top_logprobs=99, logprobs=True)),
                                       ("/v1/messages", dict(messages="nope", max_tokens=2))])
def test_error_bodies_match_their_description(srv, doc, path, body):
    r = httpx.post(srv.url + path, json={"model": "m", **body}, timeout=60)
    assert r.status_code == 400
    check(doc, body_schema(doc["paths"][path]["post"], "responses", "4XX"), r.json())


def test_model_routes_match_their_description(srv, doc):
    for path, url in (("/v1/models", "/v1/models"), ("/v1/models/{model_id}", "/v1/models/any")):
        op = doc["paths"][path]["get"]
        check(doc, body_schema(op, "responses", "200"), httpx.get(srv.url + url).json())


def test_the_description_is_not_vacuous(doc):
    """A response missing a required field, or a request with a wrong type, fails it."""
    import jsonschema

    ok = doc["paths"]["/v1/chat/completions"]["post"]
    with pytest.raises(jsonschema.ValidationError):
        check(doc, body_schema(ok, "responses", "200"), {"id": "x", "object": "chat.completion", "choices": []})
    with pytest.raises(jsonschema.ValidationError):
        check(doc, body_schema(ok), {"messages": HI, "top_logprobs": 21})
