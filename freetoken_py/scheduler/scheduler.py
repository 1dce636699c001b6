"""Continuous batching: requests join and leave between steps.

Every request computes tokens [num_computed, num_tokens) and samples when it reaches the end, so
prefill, chunked prefill, decode and recompute-after-preemption are the same operation. A step
takes running requests first (decodes cost one token of the budget), then admits waiting ones
while the token budget, the sequence limit and the free pages allow.
"""
from __future__ import annotations

from collections import deque

from freetoken_py.core import Request
from freetoken_py.engine.runner import ScheduledChunk
from freetoken_py.kvcache import PageAllocator


class Scheduler:
    def __init__(self, allocator: PageAllocator, page_size: int, max_num_seqs: int, max_num_batched_tokens: int):
        self.allocator = allocator
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages_needed(self, req: Request, upto: int) -> int:
        return max(0, -(-upto // self.page_size) - len(req.page_table))

    def _grow(self, req: Request, upto: int) -> bool:
        need = self._pages_needed(req, upto)
        if need > self.allocator.num_free:
            return False
        req.page_table.extend(self.allocator.allocate(need))
        return True

    def _preempt(self, req: Request) -> None:
        """Free the request's pages; it recomputes its tokens when readmitted."""
        self.running.remove(req)
        self.allocator.release(req.page_table)
        req.page_table = []
        req.num_computed = 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for req in list(self.running):
            if req not in self.running or budget == 0:
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            while not self._grow(req, req.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            else:
                chunks.append(ScheduledChunk(req, n))
                budget -= n
        chunks = [c for c in chunks if c.req in self.running]
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._grow(req, req.num_computed + n):
                break
            self.waiting.popleft()
            self.running.append(req)
            chunks.append(ScheduledChunk(req, n))
            budget -= n
        return chunks

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.allocator.release(req.page_table)
        req.page_table = []
