"""Start a real `freetoken serve` on 127.0.0.1 for tests (stable helper; other test files use it).

Two ways, same server code:

- `ServerThread(**engine_and_server_options)`: uvicorn in a background thread of the test process
  (fast, no second model load per process; signals are not available).
      with ServerThread(max_queue=8) as srv:
          httpx.get(srv.url + "/ready")

- `ServerProcess(*cli_args)`: `python -m freetoken_py serve --port N ...` in a subprocess (what a
  user runs; needed for SIGTERM and CLI tests). `.stop()` sends SIGTERM and returns the exit code.
      with ServerProcess("--max-queue", "4") as srv:
          ...

Both wait until `/ready` answers 200, expose `.url` ("http://127.0.0.1:PORT"), `.base_url`
(`url + "/v1"`, for the OpenAI SDK; the Anthropic SDK takes `.url`), and `.stats()` (the
/v1/freetoken/stats JSON). The default model is the bundled demo model in float32.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from freetoken_py.cli import DEMO_MODEL

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout_s: float = 120.0, alive=lambda: True, headers: dict | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("the server exited before it was ready")
        try:
            if httpx.get(url + "/ready", timeout=2, headers=headers).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout_s}s")


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class _Base:
    url: str
    api_key: str | None = None

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stats(self) -> dict:
        headers = {"x-api-key": self.api_key} if self.api_key else None
        return httpx.get(self.url + "/v1/freetoken/stats", timeout=10, headers=headers).json()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class ServerThread(_Base):
    """uvicorn in a daemon thread. Keyword options: model_dir, api_key, max_queue, limits
    (a ServerLimits), model_name, wait_ready (False: return once /health answers), and any
    EngineConfig field (dtype, max_model_len, max_num_seqs, enable_prefix_cache, ...)."""

    def __init__(self, model_dir=DEMO_MODEL, api_key=None, max_queue=64, limits=None, model_name=None,
                 wait_ready=True, **engine):
        from freetoken_py.server.protocol import ServerLimits
        from freetoken_py.server.serve import ServeOptions

        engine.setdefault("dtype", "float32")
        self.api_key = api_key
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.opts = ServeOptions(model_dir=Path(model_dir), port=self.port, api_key=api_key, max_queue=max_queue,
                                 model_name=model_name, limits=limits or ServerLimits(), engine=engine)
        self.server = None
        self.state = None
        self.wait_ready = wait_ready

    def start(self) -> ServerThread:
        import uvicorn

        from freetoken_py.server.serve import build_app

        app, self.state = build_app(self.opts)
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, daemon=True)
        self._thread.start()
        headers = {"x-api-key": self.api_key} if self.api_key else None
        if self.wait_ready:
            wait_ready(self.url, alive=self._thread.is_alive, headers=headers)
        else:  # only until it listens (/health), e.g. to watch /ready while the model loads or fails
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not _answers(self.url + "/health"):
                time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self._thread.join(timeout=30)


class ServerProcess(_Base):
    """`python -m freetoken_py serve` in a subprocess; extra CLI args are passed through."""

    def __init__(self, *args: str, api_key: str | None = None, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        key_args = ("--api-key", api_key) if api_key else ()
        self.cmd = [sys.executable, "-m", "freetoken_py", "serve", "--port", str(self.port), "--dtype", "float32",
                    *key_args, *args]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        headers = {"x-api-key": self.api_key} if self.api_key else None
        try:
            wait_ready(self.url, alive=lambda: self.proc.poll() is None, headers=headers)
        except Exception:
            self.stop()
            raise RuntimeError(f"server failed to start: {self.proc.stderr.read()[-2000:]}") from None
        return self

    def stop(self, timeout_s: float = 60) -> int | None:
        """SIGTERM (graceful drain), then SIGKILL after `timeout_s`; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


# -- fixtures shared by the server, template and client tests ----------------------------------

TEMPLATES = REPO / "tests" / "data" / "templates"


def demo_with_template(out: Path, template: Path) -> Path:
    """The demo model (weights linked, not copied) in `out` with `template` as its chat template."""
    import json
    import shutil

    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        (out / f).symlink_to(DEMO_MODEL / f)
    cfg = json.loads((DEMO_MODEL / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    shutil.copy(template, out / "chat_template.jinja")
    return out


def family_tokenizers(tmp_path_factory) -> dict:
    """Template file name -> the project's Tokenizer over the demo vocabulary with that family's
    chat template (every tests/data/templates/*.jinja)."""
    import json
    import shutil

    from freetoken_py.tokenizer import Tokenizer

    out = {}
    for path in sorted(TEMPLATES.glob("*.jinja")):
        d = tmp_path_factory.mktemp(path.stem)
        shutil.copy(DEMO_MODEL / "tokenizer.json", d / "tokenizer.json")
        (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
        shutil.copy(path, d / "chat_template.jinja")
        out[path.name] = Tokenizer(d)
    return out


_MCP_SERVER = '''
import json, sys
TOOLS = %s
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    result = {"initialize": {"protocolVersion": msg.get("params", {}).get("protocolVersion", "2025-06-18"),
                             "capabilities": {"tools": {}}, "serverInfo": {"name": "w", "version": "1"}},
              "tools/list": {"tools": TOOLS},
              "tools/call": {"content": [{"type": "text", "text": %s}]}}.get(msg["method"])
    reply = {"result": result} if result is not None else {"error": {"code": -32601, "message": "unknown"}}
    print(json.dumps({"jsonrpc": "2.0", "id": msg["id"], **reply}), flush=True)
'''


def mcp_server_script(tools: list, answer: str = "Sunny, 21 C") -> str:
    """The source of a stdio MCP server offering `tools` whose every call answers `answer`."""
    import json

    return _MCP_SERVER % (repr(json.loads(json.dumps(tools))), json.dumps(answer))
