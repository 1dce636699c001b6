"""Every environment variable freetoken reads is declared here, and read lazily.

Nothing is read at import time: call the accessor when the value is needed, so a test (or a
long-running server) sees the environment as it is at that moment. To add a variable, add its
name and one-line meaning to ``ENV_VARS`` and an accessor below.
"""
from __future__ import annotations

import os
from pathlib import Path

ENV_VARS: dict[str, str] = {
    "FREETOKEN_CACHE_DIR": "Directory for freetoken's caches (hardware profile, ...). "
    "Default: $XDG_CACHE_HOME/freetoken, else ~/.cache/freetoken.",
    "FREETOKEN_ADAPTIVE_THREADS": "0 pins every decode step to the configured thread count (default 1: "
    "re-decide between N, N-1 and N/2 threads from measured step times, so a core taken by another "
    "process does not stall every parallel region; docs/kernels.md).",
    "FREETOKEN_MALLOC_TUNING": "0 leaves glibc malloc's defaults alone (default 1: keep freed "
    "activation buffers in the heap instead of returning them to the OS; see docs/performance.md).",
    "FREETOKEN_INT_ACT": "int8 | fp32: what int4, int8 and nvfp4 expert/dense weights multiply on CPU (default "
    "int8 on x86 with AVX2, else fp32; read once, when the kernels are first imported; docs/kernels.md).",
    "FREETOKEN_BF16_ACT": "bf16 | fp32: what bf16 expert/dense weights multiply on CPU (default bf16 on x86 with "
    "AVX512-BF16: activations rounded to bf16, vdpbf16ps dots; else fp32: exact fp32 activations; read "
    "once, when the kernels are first imported; docs/kernels.md).",
    "FREETOKEN_INT4_ACT": "Old name of FREETOKEN_INT_ACT (same meaning, now for int8 weights too); "
    "read only when FREETOKEN_INT_ACT is unset.",
    "FREETOKEN_SIMD": "avx2 forces the AVX2 forms of the int4 / int8 / nvfp4 CPU dots on a CPU that has AVX-512 VNNI "
    "(and fp32 activations for bf16 weights unless FREETOKEN_BF16_ACT says otherwise) "
    "(default: AVX-512 where the compile target has avx512f/bw/vl/vnni; read once, when the kernels are first "
    "imported; docs/kernels.md).",
}


def int_act() -> str:
    """FREETOKEN_INT_ACT (else its old name FREETOKEN_INT4_ACT) lower-cased, "" when neither is set."""
    value = os.environ.get("FREETOKEN_INT_ACT", "").strip() or os.environ.get("FREETOKEN_INT4_ACT", "")
    return value.strip().lower()


def simd() -> str:
    """FREETOKEN_SIMD lower-cased ("" when unset): "avx2" caps the CPU dots at AVX2."""
    return os.environ.get("FREETOKEN_SIMD", "").strip().lower()


def bf16_act() -> str:
    """FREETOKEN_BF16_ACT lower-cased, "" when unset."""
    return os.environ.get("FREETOKEN_BF16_ACT", "").strip().lower()


def adaptive_threads() -> bool:
    return os.environ.get("FREETOKEN_ADAPTIVE_THREADS", "1") != "0"


def malloc_tuning() -> bool:
    return os.environ.get("FREETOKEN_MALLOC_TUNING", "1") != "0"


def cache_dir() -> Path:
    """The user cache directory (not created here)."""
    explicit = os.environ.get("FREETOKEN_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "freetoken"
