"""`freetoken serve` under real use: client disconnects, a full queue, keep-alive while waiting,
auth, body caps, loading/failed readiness and SIGTERM drain — real servers on 127.0.0.1, real
HTTP. Checked against invariants: every page back (free + prefix-cached == all pages) once idle,
exact 429 counts, engine abort lag in steps, event shapes."""
from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_util import ServerProcess, ServerThread

from freetoken_py.server.protocol import ServerLimits

ASK = [{"role": "user", "content": "What is a list?"}]


def long_chat(n: int, stream: bool = True) -> dict:
    return {"model": "m", "messages": ASK, "max_tokens": n, "ignore_eos": True, "temperature": 0, "stream": stream}


@pytest.fixture(scope="module")
def srv():
    with ServerThread(max_queue=4, max_num_seqs=2, limits=ServerLimits(ping_interval_s=0.05)) as s:
        yield s


def wait_idle(srv, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = srv.stats()
        if st["active"] == 0 and st["running"] == 0 and st["waiting"] == 0 and st["live_requests"] == 0:
            return st
        time.sleep(0.05)
    raise TimeoutError(f"server never went idle: {srv.stats()}")


def test_cut_streams_abort_within_two_steps_and_return_every_page(srv):
    before = wait_idle(srv)
    assert before["free_pages"] + before["cached_pages"] == before["num_pages"]
    rng = random.Random(0)
    cuts = [rng.randint(0, 6) for _ in range(100)]  # 0: right after the headers (queued or prefilling)

    async def one(client, sem, cut: int, anthropic: bool):
        url = "/v1/messages" if anthropic else "/v1/chat/completions"
        async with sem:
            while True:
                async with client.stream("POST", url, json=long_chat(400)) as r:
                    if r.status_code == 429:  # a just-cut request keeps its slot until the engine drops it
                        await asyncio.sleep(0.02)
                        continue
                    assert r.status_code == 200
                    seen = 0
                    async for _ in r.aiter_lines():
                        seen += 1
                        if seen >= cut:
                            break  # leaving the block closes the connection mid-stream
                    return

    async def main():
        sem = asyncio.Semaphore(4)
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
            await asyncio.gather(*(one(client, sem, c, i % 2 == 1) for i, c in enumerate(cuts)))

    asyncio.run(main())
    after = wait_idle(srv)
    assert after["num_aborted"] - before["num_aborted"] == 100  # 400 tokens never finish before the cut
    assert after["max_abort_lag_steps"] <= 2
    assert after["free_pages"] + after["cached_pages"] == after["num_pages"]
    time.sleep(0.2)
    assert srv.stats()["num_steps"] == after["num_steps"]  # nothing keeps generating


def test_non_streamed_request_is_aborted_when_the_client_leaves(srv):
    before = wait_idle(srv)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.base_url + "/chat/completions", json=long_chat(3000, stream=False), timeout=1.0)
    after = wait_idle(srv)
    assert after["num_aborted"] == before["num_aborted"] + 1
    assert after["free_pages"] + after["cached_pages"] == after["num_pages"]


class EngineGate:
    """Parks the server's engine thread between steps until `open()`: a stats command whose
    future's done-callback (run by set_result, on the engine thread) waits on an Event. No
    request can finish meanwhile, so admission counts follow from --max-queue alone, not from
    how fast the engine decodes. Nothing of the server is replaced."""

    def __init__(self, srv):
        import concurrent.futures

        self.parked, self._open = threading.Event(), threading.Event()
        fut = concurrent.futures.Future()
        fut.add_done_callback(lambda _: (self.parked.set(), self._open.wait(120)))
        srv.state.engine._inbox.put(("stats", fut))
        assert self.parked.wait(60), "the engine thread never took the gate"

    def open(self) -> None:
        self._open.set()


def test_burst_beyond_capacity_gets_exactly_the_expected_429s(srv):
    wait_idle(srv)
    engine = srv.state.engine
    rejected_before = engine.stats.num_rejected_queue_full
    gate = EngineGate(srv)  # the engine runs no step until every one of the 10 has its answer

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:
            tasks = [asyncio.create_task(client.post("/v1/chat/completions", json=long_chat(60, stream=False)))
                     for _ in range(10)]
            try:
                deadline = time.monotonic() + 60
                while engine.num_active + engine.stats.num_rejected_queue_full - rejected_before < 10:
                    assert time.monotonic() < deadline, "the 10 requests never all reached admission"
                    await asyncio.sleep(0.01)
                admitted_while_parked = engine.num_active
            finally:
                gate.open()
            return admitted_while_parked, await asyncio.gather(*tasks)

    admitted_while_parked, responses = asyncio.run(main())
    rejected = [r for r in responses if r.status_code == 429]
    admitted = [r for r in responses if r.status_code == 200]
    assert admitted_while_parked == 4  # max_queue=4 counts running + waiting (max_num_seqs=2)
    assert len(rejected) == 6 and len(admitted) == 4
    assert engine.stats.num_rejected_queue_full - rejected_before == 6
    for r in rejected:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error" and "busy" in r.json()["error"]["message"]
    for r in admitted:
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 60


def _hogs(srv, n: int, num_tokens: int = 400) -> list[threading.Thread]:
    """n requests that keep the engine's slots busy; 400 tokens: ~1 s of decode on the demo model
    (25 tokens once sufficed, but the fused decode step finishes them before a ping interval)."""
    hogs = [threading.Thread(target=httpx.post, args=(srv.base_url + "/chat/completions",),
                             kwargs=dict(json=long_chat(num_tokens, stream=False), timeout=300)) for _ in range(n)]
    for t in hogs:
        t.start()
    return hogs


