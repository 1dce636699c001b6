"""numba disk cache keyed on the whole kernels package, not on one file.

numba validates a cached kernel only against the source file that defines it, so editing a
helper it calls from another file (``_dots.py``, the LLVM code in ``_simd.py``) silently keeps
the stale machine code. Here every ``cache=True`` function of this package is stamped with a
hash of all the package's ``.py`` files: any edit recompiles everything on next use. Import this
module before defining cached functions. If numba's (private) locator API changes, caching falls
back to numba's default per-file behaviour.

FREETOKEN_INT_ACT / FREETOKEN_BF16_ACT / FREETOKEN_SIMD change the kernels' code without changing
any source, so each combination caches in its own subdirectory (``variant_dir``). numba keeps one
index file per function and discards (then overwrites) an index whose stamp differs, so one
directory shared by two variants made each process that ran the other variant wipe this one's
kernels: the next start recompiled them (95 s for the nvfp4 expert kernel).
"""
from __future__ import annotations

import functools
import hashlib
import os

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=8)
def _hash_sources(stats: tuple, variant: str = "") -> bytes:
    h = hashlib.sha256(variant.encode() + b"\0")
    for name, _, _ in stats:
        with open(os.path.join(_PACKAGE_DIR, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.digest()


def variant() -> str:
    """The kernel-code switches as set now (envs.int_act, envs.bf16_act, envs.simd; "" = auto)."""
    from freetoken_py.envs import bf16_act, int_act, simd
    return int_act() + "/" + bf16_act() + "|" + simd()


def variant_dir(tag: str) -> str:
    """Cache subdirectory of one variant: readable, and safe as a file name."""
    a, rest = tag.split("/", 1)
    b, c = rest.split("|", 1)
    clean = lambda v: "".join(ch for ch in v if ch.isalnum())[:16] or "auto"   # noqa: E731
    return f"freetoken-int_act-{clean(a)}-bf16_act-{clean(b)}-simd-{clean(c)}"


def package_stamp(tag: str = "") -> bytes:
    """sha256 over every .py file of freetoken_py/kernels (memoised on names, mtimes, sizes) and
    the variant `tag` (also in the directory: a file copied between variants is not trusted)."""
    names = sorted(n for n in os.listdir(_PACKAGE_DIR) if n.endswith(".py"))
    stats = tuple((n, *(lambda st: (st.st_mtime_ns, st.st_size))(os.stat(os.path.join(_PACKAGE_DIR, n))))
                  for n in names)
    return _hash_sources(stats, tag)


def _install() -> None:
    try:
        from numba.core import caching
        bases = [caching.UserProvidedCacheLocator, caching.InTreeCacheLocator, caching.UserWideCacheLocator]
        registry = caching.CacheImpl._locator_classes
    except (ImportError, AttributeError):
        return

    def make(base):
        class PackageLocator(base):
            # the variant is read when the function is defined (import time), as the kernels
            # read their modes: a later change of the environment cannot mislabel a kernel
            def __init__(self, py_func, py_file):
                super().__init__(py_func, py_file)
                self._variant = variant()
                self._cache_path = os.path.join(self._cache_path, variant_dir(self._variant))

            @classmethod
            def from_function(cls, py_func, py_file):
                if os.path.dirname(os.path.abspath(py_file)) != _PACKAGE_DIR:
                    return None
                return super().from_function(py_func, py_file)

            def get_source_stamp(self):
                return package_stamp(self._variant)

        PackageLocator.__name__ = PackageLocator.__qualname__ = f"FreetokenKernels{base.__name__}"
        return PackageLocator

    if not any(c.__name__.startswith("FreetokenKernels") for c in registry):
        registry[0:0] = [make(b) for b in bases]


_install()
