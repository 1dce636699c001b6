"""The KV-pages-versus-expert-slots memory trade, re-decided while the engine runs.

At start-up the KV cache takes its pages and the expert slots what is left. `more_pages` (the
scheduler's hook: the running requests would otherwise be preempted) grows the KV cache into
slot memory; `return_pages` (each step, and `LLM.idle`) gives it back once the requests have
used at most half the start-up pages for `return_after_steps` steps. Duck-typed on what it is
handed (allocator, runner with its `.cache`, scheduler, the residency executor), so residency/
imports none of engine, scheduler or llm.
"""
from __future__ import annotations

import torch

KV_RESPLIT_STEPS = 64   # steps of low use before the KV cache gives its growth back; and of
                        # back-off after a failed grow


class KvSlotSplit:
    def __init__(self, ex, allocator, runner, scheduler, page_bytes: int, cuda: bool):
        self.ex, self.allocator, self.runner, self.scheduler = ex, allocator, runner, scheduler
        self.page_bytes, self.cuda = page_bytes, cuda
        self.slot_floor = ex.slots.num_slots // 4
        self.grow_after = 0          # after a failed grow, the step before which none is tried
        # the other direction: pages the KV cache took from the slots go back once the requests
        # have used at most half the start-up pages for this many steps in a row
        self.base_pages = allocator.num_pages
        self.return_after_steps = KV_RESPLIT_STEPS
        self.slots_taken = 0         # slots the KV grows took (whole chunks), for return_pages
        self.idle_steps = 0

    @property
    def grown(self) -> bool:
        return self.allocator.num_pages > self.base_pages

    def more_pages(self, need: int) -> int:
        """The KV/slot split, re-decided when it matters: the running requests need `need` more
        pages than are free (the prefix cache already evicted) and would otherwise be preempted
        (and recompute their whole context later). A page is worth more than an expert slot (a
        slot saves one expert's copy per step), so the KV cache grows by taking the memory from
        the expert slots: by a quarter at least, while the slots stay above a quarter of what
        they started with. Returns the pages added (0: the slots are at that floor, or a grow
        failed less than KV_RESPLIT_STEPS steps ago)."""
        ex = self.ex
        if ex.step < self.grow_after:
            return 0
        per_page = self.page_bytes
        slot_bytes, cuda = ex.slots.slot_bytes, self.cuda
        want = max(need, self.allocator.num_pages // 4)
        # on a GPU the old pages are copied into the new cache: their bytes are needed for a moment
        # too (the slots get those back through the elastic sizing afterwards)
        copy_bytes = self.allocator.num_pages * per_page if cuda else 0
        give = -(-(want * per_page + copy_bytes) // slot_bytes)
        edges = [b for b in ex.slots.boundaries() if b >= self.slot_floor]   # whole chunks only
        if not edges:
            return 0
        target = max((b for b in edges if b <= ex.slots.num_slots - give), default=min(edges))
        add = min(want, ((ex.slots.num_slots - target) * slot_bytes - copy_bytes) // per_page)
        if add < need:
            return 0
        held = ex.slots.num_slots
        ex.resize(target)
        self.slots_taken += held - ex.slots.num_slots      # whole chunks (resize gave them back to the driver)
        pages = self.allocator.num_pages + add
        try:
            self.runner.cache.grow(pages)
        except ex.oom_errors:
            # the memory was not there as one block after all: preempt, as without the tiers; the
            # elastic sizing grows the slots back, and no grow is tried for a while
            self.grow_after = ex.step + KV_RESPLIT_STEPS
            return 0
        self.allocator.grow(pages)
        ex.lend_slots(-(-add * per_page // slot_bytes))     # the elastic sizing keeps out of the pages' share
        ex.telemetry.kv_grows.append((ex.step + 1, pages))     # the coming step
        return add

    def return_pages(self) -> int:
        """The KV/slot split re-decided the other way: the KV cache grew into slot memory
        (`more_pages`), and the running requests have since held at most half the start-up
        pages for `return_after_steps` steps in a row with nobody waiting. Then the cache goes
        back to its start-up size and the memory to the expert slots. Held pages above that size
        (a running request's, the prefix cache's) move below it first, their holders following
        (`Scheduler.move_pages_below`); the prefix cache gives back its least recently used pages
        if the room below is short, as it would at its start-up size. Returns the pages given
        back (0: not now; every failure leaves a consistent state and waits as long again)."""
        a, base, sched = self.allocator, self.base_pages, self.scheduler
        if sched.waiting or len({p for req in sched.running for p in req.page_table}) > base // 2:
            self.idle_steps = 0                      # (the prefix cache's pages are not counted)
            return 0
        self.idle_steps += 1
        if self.idle_steps < self.return_after_steps:
            return 0
        self.idle_steps = 0                          # not again for as long, whatever happens below
        kv, ex = self.runner.cache, self.ex
        per_page = self.page_bytes
        cuda, slots_before, pages = self.cuda, ex.slots.num_slots, a.num_pages
        try:
            if not sched.move_pages_below(base, kv.copy_pages):
                return 0
            if cuda:   # the smaller cache is allocated before the old one goes: make room for it
                ex.resize(max(self.slot_floor, slots_before - -(-base * per_page // ex.slots.slot_bytes)))
            kv.shrink(base)
        except ex.oom_errors:
            if ex.slots.num_slots < slots_before:
                ex.resize(slots_before)              # a grow keeps what it could allocate
            return 0                                 # the pages moved down stay there, all consistent
        a.shrink(base)
        if cuda:
            torch.cuda.empty_cache()
        ex.reclaim_slots()
        back = (pages - base) * per_page // ex.slots.slot_bytes
        if ex.elastic is None:   # nothing regrows the chunks' slack the grows took: give all of it back
            back = max(back, self.slots_taken)
        self.slots_taken = 0
        ex.resize(slots_before + back)
        ex.telemetry.kv_shrinks.append((ex.step + 1, base))
        return pages - base
