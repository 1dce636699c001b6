"""This process's memory as Linux reports it: the resident set now and at its peak (VmRSS,
VmHWM from /proc/self/status), resetting the peak, and handing glibc's freed heap back.

Peaks are VmHWM, never ``ru_maxrss``: a child's ru_maxrss starts from its parent's peak (it
survives fork and exec). Used by bench/startup_rss.py and tests/test_startup_memory.py.
"""
from __future__ import annotations

from typing import Optional


def status_bytes(key: str) -> Optional[int]:
    """A /proc/self/status field in bytes ("VmRSS", "VmHWM"); None where it is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """VmHWM back to the current RSS (Linux >= 4.0); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def release_free_heap() -> None:
    """glibc's malloc_trim(0): freed heap back to the OS first (kernels.threads.tune_allocator
    keeps freed blocks), so the RSS a measurement starts from is what is live."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
