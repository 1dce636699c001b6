"""PCIe streamer: host expert banks -> VRAM slots or a double-buffered staging pair.

With device="cuda" the copies are issued on a dedicated copy stream from pinned host banks and
the compute stream waits on an event, so copies overlap compute. Under an emulated accelerator
(device="cpu") the copy is a plain tensor copy and its *duration* is taken from the cost model
(bytes / profile PCIe bandwidth): the emulated time is what telemetry reports, labelled as such.
The CUDA branch is the same code with a stream; it is not exercised on a machine without a GPU.
There, each copy is timed with a pair of CUDA events on the copy stream, read back without
waiting (`finished_copies`), so the cost model's PCIe figure follows what the link delivers.

A copy into a slot waits for the compute stream only when compute queued since the executor's
last routing read may still read that slot (`reading`, filled by `mark_read`): the routing read
waited for everything queued before it, so a slot no work of this call reads is free to
overwrite at once, and the copy overlaps the hits' compute, as the planner's time assumes.
Staging buffers (two, reused) always wait.
"""
from __future__ import annotations

import torch

from freetoken_py.residency.slots import SlotCache


class Streamer:
    def __init__(self, slots: SlotCache, host_w13: list, host_w2: list):
        self.slots = slots
        self.host_w13, self.host_w2 = host_w13, host_w2   # per layer [E, 2I, D] / [E, D, I] (pinned on CUDA)
        self.cuda = slots.device.type == "cuda"
        self._stream = torch.cuda.Stream() if self.cuda else None
        self._staging = [self._staging_pair(), self._staging_pair()]   # double buffer for unkept copies
        self._next = 0
        self._timed: list = []     # CUDA: (start event, end event, bytes) of copies not yet read back
        self._pending: dict = {}   # CUDA: (layer, expert) -> end event of a look-ahead copy nobody waited for
        # slots compute queued since the last routing read may read (None: unknown, every copy waits)
        self.reading: set[int] | None = None
        self.slot_copies = [0, 0]  # copies into slots: [without waiting for compute, after it]

    def _staging_pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.slots
        return (torch.empty(s.w13_shape, dtype=s.dtype, device=s.device),
                torch.empty(s.w2_shape, dtype=s.dtype, device=s.device))

    def new_call(self, synced: bool) -> None:
        """The executor has read this call's routing: with `synced` (the read waited for the
        compute stream) no earlier work reads a slot any more; else the reads are unknown."""
        self.reading = set() if synced else None

    def mark_read(self, key: tuple[int, int]) -> None:
        """Compute reading (layer, expert)'s slot has been (or is about to be) queued."""
        if self.reading is not None:
            self.reading.add(self.slots.slot_of[key])

    def _copy(self, dst13: torch.Tensor, dst2: torch.Tensor, layer: int, expert: int, wait: bool = True,
              after_compute: bool = True):
        return self._copy_pairs([(dst13, self.host_w13[layer][expert]), (dst2, self.host_w2[layer][expert])], wait,
                                after_compute)

    @torch.inference_mode()   # a slot chunk grown inside a forward is an inference tensor
    def _copy_pairs(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], wait: bool = True,
                    after_compute: bool = True):
        """(device destination, host source) copies, on the copy stream where there is one. With
        `wait`, later compute waits for them; without, the caller gets the copy's end event and
        waits for it where the data is first used (a look-ahead copy must not hold up the
        current layer's work). With `after_compute` they start after the compute queued so far
        (which may read the destination)."""
        if self._stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            return None
        compute = torch.cuda.current_stream()     # taken outside the block: inside it, this is the copy stream
        if after_compute:   # the slot or staging buffer may still be read by compute queued earlier
            self._stream.wait_stream(compute)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            start.record()
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            end.record()
        if wait:
            compute.wait_stream(self._stream)       # compute waits for this copy only
        self._timed.append((start, end, sum(src.numel() * src.element_size() for _, src in pairs)))
        return end

    def finished_copies(self) -> tuple[int, float]:
        """(bytes, seconds) of the timed copies that have completed since the last call (CUDA
        events on the copy stream; never waits). (0, 0.0) without CUDA."""
        done, pending = [], []
        for item in self._timed:
            (done if item[1].query() else pending).append(item)
        self._timed = pending
        return (sum(b for _, _, b in done), sum(s.elapsed_time(e) for s, e, _ in done) / 1e3)

    def to_slot(self, layer: int, expert: int, ahead: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy into the slot the cache reserved for (layer, expert); returns the slot's views.
        `ahead` (look-ahead prefetch): compute does not wait for it now, only in `wait_for`."""
        slot = self.slots.reserve((layer, expert))
        w13, w2 = self.slots.views(slot)
        after = self.reading is None or slot in self.reading
        self.slot_copies[after] += 1
        end = self._copy(w13, w2, layer, expert, wait=not ahead, after_compute=after)
        if ahead and end is not None:
            self._pending[(layer, expert)] = end
        return w13, w2

    def wait_for(self, key: tuple[int, int]) -> None:
        """Before compute reads a slot: wait for its look-ahead copy, if one is still pending."""
        end = self._pending.pop(key, None)
        if end is not None:
            torch.cuda.current_stream().wait_event(end)

    def wait_all(self) -> None:
        """Before slots move (elastic resize): compute waits for every pending look-ahead copy."""
        for end in self._pending.values():
            torch.cuda.current_stream().wait_event(end)
        self._pending.clear()

    def to_staging(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy into the next staging buffer: a streamed expert the policy chose not to keep."""
        dst = self._staging[self._next]
        self._next ^= 1
        self._copy(dst[0], dst[1], layer, expert)
        return dst

    def to_staging_columns(self, layer: int, expert: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the first `cols` columns of an expert's intermediate dimension (gate rows [0, cols),
        up rows [I, I + cols), down columns [0, cols)) into the next staging buffer: the
        accelerator's part of an expert the planner cut in two. Returns ([2 cols, D], [D, cols])."""
        w13, w2 = self.host_w13[layer][expert], self.host_w2[layer][expert]   # [2I, D], [D, I]
        inter, dim = w2.shape[-1], w2.shape[0]
        down = w2[:, :cols].contiguous()       # the one strided part: gathered on the host
        if self.cuda:                          # pinned, so its copy stays an asynchronous DMA
            down = down.pin_memory()
        dst = self._staging[self._next]
        self._next ^= 1
        dst13 = dst[0][:2 * cols]
        dst2 = dst[1].view(-1)[:dim * cols].view(dim, cols)
        # gate rows [0, cols) and up rows [I, I + cols) are contiguous slices of the host bank
        self._copy_pairs([(dst13[:cols], w13[:cols]), (dst13[cols:], w13[inter:inter + cols]), (dst2, down)])
        return dst13, dst2
