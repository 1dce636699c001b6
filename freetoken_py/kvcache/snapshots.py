"""Prefix-state snapshots of the recurrent layers (hybrid models: Gated DeltaNet + full attention).

A hybrid model's request state is its full-attention K/V pages plus one fixed-size recurrent slot
(state.StatePool). A cached prefix is only resumable where the recurrent state at its end is also
known, so while a request computes, the scheduler copies its slot into a spare slot at chosen page
boundaries (a *snapshot*) and the radix cache keeps it on the node of the page where it was taken::

    namespace root ── node[p0] ── node[p1] ── node[p2] ── node[p3]
                                  snapshot A              snapshot B      (state after 2 / 4 pages)

A new prompt resumes from the deepest node on its shared path that holds a snapshot: the K/V pages
up to there are shared as usual and the snapshot is copied into the request's own slot.

Integrity: every snapshot slot has a generation tag (bumped when it is taken and when it is given
back), and a `SnapshotRef` records the tag, the namespace it was taken under and a checksum of its
contents. `restore` refuses a ref whose slot changed hands (tag), that was taken under another
namespace (owner), or whose bytes changed since it was taken (checksum): a corrupted or reassigned
snapshot is never read into a request. The checksum is the sum of the state's 64-bit words (mod
2**64; one numpy reduction at memory speed, ~2 ms for the 66 MB of a Qwen3.6-35B-A3B state, where
summing 32-bit words into a 64-bit total took ~40 ms). A snapshot its taker still holds privately
(a request's rolling decode snapshot, `retake`) is left unsealed (checksum None) while it is
overwritten page after page, and sealed once, when it is published (`seal`); an unsealed ref is
never restored. Counters (`bytes_copied`, `bytes_checksummed`, and the pool's `bytes_zeroed`)
make the cost countable.

Spacing (`snapshot_every_pages`): a snapshot taken L tokens after the previous one saves at most L
tokens of recompute (a prompt diverging just before it), and its bytes could instead hold
state_bytes / kv_bytes_per_token tokens of cached K/V pages, each of which would otherwise have to
be recomputed once evicted. It pays when L >= state_bytes / kv_bytes_per_token, so the rule is one
snapshot every ceil(state_bytes / (kv_bytes_per_token * page_size)) pages, both inputs measured from
the pools' tensors. On top of that the scheduler always snapshots at the last page boundary of each
prompt and of each finished sequence (where an agent's next turn diverges), which is what carries
almost every cross-turn hit.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from freetoken_py.kvcache.state import StatePool


class SnapshotRef(NamedTuple):
    slot: int        # the spare StatePool slot holding the copy
    tag: int         # the slot's generation when it was taken
    owner: Hashable  # the cache namespace it was taken under
    position: int    # tokens the state covers (a multiple of the page size)
    checksum: int | None  # of its bytes when sealed (0 when checks are off; None: not sealed yet)


def snapshot_every_pages(state_bytes: int, kv_bytes_per_token: int, page_size: int) -> int:
    """Pages between two periodic snapshots: where a snapshot's bytes equal the K/V bytes of the
    tokens it saves from recompute (module docstring)."""
    if kv_bytes_per_token <= 0:
        return 1
    return max(1, -(-state_bytes // (kv_bytes_per_token * page_size)))


def word_sum(x: torch.Tensor, on_host: bool = True) -> int:
    """The sum of a contiguous 4-byte-element tensor's 64-bit words mod 2**64 (its 32-bit words
    when the size is not a multiple of 8 bytes): numpy on the host, a torch reduction where the
    tensor lives otherwise (no transfer). Both give the same value for the same bytes."""
    if on_host:
        a = x.detach().cpu().numpy().reshape(-1)
        words = a.view(np.uint64) if a.nbytes % 8 == 0 else a.view(np.uint32)
        return int(words.sum(dtype=np.uint64))
    w = x.detach().reshape(-1)
    w = w.view(torch.int64) if w.numel() * w.element_size() % 8 == 0 else w.view(torch.int32).long() & 0xFFFFFFFF
    return int(w.sum().item()) % (1 << 64)


class SnapshotStore:
    """Snapshot slots taken from a StatePool's spares, at most `capacity` at once (the pool keeps
    the rest for running requests)."""

    def __init__(self, pool: StatePool, capacity: int, check: bool = True):
        if capacity > pool.num_free:
            raise ValueError(f"{capacity} snapshot slots asked, the state pool has {pool.num_free} free")
        self.pool = pool
        self.capacity = capacity
        self.check = check
        self.tags = np.zeros(pool.num_slots, dtype=np.int64)
        self._mine: set[int] = set()
        self.num_taken = 0
        self.num_restored = 0
        self.num_mismatches = 0   # restores refused: slot reassigned, other owner or bytes changed
        self.bytes_copied = 0     # state bytes copied into or out of snapshot slots (mixer captures too)
        self.bytes_checksummed = 0

    @property
    def num_free(self) -> int:
        return self.capacity - len(self._mine)

    @property
    def bytes_per_snapshot(self) -> int:
        return self.pool.bytes_per_slot

    @property
    def bytes_held(self) -> int:
        return len(self._mine) * self.pool.bytes_per_slot

    def checksum(self, slot: int) -> int:
        """Sum of the slot's 64-bit words (mod 2**64) over every recurrent layer: any changed word
        changes it. One reduction per layer where the state lives (numpy on the host)."""
        if not self.check:
            return 0
        total = 0
        for t in self.pool.conv + self.pool.rec:
            if t is None:
                continue
            x = t[slot]
            total += word_sum(x, on_host=x.device.type == "cpu")
            self.bytes_checksummed += x.numel() * x.element_size()
        return total % (1 << 64)

    def _slot(self) -> int:
        """A snapshot slot, not zeroed (every byte is written before it is read)."""
        slot = self.pool.allocate(zeroed=False)
        self._mine.add(slot)
        self.tags[slot] += 1
        return slot

    def take(self, src_slot: int, owner: Hashable, position: int, seal: bool = True) -> SnapshotRef | None:
        """Copy request slot `src_slot` into a new snapshot; None when every snapshot slot is used.
        seal=False: left unsealed (a rolling snapshot its taker keeps overwriting; `seal` it before
        it is published)."""
        if self.num_free <= 0 or self.pool.num_free <= 0:
            return None
        slot = self._slot()
        self.pool.copy(src_slot, slot)
        self.bytes_copied += self.pool.bytes_per_slot
        self.num_taken += 1
        ref = SnapshotRef(slot, int(self.tags[slot]), owner, position, None)
        return self.seal(ref) if seal else ref

    def reserve(self, owner: Hashable, position: int) -> SnapshotRef | None:
        """A snapshot slot the forward pass fills (a capture inside a chunk); `seal` it after."""
        if self.num_free <= 0 or self.pool.num_free <= 0:
            return None
        slot = self._slot()
        return SnapshotRef(slot, int(self.tags[slot]), owner, position, None)

    def seal(self, ref: SnapshotRef, captured: bool = False) -> SnapshotRef:
        """The slot now holds its final state: the ref with its checksum. captured: a `reserve`d
        slot the mixer just filled (counted as one snapshot taken, its bytes copied)."""
        if captured:
            self.num_taken += 1
            self.bytes_copied += self.pool.bytes_per_slot
        return ref._replace(checksum=self.checksum(ref.slot))

    def retake(self, ref: SnapshotRef, src_slot: int, position: int) -> SnapshotRef:
        """Overwrite a snapshot still held by its taker (not in the cache) with a later state,
        unsealed (no checksum until it is published)."""
        assert self.valid(ref, ref.owner), "retake of a snapshot given back"
        self.pool.copy(src_slot, ref.slot)
        self.bytes_copied += self.pool.bytes_per_slot
        self.num_taken += 1
        return ref._replace(position=position, checksum=None)

    def valid(self, ref: SnapshotRef, owner: Hashable) -> bool:
        """The slot is still this snapshot's and it belongs to `owner` (cheap: no byte check)."""
        return ref.slot in self._mine and int(self.tags[ref.slot]) == ref.tag and ref.owner == owner

    def restore(self, ref: SnapshotRef, owner: Hashable, dst_slot: int) -> bool:
        """Copy the snapshot into request slot `dst_slot`. False (nothing copied, counted) when the
        slot changed hands, the owner differs or its bytes changed since it was taken."""
        if not self.valid(ref, owner) or ref.checksum is None or self.checksum(ref.slot) != ref.checksum:
            self.num_mismatches += 1
            return False
        self.pool.copy(ref.slot, dst_slot)
        self.bytes_copied += self.pool.bytes_per_slot
        self.num_restored += 1
        return True

    def release(self, ref: SnapshotRef) -> None:
        """Give the snapshot's slot back (a ref whose slot already changed hands frees nothing)."""
        if ref.slot in self._mine and int(self.tags[ref.slot]) == ref.tag:
            self._mine.discard(ref.slot)
            self.tags[ref.slot] += 1
            self.pool.free(ref.slot)
