"""The FastAPI app: state, auth, body-size cap, error rendering, health/readiness and stats.

Every error leaves in the route's API shape — OpenAI `{"error": {message, type, param, code}}`,
Anthropic `{"type": "error", "error": {type, message}}` for /v1/messages* — including FastAPI's own
validation errors and 404/405s. A client mistake is a 4xx, never a 5xx.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from freetoken_py.errors import ContextLengthError, FreetokenError
from freetoken_py.server.async_engine import (
    AsyncEngine,
    EngineStoppedError,
    QueueFullError,
)
from freetoken_py.server.engine_api import EngineAPI
from freetoken_py.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from freetoken_py.server.metrics import render as render_metrics
from freetoken_py.server.protocol import (
    ApiError,
    ServerLimits,
    anthropic_error_body,
    is_loopback,
    openai_error_body,
)
from freetoken_py.server.toolcalls import UnsupportedToolFormat

log = logging.getLogger("freetoken.server")
OPEN_PATHS = ("/health", "/ready", "/")  # no key needed: liveness checks and Claude Code's HEAD /


def _hostname(value: str) -> str:
    """'127.0.0.1:8000' -> '127.0.0.1'; '[::1]:8000' -> '::1'; 'http://localhost:1' -> 'localhost'."""
    value = value.split("://", 1)[-1].split("/", 1)[0].lower()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


@dataclass
class ServerState:
    limits: ServerLimits
    model_name: str
    api_key: str | None = None
    max_queue: int = 64
    llm: EngineAPI | None = None   # server/engine_api.py: all the server uses of the engine
    engine: AsyncEngine | None = None
    load_error: str | None = None
    on_load_failed: Callable[[], None] | None = None  # `freetoken serve` exits; tests keep the server up
    created: int = field(default_factory=lambda: int(time.time()))


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(path: str, err: ApiError) -> JSONResponse:
    body = anthropic_error_body(err) if is_anthropic(path) else openai_error_body(err)
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def as_api_error(exc: Exception) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, QueueFullError):
        return ApiError(429, str(exc), "rate_limit", code="rate_limit_exceeded", headers={"Retry-After": "1"})
    if isinstance(exc, EngineStoppedError):
        return ApiError(503, str(exc), "overloaded", headers={"Retry-After": "5"})
    if isinstance(exc, ContextLengthError):
        return ApiError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, UnsupportedToolFormat):
        return ApiError(400, str(exc), param="tools")
    if isinstance(exc, FreetokenError):
        return ApiError(400, str(exc))
    if isinstance(exc, RequestValidationError):
        first = (exc.errors() or [{}])[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return ApiError(400, f"{where or 'request'}: {first.get('msg', 'invalid request')}", param=where or None)
    if isinstance(exc, StarletteHTTPException):
        kind = {401: "authentication", 404: "not_found", 413: "too_large"}.get(exc.status_code, "invalid_request")
        return ApiError(exc.status_code, str(exc.detail), kind, headers=dict(exc.headers or {}))
    return ApiError(500, f"internal error: {type(exc).__name__}", "api")


# ---- the guard: auth + body cap, before any route runs ----------------------------------------
class Guard:
    """Pure ASGI middleware: rejects unauthenticated requests (when a key is set) and bodies over
    the cap — by Content-Length at once, or while streaming the body in (chunked uploads)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        err = (self._auth_error(path, headers) or self._origin_error(headers) or self._length_error(headers)
               or self._not_ready(path))
        if err is not None:
            return await error_response(path, err)(scope, receive, send)
        return await self.app(scope, self._capped(receive), send)

    def _auth_error(self, path: str, headers: dict) -> ApiError | None:
        key = self.state.api_key
        if not key or path in OPEN_PATHS:
            return None
        auth = headers.get("authorization", "")
        given = headers.get("x-api-key") or (auth[7:].strip() if auth.lower().startswith("bearer ") else "")
        if given and secrets.compare_digest(given.encode(), key.encode()):
            return None
        return ApiError(401, "missing or wrong API key (send it as 'x-api-key' or 'Authorization: Bearer')",
                        "authentication", code="invalid_api_key")

    def _origin_error(self, headers: dict) -> ApiError | None:
        """Without a key the loopback server trusts whoever can reach it, so keep browsers out: a
        foreign Host is DNS rebinding, a foreign Origin is a web page posting cross-site."""
        if self.state.api_key:
            return None
        host, origin = headers.get("host"), headers.get("origin")
        if host is not None and not is_loopback(_hostname(host)):
            return ApiError(403, f"Host {host!r} is not a loopback name; set --api-key to serve other names",
                            "permission")
        if origin is not None and not is_loopback(_hostname(origin)):
            return ApiError(403, f"cross-origin request from {origin!r} refused; set --api-key to allow it",
                            "permission")
        return None

    def _not_ready(self, path: str) -> ApiError | None:
        if not path.startswith("/v1/") or self.state.engine is not None:
            return None
        msg = self.state.load_error or "the model is still loading; retry shortly (see /ready)"
        return ApiError(503, msg, "overloaded", headers={"Retry-After": "2"})

    def _length_error(self, headers: dict) -> ApiError | None:
        raw = headers.get("content-length")
        if raw is None:
            return None
        raw = raw.strip()
        if not (raw.isascii() and raw.isdigit()):  # "²".isdigit() is True but int() rejects it
            return ApiError(400, "invalid Content-Length header")
        return self._too_large() if int(raw) > self.state.limits.max_body_bytes else None

    def _too_large(self) -> ApiError:
        cap = self.state.limits.max_body_bytes
        return ApiError(413, f"request body is larger than the server's limit of {cap} bytes", "too_large")

    def _capped(self, receive):
        seen = 0

        async def wrapped():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.state.limits.max_body_bytes:
                    raise self._too_large()
            return message

        return wrapped


