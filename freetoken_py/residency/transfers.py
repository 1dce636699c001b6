"""The residency executor's host <-> accelerator traffic and kernel launches, in one place.

A decode layer-step on a GPU is bounded by its fixed costs long before its bytes: each blocking
device->host read waits for everything queued, a host->device copy from pageable memory is staged
by the driver and waits too, and every launch costs host time. So every transfer the executor
makes goes through `Transfers`, which

- reads what the host needs from the accelerator in ONE copy: `read_packed` lays the routing ids,
  the routing weights, the look-ahead's router logits and (when the CPU tier may have work) the
  activations side by side as bytes in one device buffer (one `cat` launch; the same launch also
  writes a zero block that becomes the layer's output buffer), and copies them into a pooled
  pinned host buffer;
- sends host data to the accelerator only from pooled pinned staging buffers (`to_device`);
- hands out pooled CUDA events.

`COUNTS` holds what `counting()` observed: it wraps torch's dispatcher (a dispatch mode and a
function mode) and counts, for every operation while it is on, the kernels queued on the
accelerator (any operation but a view or an allocation on an accelerator tensor), the device ->
host reads (a copy from the accelerator into host memory, `.item()`, `.tolist()`, `.numpy()`, and
an operation whose output size depends on the data: `nonzero`, boolean-mask indexing,
`masked_select`, `unique`, `repeat_interleave` without `output_size`, which on CUDA read a count
back inside the operation) and
the host -> device copies (from pinned memory or pageable memory; a host tensor other than a
0-dim one handed to an accelerator operation is an implicit pageable copy on CUDA, and counted as
one), and `kernels.gpu_moe` counts its Triton launches at the one place it makes them. Nothing is
declared by hand: a stray `.tolist()` of a device tensor added anywhere in the executor is a
counted read. On CUDA an accelerator tensor is one on the GPU; on the emulated accelerator, where
the device is the host, it is one whose storage was marked as the accelerator's (`on_device`: the
slots, the staging buffers, the executor's inputs, the transfers' device buffers) or was computed
from one; memory that would be page-locked on CUDA (the transfers' staging, the expert banks the
engine pins) is marked `pinned_like`. Tests hold a decode step to at most one read, no pageable
copy and few launches per MoE layer on the emulated accelerator: the same code path, with plain
host buffers (nothing to pin) and copies that are memcpys. Counting costs host time (every
operation passes through Python): benches count in a pass of their own.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
import time
from typing import Optional, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass
class Counts:
    d2h_reads: int = 0        # device -> host copies the host waits for
    h2d_pinned: int = 0       # host -> device copies from pinned (or registered) memory
    h2d_pageable: int = 0     # host -> device copies from pageable memory (each waits for the queue)
    torch_launches: int = 0   # torch's kernels queued on the accelerator
    triton_launches: int = 0  # kernels.gpu_moe's Triton kernels
    d2h_wait_s: float = 0.0   # seconds the host spent in the routing reads (waiting for the queue, then the copy)

    @property
    def launches(self) -> int:
        return self.torch_launches + self.triton_launches

    def __sub__(self, other: "Counts") -> "Counts":
        return Counts(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def snapshot(self) -> "Counts":
        from freetoken_py.kernels import gpu_moe

        self.triton_launches = gpu_moe.LAUNCHES.count if _ACTIVE else self.triton_launches
        return replace(self)


COUNTS = Counts()    # process-wide: tests take a snapshot before and after a decode step

# ---- what lies on the (emulated) accelerator ------------------------------------------------------
_DEVICE: dict[int, StorageWeakRef] = {}    # storages marked as the accelerator's (emulation)
_PINNED: dict[int, StorageWeakRef] = {}    # host storages that would be page-locked on CUDA
_ACTIVE = False                            # `counting()` is on


def _mark(table: dict, tensors) -> None:
    if len(table) > 8192:          # (forget the storages that have gone)
        for key in [k for k, ref in table.items() if ref.expired()]:
            del table[key]
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            s = t.untyped_storage()
            ref = table.get(s._cdata)
            if ref is None or ref.expired():
                table[s._cdata] = StorageWeakRef(s)


def _marked(table: dict, t: torch.Tensor) -> bool:
    ref = table.get(t.untyped_storage()._cdata)
    return ref is not None and not ref.expired()


def on_device(*tensors, always: bool = False) -> None:
    """Mark host tensors as the emulated accelerator's (for `counting`): memory that lasts (slots,
    staging: `always`) whether or not counting is on, a call's inputs and buffers while it is."""
    if _ACTIVE or always:
        _mark(_DEVICE, tensors)


