"""The VRAM slot cache: fixed-size slots of one expert format, addressed by (layer, expert).

    w13 [S, 2I, D]   gate and up projections of the expert in each slot
    w2  [S, D, I]    down projection

Under an emulated accelerator the slots are CPU tensors (device="cpu"); with device="cuda" the
same code holds them in VRAM and the copies go through `Streamer`. Resizing (elastic VRAM)
reallocates and compacts: surviving experts keep their contents, slot ids change.
"""
from __future__ import annotations

import torch

Key = tuple[int, int]


def _oom_types() -> tuple[type, ...]:
    types = [getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)]
    return tuple(t for t in types if t is not None) or (RuntimeError,)


OOM_ERRORS = _oom_types()


class SlotCache:
    def __init__(self, num_slots: int, w13_shape: tuple[int, int], w2_shape: tuple[int, int],
                 dtype: torch.dtype, device: str | torch.device = "cpu", alloc=torch.empty):
        self.w13_shape, self.w2_shape = tuple(w13_shape), tuple(w2_shape)
        self.dtype, self.device = dtype, torch.device(device)
        self._alloc = alloc   # injectable so tests can make an allocation fail
        self.w13 = self._alloc((num_slots, *self.w13_shape), dtype=dtype, device=self.device)  # [S, 2I, D]
        self.w2 = self._alloc((num_slots, *self.w2_shape), dtype=dtype, device=self.device)    # [S, D, I]
        self.slot_of: dict[Key, int] = {}
        self.free = list(range(num_slots - 1, -1, -1))   # pop() hands out slot 0 first

    @property
    def num_slots(self) -> int:
        return self.w13.shape[0]

    @property
    def slot_bytes(self) -> int:
        return (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size() if self.num_slots else \
            (self.w13_shape[0] * self.w13_shape[1] + self.w2_shape[0] * self.w2_shape[1]) * \
            torch.empty((), dtype=self.dtype).element_size()

    def __contains__(self, key: Key) -> bool:
        return key in self.slot_of

    def get(self, key: Key) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.slot_of[key]
        return self.w13[s], self.w2[s]

    def reserve(self, key: Key) -> int:
        """A free slot for `key` (the caller copies into it). Raises if none is free."""
        if key in self.slot_of:
            return self.slot_of[key]
        if not self.free:
            raise RuntimeError("slot cache full: the policy must evict before admitting")
        self.slot_of[key] = s = self.free.pop()
        return s

    def evict(self, key: Key) -> None:
        self.free.append(self.slot_of.pop(key))

    def resize(self, num_slots: int) -> None:
        """Reallocate to `num_slots`, keeping every resident expert (evict first when shrinking)."""
        if len(self.slot_of) > num_slots:
            raise RuntimeError(f"{len(self.slot_of)} experts resident, cannot shrink to {num_slots} slots")
        w13 = self._alloc((num_slots, *self.w13_shape), dtype=self.dtype, device=self.device)
        w2 = self._alloc((num_slots, *self.w2_shape), dtype=self.dtype, device=self.device)
        keys = sorted(self.slot_of, key=self.slot_of.get)
        for new, key in enumerate(keys):
            w13[new].copy_(self.w13[self.slot_of[key]])
            w2[new].copy_(self.w2[self.slot_of[key]])
        self.w13, self.w2 = w13, w2          # old tensors freed here (VRAM returned to the allocator)
        self.slot_of = {k: i for i, k in enumerate(keys)}
        self.free = list(range(num_slots - 1, len(keys) - 1, -1))
