"""Browser-facing hardening of the key-less loopback server, and bad input that must leave no work
behind (both found in review). Checked against the server's own counters, over real HTTP."""
from __future__ import annotations

import httpx
import pytest

from server_util import ServerThread

CHAT = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MSG = {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("headers", [{"Host": "evil.example"}, {"Host": "evil.example:8000"},
                                     {"Origin": "https://evil.example"}, {"Origin": "null"}])
def test_foreign_host_or_origin_is_refused_in_each_api_format(srv, headers):
    r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=120)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    r = httpx.post(srv.url + "/v1/messages", json=MSG, headers=headers, timeout=120)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert r.json()["type"] == "error"


@pytest.mark.parametrize("headers", [{}, {"Host": "localhost:1234"}, {"Host": "[::1]:8000"}, {"Host": "127.0.0.2:80"},
                                     {"Origin": "http://127.0.0.1:3000"}, {"Origin": "http://localhost"}])
def test_loopback_names_and_origins_are_served(srv, headers):
    r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=120)
    assert r.status_code == 200, r.text


def test_a_key_replaces_the_loopback_rule():
    with ServerThread(api_key="k") as s:
        r = httpx.post(s.url + "/v1/chat/completions", json=CHAT, headers={"Host": "box.lan", "x-api-key": "k"},
                       timeout=120)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,body", [("/v1/messages", dict(MSG, stream="yes", max_tokens=500)),
                                       ("/v1/completions", {"model": "x", "prompt": "a", "max_tokens": 500,
                                                            "stream": True, "stream_options": 5})])
def test_a_400_leaves_nothing_running(srv, path, body):
    r = httpx.post(srv.url + path, json=body, timeout=120)
    assert r.status_code == 400, r.text
    stats = srv.stats()
    assert stats["active"] == 0 and stats["running"] == 0 and stats["waiting"] == 0


def test_aborted_streams_leave_no_per_request_state(srv):
    for _ in range(3):
        with httpx.stream("POST", srv.url + "/v1/chat/completions",
                          json=dict(CHAT, stream=True, max_tokens=200), timeout=120) as r:
            next(r.iter_lines())  # the role chunk, then hang up
    srv.stats()  # a round trip through the engine thread: the aborts above were applied first
    assert srv.state.engine.llm._streams == {}  # noqa: SLF001  the detokenizer map
