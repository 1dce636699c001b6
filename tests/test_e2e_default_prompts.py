"""The real Claude Code and OpenCode CLIs with their **default** prompts (not `--bare`, their own
tools on), started through `freetoken launch`, against the server (`freetoken serve`'s app, run
in the test process by ServerThread) behind the recording proxy of tests/test_e2e_clients.py.

Served model: tests/agent_model.py's scripted qwen3_moe (the demo tokenizer and chat template, a
1 x 16-wide layer, 262K positions) — not the demo model, which needs minutes of CPU for the
clients' 17K / 9.6K-token first prompts and never ends its answer that far past its 512-token
training window. It answers "Hello from freetoken." and ends the turn, so what is checked is the
protocol: the clients' real default requests, the server's answers, what the clients then do.

- enough context (65,536): each client completes the turn and prints the answer;
- too little (8,192): the server answers in each API's own "prompt too long" shape and the
  tests record what the client does with it (docs/clients.md): Claude Code recognises it
  (`terminal_reason: prompt_too_long`, the counts from the message) and exits 1 without a retry:
  a one-exchange conversation cannot be compacted; OpenCode compacts (a summarisation request)
  and retries, again and again, as its system prompt and tools alone overflow the window.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from agent_model import ANSWER, build_agent_model
from server_util import ServerThread
from test_e2e_clients import PROMPT, RecordingProxy, _home_env, _install_clients, _launch, _sse_data

SMALL = 8192


@pytest.fixture(scope="module")
def clients():
    return _install_clients()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_agent_model(tmp_path_factory.mktemp("agent") / "model")


def _serve(model, context: int):
    # in the test process (ServerThread): one import and no second process start-up per server
    srv = ServerThread(model_dir=model, model_name="demo", max_model_len=context).start()
    return srv, RecordingProxy(srv.url)


@pytest.fixture(scope="module")
def big(model):
    srv, proxy = _serve(model, 65536)
    yield proxy
    proxy.close()
    srv.stop()


@pytest.fixture(scope="module")
def small(model):
    srv, proxy = _serve(model, SMALL)
    yield proxy
    proxy.close()
    srv.stop()


def _messages_posts(proxy, before):
    return [r for r in proxy.log[before:] if r["method"] == "POST" and r["path"].split("?")[0] == "/v1/messages"]


def _chat_posts(proxy, before):
    return [r for r in proxy.log[before:] if r["method"] == "POST" and r["path"] == "/v1/chat/completions"]


def _opencode_env(tmp_path):
    return dict(_home_env(tmp_path), OPENCODE_DISABLE_MODELS_FETCH="1")  # no models.dev lookup offline


def test_claude_code_default_prompt_completes_a_turn(clients, big, tmp_path):
    before = len(big.log)
    proc = _launch("claude", big, clients, tmp_path, _home_env(tmp_path), "-p", PROMPT, "--output-format", "json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["is_error"] is False and result["result"] == ANSWER
    (main,) = _messages_posts(big, before)
    body = json.loads(main["request"])
    assert main["status"] == 200 and body["stream"] is True
    # its default request: the full system prompt and its own tools
    system = "".join(b.get("text", "") for b in body["system"]) if isinstance(body["system"], list) else body["system"]
    assert len(body["tools"]) >= 8 and len(system) > 5000 and "--bare" not in proc.args
    start = [e for e in _sse_data(main["response"]) if e["type"] == "message_start"][0]
    assert start["message"]["usage"]["input_tokens"] > 12000


def test_opencode_default_prompt_completes_a_turn(clients, big, tmp_path):
    before = len(big.log)
    proc = _launch("opencode", big, clients, tmp_path, _opencode_env(tmp_path), "run", "--format", "json", PROMPT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    printed = "".join(ev["part"]["text"] for line in proc.stdout.splitlines() if line.startswith("{")
                      for ev in [json.loads(line)] if ev.get("type") == "text")
    assert printed.strip() == ANSWER
    main = [r for r in _chat_posts(big, before) if json.loads(r["request"]).get("tools")]
    assert len(main) == 1 and main[0]["status"] == 200
    body = json.loads(main[0]["request"])
    assert len(body["tools"]) >= 8 and len(body["messages"][0]["content"]) > 5000
    usage = _sse_data(main[0]["response"])[-1]["usage"]
    assert usage["prompt_tokens"] > 8000


def test_claude_code_prompt_too_long_is_anthropics_error_and_it_stops(clients, small, tmp_path):
    before = len(small.log)
    proc = _launch("claude", small, clients, tmp_path, _home_env(tmp_path), "-p", PROMPT, "--output-format", "json")
    posts = _messages_posts(small, before)
    assert len(posts) == 1 and posts[0]["status"] == 400  # no retry, no compaction request
    err = json.loads(posts[0]["response"])
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    msg = err["error"]["message"]
    assert msg.startswith("prompt is too long: ") and msg.endswith(f" tokens > {SMALL} maximum")
    n = int(msg.split()[4])
    assert n > SMALL
    # Claude Code read it as a prompt-too-long error, with our counts
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 1 and result["is_error"] is True
    assert result["terminal_reason"] == "prompt_too_long" and result["api_error_type"] == "invalid_request_error"
    assert f"~{n} tokens (limit {SMALL})" in result["result"]


def test_opencode_context_overflow_is_openais_error_and_it_compacts(clients, small, tmp_path):
    before = len(small.log)
    cmd = [sys.executable, "-m", "freetoken_py", "launch", "opencode", "--url", small.url, "--bin",
           str(clients / "opencode"), "--max-output-tokens", "64", "--", "run", "--format", "json", PROMPT]
    # its own session: the launcher runs OpenCode as a child, and both must go
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_opencode_env(tmp_path), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:  # it does not give up by itself: stop it after its second round of compaction
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and proc.poll() is None:
            if sum(r["status"] == 400 for r in _chat_posts(small, before)) >= 3:
                break
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    posts = [(r["status"], json.loads(r["request"]), r["response"]) for r in _chat_posts(small, before)]
    overflows = [(body, resp) for status, body, resp in posts if status == 400]
    assert len(overflows) >= 3, [p[0] for p in posts]
    for body, resp in overflows:
        err = json.loads(resp)["error"]
        assert body.get("tools") and err["code"] == "context_length_exceeded"
        assert err["type"] == "invalid_request_error" and err["message"].startswith(
            f"This model's maximum context length is {SMALL} tokens. However, your messages resulted in ")
    # between the overflows: a summarisation request without tools (answered), then the main request again
    summaries = [body for status, body, _ in posts if status == 200 and not body.get("tools")
                 and "summar" in json.dumps(body["messages"][0]).lower()]
    assert len(summaries) >= 2
    retried = overflows[1][0]["messages"]
    assert any(m["role"] == "assistant" and m.get("content") == ANSWER for m in retried)  # the summary, in place
