"""`freetoken run` with the prefix cache (real subprocesses on the bundled demo model): the REPL
reuses earlier turns and says how many prompt tokens were cached; the flags turn it off or pick
the KV dtype; a bad --kv-dtype is a one-line error."""
from __future__ import annotations

import re

from test_cli_run import freetoken

SYSTEM = "You are a careful assistant who answers questions about the Python standard library."


def _cached(stderr: str) -> list[tuple[int, int]]:
    return [(int(m[1]), int(m[2])) for m in re.finditer(r"\[prompt (\d+) tok \((\d+) cached\)", stderr)]


def test_repl_reuses_earlier_turns():
    args = ["run", "--max-tokens", "6", "--temperature", "0", "--system", SYSTEM]
    stdin = "hello\nwhat is a list?\n"
    on, off = freetoken(*args, stdin=stdin), freetoken(*args, "--no-prefix-cache", stdin=stdin)
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    (p1, c1), (p2, c2) = _cached(on.stderr)
    assert c1 == 0 and 16 <= c2 < p2 and c2 % 16 == 0  # whole pages of turn 1, never the full prompt
    assert [c for _, c in _cached(off.stderr)] == [0, 0]
    assert on.stdout == off.stdout  # same greedy answers


def test_bad_kv_dtype_is_one_line():  # also shows --kv-dtype reaches the engine config
    proc = freetoken("run", "hi", "--kv-dtype", "int3")
    assert proc.returncode == 2 and "kv dtype must be" in proc.stderr and "Traceback" not in proc.stderr
