"""Page-locking host memory where it lies (`cudaHostRegister`), so host -> GPU copies from it are
asynchronous DMA without a second, pinned copy (PyTorch's pinned allocator would also round each
block up to a power of two). Used for the expert store's banks and the residency tiers' float
expert stacks; only ever called with a CUDA GPU present, and only on memory the process owns
(anonymous memory): registering a file mapping did not return within 85 s for 256 MiB on the
H200 machine (2026-12-04, `engine.expert_store.pin_banks` copies a mapped cache file first),
while the same size of anonymous memory took 0.01 s. A failure only returns a refusal (the
memory still serves every copy, synchronously) and never leaves the CUDA runtime's error behind.
"""
from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import torch

PORTABLE = 1     # cudaHostRegisterPortable: pinned for every CUDA context (as torch.cuda._pin_memory_utils)


class Registered(NamedTuple):
    ok: bool                  # page-locked (or nothing to lock)
    error: Optional[str]      # the CUDA error's text when not ok


def register(ptr: int, nbytes: int, owner) -> Registered:
    """Page-lock [ptr, ptr + nbytes) until `owner` (the object whose lifetime holds that memory:
    an array or tensor viewing it) is collected, then unregister it, before the memory can go
    back. Memory of the process's own only: an address in a file mapping is refused without
    asking the driver (`file_mapped`); the caller copies it (or leaves it pageable)."""
    if nbytes == 0:
        return Registered(True, None)
    if file_mapped(ptr):
        return Registered(False, "a file mapping: copy it into memory of the process's own first")
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, PORTABLE)
    if int(err) == 0:
        weakref.finalize(owner, cudart.cudaHostUnregister, ptr)
        return Registered(True, None)
    error = _error_text(cudart, err)
    clear_cuda_error()
    return Registered(False, error)


def file_mapped(ptr: int) -> bool:
    """Whether address `ptr` lies in a mapping of a file (a line of /proc/self/maps with an inode);
    False where that cannot be read."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= ptr < hi:
                    return len(fields) > 4 and fields[4] != "0"
    except (OSError, ValueError):
        pass
    return False


def clear_cuda_error() -> None:
    """Consume the CUDA runtime's last error. A failed runtime call (cudaHostRegister through
    torch's binding) leaves it set, and PyTorch's next kernel launch check (`cudaGetLastError`)
    would raise it from an unrelated operation; a launch here reads and clears it."""
    try:
        torch.empty(1, device="cuda").zero_()
    except Exception:       # (torch.AcceleratorError, a RuntimeError: the error, now consumed)
        pass


def _error_text(cudart, err) -> str:
    try:
        return f"{cudart.cudaGetErrorString(err)} ({int(err)})"
    except Exception:        # (the binding's enum names only `success`)
        return f"cudaError {int(err)}"