# ---- the app --------------------------------------------------------------------------------
def create_app(load: Callable[[], object], state: ServerState) -> FastAPI:
    """`load` builds the LLM (in a worker thread, so /health answers while it loads)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.ensure_future(_load(load, state))
        try:
            yield
        finally:
            task.cancel()
            if state.engine is not None:
                await asyncio.to_thread(state.engine.stop)

    app = FastAPI(title="freetoken", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.freetoken = state
    _add_error_handlers(app)
    _add_service_routes(app, state)
    from freetoken_py.server import anthropic_api, openai_api, responses_api, schemas

    app.include_router(openai_api.router)
    app.include_router(responses_api.router)
    app.include_router(anthropic_api.router)
    schemas.install(app)   # /openapi.json: typed request / response bodies (server/schemas.py)
    app.add_middleware(Guard, state=state)
    return app


async def _load(load: Callable[[], EngineAPI], state: ServerState) -> None:
    try:
        llm = await asyncio.to_thread(load)
    except Exception as exc:  # reported by /ready and every request
        if not isinstance(exc, FreetokenError):
            log.exception("model load failed")
        state.load_error = f"model load failed: {exc}"
        if state.on_load_failed is not None:
            state.on_load_failed()
        return
    engine = AsyncEngine(llm, state.max_queue)
    engine.start()
    state.llm, state.engine = llm, engine


def _add_error_handlers(app: FastAPI) -> None:
    async def handle(request: Request, exc: Exception):
        err = as_api_error(exc)
        if isinstance(exc, ContextLengthError) and is_anthropic(request.url.path) and hasattr(exc, "limit"):
            # Anthropic's own wording: Claude Code compacts the conversation when it sees it
            err = ApiError(400, f"prompt is too long: {exc.num_tokens} tokens > {exc.limit} maximum")
        elif isinstance(exc, ContextLengthError) and hasattr(exc, "limit"):
            # OpenAI's own wording and code (clients match "maximum context length" or the code)
            err = ApiError(400, f"This model's maximum context length is {exc.limit} tokens. However, your "
                           f"messages resulted in {exc.num_tokens} tokens. Please reduce the length of the "
                           f"messages. ({exc})", param="messages", code="context_length_exceeded")
        if err.status >= 500 and not isinstance(exc, (ApiError, EngineStoppedError)):
            log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(request.url.path, err)

    for cls in (ApiError, FreetokenError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(cls, handle)


def _add_service_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        engine = state.engine
        if engine is None or not engine.accepting or engine.failed:
            why = state.load_error or (engine.failed if engine else None) or (
                "loading" if engine is None else "shutting down")
            return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)
        return {"status": "ready", "model": state.model_name}

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)  # one operation id per method
    async def root():
        return {"name": "freetoken", "model": state.model_name}

    @app.get("/v1/freetoken/stats")
    async def stats():
        return await state.engine.snapshot()

    @app.get("/metrics")
    async def metrics():
        """The same snapshot in the Prometheus text format (scrape it with the API key as a
        bearer token when one is set)."""
        if state.engine is None:
            why = state.load_error or "the model is still loading; retry shortly (see /ready)"
            return PlainTextResponse(f"# {why}\n", status_code=503, headers={"Retry-After": "2"})
        return PlainTextResponse(render_metrics(await state.engine.snapshot()), media_type=METRICS_CONTENT_TYPE)
