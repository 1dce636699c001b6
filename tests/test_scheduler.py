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
    assert [ch.req for ch in chunks] == [a] and a.page_table == [0, 1]  # freed pages reused, lowest id first
    assert b.num_computed == 0 and b.page_table == [] and list(s.waiting) == [b]
    assert s.num_preemptions == 1


def test_more_pages_is_asked_only_for_a_running_request_about_to_be_preempted():
    """The engine's hook (which may grow the KV cache) is asked before a running request is
    preempted; a waiting request that does not fit just waits, without asking."""
    alloc = PageAllocator(3)
    asked = []

    def more_pages(n):
        asked.append(n)
        alloc.grow(alloc.num_pages + n)
        return n

    s = Scheduler(alloc, page_size=4, max_num_seqs=4, max_num_batched_tokens=64, more_pages=more_pages)
    a, b = _req(8), _req(8)                         # two pages each: b cannot be admitted yet
    s.add(a), s.add(b)
    chunks = s.schedule()
    assert [c.req for c in chunks] == [a] and list(s.waiting) == [b] and asked == []
    a.output_token_ids.extend([1, 2, 3])            # 11 tokens: a third page, the last free one
    s.schedule()
    assert asked == [] and len(a.page_table) == 3 and list(s.waiting) == [b]   # b waits, nobody asked
    a.output_token_ids.extend([4, 5, 6, 7])         # 15 tokens: a fourth page, none free
    s.schedule()                                    # ask instead of preempting a
    assert asked == [1] and s.num_preemptions == 0 and a in s.running and len(a.page_table) == 4
