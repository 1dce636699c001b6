"""Elastic VRAM: how many expert slots to hold given what the device reports free.

Pure arithmetic, so it is tested without a GPU; the executor feeds it `torch.cuda.mem_get_info()`
(or, under emulation, an injected probe) once per step. Shrinking is immediate (another process
took memory); growing waits until `grow_margin_bytes` beyond the reserve is free, so a slot
count does not flap around the boundary. An allocation failure halves the slots and retries.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ElasticVram:
    slot_bytes: int
    max_slots: int                 # never more than the configured budget allows
    reserve_bytes: int = 256 * 2**20   # left free for activations and other processes' spikes
    grow_margin_bytes: int = 256 * 2**20

    def target(self, free_bytes: int, current_slots: int) -> int:
        """Slots to hold now. `free_bytes` is the device's free memory *besides* our slots."""
        usable = current_slots * self.slot_bytes + free_bytes - self.reserve_bytes
        want = max(0, min(self.max_slots, usable // self.slot_bytes))
        if want < current_slots:
            return want
        if want > current_slots and free_bytes - self.reserve_bytes >= self.grow_margin_bytes:
            return want
        return current_slots

    @staticmethod
    def after_oom(current_slots: int) -> int:
        return current_slots // 2
