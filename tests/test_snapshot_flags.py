"""The hybrid prefix-state snapshot options from the command line (real subprocesses): `freetoken
serve --prefix-snapshots N --snapshot-every-pages K` reaches the engine (the stats route reports
the slots and the spacing, and a second chat turn resumes from a snapshot), `freetoken run` with
them reuses the first REPL turn, and bad values are one-line errors."""
from __future__ import annotations

import re

import httpx
import pytest

from server_util import ServerProcess
from test_cli_run import freetoken
from test_prefix_hybrid import _build_chat_model


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("freetoken: error")]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return _build_chat_model(tmp_path_factory.mktemp("hybrid_chat") / "m")


@pytest.mark.parametrize("args,field", [
    (("run", "hi", "--prefix-snapshots", "-1"), "prefix_snapshots (--prefix-snapshots)"),
    (("serve", "--snapshot-every-pages", "-3"), "snapshot_every_pages (--snapshot-every-pages)"),
])
def test_negative_values_are_one_line(args, field):
    proc = freetoken(*args)
    assert proc.returncode == 2 and field in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(_errors(proc.stderr)) == 1


def test_snapshots_that_leave_no_pages_are_one_line(chat_model):
    proc = freetoken("run", "hi", "--model", str(chat_model), "--backend", "torch", "--kv-cache-gb", "0.0001",
                     "--prefix-snapshots", "64")
    assert proc.returncode == 2 and "--prefix-snapshots" in proc.stderr and "leaving no room" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(_errors(proc.stderr)) == 1


def test_serve_flags_reach_the_engine(chat_model):
    messages = [{"role": "system", "content": "You are a coding agent with tools to read and write files. " * 6},
                {"role": "user", "content": "Run the tests."}]
    with ServerProcess("--model", str(chat_model), "--backend", "torch", "--max-num-seqs", "2",
                       "--prefix-snapshots", "3", "--snapshot-every-pages", "2") as srv:
        cached = []
        for turn in range(2):
            r = httpx.post(srv.base_url + "/chat/completions", timeout=120, json={
                "model": "m", "messages": messages, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            cached.append((body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0))
            messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"] or ""},
                         {"role": "user", "content": f"Now fix file_{turn}.py."}]
        snaps = srv.stats()["state_snapshots"]
    assert snaps["slots"] == 3 and snaps["every_pages"] == 2 and snaps["held"] <= 3
    assert cached[0] == 0 and cached[1] > 0 and snaps["restored"] >= 1


def test_run_repl_with_the_flags_reuses_the_first_turn(chat_model):
    args = ["run", "--model", str(chat_model), "--backend", "torch", "--max-tokens", "4", "--temperature", "0",
            "--system", "You are a careful assistant who answers questions about Python. " * 4,
            "--prefix-snapshots", "2", "--snapshot-every-pages", "1"]
    proc = freetoken(*args, stdin="hello\nwhat is a list?\n")
    assert proc.returncode == 0, proc.stderr
    turns = [(int(m[1]), int(m[2])) for m in re.finditer(r"\[prompt (\d+) tok \((\d+) cached\)", proc.stderr)]
    assert len(turns) == 2 and turns[0][1] == 0 and 16 <= turns[1][1] < turns[1][0] and turns[1][1] % 16 == 0
