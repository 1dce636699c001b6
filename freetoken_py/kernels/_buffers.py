"""Page-aligned numpy buffers, the (weights, scales) storage of each format, host array plumbing."""
from __future__ import annotations

import numpy as np
import torch

from freetoken_py.quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from freetoken_py.quant.fp8 import dequantize_fp8, quantize_fp8_blocks
from freetoken_py.quant.int4 import check_group
from freetoken_py.quant.nvfp4 import FACTOR_BYTES, dequantize_nvfp4, quantize_nvfp4

PAGE_BYTES = 4096


def aligned_empty(shape, dtype, align: int = PAGE_BYTES) -> np.ndarray:
    """Uninitialised C-contiguous array whose data starts on an `align`-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def row_layout(fmt: str, k: int, group_size: int) -> tuple[np.dtype, int, int]:
    """(storage dtype, items per row, scales per row) of a [*, K] matrix in `fmt`."""
    if fmt == "fp32":
        return np.dtype(np.float32), k, 0
    if fmt == "bf16":
        return np.dtype(np.uint16), k, 0
    if fmt == "int8":
        return np.dtype(np.int8), k, 1
    if fmt == "fp8":     # e4m3 bytes, one float32 scale per row and block of group_size columns
        if group_size <= 0:
            raise ValueError(f"fp8 needs a positive column block, got {group_size}")
        return np.dtype(np.uint8), k, -(-k // group_size)
    if fmt == "nvfp4":   # e2m1 nibbles; e4m3 bytes per group, then the row's fp32 factor (quant/nvfp4.py)
        check_group(k, group_size)
        return np.dtype(np.uint8), k // 2, k // group_size + FACTOR_BYTES
    if fmt == "int4":
        check_group(k, group_size)
        if group_size != 32 and group_size % 64:   # the AVX2 dot walks pairs of 32-blocks within a group
            raise ValueError(f"int4 kernels need group_size 32 or a multiple of 64, got {group_size}")
        return np.dtype(np.uint8), k // 2, k // group_size
    raise ValueError(f"unknown weight format {fmt!r}; expected one of fp32, bf16, int8, int4, fp8, nvfp4")


def scale_dtype(fmt: str) -> np.dtype:
    """Storage dtype of a format's scales: int4's are fp16 bits held as uint16 (numba has no
    float16 arrays; the kernels convert them, as llama.cpp's Q4_0 stores fp16 scales: 4.5 bits
    per weight at group 32 instead of 5), the others float32."""
    if fmt == "nvfp4":
        return np.dtype(np.uint8)
    return np.dtype(np.uint16) if fmt == "int4" else np.dtype(np.float32)


def empty_rows(fmt: str, lead: tuple, k: int, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Page-aligned (weights [*lead, items], scales [*lead, G]) for rows of K inputs."""
    dtype, items, groups = row_layout(fmt, k, group_size)
    return aligned_empty((*lead, items), dtype), aligned_empty((*lead, groups), scale_dtype(fmt))


def encode_rows(w: torch.Tensor, fmt: str, group_size: int, w_out: np.ndarray, s_out: np.ndarray) -> None:
    """Write w [N, K] (any float dtype) into w_out [N, items] / s_out [N, G] (see row_layout)."""
    if fmt == "fp32":
        w_out[...] = w.to(torch.float32).numpy()
    elif fmt == "bf16":
        w_out[...] = w.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    elif fmt == "fp8":   # (a float source: blocks of 1 x group_size; fp8 checkpoints are copied as they are)
        q, s = quantize_fp8_blocks(w, (1, group_size))
        w_out[...] = q.view(torch.uint8).numpy()
        s_out[...] = s.numpy()
    elif fmt == "nvfp4":   # (a float source: NVFP4's rule, one global scale per row; checkpoints are copied)
        q, s = quantize_nvfp4(w, group_size)
        w_out[...] = q.numpy()
        s_out[...] = s.numpy()
    elif fmt == "int8":
        q, s = quantize_int8(w)
        w_out[...] = q.numpy()
        s_out[:, 0] = s.numpy()
    else:
        q, s = quantize_int4(w, group_size, scale_dtype=torch.float16)
        w_out[...] = q.numpy()
        s_out[...] = s.view(torch.int16).numpy().view(np.uint16)


def decode_rows(w: np.ndarray, scales: np.ndarray, fmt: str, group_size: int) -> torch.Tensor:
    """weights [..., N, items] + scales [..., N, G] -> float32 torch [..., N, K]."""
    if fmt == "fp32":
        return torch.from_numpy(w.copy())
    if fmt == "bf16":
        return torch.from_numpy((w.astype(np.uint32) << 16).view(np.float32))
    if fmt == "fp8":
        return dequantize_fp8(torch.from_numpy(np.ascontiguousarray(w)), torch.from_numpy(scales), group_size)
    if fmt == "nvfp4":
        return dequantize_nvfp4(torch.from_numpy(np.ascontiguousarray(w)), torch.from_numpy(np.ascontiguousarray(scales)),
                                group_size)
    if fmt == "int8":
        return dequantize_int8(torch.from_numpy(w), torch.from_numpy(scales[..., 0]))
    return dequantize_int4(torch.from_numpy(w), torch.from_numpy(np.ascontiguousarray(scales).view(np.float16)),
                           group_size)


