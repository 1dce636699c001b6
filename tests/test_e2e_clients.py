"""The real Claude Code, OpenCode and Codex CLIs (pinned versions from npm) against `freetoken serve`
on the demo model, started through `freetoken launch`.

A recording proxy sits between client and server (plain HTTP forwarding, responses streamed through
unchanged), so the assertions check the requests the client really sent and the answers the server
really gave — independently of what the client prints. The demo model is served from a copy whose
generation_config.json asks for greedy decoding (clients do not send a temperature), so each run is
the same: for the prompt below the model calls `get_weather`, Claude Code answers with a tool_result
(an error result: its MCP tool is named `mcp__w__get_weather`), and the model then answers in text.

Prompts are kept inside the demo model's 512-token training window: `--bare --tools ""` plus a tiny
MCP tool for Claude Code (its default first request is ~17K demo tokens), tools switched off and a
one-line agent prompt for OpenCode (~9.7K tokens by default). docs/clients.md has the measurements.
"""
from __future__ import annotations

import fcntl
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from server_util import REPO, ServerProcess
import server_util

PINNED = {"@anthropic-ai/claude-code": "2.1.332", "opencode-ai": "1.18.33", "@openai/codex": "0.169.0"}
DEMO = REPO / "freetoken_py" / "data" / "demo_model"
PROMPT = "What is the weather in Paris?"
SYSTEM = "You are a helpful assistant."


# -- pinned clients, installed once into a cache dir ------------------------------------------