def _wait_for(srv, key: str, value: int) -> None:
    deadline = time.monotonic() + 60
    while srv.stats()[key] < value:
        assert time.monotonic() < deadline, srv.stats()
        time.sleep(0.01)


def test_full_queue_refuses_anthropic_in_anthropic_shape(srv):
    wait_idle(srv)
    hogs = _hogs(srv, 4)
    _wait_for(srv, "active", 4)
    r = httpx.post(srv.url + "/v1/messages", json={"model": "m", "max_tokens": 4, "messages": ASK})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json() == {"type": "error", "error": {"type": "rate_limit_error", "message": r.json()["error"]["message"]}}
    for t in hogs:
        t.join()


def test_first_event_at_once_then_keepalives_while_queued(srv):
    wait_idle(srv)
    hogs = _hogs(srv, 2)
    _wait_for(srv, "running", 2)  # both engine slots busy: the next requests wait, and must hear pings
    got: dict = {}

    def read(name, url, body):
        with httpx.stream("POST", srv.url + url, json=body, timeout=120) as r:
            got[name] = [line for line in r.iter_lines() if line]

    readers = [threading.Thread(target=read, args=("anthropic", "/v1/messages",
                                                   {"model": "m", "max_tokens": 4, "stream": True, "messages": ASK})),
               threading.Thread(target=read, args=("openai", "/v1/chat/completions", long_chat(4)))]
    for t in readers:
        t.start()
    for t in readers + hogs:
        t.join()
    lines = got["anthropic"]
    assert lines[0] == "event: message_start"
    first_block = next(i for i, line in enumerate(lines) if line == "event: content_block_start")
    assert "event: ping" in lines[:first_block]
    olines = got["openai"]
    assert json.loads(olines[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    first_text = next(i for i, line in enumerate(olines) if '"content":"' in line and i > 0)
    assert ": keep-alive" in olines[:first_text] and olines[-1] == "data: [DONE]"


def test_auth_and_body_cap():
    with ServerThread(api_key="sekrit", limits=ServerLimits(max_body_bytes=4096)) as srv:
        chat = {"model": "m", "messages": ASK, "max_tokens": 2}
        assert httpx.get(srv.url + "/health").status_code == 200 and httpx.get(srv.url + "/ready").status_code == 200
        r = httpx.post(srv.base_url + "/chat/completions", json=chat)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(srv.url + "/v1/messages", json=chat, headers={"x-api-key": "wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.post(srv.base_url + "/chat/completions", json=chat,
                          headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert httpx.post(srv.url + "/v1/messages", json=chat, headers={"x-api-key": "sekrit"}).status_code == 200
        big = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "x" * 5000}]}
        r = httpx.post(srv.url + "/v1/messages", json=big, headers={"x-api-key": "sekrit"})
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"

        def chunks():  # no Content-Length: the cap is enforced while reading
            yield json.dumps(big).encode()

        r = httpx.post(srv.base_url + "/chat/completions", content=chunks(), headers={"x-api-key": "sekrit"})
        assert r.status_code == 413 and "4096" in r.json()["error"]["message"]


def test_failed_load_is_reported_by_ready_and_requests(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with ServerThread(model_dir=tmp_path, wait_ready=False) as srv:
        deadline = time.monotonic() + 30
        while srv.state.load_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        r = httpx.get(srv.url + "/ready")
        assert r.status_code == 503 and "model load failed" in r.json()["reason"]
        r = httpx.post(srv.url + "/v1/messages", json={"model": "m", "max_tokens": 2, "messages": ASK})
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
        assert httpx.get(srv.url + "/health").status_code == 200


def test_sigterm_drains_then_aborts_with_terminal_events():
    srv = ServerProcess("--drain-timeout", "2", "--max-num-seqs", "4").start()
    results: dict = {}

    def read(name, url, body):
        with httpx.stream("POST", srv.url + url, json=body, timeout=120) as r:
            results[name] = [line for line in r.iter_lines() if line]

    readers = [threading.Thread(target=read, args=("openai", "/v1/chat/completions", long_chat(4000))),
               threading.Thread(target=read, args=("anthropic", "/v1/messages", long_chat(4000) | {"max_tokens": 3000}))]
    for t in readers:
        t.start()
    deadline = time.monotonic() + 60
    while srv.stats()["running"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    srv.proc.send_signal(15)
    time.sleep(0.3)
    r = httpx.post(srv.base_url + "/chat/completions", json=long_chat(2, stream=False))
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(srv.url + "/ready").status_code == 503
    for t in readers:
        t.join(timeout=60)
    assert srv.proc.wait(timeout=60) == 0
    assert json.loads(results["openai"][-2][6:])["error"]["type"] == "service_unavailable"
    assert results["openai"][-1] == "data: [DONE]"
    assert results["anthropic"][-2] == "event: error"
    assert json.loads(results["anthropic"][-1][6:])["error"]["type"] == "overloaded_error"


def test_non_loopback_host_needs_an_api_key():
    proc = subprocess.run([sys.executable, "-m", "freetoken_py", "serve", "--host", "0.0.0.0"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--api-key" in proc.stderr and "Traceback" not in proc.stderr
