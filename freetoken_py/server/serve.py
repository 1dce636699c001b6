"""`freetoken serve`: build the app around a lazily loaded LLM and run uvicorn with a draining
shutdown (SIGTERM/SIGINT: refuse new work with 503, let running requests finish for
`drain_timeout_s`, abort the rest with a terminal error event, then exit 0; a second signal
exits at once)."""
from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from freetoken_py.errors import FreetokenError
from freetoken_py.server.protocol import ServerLimits, is_loopback

log = logging.getLogger("freetoken.server")


@dataclass(frozen=True)
class ServeOptions:
    model_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 64
    model_name: str | None = None  # what /v1/models reports (default: the model folder's name)
    threads: int = 0
    limits: ServerLimits = field(default_factory=ServerLimits)
    engine: dict = field(default_factory=dict)  # EngineConfig overrides (dtype, max_model_len, ...)


def check_options(opts: ServeOptions) -> None:
    if not is_loopback(opts.host) and not opts.api_key:
        raise FreetokenError(f"--host {opts.host} exposes the server beyond this machine; "
                             "set --api-key too (clients send it as x-api-key or Authorization: Bearer)")
    if not 0 <= opts.port <= 65535:
        raise FreetokenError(f"--port must be in [0, 65535] (got {opts.port})")
    if opts.max_queue < 1:
        raise FreetokenError("--max-queue must be >= 1")
    from freetoken_py.config import EngineConfig

    EngineConfig(model=str(opts.model_dir), **opts.engine)  # bad engine options fail before listening


def build_app(opts: ServeOptions):
    """The app with its model loader (the model loads once the server runs)."""
    from freetoken_py.server.app import ServerState, create_app

    def load():
        from freetoken_py.llm import GPU_HINT, LLM

        llm = LLM(opts.model_dir, show_progress=False, **opts.engine)
        if llm.unused_gpu:
            print(GPU_HINT, file=sys.stderr, flush=True)
        return llm

    state = ServerState(limits=opts.limits, model_name=opts.model_name or opts.model_dir.name,
                        api_key=opts.api_key, max_queue=opts.max_queue)
    return create_app(load, state), state


def _server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's Server with a drain step before its own shutdown."""

        def __init__(self, config, state):
            super().__init__(config)
            self.state = state
            self._draining = False
            self._loop = None

        async def serve(self, sockets=None):
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig, frame) -> None:
            if self._draining or self._loop is None:
                self.should_exit = True
                self.force_exit = self._draining
                return
            self._draining = True
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit()))

        async def _drain_then_exit(self) -> None:
            engine = self.state.engine
            if engine is not None:
                aborted = await engine.drain(self.state.limits.drain_timeout_s)
                if aborted:
                    log.warning("shutdown: aborted %d unfinished request(s)", aborted)
                await asyncio.sleep(0.2)  # let the handlers write their terminal events
            self.should_exit = True

    return DrainingServer


def serve_main(opts: ServeOptions) -> None:
    import uvicorn

    from freetoken_py.kernels import configure_threads

    check_options(opts)
    configure_threads(opts.threads or None)
    app, state = build_app(opts)
    config = uvicorn.Config(app, host=opts.host, port=opts.port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5, lifespan="on")
    server = _server_class()(config, state)
    state.on_load_failed = lambda: setattr(server, "should_exit", True)
    print(f"freetoken: serving {state.model_name} on http://{opts.host}:{opts.port} "
          f"(OpenAI: /v1/chat/completions, Anthropic: /v1/messages)", file=sys.stderr, flush=True)
    try:
        server.run()
    except SystemExit:  # uvicorn exits this way when it cannot bind
        if not server.started:
            raise FreetokenError(f"could not listen on {opts.host}:{opts.port} (address in use or not "
                                 "available)") from None
        raise
    if state.load_error:
        raise FreetokenError(state.load_error)
