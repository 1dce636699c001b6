"""Elastic VRAM: how many expert slots to hold given what the device reports free.

Pure arithmetic, so it is tested without a GPU; the executor feeds it the free VRAM (on CUDA
`cuda_free_bytes`: what the driver reports free plus what PyTorch's allocator holds unused;
under emulation an injected probe) once per step. Shrinking is immediate (another process took
memory); growing waits until `grow_margin_bytes` beyond the reserve is free, so a slot count
does not flap around the boundary. The slot cache itself never needs memory to shrink and keeps
what it could get when a grow fails (slots.py).
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


def cuda_free_bytes() -> int:
    """Free VRAM as this process can use it: the driver's free figure plus the blocks PyTorch's
    caching allocator holds but no tensor uses (a finished prefill's activations, say)."""
    import torch

    return torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
