"""The scheduler's side of prefix-state reuse for hybrid models (kvcache/snapshots.py).

A hybrid request's state is its full-attention K/V pages plus its recurrent slot, so a cached
prefix is resumable only at a page boundary where a snapshot of the recurrent state was taken.
This object decides where those are and keeps them in the radix cache:

- **Admission** (`match`): the deepest cached node on the prompt's path that holds a valid
  snapshot; the snapshot is restored into the request's slot (its checksum, tag and owner
  checked: a refused one is dropped and the next shallower one tried) and the pages up to it are
  shared. `num_cached_tokens` is exactly that position, the tokens really skipped.
- **Snapshot points**: every `every_pages` pages (the measured-cost rule,
  snapshots.snapshot_every_pages) and the last page boundary of the tokens known at admission
  (the prompt; prompt + output after a preemption), where an agent's next turn diverges.
- **Capture** (`plan`): a point inside a prefill chunk is captured by the model's linear-attention
  mixer itself (ScheduledChunk.captures -> AttentionMetadata.state_captures: the mixer splits
  that request's rows there and copies its state into a reserved snapshot slot), so the prompt
  still runs in as few passes as without snapshots. With a mixer that cannot (`captures` not
  set on it), `cut` ends the chunk at the point instead (one more pass).
- **After a forward** (`after_forward`): a request whose computed length lands on such a point
  has its slot copied into a snapshot, its pages up to there inserted and the snapshot attached
  to the node of the last one. Past that point (decode), the request keeps one *rolling*
  snapshot, overwritten at each page boundary it crosses (a copy, no checksum: it is sealed once,
  when it is published at release).
- **Release** (`release`): a request that finishes, aborts or is preempted (publishing) inserts its
  pages up to the rolling snapshot and attaches it; pages past the last snapshot are not cached
  (a hybrid can never resume there). Unpublished, the rolling snapshot is just freed.

Snapshot slots are a fixed number of the state pool's spares (counted in the KV budget, llm.py);
when they run out the least recently used snapshot in the cache is freed first.
"""
from __future__ import annotations

from typing import Hashable

from freetoken_py.core import Request
from freetoken_py.kvcache.radix import MatchResult, RadixCache
from freetoken_py.kvcache.snapshots import SnapshotRef, SnapshotStore


class PrefixStateReuse:
    def __init__(self, cache: RadixCache, store: SnapshotStore, page_size: int, every_pages: int,
                 in_layer: bool = False):
        self.cache, self.store, self.page_size = cache, store, page_size
        self.every = every_pages * page_size  # tokens between periodic snapshots
        self.in_layer = in_layer  # the mixer captures inside a chunk (else chunks are cut)
        self._end: dict[int, int] = {}  # request id -> its last snapshot point (set at admission)
        self._rolling: dict[int, SnapshotRef] = {}  # request id -> its decode-time snapshot
        self._planned: dict[int, list[SnapshotRef]] = {}  # request id -> captures of the pass in flight

    def match(self, req: Request, ns: Hashable, tokens: list[int]) -> MatchResult:
        """Restore the deepest usable snapshot of `tokens` into the request's slot (m.snapshot is
        then the restored one; None: nothing restored, the slot is left as it was)."""
        self._end[req.request_id] = req.num_tokens // self.page_size * self.page_size
        while True:
            m = self.cache.match(ns, tokens, with_state=True)
            if m.snapshot is None or self.store.restore(m.snapshot, ns, req.state_slot):
                return m
            self.cache.drop_snapshot(m.handle)  # corrupted or reassigned: never read; try shallower

    def _points(self, req: Request, start: int, stop: int) -> list[int]:
        """Snapshot points p with start < p < stop."""
        end = self._end.get(req.request_id, 0)
        pts = list(range((start // self.every + 1) * self.every, min(stop, end + 1), self.every))
        if start < end < stop and end not in pts:
            pts.append(end)
        return sorted(p for p in pts if p < stop)

    def plan(self, chunk, ns: Hashable | None) -> None:
        """Reserve a snapshot slot for each point strictly inside the chunk (the mixer fills it)."""
        req = chunk.req
        if not self.in_layer or ns is None or chunk.num_new < 2:
            return
        start = req.num_computed
        for p in self._points(req, start, start + chunk.num_new):
            if self.cache.snapshot_at(ns, req.all_token_ids[:p]) is not None or not self._room():
                continue
            ref = self.store.reserve(ns, p)
            if ref is None:
                return
            chunk.captures.append((p - start, ref.slot))
            self._planned.setdefault(req.request_id, []).append(ref)

    def cut(self, req: Request, n: int) -> int:
        """`n` new tokens, shortened so the chunk ends at the next snapshot point (unless the
        mixer captures inside chunks)."""
        start = req.num_computed
        end = self._end.get(req.request_id, 0)
        if start >= end or self.in_layer:
            return n
        nxt = min((start // self.every + 1) * self.every, end)
        return max(1, min(n, nxt - start))

    def _room(self) -> bool:
        if self.store.num_free <= 0:
            self.cache.evict_snapshots(1)
        return self.store.num_free > 0

    def after_forward(self, req: Request, ns: Hashable | None) -> None:
        """Called once the request's latest chunk is computed (its slot holds the state at
        `num_computed`)."""
        pos, S = req.num_computed, self.page_size
        for ref in self._planned.pop(req.request_id, ()):   # captured inside the chunk just computed
            tokens = req.all_token_ids[:ref.position]
            ref = self.store.seal(ref, captured=True)
            self.cache.insert(ns, tokens, req.page_table)
            if not self.cache.attach(ns, tokens, ref):
                self.store.release(ref)
        if ns is None or pos % S or pos == 0:
            return
        end = self._end.get(req.request_id, 0)
        tokens = req.all_token_ids[:pos]
        if pos <= end:
            if pos % self.every and pos != end:
                return
            if self.cache.snapshot_at(ns, tokens) is not None:
                return  # this state is cached already
            if not self._room():
                return
            ref = self.store.take(req.state_slot, ns, pos)
            if ref is None:
                return
            self.cache.insert(ns, tokens, req.page_table)
            if not self.cache.attach(ns, tokens, ref):
                self.store.release(ref)
            return
        ref = self._rolling.get(req.request_id)   # a copy per page crossed; sealed only when published
        if ref is not None and self.store.valid(ref, ns):
            self._rolling[req.request_id] = self.store.retake(ref, req.state_slot, pos)
        elif self._room():
            ref = self.store.take(req.state_slot, ns, pos, seal=False)
            if ref is not None:
                self._rolling[req.request_id] = ref

    def release(self, req: Request, ns: Hashable | None) -> None:
        """The request leaves (ns None: without publishing): attach or free its rolling snapshot."""
        self._end.pop(req.request_id, None)
        for planned in self._planned.pop(req.request_id, ()):   # a pass that never completed
            self.store.release(planned)
        ref = self._rolling.pop(req.request_id, None)
        if ref is None:
            return
        tokens = req.all_token_ids[:ref.position]
        if ns is not None and ref.owner == ns and ref.position <= req.num_computed and self.store.valid(ref, ns):
            if self.cache.snapshot_at(ns, tokens) is None:
                self.cache.insert(ns, tokens, req.page_table)
                if self.cache.attach(ns, tokens, self.store.seal(ref)):   # its one checksum
                    return
        self.store.release(ref)
