"""Page-locking host memory where it lies (`cudaHostRegister`), so host -> GPU copies from it are
asynchronous DMA without a second, pinned copy (PyTorch's pinned allocator would also round each
block up to a power of two). Used for the expert store's banks and the residency tiers' float
expert stacks; only ever called with a CUDA GPU present.

UNTESTED on a GPU (none on the development machine): a failure only returns False (the memory
still serves every copy, synchronously) and never leaves the CUDA runtime's error behind.
"""
from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import torch

PORTABLE = 1     # cudaHostRegisterPortable: pinned for every CUDA context (as torch.cuda._pin_memory_utils)
READ_ONLY = 8    # cudaHostRegisterReadOnly (CUDA >= 11.1): the device only reads; not every GPU has it


class Registered(NamedTuple):
    ok: bool                  # page-locked (or nothing to lock)
    read_only: bool           # with the device-read-only flag
    error: Optional[str]      # the CUDA error's text when not ok


def register(ptr: int, nbytes: int, owner, read_only: bool = False) -> Registered:
    """Page-lock [ptr, ptr + nbytes) until `owner` (the object whose lifetime holds that memory:
    an array or tensor viewing it) is collected, then unregister it, before the memory can go
    back. `read_only` (a copy-on-write file mapping): register it device-read-only first, so the
    pages stay shared with the page cache; where the GPU lacks that flag
    (`cudaDevAttrHostRegisterReadOnlySupported` is 0 on many discrete cards), register it plainly,
    which gives the mapping private copies of its pages (as much memory as a bank built in
    memory)."""
    if nbytes == 0:
        return Registered(True, read_only, None)
    cudart = torch.cuda.cudart()
    error = None
    for flags in ((PORTABLE | READ_ONLY, PORTABLE) if read_only else (PORTABLE,)):
        err = cudart.cudaHostRegister(ptr, nbytes, flags)
        if int(err) == 0:
            weakref.finalize(owner, cudart.cudaHostUnregister, ptr)
            return Registered(True, bool(flags & READ_ONLY), None)
        error = _error_text(cudart, err)
        clear_cuda_error()
    return Registered(False, False, error)


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