def pinned_like(*tensors) -> None:
    """Mark host tensors that would be page-locked on CUDA (staging, the pinned expert banks)."""
    _mark(_PINNED, tensors)


def _dev(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" or (t.device.type == "cpu" and _marked(_DEVICE, t))


def _is_pinned(t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and torch.cuda.is_available() and t.is_pinned()) or _marked(_PINNED, t)


_aten = torch.ops.aten
_NO_KERNEL = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
              _aten.lift_fresh.default, _aten._unsafe_view.default, _aten.resize_.default,
              _aten.set_.source_Storage_storage_offset, _aten.set_.source_Tensor, _aten.sym_size.int,
              _aten.sym_stride.int, _aten.sym_numel.default, _aten.sym_storage_offset.default}

# operations whose output size depends on the data: on CUDA each waits for the device and reads a
# count back inside the operation (not through the dispatcher), so each is a read as well
_SIZE_READS = {_aten.nonzero.default, _aten.masked_select.default, _aten._unique2.default,
               _aten.unique_dim.default, _aten.unique_consecutive.default}
_INDEXING = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default, _aten._index_put_impl_.default}


def _reads_a_size(func, args, kwargs) -> bool:
    if func in _SIZE_READS:
        return True
    if func is _aten.repeat_interleave.Tensor:   # (its only positional argument is the repeats)
        return kwargs.get("output_size") is None
    if func in _INDEXING and len(args) > 1:       # a boolean mask among the indices: a nonzero first
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
    return False


class _Dispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from freetoken_py.kernels import gpu_moe

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if gpu_moe.LAUNCHES.inside:        # (Triton's interpreter at work inside a counted launch)
            return out
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on = [_dev(t) for t in ins]
        if func is _aten.copy_.default or func is _aten._to_copy.default:
            # copy_(dst, src), or src.to(...): across the link, or a kernel on one side
            if func is _aten.copy_.default:
                dst, src, d, s = ins[0], ins[1], on[0], on[1]
            else:                  # (a cast of an emulated accelerator tensor stays there)
                dst, src, s = out, ins[0], on[0]
                d = out.device.type == "cuda" or (out.device.type == "cpu" and s and src.device.type == "cpu")
            if d and not s:
                if _is_pinned(src):
                    COUNTS.h2d_pinned += 1
                else:
                    COUNTS.h2d_pageable += 1
            elif s and not d:
                COUNTS.d2h_reads += 1
            elif d and s:
                COUNTS.torch_launches += 1
            if d:
                on_device(dst)
            return out
        if func is _aten._local_scalar_dense.default:
            COUNTS.d2h_reads += any(on)
            return out
        if not any(on):
            return out
        if not (func.is_view or func in _NO_KERNEL):
            COUNTS.torch_launches += 1
        if _reads_a_size(func, args, kwargs):
            COUNTS.d2h_reads += 1
        # a host tensor (not a 0-dim scalar) in an accelerator operation: an implicit copy on CUDA
        COUNTS.h2d_pageable += sum(1 for t, o in zip(ins, on) if not o and t.dim() > 0 and t.device.type == "cpu")
        on_device(*(t for t in tree_leaves(out) if isinstance(t, torch.Tensor)))
        return out


class _Function(TorchFunctionMode):
    """`.tolist()` / `.numpy()` of an emulated accelerator tensor read it on the host without
    passing torch's dispatcher (on CUDA they copy to the host through it: counted there)."""
    READS = (torch.Tensor.tolist, torch.Tensor.numpy)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu":
            from freetoken_py.kernels import gpu_moe

            if not gpu_moe.LAUNCHES.inside and _marked(_DEVICE, args[0]):
                COUNTS.d2h_reads += 1
        return func(*args, **(kwargs or {}))


class counting:
    """Count what passes between the host and the accelerator, and the accelerator's kernels,
    while on (`COUNTS`; the module's docstring says what counts as what)."""

    def __enter__(self):
        global _ACTIVE
        from freetoken_py.kernels import gpu_moe

        self._was, _ACTIVE = _ACTIVE, True
        if self._was:              # (nested: the outer one counts)
            self._modes = ()
            return COUNTS
        COUNTS.triton_launches = gpu_moe.LAUNCHES.count
        self._modes = (_Function(), _Dispatch())
        for m in self._modes:
            m.__enter__()
        return COUNTS

    def __exit__(self, *exc):
        global _ACTIVE
        for m in reversed(self._modes):
            m.__exit__(*exc)
        if self._modes:
            COUNTS.snapshot()
        _ACTIVE = self._was


