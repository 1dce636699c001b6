"""Scheduler and page allocator bookkeeping: exact page ids, budgets, preemption. No model."""
from __future__ import annotations

from freetoken_py.core import Request, SamplingParams
from freetoken_py.kvcache import PageAllocator
from freetoken_py.scheduler.scheduler import Scheduler


def _req(n):
    return Request(list(range(n)), SamplingParams(max_tokens=100))


def test_pages_allocated_lowest_first_and_freed():
    alloc = PageAllocator(6)
    s = Scheduler(alloc, page_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _req(5), _req(4)
    s.add(a)
    s.add(b)
    chunks = s.schedule()
    assert [(c.req, c.num_new) for c in chunks] == [(a, 5), (b, 4)]
    assert a.page_table == [0, 1] and b.page_table == [2]
    s.finish(a)
    assert alloc.num_free == 5 and alloc.refcount(0) == 0


def test_token_budget_chunks_prefill_and_decodes_go_first():
    alloc = PageAllocator(16)
    s = Scheduler(alloc, page_size=4, max_num_seqs=4, max_num_batched_tokens=6)
    a = _req(10)
    s.add(a)
    (c,) = s.schedule()
    assert c.num_new == 6
    a.num_computed += 6
    b = _req(3)
    s.add(b)
    chunks = s.schedule()
    assert [(ch.req, ch.num_new) for ch in chunks] == [(a, 4), (b, 2)]


def test_preemption_frees_the_newest_request():
    alloc = PageAllocator(3)
    s = Scheduler(alloc, page_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _req(4), _req(8)
    s.add(a)
    s.add(b)
    for ch in s.schedule():
        ch.req.num_computed += ch.num_new
    a.output_token_ids.append(1)  # a needs a second page; none are free
    chunks = s.schedule()
    assert [ch.req for ch in chunks] == [a] and a.page_table == [0, 2]  # freed pages reused LIFO
    assert b.num_computed == 0 and b.page_table == [] and list(s.waiting) == [b]
    assert s.num_preemptions == 1
