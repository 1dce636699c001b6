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

import math

import torch

from freetoken_py.residency.formats import ExpertFormat
from freetoken_py.residency.slots import SlotCache
from freetoken_py.residency.transfers import on_device, pinned_like


class Streamer:
    def __init__(self, slots: SlotCache, host: list, fmt: ExpertFormat):
        self.slots, self.fmt = slots, fmt
        self.host = host      # per layer: the parts' host banks [E, ...] (pinned on CUDA), or None
        self.cuda = slots.device.type == "cuda"
        self._stream = torch.cuda.Stream() if self.cuda else None
        self._staging = [self._staging_pair(), self._staging_pair()]   # double buffer for unkept copies
        self._next = 0
        self._timed: list = []     # CUDA: (start event, end event, bytes) of copies not yet read back
        self._pending: dict = {}   # CUDA: (layer, expert) -> end event of a look-ahead copy nobody waited for
        # slots compute queued since the last routing read may read (None: unknown, every copy waits)
        self.reading: set[int] | None = None
        self.slot_copies = [0, 0]  # copies into slots: [without waiting for compute, after it]

    def _staging_pair(self) -> tuple[torch.Tensor, ...]:
        s = self.slots
        pair = tuple(torch.empty(shape, dtype=dtype, device=s.device) for shape, dtype in s.specs)
        on_device(*pair, always=True)
        return pair

    def new_call(self, synced: bool) -> None:
        """The executor has read this call's routing: with `synced` (the read waited for the
        compute stream) no earlier work reads a slot any more; else the reads are unknown."""
        self.reading = set() if synced else None

    def mark_read(self, key: tuple[int, int]) -> None:
        """Compute reading (layer, expert)'s slot has been (or is about to be) queued."""
        if self.reading is not None:
            self.reading.add(self.slots.slot_of[key])

    def _copy(self, dst: tuple, layer: int, expert: int, wait: bool = True, after_compute: bool = True):
        return self._copy_pairs([(d, part[expert]) for d, part in zip(dst, self.host[layer])], wait, after_compute)

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

    def to_slot(self, layer: int, expert: int, ahead: bool = False) -> tuple[torch.Tensor, ...]:
        """Copy into the slot the cache reserved for (layer, expert); returns the slot's parts.
        `ahead` (look-ahead prefetch): compute does not wait for it now, only in `wait_for`."""
        slot = self.slots.reserve((layer, expert))
        parts = self.slots.views(slot)
        after = self.reading is None or slot in self.reading
        self.slot_copies[after] += 1
        end = self._copy(parts, layer, expert, wait=not ahead, after_compute=after)
        if ahead and end is not None:
            self._pending[(layer, expert)] = end
        return parts

    def wait_for(self, key: tuple[int, int]) -> None:
        """Before compute reads a slot: wait for its look-ahead copy, if one is still pending."""
        end = self._pending.pop(key, None)
        if end is not None:
            torch.cuda.current_stream().wait_event(end)

    def wait_layer(self, layer: int) -> None:
        """Before compute reads any of `layer`'s slots: wait for their pending look-ahead copies."""
        for key in [k for k in self._pending if k[0] == layer]:
            self.wait_for(key)

    def wait_all(self) -> None:
        """Before slots move (elastic resize): compute waits for every pending look-ahead copy."""
        for end in self._pending.values():
            torch.cuda.current_stream().wait_event(end)
        self._pending.clear()

    def to_staging(self, layer: int, expert: int) -> tuple[torch.Tensor, ...]:
        """Copy into the next staging buffer: a streamed expert the policy chose not to keep."""
        dst = self._staging[self._next]
        self._next ^= 1
        self._copy(dst, layer, expert)
        return dst

    def to_staging_columns(self, layer: int, expert: int, cols: int) -> tuple[torch.Tensor, ...]:
        """Copy the first `cols` columns of an expert's intermediate dimension (gate rows [0, cols),
        up rows [I, I + cols), the down part's first columns: `ExpertFormat.column_pieces`) into
        the next staging buffer: the accelerator's part of an expert the planner cut in two.
        Returns its parts (float: [2 cols, D], [D, cols])."""
        pieces = self.fmt.column_pieces(tuple(part[expert] for part in self.host[layer]), cols)
        dst = self._staging[self._next]
        self._next ^= 1
        out, pairs = [], []
        for buf, shape, srcs in zip(dst, self.fmt.column_shapes(cols), pieces):
            view = buf.view(-1)[:math.prod(shape)].view(shape)
            row = 0
            for src in srcs:
                if not src.is_contiguous():    # the down part's first columns: gathered on the host,
                    src = src.contiguous()     # pinned, so its copy stays an asynchronous DMA
                    if self.cuda:
                        src = src.pin_memory()
                    else:
                        pinned_like(src)   # (emulated: as it would be on CUDA)
                pairs.append((view[row:row + src.shape[0]], src))
                row += src.shape[0]
            out.append(view)
        self._copy_pairs(pairs)
        return tuple(out)
