"""On-disk cache of the expert banks: one raw file per (model identity, format, group size).

Layout (little-endian)::

    0   8 bytes   magic b"FTEXPB01"
    8   u64       header length H
    16  32 bytes  sha256 of the header bytes
    48  H bytes   JSON header: version, identity, fmt, group_size, layout, file_bytes, per-layer arrays
    ... zero padding to the next 4096-byte page
        every array raw, C order, each starting on a 4096-byte page (offsets in the header)

Only this raw format and JSON are ever written or read (no pickle, no np.save of objects). A
file is used only if the magic, header checksum, version, model identity, format, group size,
array plan and file size all match; anything else raises `CacheInvalid` (the store warns and
rebuilds). The array bytes themselves are not checksummed (that would read the whole file on
every start, which is what the mmap avoids): a same-size in-place corruption of the payload is
not detected.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from freetoken_py.kernels._buffers import PAGE_BYTES

MAGIC = b"FTEXPB01"
VERSION = 1
_PREFIX = 48  # magic + length + sha256
_MAX_HEADER = 64 * 2**20
ARRAYS = ("w13", "s13", "w2", "s2")


class CacheInvalid(Exception):
    """The cache file cannot be used; the message says why (one line)."""


def _round_up(n: int) -> int:
    return -(-n // PAGE_BYTES) * PAGE_BYTES


def plan_layout(layer_specs: list[dict | None], header_base: dict) -> tuple[bytes, dict]:
    """layer_specs: per layer None (dense) or {array name: (dtype str, shape)}.

    Returns (header bytes, header dict) with page-aligned offsets and the total file size; the
    header is sized first so data offsets do not depend on themselves.
    """
    layers = [None if spec is None else {k: {"dtype": d, "shape": list(s)} for k, (d, s) in spec.items()}
              for spec in layer_specs]
    header = dict(header_base, magic=MAGIC.decode(), version=VERSION, layers=layers, file_bytes=0)
    # each later `,"offset":N` adds at most 30 bytes (N < 10**20): reserve 32 per array, and file_bytes
    data_start = _round_up(_PREFIX + len(_dump(header)) + 32 * (len(ARRAYS) * len(layers) + 1))
    pos = data_start
    for layer in layers:
        for name in ARRAYS if layer is not None else ():
            a = layer[name]
            a["offset"] = pos
            nbytes = int(np.prod(a["shape"], dtype=np.int64)) * np.dtype(a["dtype"]).itemsize
            pos = _round_up(pos + nbytes)
    header["file_bytes"] = pos
    raw = _dump(header)
    if _PREFIX + len(raw) > data_start:
        raise AssertionError("expert cache header outgrew its reserved space")  # cannot happen: see above
    return raw, header


def _dump(header: dict) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()


def write_prefix(f, raw_header: bytes) -> None:
    f.write(MAGIC + struct.pack("<Q", len(raw_header)) + hashlib.sha256(raw_header).digest() + raw_header)


def write_layer(f, layer_header: dict, arrays: dict[str, np.ndarray]) -> None:
    """Write one layer's arrays at their planned offsets (shapes/dtypes checked against the plan)."""
    for name in ARRAYS:
        a, meta = arrays[name], layer_header[name]
        if list(a.shape) != meta["shape"] or a.dtype.str != meta["dtype"] or not a.flags.c_contiguous:
            raise AssertionError(f"{name}: built {a.dtype.str} {list(a.shape)}, planned {meta}")
        if a.size:
            f.seek(meta["offset"])
            f.write(memoryview(a.reshape(-1)).cast("B"))  # zero copy


def read_header(path: Path) -> dict:
    """The validated-by-checksum header of a cache file (CacheInvalid if unreadable or corrupt)."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(_PREFIX)
            if len(prefix) < _PREFIX or prefix[:8] != MAGIC:
                raise CacheInvalid("not an expert cache file (bad magic or too short)")
            (length,) = struct.unpack("<Q", prefix[8:16])
            if length > _MAX_HEADER:
                raise CacheInvalid(f"header length {length} is implausible")
            raw = f.read(length)
    except OSError as exc:
        raise CacheInvalid(f"cannot read ({exc.strerror})") from None
    if len(raw) != length:
        raise CacheInvalid("truncated header")
    if hashlib.sha256(raw).digest() != prefix[16:48]:
        raise CacheInvalid("header checksum mismatch")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CacheInvalid("header is not JSON") from None


def check_header(header: dict, expected: dict, path: Path) -> None:
    """Everything that decides the bytes must equal what this start would build."""
    if header.get("version") != VERSION:
        raise CacheInvalid(f"format version {header.get('version')} (this build reads {VERSION})")
    for key in ("identity", "fmt", "group_size"):
        if header.get(key) != expected[key]:
            raise CacheInvalid(f"{key} differs (the model files or options changed since it was written)")
    if header.get("layout", "rows") != expected.get("layout", "rows"):      # files from before "r16" hold rows
        raise CacheInvalid(f"its experts are in the {header.get('layout', 'rows')} layout, this start needs "
                           f"{expected.get('layout', 'rows')}")
    if header.get("layers") != expected["layers"] or header.get("file_bytes") != expected["file_bytes"]:
        raise CacheInvalid("array layout differs from what this model needs")
    size = path.stat().st_size
    if size != header["file_bytes"]:
        raise CacheInvalid(f"file is {size} bytes, header says {header['file_bytes']} (truncated?)")


def map_arrays(path: Path, header: dict) -> list[dict[str, np.ndarray] | None]:
    """Views of every layer's arrays over one mmap of the file (zero copy).

    The file is opened read-only and mapped copy-on-write (MAP_PRIVATE): nothing can ever write
    it back, and the arrays stay writeable so numba sees the same array types as for built banks
    (a read-only array is a separate specialisation: ~9 s of extra compilation, not warmed up).
    The kernels never write their weights, so no page is ever copied.
    """
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    out = []
    for layer in header["layers"]:
        if layer is None:
            out.append(None)
            continue
        views = {}
        for name in ARRAYS:
            m = layer[name]
            dtype = np.dtype(m["dtype"])
            count = int(np.prod(m["shape"], dtype=np.int64))
            if count == 0:  # the empty scale arrays of fp32 / bf16 (may sit at the very end of the file)
                views[name] = np.empty(m["shape"], dtype)
                continue
            views[name] = np.frombuffer(mm, dtype, count, m["offset"]).reshape(m["shape"])  # keeps mm alive
        out.append(views)
    return out


def remove_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
