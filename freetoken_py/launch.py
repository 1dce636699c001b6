"""`freetoken launch claude|opencode|codex`: start a coding agent pointed at a running `freetoken serve`.

The server is asked for its model id and context length (`GET /v1/models`), and the agent gets the
settings it needs to use them well (docs/clients.md explains each one):

- Claude Code: ANTHROPIC_BASE_URL + a token, the model id for every model slot (it sends background
  requests under other names), the context and output limits (unknown models are assumed to have
  1M tokens of context, so it would never compact), no attribution header (its hash changes every
  prompt and defeats the prefix cache), no telemetry / non-essential traffic, and
  `--permission-mode default` (its "auto" mode relies on Anthropic's servers to flag commands).
- OpenCode: a provider config (`@ai-sdk/openai-compatible`) listing the model with
  `limit.context` / `limit.output` (unlisted models fail without a request; without a context limit
  it never compacts), passed inline in OPENCODE_CONFIG_CONTENT: it is merged over the user's and
  the project's opencode.json with the highest precedence (OPENCODE_CONFIG would lose to any
  opencode.json in the working directory or its parents).
- Codex CLI: a model provider speaking the Responses API (`wire_api="responses"`) at the server's
  /v1, given as `-c` overrides (they win over ~/.codex/config.toml), the model id, its context
  window, and auto-compaction where the server's output still fits (Codex sends no
  max_output_tokens, so an answer may run to the end of the context). The key goes in its own
  variable (FREETOKEN_API_KEY), so a user's OPENAI_API_KEY is neither sent nor overwritten.

Standard library only: this runs before anything heavy is needed.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from freetoken_py.errors import FreetokenError

AGENTS = {"claude": ("claude", "npm install -g @anthropic-ai/claude-code"),
          "opencode": ("opencode", "npm install -g opencode-ai"),
          "codex": ("codex", "npm install -g @openai/codex")}
DEFAULT_URL = "http://127.0.0.1:8000"
LOCAL_KEY = "freetoken-local"  # clients refuse to start without a key; a keyless server ignores it
CODEX_KEY_ENV = "FREETOKEN_API_KEY"  # the variable Codex's provider reads the key from


@dataclass(frozen=True)
class ServerInfo:
    url: str  # without a trailing slash or /v1
    model_id: str
    context_len: int


@dataclass(frozen=True)
class LaunchPlan:
    argv: list[str]
    env: dict[str, str]  # set on top of the caller's environment
    unset: tuple[str, ...] = ()  # removed from it (settings that would conflict)


def fetch_server_info(url: str, api_key: str | None = None, timeout_s: float = 5.0) -> ServerInfo:
    """Ask the server which model it serves and its context length; one-line errors."""
    url = url.rstrip("/").removesuffix("/v1")
    req = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        hint = " (pass --api-key)" if exc.code == 401 else ""
        raise FreetokenError(f"the server at {url} answered HTTP {exc.code} to /v1/models{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise FreetokenError(f"cannot reach a freetoken server at {url} ({reason}); start one with "
                             "`freetoken serve` or pass --url") from None
    except ValueError:
        raise FreetokenError(f"{url}/v1/models did not return JSON; is this a freetoken server?") from None
    models = body.get("data") if isinstance(body, dict) else None
    if not isinstance(models, list) or not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise FreetokenError(f"{url}/v1/models lists no model")
    first = models[0]
    context = first.get("context_length") or first.get("max_model_len")
    if not isinstance(context, int) or context <= 0:
        raise FreetokenError(f"{url}/v1/models does not report the context length; is this a freetoken server?")
    return ServerInfo(url, str(first["id"]), context)


def output_limit(context_len: int, requested: int | None) -> int:
    """Max output tokens to configure: Claude Code refuses every prompt ("Prompt is too long") when
    the output reservation eats most of the window (4096 context with 2048 output fails, with 512
    works), so default to an eighth of the context."""
    if requested is not None:
        if not 0 < requested < context_len:
            raise FreetokenError(f"--max-output-tokens {requested}: must be between 1 and the context "
                                 f"length ({context_len})")
        return requested
    return max(1, min(32_000, context_len // 8))


def find_agent(agent: str, explicit: str | None = None) -> str:
    if agent not in AGENTS:
        raise FreetokenError(f"unknown agent {agent!r}; choose one of: {', '.join(AGENTS)}")
    name, install = AGENTS[agent]
    path = explicit or shutil.which(name)
    if not path or not Path(path).exists():
        where = f"{explicit} does not exist" if explicit else f"`{name}` is not on PATH"
        raise FreetokenError(f"{agent} is not installed ({where}); install it with `{install}`")
    return path


def claude_plan(exe: str, info: ServerInfo, api_key: str | None, max_output: int, extra: list[str]) -> LaunchPlan:
    env = {
        "ANTHROPIC_BASE_URL": info.url,  # no /v1: Claude Code appends /v1/messages itself
        "ANTHROPIC_AUTH_TOKEN": api_key or LOCAL_KEY,  # Bearer; an API key would need interactive approval
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(info.context_len),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output),
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
    }
    for slot in ("ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL",
                 "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL"):
        env[slot] = info.model_id
    chosen = any(a.startswith("--permission-mode") or a == "--dangerously-skip-permissions" for a in extra)
    argv = [exe] + ([] if chosen else ["--permission-mode", "default"]) + list(extra)
    return LaunchPlan(argv, env, unset=("ANTHROPIC_API_KEY",))


def opencode_config(info: ServerInfo, api_key: str | None, max_output: int) -> dict:
    model = {"name": info.model_id, "limit": {"context": info.context_len, "output": max_output}}
    ref = "freetoken/" + info.model_id
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"freetoken": {"npm": "@ai-sdk/openai-compatible", "name": "freetoken (local)",
                                   "options": {"baseURL": info.url + "/v1", "apiKey": api_key or LOCAL_KEY},
                                   "models": {info.model_id: model}}},
        "model": ref, "small_model": ref,  # titles go to the same local model
        "autoupdate": False, "share": "disabled",
    }


def opencode_plan(exe: str, info: ServerInfo, api_key: str | None, max_output: int, extra: list[str]) -> LaunchPlan:
    content = json.dumps(opencode_config(info, api_key, max_output))
    return LaunchPlan([exe] + list(extra), {"OPENCODE_CONFIG_CONTENT": content})


def codex_overrides(info: ServerInfo, max_output: int) -> list[str]:
    """Codex `-c key=value` settings (values are TOML; JSON strings are valid TOML strings)."""
    provider = (f'{{name="freetoken (local)",base_url={json.dumps(info.url + "/v1")},wire_api="responses",'
                f'env_key="{CODEX_KEY_ENV}"}}')
    settings = {"model_provider": '"freetoken"', "model_providers.freetoken": provider,
                "model": json.dumps(info.model_id), "model_context_window": str(info.context_len),
                "model_auto_compact_token_limit": str(max(1, info.context_len - max_output))}
    return [arg for k, v in settings.items() for arg in ("-c", f"{k}={v}")]


def codex_plan(exe: str, info: ServerInfo, api_key: str | None, max_output: int, extra: list[str]) -> LaunchPlan:
    # root-level -c overrides apply to every subcommand (`codex -c ... exec "..."`)
    return LaunchPlan([exe, *codex_overrides(info, max_output), *extra], {CODEX_KEY_ENV: api_key or LOCAL_KEY})


def run_plan(plan: LaunchPlan) -> int:
    """Start the agent in the foreground with the plan's environment; return its exit code."""
    env = {k: v for k, v in os.environ.items() if k not in plan.unset}
    env.update(plan.env)
    proc = subprocess.Popen(plan.argv, env=env)
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # the agent shares our terminal and handles Ctrl-C itself
            continue


def launch_main(agent: str, url: str = DEFAULT_URL, api_key: str | None = None, extra: list[str] | None = None,
                max_output_tokens: int | None = None, agent_bin: str | None = None, print_only: bool = False) -> int:
    try:
        exe = find_agent(agent, agent_bin)
    except FreetokenError:
        if not print_only or agent not in AGENTS:
            raise
        exe = agent_bin or AGENTS[agent][0]  # printing the settings needs no installed agent
    info = fetch_server_info(url, api_key)
    max_output = output_limit(info.context_len, max_output_tokens)
    make = {"claude": claude_plan, "opencode": opencode_plan, "codex": codex_plan}[agent]
    plan = make(exe, info, api_key, max_output, extra or [])
    if print_only:
        print(json.dumps({"argv": plan.argv, "env": plan.env, "unset": list(plan.unset)}, indent=2))
        return 0
    return run_plan(plan)
