"""The accelerator experts' slot table and per-step plan (host side of `_triton_moe`; no Triton here).

A `SlotTable` is built once for a set of experts already in device memory (a slot chunk, or the
experts of one call): per part a typed base tensor and every slot's offset from it in loaded
elements, int64 [4, S] (q13, s13, q2, s2; a float expert's scale rows are zeros). Everything a
kernel assumes about the experts (shapes, dtypes, word alignment, whether the rows start at
16-byte boundaries) is checked here, once, so a launch does no Python validation per pair.

A step's plan groups its pairs by slot (first appearance order), at most `MAX_GROUP` pairs a
group: each expert is read once for all its tokens. It is int64 [groups + groups * NT]: the slot
of each group, then each group's pair indices padded with -1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

FORMATS = {"float": 0, "int8": 1, "int4": 2, "fp8": 3, "nvfp4": 4}
UNIT = {0: 1, 1: 4, 2: 8, 3: 4, 4: 8}        # columns per loaded element (float: 1; else an int32 word)
MAX_GROUP = 8                                  # pairs of one expert in one group (NT <= 8)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class SlotTable:
    fmt: str
    group_size: int
    inter: int                 # I
    hidden: int                # D
    bases: tuple               # 4 typed tensors (q13, s13, q2, s2): what the kernels index from
    offsets: torch.Tensor      # int64 [4, S] on the host, in each base's elements
    align: int                 # elements per 16 bytes of the weight parts when every row is aligned, else 1
    device_offsets: torch.Tensor | None = None   # `offsets` on the device (`to_device`, at admission)

    def to_device(self, device) -> "SlotTable":
        """Keep the offsets on `device` too, so a step ships only its plan."""
        self.device_offsets = self.offsets.to(device)
        return self

    @property
    def slots(self) -> int:
        return self.offsets.shape[1]

    @property
    def fmt_id(self) -> int:
        return FORMATS[self.fmt]

    def row_words(self, k: int) -> int:
        """A weight row of k columns in loaded elements."""
        return k // UNIT[self.fmt_id]

    def scale_row(self, k: int) -> int:
        """A scale row's length for k columns (nvfp4: the e4m3 bytes, then the 4 factor bytes)."""
        f, g = self.fmt, self.group_size
        return {"float": 0, "int8": 1, "int4": k // g, "fp8": -(-k // g), "nvfp4": k // 16 + 4}[f]


def _shapes(fmt: str, inter: int, hidden: int, g: int) -> list[tuple]:
    if fmt == "float":
        return [(2 * inter, hidden), (hidden, inter)]
    cols = {"int8": (hidden, inter), "fp8": (hidden, inter), "int4": (hidden // 2, inter // 2),
            "nvfp4": (hidden // 2, inter // 2)}[fmt]
    sc = {"int8": (1, 1), "int4": (hidden // g, inter // g), "fp8": (-(-hidden // g), -(-inter // g)),
          "nvfp4": (hidden // 16 + 4, inter // 16 + 4)}[fmt]
    return [(2 * inter, cols[0]), (2 * inter, sc[0]), (hidden, cols[1]), (hidden, sc[1])]


def _check_format(fmt: str, inter: int, hidden: int, g: int) -> None:
    """The column counts a format's word reads need (a one-line error naming them otherwise)."""
    unit = UNIT[FORMATS[fmt]]
    need = {"int4": g, "nvfp4": 16}.get(fmt, unit)
    if fmt in ("int4", "fp8") and (g < 8 or g & (g - 1)):
        raise ValueError(f"gpu experts: {fmt} group_size must be a power of two >= 8, got {g}")
    if hidden % need or inter % need:
        raise ValueError(f"gpu experts: {fmt} needs D and I divisible by {need}, got D={hidden}, I={inter}")


def _base(t: torch.Tensor, word: bool) -> torch.Tensor:
    """A flat view of `t` in the dtype the kernel loads (int32 words for packed weights)."""
    flat = t.reshape(-1)
    return flat.view(torch.int32) if word else flat


def build_table(experts: Sequence[tuple], fmt: str, group_size: int = 32) -> SlotTable:
    """The slot table of `experts` (one tuple of parts per slot: (w13, w2) float, else (q13,
    s13, q2, s2) in the expert store's layouts), all on one device. ValueError naming the part
    when a shape, dtype, contiguity or alignment does not fit."""
    if fmt not in FORMATS:
        raise ValueError(f"gpu experts: format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    first = experts[0]
    if fmt == "float":
        two_i, hidden = first[0].shape
        if first[0].dtype not in FLOAT_DTYPES:
            raise ValueError(f"gpu experts: float weights must be one of {', '.join(map(str, FLOAT_DTYPES))}, "
                             f"got {first[0].dtype}")
    else:
        two_i, hidden = first[0].shape[0], first[2].shape[0]
    inter = two_i // 2
    _check_format(fmt, inter, hidden, group_size)
    shapes = _shapes(fmt, inter, hidden, group_size)
    word = fmt != "float"
    for parts in experts:
        for k, (t, shape, ref) in enumerate(zip(parts, shapes, first)):
            if tuple(t.shape) != shape or t.dtype != ref.dtype or not t.is_contiguous() or t.device != ref.device:
                raise ValueError(f"gpu experts: every expert's part {k} must be contiguous {shape} {ref.dtype} on "
                                 f"{ref.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")
        if word and any(parts[k].data_ptr() % 4 for k in (0, 2)):
            raise ValueError("gpu experts: packed weights must start at 4-byte boundaries")
    full = list(first) if word else [first[0], first[0], first[1], first[1]]
    bases = tuple(_base(t, word and k in (0, 2)) for k, t in enumerate(full))
    offs = torch.zeros((4, len(experts)), dtype=torch.int64)
    for k in range(4):
        if not word and k in (1, 3):
            continue                                      # (a float expert has no scales)
        size, start = bases[k].element_size(), bases[k].data_ptr()
        for e, parts in enumerate(experts):
            t = parts[k if word else k // 2]
            delta = t.data_ptr() - start
            if delta % size:
                raise ValueError(f"gpu experts: part {k} of slot {e} is not aligned to its {size}-byte elements")
            offs[k, e] = delta // size
    per16 = 16 // bases[0].element_size()
    rows_ok = all(_row_elems(shapes[k], fmt) % per16 == 0 for k in ((0, 2) if word else (0, 1)))
    starts_ok = all(int(o) % per16 == 0 for k in (0, 2) for o in offs[k]) and \
        all(bases[k].data_ptr() % 16 == 0 for k in (0, 2))
    return SlotTable(fmt, group_size, inter, hidden, bases, offs, per16 if rows_ok and starts_ok else 1)


def _row_elems(shape: tuple, fmt: str) -> int:
    return shape[1] if fmt == "float" else shape[1] // 4


def plan(pair_slots: Sequence[int]) -> tuple[list[int], list[list[int]], int]:
    """(slot of each group, each group's pair indices, NT): pairs grouped by slot in first-appearance
    order, at most MAX_GROUP a group; NT the next power of two of the largest group."""
    if len(set(pair_slots)) == len(pair_slots):     # (decode: one token, distinct experts: a group a pair)
        return [int(s) for s in pair_slots], [[p] for p in range(len(pair_slots))], 1
    groups: dict[int, list[list[int]]] = {}
    for p, s in enumerate(pair_slots):
        chunks = groups.setdefault(int(s), [[]])
        if len(chunks[-1]) == MAX_GROUP:
            chunks.append([])
        chunks[-1].append(p)
    slots, members = [], []
    for s, chunks in groups.items():
        for c in chunks:
            slots.append(s)
            members.append(c)
    widest = max(len(m) for m in members)
    nt = 1 << (widest - 1).bit_length()
    return slots, members, nt


def packed_plan(pair_slots: Sequence[int], table: SlotTable | None = None) -> tuple[torch.Tensor, int, int]:
    """One int64 host tensor: [table offsets (4 * S) when `table` has none on the device | group slots | group pairs
    padded to NT with -1]; returns it, the number of groups and NT."""
    slots, members, nt = plan(pair_slots)
    head = [] if table is None or table.device_offsets is not None else table.offsets.reshape(-1).tolist()
    body = [p for m in members for p in m + [-1] * (nt - len(m))]
    return torch.tensor(head + slots + body, dtype=torch.int64), len(slots), nt
