"""One engine thread owns the (not thread-safe) LLM; asyncio handlers talk to it through queues.

    handler (event loop) --submit/abort--> inbox (queue.Queue) --> engine thread: add/abort, step()
    handler <-- stream.queue (asyncio.Queue) <-- loop.call_soon_threadsafe(put) <-- outputs

Admission is counted on the event loop (single-threaded, so exact): at most `max_queue` requests
are inside the engine at once (running + waiting); the next one is refused before it costs
anything. A request leaves the count when its last output (or error) is delivered.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from freetoken_py.core import RequestOutput, SamplingParams
from freetoken_py.errors import ContextLengthError, FreetokenError
from freetoken_py.server.engine_api import EngineAPI
from freetoken_py.server.metrics import LATENCY_BUCKETS, TTFT_BUCKETS, Histogram

log = logging.getLogger("freetoken.server")
IDLE_AFTER_S = 2.0   # seconds without a request before the engine's idle work (LLM.idle)


class QueueFullError(FreetokenError):
    """Every admission slot is taken; the client should retry later."""


class EngineStoppedError(FreetokenError):
    """The server is shutting down (or the engine died) and takes no new requests."""


@dataclass(frozen=True)
class StreamError:
    """A terminal error delivered in place of an output (shutdown abort, engine failure)."""
    kind: str  # "overloaded" (shutdown) | "internal"
    message: str


@dataclass(eq=False)
class Stream:
    """One request as the handler sees it: outputs arrive on `queue`, ending with a finished
    RequestOutput or a StreamError."""
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    req: object | None = None  # core.Request, set by the engine thread
    done: bool = False  # set on the loop when the terminal item is delivered
    num_output_tokens: int = 0
    started: bool = False  # engine thread: its first output was counted (prompt tokens)
    after: Stream | None = None  # n > 1: the sibling whose prompt pages this one reuses (LLM.add_request)

    async def next(self, timeout: float | None):
        """The next output, a StreamError, or None when `timeout` passes first (send a ping)."""
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return None


@dataclass
class EngineStats:
    num_steps: int = 0
    num_requests: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_rejected_queue_full: int = 0
    max_abort_lag_steps: int = 0  # steps between a handler's abort() and the engine applying it
    # engine thread: tokens, and the request timings of /metrics' histograms (under `lock`)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    request: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe(self, out: RequestOutput, first: bool) -> None:
        """Count an output of the engine's step (`first`: the request's first)."""
        self.generation_tokens += len(out.new_token_ids)
        if first:
            self.prompt_tokens += len(out.prompt_token_ids)
            self.cached_prompt_tokens += out.num_cached_tokens
            if out.ttft_s is not None:      # now, not at the end: a request aborted later counts too
                with self.lock:
                    self.ttft.observe(out.ttft_s)
        if out.finished and out.total_s is not None:
            with self.lock:
                self.request.observe(out.total_s)

    def histograms(self) -> dict:
        with self.lock:
            return {"ttft_seconds": self.ttft.as_dict(), "request_seconds": self.request.as_dict()}


class AsyncEngine:
    def __init__(self, llm: EngineAPI, max_queue: int = 64):
        if max_queue < 1:
            raise FreetokenError("--max-queue must be >= 1")
        self.llm = llm
        self.max_queue = max_queue
        self.stats = EngineStats()
        self.idle_after_s = IDLE_AFTER_S
        self._active_at = time.monotonic()   # engine thread: the last request, abort or step
        self.num_active = 0  # admitted and not yet finished (loop thread only)
        self.accepting = True
        self._streams: set[Stream] = set()  # loop thread only
        self._inbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._live: dict[int, Stream] = {}  # request_id -> stream (engine thread only)
        self.failed: str | None = None

    # ---- lifecycle (loop thread) ------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="freetoken-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.accepting = False
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout=30)

    async def drain(self, timeout_s: float) -> int:
        """Stop admitting; wait up to `timeout_s` for running requests; abort the rest with a
        terminal error. Returns how many were aborted."""
        self.accepting = False
        deadline = time.monotonic() + timeout_s
        while self.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = [s for s in self._streams if not s.done]
        for s in left:
            self.abort(s)
            self._deliver(s, StreamError("overloaded", "the server is shutting down; request aborted"))
        return len(left)

    # ---- requests (loop thread) -------------------------------------------------------------
    def check_prompt(self, num_prompt_tokens: int) -> None:
        """The context check LLM.add_request makes, done on the loop so the client gets a 400
        before any response header (and before any page is allocated)."""
        limit = self.context_limit
        if num_prompt_tokens == 0:
            raise FreetokenError("the prompt is empty")
        if num_prompt_tokens >= limit:
            err = ContextLengthError(
                f"prompt has {num_prompt_tokens} tokens but the context limit is {limit} "
                f"(model {self.llm.max_model_len}, KV cache {self.llm.kv_capacity_tokens}); shorten the prompt")
            err.num_tokens, err.limit = num_prompt_tokens, limit  # for each API's own "too long" shape
            raise err

    @property
    def context_limit(self) -> int:
        return min(self.llm.max_model_len, self.llm.kv_capacity_tokens)

    def submit(self, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None = None,
               after: Stream | None = None) -> Stream:
        self._admit(1)
        self.check_prompt(len(prompt_ids))
        stream = Stream(prompt_ids, params, cache_salt, after=after)
        self.num_active += 1
        self.stats.num_requests += 1
        self._streams.add(stream)
        self._inbox.put(("add", stream))
        return stream

    def submit_n(self, prompt_ids: list[int], params: list[SamplingParams], cache_salt: str | None = None
                 ) -> list[Stream]:
        """n completions of one prompt (all admitted or none): the first computes the prompt, the
        others wait for it and read its pages from the prefix cache."""
        self._admit(len(params))
        first = self.submit(prompt_ids, params[0], cache_salt)
        return [first] + [self.submit(prompt_ids, p, cache_salt, after=first) for p in params[1:]]

    def _admit(self, n: int) -> None:
        if not self.accepting or self.failed:
            raise EngineStoppedError(self.failed or "the server is shutting down")
        if self.num_active + n > self.max_queue:
            self.stats.num_rejected_queue_full += 1
            raise QueueFullError(f"all {self.max_queue} request slots are busy; retry shortly"
                                 if n == 1 else f"{n} completions need {n} of the {self.max_queue} request "
                                 f"slots and {self.max_queue - self.num_active} are free; retry shortly")

    def abort(self, stream: Stream) -> None:
        """Cancel a request (client gone). Safe to call twice or after it finished."""
        if stream.done:
            return
        self._inbox.put(("abort", (stream, self.stats.num_steps)))

    def _deliver(self, stream: Stream, item) -> None:
        """Loop thread: hand an output to the handler; release the slot on the terminal item."""
        if stream.done:
            return
        if isinstance(item, RequestOutput):
            stream.num_output_tokens = len(item.token_ids)
        terminal = isinstance(item, StreamError) or item.finished
        if terminal:
            stream.done = True
            self.num_active -= 1
            self._streams.discard(stream)
        stream.queue.put_nowait(item)

    async def snapshot(self) -> dict:
        """Engine counters for /v1/freetoken/stats, read by the engine thread between steps (so
        the page counts are consistent with each other)."""
        pages = {}
        if self._thread is not None and self._thread.is_alive():
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._inbox.put(("stats", fut))
            try:
                pages = await asyncio.wait_for(asyncio.wrap_future(fut), 60)
            except asyncio.TimeoutError:  # a very long step: answer with the loop-side counters only
                pages = {"stale": True}
        s = self.stats
        return {**pages, "active": self.num_active, "max_queue": self.max_queue, "accepting": self.accepting,
                "num_steps": s.num_steps, "num_requests": s.num_requests, "num_finished": s.num_finished,
                "num_aborted": s.num_aborted, "num_rejected_queue_full": s.num_rejected_queue_full,
                "max_abort_lag_steps": s.max_abort_lag_steps, "failed": self.failed,
                "prompt_tokens": s.prompt_tokens, "cached_prompt_tokens": s.cached_prompt_tokens,
                "generation_tokens": s.generation_tokens, **s.histograms()}

    def _page_stats(self) -> dict:
        """LLM.stats() (pages, queues, residency telemetry) plus the requests this thread runs."""
        return {**self.llm.stats(), "live_requests": len(self._live)}

    # ---- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                block = not self.llm.has_unfinished
                if not self._apply_commands(block):
                    return
                if self.llm.has_unfinished:
                    self._step()
        except Exception as exc:  # a bug: fail every request loudly rather than hang them
            log.exception("engine thread died")
            self.failed = f"the engine failed: {type(exc).__name__}: {exc}"
            self._loop.call_soon_threadsafe(self._fail_all, self.failed)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued add/abort commands; False when told to stop. Blocking with nothing to
        run, `idle_after_s` after the last request, abort or step (a stats or metrics poll does
        not count) the engine does its idle work (`LLM.idle`: a KV cache grown into expert-slot
        memory gives it back)."""
        while True:
            try:
                idle_wait = None
                if block and self.llm.idle_work:
                    idle_wait = max(0.0, self._active_at + self.idle_after_s - time.monotonic())
                cmd, arg = self._inbox.get(block=block, timeout=idle_wait)
            except queue.Empty:
                if block:
                    self.llm.idle()
                    continue
                return True
            if cmd in ("add", "abort"):
                self._active_at = time.monotonic()
            block = False
            if cmd == "stop":
                return False
            if cmd == "add":
                self._add(arg)
            elif cmd == "abort":
                self._abort(*arg)
            elif cmd == "stats":
                arg.set_result(self._page_stats())

    def _add(self, stream: Stream) -> None:
        try:
            after = stream.after.req if stream.after is not None else None
            stream.req = self.llm.add_request(stream.prompt_ids, stream.params, cache_salt=stream.cache_salt,
                                              after=after)
            self._live[stream.req.request_id] = stream
        except FreetokenError as exc:  # checked on the loop already; a late failure is terminal
            self._post(stream, StreamError("invalid", str(exc)))

    def _abort(self, stream: Stream, step_at_request: int) -> None:
        req = stream.req
        if req is None or req.finished:
            return
        self.llm.abort(req)
        self._live.pop(req.request_id, None)
        lag = self.stats.num_steps - step_at_request
        self.stats.num_aborted += 1
        self.stats.max_abort_lag_steps = max(self.stats.max_abort_lag_steps, lag)
        self._post(stream, StreamError("aborted", "request aborted"))

    def _step(self) -> None:
        self._active_at = time.monotonic()
        try:
            outputs = self.llm.step()
        except FreetokenError as exc:  # e.g. the KV cache cannot hold even one request
            self._fail_live(str(exc))
            return
        self.stats.num_steps += 1
        for out in outputs:
            stream = self._live.get(out.request_id)
            if stream is None:
                continue
            self.stats.observe(out, first=not stream.started)
            stream.started = True
            if out.finished:
                self.stats.num_finished += 1
                del self._live[out.request_id]
            self._post(stream, out)

    def _post(self, stream: Stream, item) -> None:
        self._loop.call_soon_threadsafe(self._deliver, stream, item)

    def _fail_live(self, message: str) -> None:
        for stream in list(self._live.values()):
            self.llm.abort(stream.req)
            self._post(stream, StreamError("internal", message))
        self._live.clear()

    def _fail_all(self, message: str) -> None:
        for stream in list(self._streams):
            self._deliver(stream, StreamError("internal", message))