def _align(n: int, to: int = 64) -> int:
    return -(-n // to) * to


# layouts (and kept device buffers) held before all are dropped: a decode step's few shapes, the
# prefill chunks' and one slot map per MoE layer (up to ~94 layers in the published models), with
# room to spare: 128 made a 90-layer model drop and remake them over and over
MAX_LAYOUTS = 1024


class Transfers:
    """Pooled staging for one executor's transfers to and from `device` (pinned host buffers on
    CUDA, plain host buffers otherwise), reused call after call: a buffer is rewritten only after
    the next routing read, which waited for every copy queued from it before."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._host: dict[str, torch.Tensor] = {}
        self._zeros: Optional[torch.Tensor] = None      # [n] uint8 zeros on the device
        self._layouts: dict = {}                         # read_packed's layouts, by the parts' shapes
        self._kept: dict = {}                            # to_device(keep=True)'s device buffers, by role and shapes
        self._events: list = []

    # ---- pooled buffers and events -------------------------------------------------------------
    def host(self, role: str, nbytes: int) -> torch.Tensor:
        """A pooled host buffer of at least `nbytes` bytes for `role` (uint8 [nbytes])."""
        buf = self._host.get(role)
        if buf is None or buf.numel() < nbytes:
            with torch.inference_mode(False):   # (written in place in and out of inference mode)
                buf = torch.empty(max(4096, 1 << max(0, nbytes - 1).bit_length()), dtype=torch.uint8,
                                  pin_memory=self.pinned)
            pinned_like(buf)
            self._host[role] = buf
        return buf[:nbytes]

    def _zero_bytes(self, nbytes: int) -> torch.Tensor:
        if self._zeros is None or self._zeros.numel() < nbytes:
            with torch.inference_mode(False):
                self._zeros = torch.zeros(max(4096, 1 << max(0, nbytes - 1).bit_length()), dtype=torch.uint8,
                                          device=self.device)
                on_device(self._zeros, always=True)
        return self._zeros[:nbytes]

    def event(self, timing: bool = False):
        """A CUDA event from the pool (give it back with `release` once it has been read)."""
        for i, (ev, t) in enumerate(self._events):
            if t == timing:
                return self._events.pop(i)[0]
        return torch.cuda.Event(enable_timing=timing)

    def release(self, *events, timing: bool = True) -> None:
        self._events.extend((ev, timing) for ev in events if ev is not None)

    # ---- device -> host --------------------------------------------------------------------------
    def read_packed(self, parts: Sequence[Optional[torch.Tensor]], out_like: Optional[torch.Tensor] = None,
                    role: str = "read") -> tuple[list[Optional[torch.Tensor]], Optional[torch.Tensor]]:
        """`parts` (device tensors or None) on the host, in one device -> host copy. With
        `out_like`, also a zeroed device tensor of its shape and dtype, written by the same
        launch (the layer's output buffer). Returns (host views of the parts, in their shapes
        and dtypes, valid until the next read for `role`; the zeroed tensor or None)."""
        key = (role, tuple(None if p is None else (p.shape, p.dtype) for p in parts),
               None if out_like is None else (out_like.shape, out_like.dtype))
        layout = self._layouts.get(key)
        if layout is None:          # (decode repeats one layout: its views are made once)
            if len(self._layouts) >= MAX_LAYOUTS:
                self._layouts.clear()
                self._kept.clear()
            layout = self._layouts[key] = self._layout(parts, out_like, role)
        order, zero, dst, got, rows = layout
        flat = [] if zero is None else [zero]
        if rows:                    # one row each: [1, n] byte views side by side (no reshapes)
            for i in order:
                p = parts[i]
                if not p.is_contiguous():
                    p = p.contiguous()
                flat.append(p.view(torch.uint8))
            packed = torch.cat(flat, 1) if len(flat) > 1 else flat[0].clone()
            tail = packed[:, zero.shape[1]:] if zero is not None else packed
        else:
            for i in order:
                p = parts[i]
                if not p.is_contiguous():
                    p = p.contiguous()
                flat.append(p.reshape(-1).view(torch.uint8))
            packed = torch.cat(flat) if len(flat) > 1 else flat[0].clone()
            tail = packed[zero.numel():] if zero is not None else packed
        if dst.numel():
            t0 = time.perf_counter()
            dst.copy_(tail)                     # pinned on CUDA: waits for the queue, once
            COUNTS.d2h_wait_s += time.perf_counter() - t0
        out = None
        if out_like is not None:
            n = out_like.numel() * out_like.element_size()
            if rows and out_like.dim() == 2:
                out = packed[:, :n].view(out_like.dtype)          # [1, D]
            else:
                out = packed.view(-1)[:n].view(out_like.dtype).view(out_like.shape)
        return got, out

    def _layout(self, parts, out_like, role: str) -> tuple:
        """Where each part lies in the packed bytes: (the parts' order, widest elements first, so
        every part starts at a multiple of its element size; the zero block, a view of the pooled
        zeros, or None; the host buffer the bytes are read into; the parts' host views, None for
        an absent part; whether every part and the output are one contiguous row [1, n], which
        packs along dim 1 with no reshapes: a decode step's)."""
        with torch.inference_mode(False):   # (views written in place in and out of inference mode)
            order = sorted((i for i, p in enumerate(parts) if p is not None), key=lambda i: -parts[i].element_size())
            sizes = [parts[i].numel() * parts[i].element_size() for i in order]
            zero_n = _align(out_like.numel() * out_like.element_size()) if out_like is not None else 0
            rows = all(parts[i].dim() == 2 and parts[i].shape[0] == 1 and parts[i].is_contiguous() for i in order) \
                and (out_like is None or (out_like.dim() in (1, 2) and out_like.numel() == out_like.shape[-1]))
            zero = None
            if zero_n:
                zero = self._zero_bytes(zero_n)
                zero = zero.view(1, zero_n) if rows else zero
            dst = self.host(role, sum(sizes))
            got: list[Optional[torch.Tensor]] = [None] * len(parts)
            at = 0
            for i, n in zip(order, sizes):
                got[i] = dst[at:at + n].view(parts[i].dtype).view(parts[i].shape)
                at += n
            if rows and dst.numel():
                dst = dst.view(1, -1)
        return order, zero, dst, got, rows
    def read(self, t: torch.Tensor, role: str = "read_one") -> torch.Tensor:
        """One device tensor on the host (a pooled buffer's view; valid until the next read for
        `role`)."""
        return self.read_packed([t], role=role)[0][0]

    # ---- host -> device --------------------------------------------------------------------------
    def staged(self, shape, dtype: torch.dtype, role: str = "send") -> torch.Tensor:
        """The pooled staging view `to_device([t], role)` sends a tensor of this shape and dtype
        from: a producer on the host may write its result there directly (no copy into staging
        then). Valid until the next routing read (see the class)."""
        return self._send_layout(role, ((torch.Size(shape), dtype),))[2][0]

    def to_device(self, parts: Sequence[torch.Tensor], role: str = "send", keep: bool = False) -> list[torch.Tensor]:
        """Host tensors on the device in one copy from a pooled pinned buffer (each part's bytes
        laid side by side there first: a host memcpy, skipped for a part already in its staging
        view, `staged`). Returns device tensors of the parts' shapes and dtypes (views of one
        device buffer): fresh ones, or with `keep` the same ones call after call for this role
        and these shapes (rewritten, like the staging, only after the next routing read: for data
        the call's own kernels consume, so a plan made from them can be kept too)."""
        meta = tuple((p.shape, p.dtype) for p in parts)
        total, stage, views, spans = self._send_layout(role, meta)
        for v, p in zip(views, parts):
            if p.data_ptr() != v.data_ptr():
                v.copy_(p)
        kept = self._kept.get((role, meta)) if keep else None
        if kept is not None:
            dev, out = kept
        elif len(parts) == 1:
            dev = torch.empty(views[0].shape, dtype=views[0].dtype, device=self.device)
            out = [dev]
        else:
            dev = torch.empty(total, dtype=torch.uint8, device=self.device)
            out = [dev[a:b].view(v.dtype).view(v.shape) for (a, b), v in zip(spans, views)]
        if keep and kept is None:
            on_device(dev, always=True)
            self._kept[(role, meta)] = (dev, out)
        else:
            on_device(dev)
        if total:
            dev.copy_(views[0] if len(parts) == 1 else stage, non_blocking=self.pinned)
        return out

    def _send_layout(self, role: str, meta: tuple) -> tuple:
        """`to_device`'s staging for parts of these (shape, dtype)s: (total bytes, the staging
        bytes, a typed view per part, its byte span), made once per shape."""
        key = ("send", role, meta)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= MAX_LAYOUTS:
                self._layouts.clear()
                self._kept.clear()
            with torch.inference_mode(False):
                elem = [torch.empty(0, dtype=d).element_size() for _, d in meta]
                order = sorted(range(len(meta)), key=lambda i: -elem[i])
                sizes = {i: elem[i] * int(torch.Size(meta[i][0]).numel()) for i in order}
                total = sum(sizes.values())
                stage = self.host(role, total)
                views, spans, at = [None] * len(meta), [None] * len(meta), 0
                for i in order:
                    spans[i] = (at, at + sizes[i])
                    views[i] = stage[at:at + sizes[i]].view(meta[i][1]).view(meta[i][0])
                    at += sizes[i]
            layout = self._layouts[key] = (total, stage, views, spans)
        return layout
