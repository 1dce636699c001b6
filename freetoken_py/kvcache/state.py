"""Fixed-size per-request state of the `recurrent` layers (spec.Recurrent: Gated DeltaNet).

Layout, per model layer i with a Recurrent spec (None for every other layer)::

    conv[i] : fp32 [num_slots, conv_dim, conv_width]   the last conv_width pre-conv inputs, oldest first
    rec[i]  : fp32 [num_slots, Hv, dk, dv]             delta-rule state S (o = q @ S)

A request holds one slot (Request.state_slot) from admission to finish / abort / preemption; a
slot is zeroed when handed out, so recompute after preemption starts from scratch. Slots beyond
`max_num_seqs` are spares for prefix-state snapshots (`copy` a request's slot into one).
"""
from __future__ import annotations

import heapq

import torch

from freetoken_py.kvcache.spec import Recurrent, StateSpec


class OutOfStateSlotsError(RuntimeError):
    """Every state slot is held."""


class StatePool:
    def __init__(self, specs: list[StateSpec], num_slots: int, device: str | torch.device = "cpu"):
        if num_slots <= 0:
            raise ValueError("num_slots must be positive")
        self.num_slots = num_slots
        self.specs = list(specs)
        self.device = torch.device(device)
        self.conv: list[torch.Tensor | None] = []
        self.rec: list[torch.Tensor | None] = []
        for s in specs:
            if isinstance(s, Recurrent):
                self.conv.append(torch.zeros(num_slots, s.conv_dim, s.conv_width, device=self.device))
                self.rec.append(torch.zeros(num_slots, s.num_v_heads, s.k_head_dim, s.v_head_dim, device=self.device))
            else:
                self.conv.append(None)
                self.rec.append(None)
        self._free = list(range(num_slots))
        self._held = [False] * num_slots
        self.bytes_zeroed = 0  # state bytes written by `reset` (zeroing a slot), counted
        self.bytes_copied = 0  # state bytes written by `copy` (snapshots taken and restored), counted

    @property
    def layers(self) -> list[int]:
        return [i for i, c in enumerate(self.conv) if c is not None]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one request's state across every recurrent layer (measured from the tensors)."""
        return sum(t[0].numel() * t.element_size() for t in self.conv + self.rec if t is not None)

    def allocate(self, zeroed: bool = True) -> int:
        """A free slot, zeroed (zeroed=False: its old bytes, for a caller that overwrites them
        all before any read: a snapshot copy, a restore)."""
        if not self._free:
            raise OutOfStateSlotsError(f"all {self.num_slots} state slots are held")
        slot = heapq.heappop(self._free)
        self._held[slot] = True
        if zeroed:
            self.reset(slot)
        return slot

    def free(self, slot: int) -> None:
        assert self._held[slot], f"double free of state slot {slot}"
        self._held[slot] = False
        heapq.heappush(self._free, slot)

    def reset(self, slot: int) -> None:
        for t in self.conv + self.rec:
            if t is not None:
                t[slot].zero_()
        self.bytes_zeroed += self.bytes_per_slot

    def copy(self, src: int, dst: int) -> None:
        """Slot `dst` becomes a copy of slot `src` in every recurrent layer."""
        for t in self.conv + self.rec:
            if t is not None:
                t[dst].copy_(t[src])
        self.bytes_copied += self.bytes_per_slot
