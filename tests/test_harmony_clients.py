"""The real Claude Code, OpenCode and Codex CLIs (the pinned npm versions of tests/test_e2e_clients.py),
started through `freetoken launch`, against the server running a tiny gpt_oss checkpoint that
speaks harmony (tests/harmony_model.py: gpt-oss's published chat template, harmony's tags as
special tokens; greedy, it writes an analysis message, then the final answer ANSWER), behind the
recording proxy. The clients' own default requests (their system prompts and tools, tool_choice
auto: the harmony grammar lets the model answer) go through the harmony template and parser:
each client completes the turn and prints ANSWER, and the server's streamed answer carried the
analysis as each API's reasoning (Anthropic thinking block, chat reasoning_content, Responses
reasoning item) and no harmony tag in the text."""
from __future__ import annotations

import json

import pytest

import harmony_model
from server_util import ServerThread
from test_e2e_clients import CODEX_SLIM, PROMPT, RecordingProxy, _home_env, _install_clients, _launch, _sse_data


@pytest.fixture(scope="module")
def clients():
    return _install_clients()


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    model = harmony_model.build(tmp_path_factory.mktemp("harmony_clients") / "model")
    srv = ServerThread(model_dir=model, model_name="gpt-oss-tiny", max_model_len=65536).start()
    rec = RecordingProxy(srv.url)
    yield rec
    rec.close()
    srv.stop()


def _posts(proxy, before, path):
    return [r for r in proxy.log[before:] if r["method"] == "POST" and r["path"].split("?")[0] == path]


def test_claude_code_answers_through_harmony(clients, proxy, tmp_path):
    before = len(proxy.log)
    proc = _launch("claude", proxy, clients, tmp_path, _home_env(tmp_path), "-p", PROMPT, "--output-format", "json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["is_error"] is False and result["result"] == harmony_model.ANSWER
    main = [r for r in _posts(proxy, before, "/v1/messages") if json.loads(r["request"]).get("tools")]
    assert main and all(r["status"] == 200 for r in main)
    events = _sse_data(main[-1]["response"])
    thinking = "".join(e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta")
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert thinking == harmony_model.REASONING and text == harmony_model.ANSWER


def test_opencode_answers_through_harmony(clients, proxy, tmp_path):
    before = len(proxy.log)
    env = dict(_home_env(tmp_path), OPENCODE_DISABLE_MODELS_FETCH="1")
    proc = _launch("opencode", proxy, clients, tmp_path, env, "run", "--format", "json", PROMPT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    printed = "".join(ev["part"]["text"] for line in proc.stdout.splitlines() if line.startswith("{")
                      for ev in [json.loads(line)] if ev.get("type") == "text")
    assert printed.strip() == harmony_model.ANSWER
    main = [r for r in _posts(proxy, before, "/v1/chat/completions") if json.loads(r["request"]).get("tools")]
    assert len(main) == 1 and main[0]["status"] == 200
    deltas = [c["choices"][0]["delta"] for c in _sse_data(main[0]["response"]) if c.get("choices")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == harmony_model.REASONING
    assert "".join(d.get("content") or "" for d in deltas) == harmony_model.ANSWER


def test_codex_answers_through_harmony(clients, proxy, tmp_path):
    env = dict(_home_env(tmp_path), CODEX_HOME=str(tmp_path / "home" / ".codex"))
    (tmp_path / "home" / ".codex").mkdir()
    before = len(proxy.log)
    proc = _launch("codex", proxy, clients, tmp_path, env, "exec", "--skip-git-repo-check", *CODEX_SLIM, PROMPT,
                   timeout=400)
    calls = _posts(proxy, before, "/v1/responses")
    assert calls and all(r["status"] == 200 for r in calls), (proc.stderr[-3000:], calls[:1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert harmony_model.ANSWER in proc.stdout
    done = [e["item"] for e in _sse_data(calls[-1]["response"]) if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == ["reasoning", "message"]
    assert done[0]["content"][0]["text"] == harmony_model.REASONING
    assert done[1]["content"][0]["text"] == harmony_model.ANSWER
