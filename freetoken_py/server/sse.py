"""Server-sent events, disconnect-aware responses, and the engine-output -> parser-event pump
shared by both APIs."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio
from starlette.responses import StreamingResponse

from freetoken_py.core import RequestOutput
from freetoken_py.server.async_engine import AsyncEngine, Stream, StreamError

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}
KEEPALIVE_COMMENT = ": keep-alive\n\n"


def data_line(obj) -> str:
    """OpenAI style: `data: <json>` (compact JSON, no newlines inside)."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def event_line(obj: dict) -> str:
    """Anthropic style: `event: <type>` + `data: <json>`; the SDKs dispatch on the event line."""
    return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass(frozen=True)
class Final:
    """The last item of `engine_events`: the finished output, or the error that ended the stream."""
    output: RequestOutput | None
    error: StreamError | None


@dataclass(frozen=True)
class Logprobs:
    """With `logprobs=True`: an output's new tokens' logprobs (core.TokenLogprob), before the
    parser events of its text; `prompt` on the first output of a request that scored its prompt."""
    tokens: list
    prompt: list | None = None


async def engine_events(engine: AsyncEngine, stream: Stream, parser, ping_s: float,
                        logprobs: bool = False) -> AsyncIterator:
    """Parser events from the request's outputs; None whenever `ping_s` passes with nothing to
    send; ends with a Final. Leaving early (client gone, cancellation) aborts the request."""
    first = True
    try:
        while True:
            item = await stream.next(ping_s)
            if item is None:
                yield None
                continue
            if isinstance(item, StreamError):
                yield Final(None, item)
                return
            if item.finish_reason == "abort":  # the engine aborted it (e.g. KV integrity check)
                yield Final(None, StreamError("internal", str(item.stop_reason or "request aborted by the engine")))
                return
            if logprobs:
                done = len(item.token_ids)
                new = item.logprobs[done - len(item.new_token_ids):done] if item.logprobs is not None else []
                yield Logprobs(new, item.prompt_logprobs if first else None)
                first = False
            for ev in parser.feed(item.new_text):
                yield ev
            if item.finished:
                for ev in parser.finish():
                    yield ev
                yield Final(item, None)
                return
    finally:
        engine.abort(stream)


async def merged(gens: list[AsyncIterator]) -> AsyncIterator:
    """The items of several async generators as they come (n > 1 choices streamed together).
    Leaving early cancels the pumps, which closes each generator (its `finally` aborts)."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield item
        return
    q: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(gen) -> None:
        try:
            async for item in gen:
                await q.put(item)
        finally:
            q.put_nowait(end)

    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    try:
        left = len(gens)
        while left:
            item = await q.get()
            if item is end:
                left -= 1
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


class SSEResponse(StreamingResponse):
    """A StreamingResponse that also watches for the client going away (whatever the ASGI spec
    version) and then cancels the body iterator at once, so its `finally` aborts the request
    within a step instead of whenever the next write fails."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def run_stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the socket went away mid-write
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(run_stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self.on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


async def until_disconnect(receive, work: asyncio.Future, on_disconnect: Callable[[], None]):
    """Await `work` (a non-streaming generation) unless the client disconnects first; then call
    `on_disconnect` (abort) and return None (nobody is left to answer)."""
    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        on_disconnect()
        work.cancel()
        return None
    finally:
        watcher.cancel()
        if not work.done():
            on_disconnect()
            work.cancel()
