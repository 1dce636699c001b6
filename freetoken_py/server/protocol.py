"""Request limits, the API error type, and small typed readers for JSON request bodies.

Bodies are read as plain JSON and checked field by field (not pydantic models): unknown fields
must be ignored, and every rejection must carry a message naming the field in the API's own error
shape. Anything a client could send ends as a value or an ApiError, never an exception.
"""
from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass

_MISSING = object()


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 32 * 2**20  # Claude Code's first request is ~76 KB; long sessions grow to MBs
    max_messages: int = 10_000
    max_tools: int = 1_024
    max_stop: int = 16
    ping_interval_s: float = 5.0  # keep-alive comment / ping while nothing else is sent
    drain_timeout_s: float = 30.0  # SIGTERM: how long running requests may finish


def is_loopback(host: str) -> bool:
    """'localhost' or any loopback address (127.0.0.0/8, ::1), bracketed or not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ApiError(Exception):
    """An error with an HTTP status; rendered in the route's API format by app.py.

    kind: invalid_request | authentication | not_found | too_large | rate_limit | overloaded | api
    """

    def __init__(self, status: int, message: str, kind: str = "invalid_request", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}


_OPENAI_TYPES = {"invalid_request": "invalid_request_error", "authentication": "authentication_error",
                 "not_found": "not_found_error", "too_large": "invalid_request_error",
                 "rate_limit": "rate_limit_error", "overloaded": "service_unavailable", "api": "server_error",
                 "permission": "permission_error"}
_ANTHROPIC_TYPES = {"invalid_request": "invalid_request_error", "authentication": "authentication_error",
                    "not_found": "not_found_error", "too_large": "request_too_large",
                    "rate_limit": "rate_limit_error", "overloaded": "overloaded_error", "api": "api_error",
                    "permission": "permission_error"}


def openai_error_body(err: ApiError) -> dict:
    return {"error": {"message": err.message, "type": _OPENAI_TYPES.get(err.kind, "invalid_request_error"),
                      "param": err.param, "code": err.code}}


def anthropic_error_body(err: ApiError) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(err.kind, "invalid_request_error"),
                                       "message": err.message}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request", param, code)


def parse_json_object(raw: bytes) -> dict:
    if not raw.strip():
        raise bad("the request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly nested input
        raise bad(f"the request body is not valid JSON ({str(exc)[:100]})") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, not {type(body).__name__}")
    return body


_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
               dict: "an object"}


def get(body: dict, name: str, typ, default=None, *, lo=None, hi=None, param: str | None = None):
    """body[name] checked against `typ` (int accepts no bools; float accepts ints) and bounds.
    A missing field or JSON null gives `default`."""
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    ok = isinstance(value, typ) and not (typ in (int, float) and isinstance(value, bool))
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise bad(f"'{name}' must be {_TYPE_NAMES.get(typ, typ.__name__)}", param or name)
    if typ is float and value != value:  # NaN passes every comparison below
        raise bad(f"'{name}' must be a number", param or name)
    if lo is not None and value < lo:
        raise bad(f"'{name}' must be >= {lo} (got {value})", param or name)
    if hi is not None and value > hi:
        raise bad(f"'{name}' must be <= {hi} (got {value})", param or name)
    return value


def get_stop(body: dict, name: str, limits: ServerLimits) -> tuple[str, ...]:
    """A stop string or a list of them (OpenAI `stop`, Anthropic `stop_sequences`)."""
    value = body.get(name)
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad(f"'{name}' must be a string or an array of strings", name)
    if len(items) > limits.max_stop:
        raise bad(f"'{name}' has {len(items)} entries; at most {limits.max_stop} are allowed", name)
    return tuple(s for s in items if s)


def clamp_max_tokens(requested: int | None, num_prompt_tokens: int, context_limit: int) -> int:
    """Output budget: what was asked for, clamped to the room left in the context (>= 1)."""
    room = max(1, context_limit - num_prompt_tokens)
    return room if requested is None else max(1, min(requested, room))


def sampling_fields(body: dict) -> dict:
    """Sampling fields both APIs share (names as in SamplingParams); None = model default."""
    return dict(
        temperature=get(body, "temperature", float, lo=0.0, hi=2.0),
        top_p=get(body, "top_p", float, lo=0.0, hi=1.0),
        top_k=get(body, "top_k", int, lo=-1, hi=1_000_000),
        min_p=get(body, "min_p", float, lo=0.0, hi=1.0),
        seed=get(body, "seed", int, lo=-(2**63), hi=2**64 - 1),
        repetition_penalty=get(body, "repetition_penalty", float, lo=0.01, hi=10.0),
        ignore_eos=get(body, "ignore_eos", bool),  # vLLM's extension; benches and tests need fixed lengths
    )


def fix_sampling(values: dict) -> dict:
    """Map API conventions onto SamplingParams: top_k -1 = off, top_p 0 -> smallest positive,
    seeds into torch's accepted range."""
    out = dict(values)
    if out.get("top_k") == -1:
        out["top_k"] = 0
    if out.get("top_p") == 0.0:
        out["top_p"] = 1e-9  # top_p 0 means "only the top token" to clients; SamplingParams wants > 0
    if out.get("seed") is not None:
        out["seed"] = out["seed"] % (2**63)
    return out
