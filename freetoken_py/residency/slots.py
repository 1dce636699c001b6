"""The VRAM slot cache: fixed-size slots of one expert format, addressed by (layer, expert).

An expert is a few parts (`formats.ExpertFormat.specs`: w13 [2I, D] and w2 [D, I] for float
weights; the packed weights and scales of both for int8 / int4). Slots live in chunks of
`chunk_slots` experts (at most CHUNK_BYTES, at least 16 chunks), one tensor per part:

    part p's chunk [c, *shape_p]   that part of the experts in those slots

so the cache can change size without ever holding two copies of itself. Shrinking (elastic
VRAM: another process took memory) moves the experts that sit in the chunks to be dropped into
free slots of the chunks that stay, then drops them: no allocation, so it cannot run out of
memory. Growing appends chunks one at a time and stops at the first allocation failure, keeping
what it got. Surviving experts keep their contents; their slot ids may change.

Under an emulated accelerator the slots are CPU tensors (device="cpu"); with device="cuda" the
same code holds them in VRAM and the copies go through `Streamer`.
"""
from __future__ import annotations

import math
from bisect import bisect_right

import torch

from freetoken_py.residency.transfers import on_device

Key = tuple[int, int]
CHUNK_BYTES = 64 * 2**20


def _oom_types() -> tuple[type, ...]:
    types = [getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)]
    return tuple(t for t in types if t is not None) or (RuntimeError,)


OOM_ERRORS = _oom_types()


def parts_bytes(specs) -> int:
    """Bytes of one expert made of parts `specs` [(shape, dtype)]."""
    return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs)


class SlotCache:
    def __init__(self, num_slots: int, specs, device: str | torch.device = "cpu", alloc=torch.empty,
                 chunk_slots: int = 0):
        """`specs`: per part of an expert, (shape, dtype) (`ExpertFormat.specs`)."""
        self.specs = tuple((tuple(shape), dtype) for shape, dtype in specs)
        self.device = torch.device(device)
        self._alloc = alloc   # injectable so tests can make an allocation fail
        # at most CHUNK_BYTES a chunk, and at least 16 chunks, so a shrink can free a sixteenth
        self.chunk_slots = chunk_slots or max(1, min(CHUNK_BYTES // self.slot_bytes, -(-num_slots // 16)))
        self._chunks: list[tuple[torch.Tensor, ...]] = []   # per chunk, a tensor [c, *shape] per part
        self._starts: list[int] = []         # first slot id of each chunk
        self.slot_of: dict[Key, int] = {}
        self.free: list[int] = []            # free slot ids (pop() takes the last)
        self.layout_version = 0              # changes whenever the chunks do (a table of the slots is then stale)
        self.assign_version: dict[int, int] = {}   # per layer: changes whenever one of its experts gets,
                                                    # leaves or changes its slot
        for size in self._chunk_sizes(0, num_slots):   # at start-up an allocation failure is an error
            self._append_chunk(size)
        self.free = list(range(self.num_slots - 1, -1, -1))

    @property
    def num_slots(self) -> int:
        return self._starts[-1] + self._chunks[-1][0].shape[0] if self._chunks else 0

    @property
    def slot_bytes(self) -> int:
        return parts_bytes(self.specs)

    def __contains__(self, key: Key) -> bool:
        return key in self.slot_of

    def views(self, slot: int) -> tuple[torch.Tensor, ...]:
        """The parts of one slot (for float experts, the [2I, D] and [D, I] tensors)."""
        c = bisect_right(self._starts, slot) - 1
        i = slot - self._starts[c]
        return tuple(part[i] for part in self._chunks[c])

    def get(self, key: Key) -> tuple[torch.Tensor, ...]:
        return self.views(self.slot_of[key])

    def reserve(self, key: Key) -> int:
        """A free slot for `key` (the caller copies into it). Raises if none is free."""
        if key in self.slot_of:
            return self.slot_of[key]
        if not self.free:
            raise RuntimeError("slot cache full: the policy must evict before admitting")
        self.slot_of[key] = s = self.free.pop()
        self._assigned(key)
        return s

    def evict(self, key: Key) -> None:
        self.free.append(self.slot_of.pop(key))
        self._assigned(key)

    def boundaries(self) -> list[int]:
        """The slot counts a shrink can land on exactly (chunk edges), 0 and the current one included."""
        return [0, *self._starts[1:], self.num_slots] if self._starts else [0]

    def held_after_shrink(self, num_slots: int) -> int:
        """The slots a shrink toward `num_slots` would hold: whole chunks, the fewest that still
        have `num_slots` (so at most one chunk's worth more)."""
        keep = sum(1 for start in self._starts if start < num_slots)
        return self._starts[keep] if keep < len(self._starts) else self.num_slots

    @torch.inference_mode()
    def resize(self, num_slots: int) -> int:
        """Shrink or grow toward `num_slots`, keeping every resident expert (evict first when
        shrinking). Returns the slot count held: a shrink keeps whole chunks, so it may hold a
        little more than asked (never more than one chunk); a grow stops at the first allocation
        failure. Never raises for lack of memory. Always in inference mode: a chunk grown inside
        a forward is an inference tensor, and a shrink outside one (an out-of-memory retry, the
        KV/slot split) moves experts into it."""
        if len(self.slot_of) > num_slots:
            raise RuntimeError(f"{len(self.slot_of)} experts resident, cannot shrink to {num_slots} slots")
        if num_slots < self.num_slots:
            self._shrink(num_slots)
        elif num_slots > self.num_slots:
            start = self.num_slots
            for size in self._chunk_sizes(start, num_slots):
                try:
                    self._append_chunk(size)
                except OOM_ERRORS:
                    break
            self.free = sorted(set(self.free) | set(range(start, self.num_slots)), reverse=True)
        return self.num_slots

    # ---- internals ------------------------------------------------------------------------
    def _assigned(self, key: Key) -> None:
        self.assign_version[key[0]] = self.assign_version.get(key[0], 0) + 1

    def _chunk_sizes(self, start: int, end: int) -> list[int]:
        return [min(self.chunk_slots, end - s) for s in range(start, end, self.chunk_slots)]

    def _append_chunk(self, size: int) -> None:
        chunk = tuple(self._alloc((size, *shape), dtype=dtype, device=self.device) for shape, dtype in self.specs)
        on_device(*chunk, always=True)       # (the emulated accelerator's memory, for transfers.counting)
        self.layout_version += 1
        self._starts.append(self.num_slots)
        self._chunks.append(chunk)

    def _shrink(self, num_slots: int) -> None:
        keep = sum(1 for start in self._starts if start < num_slots)   # chunks kept
        total = self.held_after_shrink(num_slots)
        spare = sorted((s for s in self.free if s < total), reverse=True)   # lowest last: pop() it
        for key, s in sorted(self.slot_of.items(), key=lambda kv: kv[1]):
            if s >= total:            # in a chunk that goes: move it into a slot that stays
                dst = spare.pop()
                for d, src in zip(self.views(dst), self.views(s)):
                    d.copy_(src)
                self.slot_of[key] = dst
                self._assigned(key)
        del self._chunks[keep:], self._starts[keep:]   # their memory goes back
        self.layout_version += 1
        used = set(self.slot_of.values())
        self.free = [s for s in range(total - 1, -1, -1) if s not in used]
