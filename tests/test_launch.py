"""`freetoken launch`: against a real `freetoken serve` on 127.0.0.1, with a stand-in agent (a small
Python script, not our code) that uses the settings it was given to make a real request — so the test
checks that the settings actually reach the server, not only what they look like. The real Claude
Code and OpenCode binaries are driven in tests/test_e2e_clients.py."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

import httpx
import pytest

from server_util import REPO, ServerThread, free_port

# Records argv/env/OpenCode config, then talks to the server the way the real agent would.
AGENT = textwrap.dedent("""\
    #!{python}
    import json, os, sys, tomllib, urllib.request
    rec = {{"argv": sys.argv[1:], "env": {{k: v for k, v in os.environ.items()
            if k.startswith(("ANTHROPIC", "CLAUDE", "DISABLE", "OPENCODE", "FREETOKEN"))}}}}
    args = sys.argv[1:]
    overrides = [args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "-c"]  # Codex: -c key=TOML
    if overrides:
        cfg = rec["config"] = {{k: tomllib.loads("v = " + v)["v"] for k, v in overrides}}
        prov = cfg["model_providers." + cfg["model_provider"]]
        url = prov["base_url"] + "/responses"
        body = {{"model": cfg["model"], "max_output_tokens": 2, "input": "hi"}}
        headers = {{"Authorization": "Bearer " + os.environ[prov["env_key"]]}}
    elif "OPENCODE_CONFIG_CONTENT" in os.environ:
        cfg = json.loads(os.environ["OPENCODE_CONFIG_CONTENT"])
        rec["config"] = cfg
        prov = cfg["provider"]["freetoken"]
        url = prov["options"]["baseURL"] + "/chat/completions"
        body = {{"model": cfg["model"].split("/", 1)[1], "max_tokens": 2,
                "messages": [{{"role": "user", "content": "hi"}}]}}
        headers = {{"Authorization": "Bearer " + prov["options"]["apiKey"]}}
    else:
        url = os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages?beta=true"
        body = {{"model": os.environ["ANTHROPIC_MODEL"], "max_tokens": 2,
                "messages": [{{"role": "user", "content": "hi"}}]}}
        headers = {{"Authorization": "Bearer " + os.environ["ANTHROPIC_AUTH_TOKEN"]}}
    req = urllib.request.Request(url, json.dumps(body).encode(), dict(headers, **{{"content-type": "application/json"}}))
    with urllib.request.urlopen(req, timeout=60) as resp:
        rec["status"], rec["reply"] = resp.status, json.loads(resp.read())
    json.dump(rec, open(os.environ["AGENT_RECORD"], "w"))
    sys.exit(int(os.environ.get("AGENT_EXIT", "0")))
    """)


@pytest.fixture(scope="module")
def server():
    with ServerThread(api_key="sekrit", max_model_len=2048) as srv:
        yield srv


@pytest.fixture()
def agent(tmp_path):
    path = tmp_path / "agent"
    path.write_text(AGENT.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _launch(*args, env=None, timeout=120):
    env = {**os.environ, "ANTHROPIC_API_KEY": "users-real-key", **(env or {})}
    return subprocess.run([sys.executable, "-m", "freetoken_py", "launch", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_claude_settings_reach_the_server(server, agent, tmp_path):
    record = tmp_path / "rec.json"
    proc = _launch("claude", "--url", server.url, "--api-key", "sekrit", "--bin", str(agent), "-p", "hello",
                   "--output-format", "json", env={"AGENT_RECORD": str(record), "AGENT_EXIT": "3"})
    assert proc.returncode == 3, proc.stderr  # the agent's exit code is ours
    rec = json.loads(record.read_text())
    models = httpx.get(server.url + "/v1/models", headers={"x-api-key": "sekrit"}).json()["data"][0]
    assert rec["argv"] == ["--permission-mode", "default", "-p", "hello", "--output-format", "json"]
    env = rec["env"]
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == str(models["context_length"]) == "2048"
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "256"  # an eighth: Claude Code needs room for the prompt
    assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_SMALL_FAST_MODEL"] == models["id"]
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0" and env["DISABLE_TELEMETRY"] == "1"
    assert "ANTHROPIC_API_KEY" not in env  # would conflict with the token (Claude Code warns and asks)
    assert rec["status"] == 200 and rec["reply"]["type"] == "message"


def test_opencode_config_reaches_the_server(server, agent, tmp_path):
    record = tmp_path / "rec.json"
    proc = _launch("opencode", "--url", server.url + "/v1/", "--api-key", "sekrit", "--bin", str(agent),
                   "--max-output-tokens", "300", "run", "hi", env={"AGENT_RECORD": str(record)})
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(record.read_text())
    prov = rec["config"]["provider"]["freetoken"]
    assert prov["npm"] == "@ai-sdk/openai-compatible" and prov["options"]["baseURL"] == server.url + "/v1"
    (name, model), = prov["models"].items()
    assert model["limit"] == {"context": 2048, "output": 300} and rec["config"]["model"] == "freetoken/" + name
    assert rec["argv"] == ["run", "hi"]
    assert rec["status"] == 200 and rec["reply"]["object"] == "chat.completion"


def test_codex_settings_reach_the_server(server, agent, tmp_path):
    record = tmp_path / "rec.json"
    proc = _launch("codex", "--url", server.url, "--api-key", "sekrit", "--bin", str(agent), "exec", "hi",
                   env={"AGENT_RECORD": str(record), "OPENAI_API_KEY": "users-openai-key"})
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(record.read_text())
    cfg = rec["config"]
    assert cfg["model_providers.freetoken"] == {"name": "freetoken (local)", "base_url": server.url + "/v1",
                                                "wire_api": "responses", "env_key": "FREETOKEN_API_KEY"}
    assert cfg["model_provider"] == "freetoken" and cfg["model"] == "demo_model"
    assert cfg["model_context_window"] == 2048 and cfg["model_auto_compact_token_limit"] == 2048 - 256
    assert rec["argv"][-2:] == ["exec", "hi"]  # the agent's own arguments after the overrides
    assert rec["env"]["FREETOKEN_API_KEY"] == "sekrit"  # the user's OPENAI_API_KEY is left alone
    assert rec["status"] == 200 and rec["reply"]["object"] == "response"


def test_permission_mode_from_the_user_wins(server, agent):
    proc = _launch("claude", "--url", server.url, "--api-key", "sekrit", "--bin", str(agent), "--print-config",
                   "--", "--permission-mode", "plan")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["argv"][1:] == ["--permission-mode", "plan"]


@pytest.mark.parametrize("args, message", [
    (["claude", "--url", "http://127.0.0.1:{port}"], "cannot reach a freetoken server at http://127.0.0.1:"),
    (["claude", "--url", "{server}"], "HTTP 401 to /v1/models (pass --api-key)"),
    (["opencode", "--url", "{server}", "--api-key", "sekrit", "--max-output-tokens", "5000"],
     "--max-output-tokens 5000: must be between 1 and the context length (2048)"),
    (["aider"], "unknown agent 'aider'"),
])
def test_one_line_errors(server, agent, args, message):
    args = [a.format(port=free_port(), server=server.url) for a in args]
    proc = _launch(*args, "--bin", str(agent))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1  # one line, no traceback


def test_agent_not_installed(server):
    proc = _launch("opencode", "--url", server.url, env={"PATH": "/nonexistent"})
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("freetoken: error: opencode is not installed (`opencode` is not on PATH); "
                                   "install it with `npm install -g opencode-ai`")


def test_print_config_needs_no_installed_agent(server):
    """--print-config shows what would run (the settings come from the server), agent or not."""
    proc = _launch("claude", "--url", server.url, "--api-key", "sekrit", "--print-config",
                   env={"PATH": "/nonexistent"})
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["argv"][0] == "claude" and plan["env"]["ANTHROPIC_BASE_URL"] == server.url
