"""How many threads each decode step's numba kernels use, re-decided from measured step times.

Why: every parallel region ends in a barrier, and libgomp's workers spin there. When another
process (a browser, a build, the server's own event loop) holds one of the cores, a region waits
for a descheduled worker's next time slice: measured on the 2-core box, decode fell from ~470 to
5-7 tokens/s with 2 threads, while 1 thread kept ~100. A fixed thread count is wrong on a desktop
whose load comes and goes, so the governor keeps measuring (docs/kernels.md, "Threads"):

- candidates: the configured count N, N - 1 and N / 2 (2 cores: {2, 1});
- each candidate is timed on the first steps of a batch-size bucket, then the fastest (median of
  its last 3 step times) runs; every `probe_every` steps another candidate runs once, so a stale
  figure is refreshed and the choice follows the machine's load both ways — backing off (up to
  every 512 steps) while a candidate keeps measuring > SLOWER x slower: a probe on a collapsed
  count costs ~10x a step, and on a quiet 2-core machine one thread decodes 1.3-1.4x slower
  (memory-bound: one core streams 22-24 GB/s where two stream 30-33), so probing it every 16
  steps cost ~2 % of decode (it backed off only past 1.5x until 2026-12); a collapse of the
  running count needs no probe (its own median rises past the loser's last figure);
- results do not depend on the count (every kernel reduces in a fixed order per output row).

Decode steps only: prefill regions are long, so a late worker costs them little.
"""
from __future__ import annotations

import statistics
from collections import deque


def _bucket(num_rows: int, context: int = 0) -> tuple[int, int]:
    """Steps share timings when their batch sizes (1, 2, 3-4, 5-8, ...) and total context tokens
    (0-255, 256-511, 512-1023, ...) fall in the same power-of-two band: a step's cost grows with
    both, and a figure from another band would be compared unfairly."""
    return (num_rows - 1).bit_length(), (context // 256).bit_length()


SLOWER = 1.15     # a probe this much slower than the running count backs off (module doc)


class ThreadGovernor:
    def __init__(self, max_threads: int, probe_every: int = 16, window: int = 3, max_interval: int = 512):
        self.max_threads = max(1, int(max_threads))
        n = self.max_threads
        self.candidates = sorted({n, max(1, n - 1), max(1, n // 2)}, reverse=True)
        self.probe_every = probe_every
        self.max_interval = max_interval
        self.window = window
        self._times: dict[tuple[int, int], deque] = {}
        self._interval: dict[tuple[int, int], int] = {}  # steps between probes of a losing candidate
        self._last_probe: dict[tuple[int, int], int] = {}
        self._steps = 0

    def _median(self, bucket: int, n: int) -> float | None:
        times = self._times.get((bucket, n))
        return statistics.median(times) if times else None

    def best(self, num_rows: int, context: int = 0) -> int:
        """The candidate with the lowest recent median for this batch size (max_threads if none)."""
        b = _bucket(num_rows, context)
        timed = [(m, -n) for n in self.candidates if (m := self._median(b, n)) is not None]
        return -min(timed)[1] if timed else self.max_threads

    def choose(self, num_rows: int, context: int = 0) -> int:
        """Thread count for the next decode step of `num_rows` rows."""
        self._steps += 1
        b = _bucket(num_rows, context)
        for n in self.candidates:  # first visit of a bucket: time every candidate once
            if (b, n) not in self._times:
                return n
        best = self.best(num_rows, context)
        for n in self.candidates:  # a losing candidate is re-timed now and then (backing off while
            key = (b, n)           # it stays much slower: a collapsed probe step is expensive)
            if n != best and self._steps - self._last_probe.get(key, 0) >= self._interval.get(key, self.probe_every):
                self._last_probe[key] = self._steps
                return n
        return best

    def record(self, num_rows: int, threads: int, seconds: float, context: int = 0) -> None:
        b = _bucket(num_rows, context)
        best = self.best(num_rows, context)
        self._times.setdefault((b, threads), deque(maxlen=self.window)).append(seconds)
        if threads != best and (m := self._median(b, best)) is not None:  # a probe
            slow = seconds > SLOWER * m
            cur = self._interval.get((b, threads), self.probe_every)
            self._interval[(b, threads)] = min(2 * cur, self.max_interval) if slow else self.probe_every

    def reset(self) -> None:
        """Forget every timing (the start-up warm-up's steps include compiling the kernels)."""
        self._times.clear()
        self._interval.clear()
        self._last_probe.clear()
        self._steps = 0

    def snapshot(self) -> dict:
        """{(batch-size band, context band): {threads: median seconds}} for stats and tests."""
        out: dict[int, dict[int, float]] = {}
        for (b, n), times in self._times.items():
            out.setdefault(b, {})[n] = statistics.median(times)
        return out