R16_ROWS = 16     # rows per slab of the "r16" layout (int4 / nvfp4 / fp8 / int8; _simd "weights in 16-row interleaved slabs")
# The layout travels in the scales' dtype: the same bytes held as int16 (int4's fp16 bits, uint16 in
# rows) or int8 (nvfp4's e4m3 bytes and row factors, uint8 in rows), so the kernels pick the slab
# loops at compile time from the arrays alone (no flag to thread through).
R16_SCALES = {"int4": np.dtype(np.int16), "nvfp4": np.dtype(np.int8), "fp8": np.dtype(np.int32), "int8": np.dtype(np.int32)}
_ROW_SCALES = {np.dtype(np.int16): np.dtype(np.uint16), np.dtype(np.int8): np.dtype(np.uint8),
               np.dtype(np.int32): np.dtype(np.float32)}
# fp8 slabs (scales int32: the fp32 block scales' bits): per 4-column unit u one 64-byte chunk, row
# r's columns 4u + j at byte _FP8_SLOT[r, j] = 16 (r // 4) + 2 (r % 4) + 8 (j // 2) + j % 2 — the
# order in which the byte unpacks of _simd's fp8 slab dot leave row r's column pairs in dword lane r.
_FP8_SLOT = np.array([[16 * (r // 4) + 2 * (r % 4) + 8 * (j // 2) + j % 2 for j in range(4)] for r in range(16)])
_FP8_FROM = np.argsort(_FP8_SLOT.reshape(-1))     # chunk byte i <- row-major (r, j) index _FP8_FROM[i]


def is_r16_scales(s: np.ndarray) -> bool:
    """True for scales in the "r16" layout (int16 / int8 / int32)."""
    return s.dtype in _ROW_SCALES


def r16_fits(fmt: str, n: int, k: int, group_size: int) -> bool:
    """True where [n, k] rows of fmt can take the "r16" layout: whole slabs of 16 rows, whole
    32-column blocks; int4 groups and fp8 scale blocks of whole 32-column blocks, nvfp4 its groups of 16."""
    if n <= 0 or n % R16_ROWS or k % 32:
        return False
    return fmt == "int8" or (fmt in ("int4", "fp8") and group_size % 32 == 0) or (fmt == "nvfp4" and group_size == 16)


def _i8_slab_bytes(w: np.ndarray) -> np.ndarray:
    """int8 rows [..., N, K] -> the r16 bytes: per slab and 4-column unit u one 64-byte chunk, byte
    4r + j = row r's column 4u + j (dword lane r of one vpdpbusd)."""
    *lead, n, k = w.shape
    nd = len(lead)
    q = w.reshape(*lead, n // 16, 16, k // 4, 4)                                  # slab, r, u, j
    return np.ascontiguousarray(q.transpose(tuple(range(nd)) + tuple(nd + a for a in (0, 2, 1, 3)))).reshape(w.shape)


def _i8_row_bytes(w: np.ndarray) -> np.ndarray:
    """The inverse of _i8_slab_bytes."""
    *lead, n, k = w.shape
    nd = len(lead)
    q = np.ascontiguousarray(w).reshape(*lead, n // 16, k // 4, 16, 4)           # slab, u, r, j
    return np.ascontiguousarray(q.transpose(tuple(range(nd)) + tuple(nd + a for a in (0, 2, 1, 3)))).reshape(w.shape)


def _permute_chunks(w: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Every 64 consecutive bytes of w (a slab's unit chunk: N % 16 == 0, K % 4 == 0) reordered,
    byte i <- order[i]."""
    return np.ascontiguousarray(np.ascontiguousarray(w).reshape(-1, 64)[:, order]).reshape(w.shape)


def _fp8_slab_bytes(w: np.ndarray) -> np.ndarray:
    """fp8 rows [..., N, K] -> the r16 bytes: int8's 4-column unit chunks, each in _FP8_SLOT's order."""
    return _permute_chunks(_i8_slab_bytes(w), _FP8_FROM)


def _fp8_row_bytes(w: np.ndarray) -> np.ndarray:
    """The inverse of _fp8_slab_bytes."""
    return _i8_row_bytes(_permute_chunks(w, _FP8_SLOT.reshape(-1)))


def _slab_bytes(w: np.ndarray) -> np.ndarray:
    """Packed nibbles [..., N, K/2] (low = even column) -> the r16 weight bytes, same shape."""
    *lead, n, kh = w.shape
    q = np.empty((*lead, n, 2 * kh), np.uint8)
    q[..., 0::2] = w & 15
    q[..., 1::2] = w >> 4
    q = q.reshape(*lead, n // 16, 16, kh // 16, 4, 2, 4)           # slab, r, b, c, half, j
    packed = q[..., 0, :] | (q[..., 1, :] << 4)                    # slab, r, b, c, j
    nd = len(lead)
    perm = tuple(range(nd)) + tuple(nd + a for a in (0, 2, 3, 1, 4))   # slab, b, c, r, j
    return np.ascontiguousarray(packed.transpose(perm)).reshape(w.shape)


def _row_bytes(w: np.ndarray) -> np.ndarray:
    """The inverse of _slab_bytes."""
    *lead, n, kh = w.shape
    nd = len(lead)
    b = np.ascontiguousarray(w).reshape(*lead, n // 16, kh // 16, 4, 16, 4)     # slab, b, c, r, j
    b = b.transpose(tuple(range(nd)) + tuple(nd + a for a in (0, 3, 1, 2, 4)))  # slab, r, b, c, j
    q = np.stack([b & 15, b >> 4], axis=-2).reshape(*lead, n, 2 * kh)           # slab, r, b, c, half, j
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def r16_pack(w: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int4 (s uint16 [..., N, G]) or nvfp4 (s uint8 [..., N, K/16 + 4]) rows in the row layout
    (w uint8 [..., N, K/2], low nibble = even column) -> the same bytes in the "r16" layout, same
    shapes: per slab of 16 rows and 32-column block b, 4 chunks c of 64 bytes, byte 4r + j holding
    row r's columns 32b + 8c + j (low nibble) and 32b + 8c + 4 + j (high nibble). Scales per slab:
    int4 [G, 16] as int16; nvfp4 [K/16, 16] e4m3 bytes then the 16 rows' fp32 factors, as int8.
    fp8 (w uint8 [..., N, K] e4m3, s float32 [..., N, G]): per slab one 64-byte chunk per 4 columns
    (_FP8_SLOT), scales [G, 16] as int32. int8 (w int8 [..., N, K], s float32 [..., N, 1]): per slab
    one 64-byte chunk per 4 columns, byte 4r + j = row r's column 4u + j; the 16 row scales as int32."""
    *lead, n, _ = w.shape
    nd = len(lead)
    sperm = tuple(range(nd)) + (nd, nd + 2, nd + 1)
    if s.dtype in (np.uint16, np.float32):
        g = s.shape[-1]
        sr = np.ascontiguousarray(s.reshape(*lead, n // 16, 16, g).transpose(sperm)).reshape(s.shape)
        if s.dtype == np.float32:
            return (_i8_slab_bytes(w) if w.dtype == np.int8 else _fp8_slab_bytes(w)), sr.view(np.int32)
        return _slab_bytes(w), sr.view(R16_SCALES["int4"])
    ng = s.shape[-1] - 4
    e = s[..., :ng].reshape(*lead, n // 16, 16, ng).transpose(sperm).reshape(*lead, n // 16, 16 * ng)
    f = np.ascontiguousarray(s[..., ng:]).reshape(*lead, n // 16, 64)
    sr = np.ascontiguousarray(np.concatenate([e, f], axis=-1)).reshape(s.shape)
    return _slab_bytes(w), sr.view(R16_SCALES["nvfp4"])


def r16_unpack(w: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of r16_pack: "r16" slabs back to the row layout (scales uint16 / uint8 again)."""
    *lead, n, _ = w.shape
    nd = len(lead)
    sperm = tuple(range(nd)) + (nd, nd + 2, nd + 1)
    s = np.ascontiguousarray(s).view(_ROW_SCALES[s.dtype])
    if s.dtype in (np.uint16, np.float32):
        g = s.shape[-1]
        sr = np.ascontiguousarray(s.reshape(*lead, n // 16, g, 16).transpose(sperm)).reshape(s.shape)
        if s.dtype == np.float32:
            return (_i8_row_bytes(w) if w.dtype == np.int8 else _fp8_row_bytes(w)), sr
        return _row_bytes(w), sr
    ng = s.shape[-1] - 4
    flat = s.reshape(*lead, n // 16, 16 * (ng + 4))
    e = flat[..., :16 * ng].reshape(*lead, n // 16, ng, 16).transpose(sperm)
    f = flat[..., 16 * ng:].reshape(*lead, n // 16, 16, 4)
    sr = np.ascontiguousarray(np.concatenate([e, f], axis=-1)).reshape(s.shape)
    return _row_bytes(w), sr


_TORCH_DTYPES = {np.float32: torch.float32, np.int64: torch.int64}


def host_array(a, dtype) -> np.ndarray:
    """A C-contiguous numpy array of `dtype` (zero-copy for a matching CPU tensor or array)."""
    if isinstance(a, torch.Tensor):
        if a.dtype != _TORCH_DTYPES[dtype] or not a.is_cpu:
            a = a.to("cpu", _TORCH_DTYPES[dtype])
        if a.requires_grad:
            a = a.detach()
        return (a if a.is_contiguous() else a.contiguous()).numpy()
    return np.ascontiguousarray(a, dtype)
