"""Page integrity tags without a model: every injected fault (page freed, freed and handed to
someone else, or re-tagged under a live holder) is reported for exactly the requests holding that
page, over many random trials; intact requests are never reported; the null tracker is inert."""
from __future__ import annotations

import random

from freetoken_py.kvcache import PageAllocator
from freetoken_py.kvcache.tags import IntegrityTracker, NullTracker


def _holders(num_reqs=5, pages_each=3, shared=(0, 1)):
    alloc = PageAllocator(32)
    tracker = IntegrityTracker(alloc)
    common = alloc.allocate(1)  # a prefix page shared by the requests in `shared`
    tables = {}
    for rid in range(num_reqs):
        own = alloc.allocate(pages_each)
        if rid in shared:
            alloc.share(common)
            tables[rid] = common + own
        else:
            tables[rid] = own
        tracker.record(rid, tables[rid])
    alloc.release(common)  # only the sharers hold it now
    return alloc, tracker, tables


def test_every_fault_is_reported_for_exactly_its_holders():
    rng = random.Random(0)
    for trial in range(200):
        alloc, tracker, tables = _holders()
        assert tracker.check() == {}
        rid = rng.choice(list(tables))
        page = rng.choice(tables[rid])
        kind = rng.choice(["retag", "free", "free_and_reuse"])
        if kind == "retag":
            alloc.tags[page] += 1
        else:
            while alloc.refcount(page):
                alloc.release([page])
            if kind == "free_and_reuse":
                while page in alloc._free:  # hand pages out until the victim page is reused
                    alloc.allocate(1)
        expected = {r: [page] for r, t in tables.items() if page in t}
        assert tracker.check() == expected, (trial, kind)
        assert tracker.num_mismatches == len(expected)
        for r in expected:  # the faulty page is not the request's to release any more
            assert page not in tracker.valid_pages(r) and len(tracker.valid_pages(r)) == len(tables[r]) - 1


def test_forget_and_growth_keep_the_check_exact():
    alloc, tracker, tables = _holders()
    tracker.forget(3)
    alloc.release(tables[3])  # a finished request's pages are reused by request 4 as it grows
    more = alloc.allocate(3)
    tracker.record(4, more)
    assert tracker.check() == {}
    alloc.tags[more[1]] += 1
    assert tracker.check() == {4: [more[1]]}


def test_tags_bump_on_allocate_and_free_only():
    alloc = PageAllocator(4)
    (p,) = alloc.allocate(1)
    assert alloc.tags[p] == 1
    alloc.share([p])
    alloc.release([p])
    assert alloc.tags[p] == 1  # sharing and partial release keep the page's identity
    alloc.release([p])
    assert alloc.tags[p] == 2


def test_null_tracker_is_inert():
    alloc = PageAllocator(4)
    t = NullTracker(alloc)
    t.record(1, alloc.allocate(2))
    alloc.tags += 5
    assert t.check() == {} and t.valid_pages(1) is None and not t.enabled


def test_a_request_that_lost_a_page_never_publishes_it_and_stale_nodes_never_match():
    """Found in review: a request whose page was freed and handed on before the next check used to
    publish that page into the prefix cache on finish, and a later request with the same prompt
    read the new owner's K/V with no alarm. Now it publishes nothing, and even a cache node whose
    page changed hands is skipped by `match`."""
    from freetoken_py.core import FinishReason, Request, SamplingParams
    from freetoken_py.kvcache.radix import RadixCache
    from freetoken_py.scheduler.scheduler import Scheduler

    S = 4
    alloc = PageAllocator(8)
    cache, tracker = RadixCache(alloc, S), IntegrityTracker(alloc)
    sched = Scheduler(alloc, S, 4, 64, cache, tracker=tracker)
    a = Request([1, 2, 3, 4, 5], SamplingParams())
    sched.add(a)
    sched.schedule()
    a.num_computed = 5
    lost = a.page_table[0]
    alloc.release([lost])  # a bookkeeping bug elsewhere frees A's page under it ...
    c = Request([9] * 9, SamplingParams())
    sched.add(c)
    sched.schedule()
    assert lost in c.page_table  # ... and C now owns it
    a.finish_reason = FinishReason.STOP
    sched.finish(a)  # before the next step's check
    assert lost not in cache.cached_pages()
    d = Request([1, 2, 3, 4, 5], SamplingParams())
    sched.add(d)
    sched.schedule()
    assert d.num_computed == 0 and lost not in d.page_table

    # a node whose page changed hands (tag moved on) is stale: never matched
    e = Request([7, 7, 7, 7, 7], SamplingParams())
    pages = alloc.allocate(2)
    cache.insert("ns", e.prompt_token_ids[:4], pages)
    alloc.tags[pages[0]] += 1
    assert cache.match("ns", e.prompt_token_ids[:4]).num_tokens == 0


def test_growing_the_allocator_keeps_holders_and_tags():
    """More page ids (the KV cache grew): held pages, their tags and the tracker's view survive;
    the new ids are free and handed out after the old free ones."""
    alloc = PageAllocator(4)
    tracker = IntegrityTracker(alloc)
    held = alloc.allocate(3)
    tracker.record(7, held)
    alloc.release([held[2]])                       # bumps its tag; id 2 and 3 are free now
    tags_before = alloc.tags_np.copy()
    alloc.grow(7)
    assert alloc.num_pages == 7 and alloc.num_free == 2 + 3
    assert (alloc.tags_np[:4] == tags_before).all() and (alloc.tags_np[4:] == 0).all()
    assert alloc.tags[5].item() == 0               # the torch view follows the new array
    assert tracker.check() == {7: [held[2]]}       # the released page still reads as lost, nothing else
    first = alloc.allocate(2)
    assert sorted(first) == [2, 3] and sorted(alloc.allocate(3)) == [4, 5, 6]
    alloc.grow(5)                                  # never shrinks
    assert alloc.num_pages == 7


def test_shrinking_the_allocator_drops_only_free_ids_and_their_tags_never_repeat():
    """The KV cache gives its growth back: only free ids can be dropped (a held one is named);
    `allocate_below` takes the lowest free ids under a limit; a dropped id's tag is bumped and
    kept, so after a later grow a stale record of it still mismatches."""
    import pytest

    alloc = PageAllocator(8)
    tracker = IntegrityTracker(alloc)
    held = alloc.allocate(6)                       # lowest first: 0..5
    assert held == [0, 1, 2, 3, 4, 5]
    tracker.record(1, [5])
    with pytest.raises(ValueError, match=r"\[5\]"):
        alloc.shrink(5)
    with pytest.raises(Exception, match="below 5"):
        alloc.allocate_below(1, 5)                 # nothing free under 5
    alloc.release([1, 3])
    assert alloc.allocate_below(1, 5) == [1] and alloc.refcount(1) == 1
    stale = int(alloc.tags_np[5])
    alloc.release([5])                             # 5 is free now (its tag bumped again)
    tags = alloc.tags_np.copy()
    alloc.shrink(5)
    assert alloc.num_pages == 5 and alloc.num_free == 1            # 3; 5, 6, 7 dropped
    assert (alloc.tags_np[5:8] == tags[5:8] + 1).all() and (alloc.tags_np[:5] == tags[:5]).all()
    assert tracker.check() == {1: [5]}             # the stale record of 5 stays a mismatch
    assert alloc.allocate(1) == [3]
    alloc.grow(8)
    assert alloc.allocate(3) == [5, 6, 7] and alloc.tags_np[5] > stale + 1
    assert tracker.check() == {1: [5]}             # re-handed out: still not the page it recorded
