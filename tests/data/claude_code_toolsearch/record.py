"""Record a real Claude Code (2.1.332) conversation that loads deferred MCP tools through ToolSearch.

    python tests/data/claude_code_toolsearch/record.py OUT.json [--bare]

What is real and what is scripted:
- real: every request body (Claude Code 2.1.332 with its default system prompt and tools, unless
  --bare, `ENABLE_TOOL_SEARCH=true` so its MCP tools go out with `defer_loading` and a ToolSearch
  tool is offered), the ToolSearch run (Claude Code executes it itself and answers with
  `tool_reference` blocks), the MCP server's tool result, and the server's last answer.
- scripted: the model's first two answers (no small model calls tools on a 17K-token prompt):
  turn 1 is a `ToolSearch` call selecting the weather tool, turn 2 a call of the tool it loaded;
  they are sent back as an Anthropic SSE stream by the proxy below instead of being forwarded.
  Turn 3 is forwarded to `freetoken serve` on tests/agent_model.py's scripted model (the demo
  tokenizer and template; it answers "Hello from freetoken." and ends the turn).

Needs the pinned clients installed (tests/test_e2e_clients.py installs them) and runs
`freetoken serve` itself. Writes the main conversation's requests (bodies as sent, the answers
the client got) to OUT.json; background requests (none were sent in this mode) are left out.
"""
from __future__ import annotations

import http.client
import json
import sys
import tempfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
import threading
import subprocess

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path[:0] = [str(REPO / "tests"), str(REPO)]

MCP_TOOLS = [
    {"name": "get_weather", "description": "Get the current weather for a city",
     "inputSchema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"name": "get_time", "description": "Get the local time in a time zone",
     "inputSchema": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}},
    {"name": "convert_currency", "description": "Convert an amount between two currencies",
     "inputSchema": {"type": "object", "properties": {"amount": {"type": "number"}, "from": {"type": "string"},
                                                       "to": {"type": "string"}},
                     "required": ["amount", "from", "to"]}},
]
import server_util  # noqa: E402  (tests/ is on sys.path from here)

MCP_SERVER = server_util.mcp_server_script(MCP_TOOLS)
PROMPT = "What is the weather in Paris? Use the weather tool."


def sse_tool_use(name: str, tool_input: dict, tool_id: str, model: str) -> bytes:
    """An Anthropic stream whose only block is one tool_use (what a model calling the tool sends)."""
    events = [
        {"type": "message_start", "message": {"id": "msg_scripted_" + tool_id, "type": "message", "role": "assistant",
                                              "model": model, "content": [], "stop_reason": None,
                                              "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}},
        {"type": "content_block_start", "index": 0,
         "content_block": {"type": "tool_use", "id": tool_id, "name": name, "input": {}}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "input_json_delta", "partial_json": json.dumps(tool_input)}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
         "usage": {"output_tokens": 20}},
        {"type": "message_stop"},
    ]
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()


def script_for(body: dict) -> bytes | None:
    """The scripted answer for a main-conversation request, or None to forward it."""
    names = [t.get("name") for t in body.get("tools") or []]
    if "ToolSearch" not in names:
        return None  # a background request (title, ...) or no tool search: forward
    results = [b for m in body["messages"] if isinstance(m.get("content"), list) for b in m["content"]
               if isinstance(b, dict) and b.get("type") == "tool_result"]
    model = body.get("model", "demo")
    if not results:
        return sse_tool_use("ToolSearch", {"query": "select:mcp__w__get_weather", "max_results": 5},
                            "toolu_scripted_search", model)
    if len(results) == 1:
        return sse_tool_use("mcp__w__get_weather", {"city": "Paris"}, "toolu_scripted_weather", model)
    return None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    upstream: tuple[str, int]
    log: list[dict]

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        scripted = None
        if self.path.startswith("/v1/messages") and "count_tokens" not in self.path:
            try:
                scripted = script_for(json.loads(body))
            except ValueError:
                scripted = None
        if scripted is not None:
            status, data = 200, scripted
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            conn = http.client.HTTPConnection(*self.upstream, timeout=600)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            status, data = resp.status, resp.read()
            self.send_response(status)
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length", "date", "server"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            conn.close()
        self.log.append({"method": self.command, "path": self.path, "status": status, "scripted": scripted is not None,
                         "request": json.loads(body) if body else None, "response": data.decode("utf-8", "replace")})

    do_GET = do_HEAD = do_POST


def main() -> int:
    from server_util import ServerProcess, wait_ready
    from test_e2e_clients import _install_clients

    out = Path(sys.argv[1])
    bare = "--bare" in sys.argv[2:]
    from agent_model import build_agent_model

    bins = _install_clients()
    model = build_agent_model(Path(tempfile.mkdtemp()) / "agent_model")
    srv = ServerProcess("--model", str(model), "--max-model-len", "65536", "--served-model-name", "demo")
    srv.proc = subprocess.Popen(srv.cmd, cwd=REPO, env=srv.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        run(srv, bins, out, bare)
    finally:
        srv.stop()
    return 0


def run(srv, bins, out, bare):
    from server_util import wait_ready

    with tempfile.TemporaryDirectory() as tmp:
        wait_ready(srv.url, timeout_s=600, alive=lambda: srv.proc.poll() is None)
        tmp = Path(tmp)
        (tmp / "mcp.py").write_text(MCP_SERVER)
        home = tmp / "home"
        home.mkdir()
        log: list[dict] = []
        host, port = srv.url.removeprefix("http://").split(":")
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (Handler,), {"upstream": (host, int(port)),
                                                                            "log": log}))
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        mcp = {"mcpServers": {"w": {"command": sys.executable, "args": [str(tmp / "mcp.py")]}}}
        env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"),
               "PYTHONPATH": str(REPO), "ENABLE_TOOL_SEARCH": "true"}
        args = ["-p", PROMPT, "--output-format", "json", "--mcp-config", json.dumps(mcp), "--strict-mcp-config",
                "--max-turns", "4", "--allowedTools", "mcp__w__get_weather",
                "--debug-file", str(tmp / "claude-debug.log")] + (["--bare"] if bare else [])
        cmd = [sys.executable, "-m", "freetoken_py", "launch", "claude", "--url",
               f"http://127.0.0.1:{httpd.server_address[1]}", "--bin", str(bins / "claude"),
               "--max-output-tokens", "64", "--", *args]
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900,
                              stdin=subprocess.DEVNULL)
        httpd.shutdown()
    print(proc.returncode, proc.stdout[-1500:], proc.stderr[-1500:], file=sys.stderr)
    main = [r for r in log if r["path"].startswith("/v1/messages") and "count_tokens" not in r["path"]
            and "ToolSearch" in [t.get("name") for t in (r["request"] or {}).get("tools") or []]]
    out.write_text(json.dumps({"client": "@anthropic-ai/claude-code@2.1.332", "prompt": PROMPT, "bare": bare,
                               "env": {"ENABLE_TOOL_SEARCH": "true"}, "args": args[:1] + ["PROMPT"] + args[2:],
                               "exit_code": proc.returncode, "result": proc.stdout.strip().splitlines()[-1:],
                               "requests": main}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