def _install_clients() -> Path:
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the end-to-end client tests need it to install the pinned CLIs")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = cache / "freetoken-tests" / ("npm-" + "-".join(v for v in PINNED.values()))
    bins = {name: root / "node_modules" / ".bin" / name for name in ("claude", "opencode", "codex")}
    root.mkdir(parents=True, exist_ok=True)
    # one installer at a time: the test files that use the clients run on different xdist workers,
    # and a second `npm install` into the same prefix re-lays node_modules under the first one's
    # running tests (on a fresh machine their binaries were missing mid-test)
    with open(root.parent / (root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not all(b.exists() for b in bins.values()):
            # the packages' postinstall scripts (skipped by npm's allowScripts default) only copy the
            # platform binary into place; npm links the same binary from the optional dependency itself
            cmd = [npm, "install", "--prefix", str(root), "--no-audit", "--no-fund", "--no-save",
                   *(f"{p}@{v}" for p, v in PINNED.items())]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, f"npm install failed: {proc.stderr[-2000:]}"
    for name, path in bins.items():
        version = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60).stdout
        assert set(version.split()) & set(PINNED.values()), f"{name} --version says {version!r}"
    return root / "node_modules" / ".bin"


# -- a recording proxy ------------------------------------------------------------------------

class _Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    upstream: tuple[str, int]
    log: list[dict]

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _forward(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        conn = http.client.HTTPConnection(*self.upstream, timeout=300)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
        conn.request(self.command, self.path, body=body, headers=headers)
        resp = conn.getresponse()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length", "date", "server"):
                self.send_header(k, v)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        received = bytearray()
        while chunk := resp.read1(65536):  # stream through as it arrives (SSE)
            received += chunk
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.log.append({"method": self.command, "path": self.path, "status": resp.status,
                         "request": body.decode("utf-8", "replace"), "response": received.decode("utf-8", "replace")})
        conn.close()

    do_GET = do_POST = do_HEAD = _forward


class RecordingProxy:
    def __init__(self, upstream_url: str):
        host, port = upstream_url.removeprefix("http://").split(":")
        self.log: list[dict] = []
        handler = type("Handler", (_Proxy,), {"upstream": (host, int(port)), "log": self.log})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def posts(self, path_prefix: str) -> list[dict]:
        return [r for r in self.log if r["method"] == "POST" and r["path"].startswith(path_prefix)]

    def close(self):
        self.httpd.shutdown()


def _sse_data(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


# -- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def clients():
    return _install_clients()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tmp_path_factory.mktemp("greedy_demo")
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (model / f).symlink_to(DEMO / f)
    gen = json.loads((DEMO / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(dict(gen, temperature=0.0)))
    # 8192 > the demo's 4096 positions (RoPE extends): Claude Code reserves room for compaction and
    # refuses prompts when the window is small; the prompts themselves stay ~200-300 tokens
    with ServerProcess("--model", str(model), "--max-model-len", "8192", "--served-model-name", "demo") as srv:
        proxy = RecordingProxy(srv.url)
        yield proxy
        proxy.close()


def _home_env(tmp: Path) -> dict:
    home = tmp / "home"
    home.mkdir()
    return {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"),
            "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local/share"),
            "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local/state"),
            "PYTHONPATH": str(REPO)}


def _launch(agent: str, proxy: RecordingProxy, clients: Path, cwd: Path, env: dict, *args: str, timeout=110):
    cmd = [sys.executable, "-m", "freetoken_py", "launch", agent, "--url", proxy.url,
           "--bin", str(clients / agent), "--max-output-tokens", "64", "--", *args]
    # stdin closed: `codex exec` reads more prompt from a stdin that is not a terminal
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


# -- the tests --------------------------------------------------------------------------------

WEATHER = {"name": "get_weather", "description": "Get the weather for a city",
           "inputSchema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
MCP_SERVER = server_util.mcp_server_script([WEATHER])


def test_claude_code_tool_round_trip(clients, server, tmp_path):
    (tmp_path / "mcp_weather.py").write_text(MCP_SERVER)
    mcp = {"mcpServers": {"w": {"command": sys.executable, "args": [str(tmp_path / "mcp_weather.py")]}}}
    before = len(server.log)
    proc = _launch("claude", server, clients, tmp_path, _home_env(tmp_path), "-p", PROMPT, "--output-format", "json",
                   "--bare", "--tools", "", "--system-prompt", SYSTEM, "--mcp-config", json.dumps(mcp),
                   "--strict-mcp-config")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["is_error"] is False and result["subtype"] == "success"

    calls = [r for r in server.log[before:] if r["path"].startswith("/v1/messages?") or r["path"] == "/v1/messages"]
    assert len(calls) >= 2 and all(r["status"] == 200 for r in calls)
    first, last = json.loads(calls[0]["request"]), json.loads(calls[-1]["request"])
    assert first["stream"] is True and [t["name"] for t in first["tools"]] == ["mcp__w__get_weather"]
    # the server answered the first request with a real tool_use block ...
    events = _sse_data(calls[0]["response"])
    tool_use = [e["content_block"] for e in events if e["type"] == "content_block_start"
                and e["content_block"]["type"] == "tool_use"]
    assert tool_use and [e for e in events if e["type"] == "message_delta"][0]["delta"]["stop_reason"] == "tool_use"
    # ... and Claude Code sent a tool_result for that id back
    results = [b for m in last["messages"] if m["role"] == "user" and isinstance(m["content"], list)
               for b in m["content"] if b.get("type") == "tool_result"]
    assert [b["tool_use_id"] for b in results] == [tool_use[0]["id"]]
    # the final answer printed is the text the server streamed for the last request
    final_text = "".join(e["delta"]["text"] for e in _sse_data(calls[-1]["response"])
                         if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta")
    assert final_text and result["result"] == final_text and result["num_turns"] == len(calls)


def test_opencode_answers(clients, server, tmp_path):
    # a project config next to the prompt: no tools and a one-line agent prompt keep the request small;
    # the provider and model come from `freetoken launch` (OPENCODE_CONFIG_CONTENT)
    project = {"tools": {t: False for t in ("bash", "edit", "glob", "grep", "read", "skill", "task", "todowrite",
                                            "webfetch", "write")},
               "agent": {"build": {"prompt": SYSTEM}}}
    (tmp_path / "opencode.json").write_text(json.dumps(project))
    env = dict(_home_env(tmp_path), OPENCODE_DISABLE_MODELS_FETCH="1")  # no models.dev lookup offline
    before = len(server.log)
    proc = _launch("opencode", server, clients, tmp_path, env, "run", "--format", "json", PROMPT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    calls = [r for r in server.log[before:] if r["path"] == "/v1/chat/completions"]
    main = [r for r in calls if SYSTEM in r["request"] and PROMPT in r["request"]]
    assert len(main) == 1 and main[0]["status"] == 200
    body = json.loads(main[0]["request"])
    assert body["model"] == "demo" and body["stream"] is True and body["max_tokens"] == 64
    chunks = _sse_data(main[0]["response"])
    answer = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    assert answer and chunks[-1]["usage"]["completion_tokens"] > 0  # include_usage honoured
    printed = "".join(ev["part"]["text"] for line in proc.stdout.splitlines() if line.startswith("{")
                      for ev in [json.loads(line)] if ev.get("type") == "text")
    assert re.sub(r"\s+", " ", printed).strip() == re.sub(r"\s+", " ", answer).strip()


# Codex's defaults send ~8,800 demo tokens (a 17K-character base prompt, skills, permissions and
# environment context, eight tools); these switches bring its first request to ~1,100 tokens: the
# base prompt from a file, the context blocks and tool families off. What stays: its MCP resource
# tools, request_user_input, and the MCP server's get_weather (in a `namespace` entry).
CODEX_SLIM = ["-c", "include_permissions_instructions=false", "-c", "include_environment_context=false",
              "-c", "include_skills_usage_instructions=false", "-c", "include_plugin_usage_instructions=false",
              "-c", "include_apps_usage_instructions=false", *(a for f in ("goals", "multi_agent", "view_image",
                                                                           "shell_tool", "skill_search", "plugins",
                                                                           "apps") for a in ("--disable", f))]


def _items(body: dict, kind: str) -> list[dict]:
    return [i for i in body["input"] if i.get("type") == kind]


def test_codex_tool_round_trip(clients, server, tmp_path):
    """`codex exec` speaks the Responses API. The model's call is valid by construction (the
    tool's schema closes its object: additionalProperties false); unconstrained, the demo model
    writes `"arguments": "<junk>"` at this prompt length (~1,100 tokens, past its 512-token
    training window) and no call parses."""
    mcp = tmp_path / "mcp_weather.py"
    mcp.write_text(server_util.mcp_server_script(
        [{**WEATHER, "inputSchema": {**WEATHER["inputSchema"], "additionalProperties": False}}]))
    (tmp_path / "instructions.md").write_text(SYSTEM)
    settings = ["-c", f"model_instructions_file={json.dumps(str(tmp_path / 'instructions.md'))}", *CODEX_SLIM,
                "-c", f"mcp_servers.w={{command={json.dumps(sys.executable)},args=[{json.dumps(str(mcp))}],"
                f"default_tools_approval_mode=\"approve\"}}"]
    env = dict(_home_env(tmp_path), CODEX_HOME=str(tmp_path / "home" / ".codex"))
    (tmp_path / "home" / ".codex").mkdir()
    before = len(server.log)
    proc = _launch("codex", server, clients, tmp_path, env, "exec", "--skip-git-repo-check", *settings, PROMPT,
                   timeout=400)
    calls = [r for r in server.log[before:] if r["path"] == "/v1/responses"]
    assert len(calls) >= 2 and all(r["status"] == 200 for r in calls), (proc.stderr[-3000:], calls[:1])
    first, second = json.loads(calls[0]["request"]), json.loads(calls[1]["request"])
    assert first["stream"] is True and first["store"] is False and first["model"] == "demo"
    assert any(t.get("type") == "namespace" and t.get("name") == "mcp__w" for t in first["tools"])
    # the server answered the first request with a function_call for the namespaced MCP tool ...
    events = _sse_data(calls[0]["response"])
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    (call,) = [i for i in done if i["type"] == "function_call"]
    assert call["name"] == "get_weather" and call["namespace"] == "mcp__w"
    assert set(json.loads(call["arguments"])) == {"city"}
    # ... Codex ran it and sent the call and its output back in the next request
    assert [c["call_id"] for c in _items(second, "function_call")] == [call["call_id"]]
    (output,) = _items(second, "function_call_output")
    assert output["call_id"] == call["call_id"] and "Sunny, 21 C" in json.dumps(output["output"])
    # what became of the model's answer to it
    last = _sse_data(calls[-1]["response"])[-1]
    assert last["type"] in ("response.completed", "response.incomplete")
    assert proc.returncode == (0 if last["type"] == "response.completed" else 1), proc.stderr[-2000:]
