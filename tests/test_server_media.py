"""Images, audio and documents sent to a model without vision are a 400 in each API's own error
shape, never dropped silently (the client would get an answer about a picture nobody saw): OpenAI
chat `image_url` / `input_audio` / `file` parts, Responses `input_image` / `input_file` parts (also in
a function_call_output), Anthropic `image` / `document` blocks (also inside tool_result content),
count_tokens too. The same requests with the media removed are answered, so the check refuses
media, not the message around it. A served tiny kimi_k25 (its vision tower skipped) says why."""
from __future__ import annotations

import shutil

import httpx
import pytest

from freetoken_py.cli import DEMO_MODEL
from server_util import ServerThread, wait_ready

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
IMAGE_URL = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG}}
A_IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
A_DOC = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "a doc"}}
TEXT = {"type": "text", "text": "What is in the picture?"}


def _started(s: ServerThread) -> ServerThread:
    s.start()
    wait_ready(s.url, timeout_s=900, alive=s._thread.is_alive)  # a loaded shared machine loads slowly
    return s


@pytest.fixture(scope="module")
def srv():
    s = _started(ServerThread(wait_ready=False))
    yield s
    s.stop()


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.base_url.removesuffix("/v1") + path, json=body, timeout=120)


def _openai_400(r: httpx.Response, where: str, noun: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and where in err["message"] and noun in err["message"]
    return err["message"]


def _anthropic_400(r: httpx.Response, where: str, noun: str) -> str:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert where in body["error"]["message"] and noun in body["error"]["message"]
    return body["error"]["message"]


CHAT_CASES = [
    (IMAGE_URL, "images"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio"),
    ({"type": "file", "file": {"file_data": "data:application/pdf;base64,AAAA", "filename": "a.pdf"}}, "documents"),
]


@pytest.mark.parametrize("part,noun", CHAT_CASES, ids=lambda c: c["type"] if isinstance(c, dict) else c)
def test_chat_completions_media_parts(srv, part, noun):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Look:"}, part]}]
    body = {"model": "m", "max_tokens": 2, "messages": msgs}
    msg = _openai_400(_post(srv, "/v1/chat/completions", body), "messages[1].content[1]", noun)
    assert "no vision" in msg and part["type"] in msg
    _openai_400(_post(srv, "/v1/chat/completions", dict(body, stream=True)), "messages[1].content[1]", noun)
    msgs[1]["content"].pop()
    assert _post(srv, "/v1/chat/completions", body).status_code == 200


def test_responses_media_parts(srv):
    item = {"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "Look:"}, {"type": "input_image", "image_url": "data:,x"}]}
    body = {"model": "m", "max_output_tokens": 2, "input": [item]}
    _openai_400(_post(srv, "/v1/responses", body), "input[0].content[1]", "images")
    item["content"][1] = {"type": "input_file", "file_data": "AAAA", "filename": "a.pdf"}
    _openai_400(_post(srv, "/v1/responses", dict(body, stream=True)), "input[0].content[1]", "documents")
    item["content"].pop()
    call = [{"type": "function_call", "call_id": "call_1", "name": "shot", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1",
             "output": [{"type": "input_text", "text": "here"}, {"type": "input_image", "image_url": "data:,x"}]}]
    _openai_400(_post(srv, "/v1/responses", dict(body, input=[item] + call)), "input[2].output[1]", "images")
    assert _post(srv, "/v1/responses", body).status_code == 200


def test_anthropic_media_blocks(srv):
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [TEXT, A_IMAGE]}]}
    msg = _anthropic_400(_post(srv, "/v1/messages", body), "messages.0.content.1", "images")
    assert "'image'" in msg
    _anthropic_400(_post(srv, "/v1/messages?beta=true", dict(body, stream=True)), "messages.0.content.1", "images")
    _anthropic_400(_post(srv, "/v1/messages/count_tokens", body), "messages.0.content.1", "images")
    body["messages"][0]["content"][1] = A_DOC
    _anthropic_400(_post(srv, "/v1/messages", body), "messages.0.content.1", "documents")
    # a screenshot returned by a tool (Claude Code's Read of a .png) sits inside tool_result content
    turns = [{"role": "user", "content": "Read shot.png"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                           "content": [{"type": "text", "text": "ok"}, A_IMAGE]}, TEXT]}]
    _anthropic_400(_post(srv, "/v1/messages", dict(body, messages=turns)), "messages.2.content.0.content.1", "images")
    turns[2]["content"][0]["content"].pop()
    assert _post(srv, "/v1/messages", dict(body, messages=turns)).status_code == 200
    assert _post(srv, "/v1/messages/count_tokens", dict(body, messages=turns)).status_code == 200


def test_kimi_k25_says_its_vision_tower_is_skipped(tmp_path):
    """A real kimi_k25 wrapper (transformers' Kimi_K25ForConditionalGeneration, vision tower and all)
    served: the refusal says this runtime's build of the model reads no images."""
    from mla_util import build

    path = build("kimi_k25", tmp_path / "kimi")
    shutil.copy(DEMO_MODEL / "tokenizer.json", path / "tokenizer.json")
    s = _started(ServerThread(path, max_model_len=64, kv_cache_bytes=16 << 20, wait_ready=False))
    try:
        r = _post(s, "/v1/messages", {"model": "k", "max_tokens": 2,
                                      "messages": [{"role": "user", "content": [TEXT, A_IMAGE]}]})
        msg = _anthropic_400(r, "messages.0.content.1", "images")
        assert "kimi_k25" in msg and "vision tower" in msg
        r = _post(s, "/v1/chat/completions", {"model": "k", "messages": [{"role": "user", "content": [IMAGE_URL]}]})
        assert "kimi_k25" in _openai_400(r, "messages[0].content[0]", "images")
    finally:
        s.stop()
