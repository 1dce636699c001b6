"""numba disk cache keyed on the whole kernels package, not on one file.

numba validates a cached kernel only against the source file that defines it, so editing a
helper it calls from another file (``_dots.py``, the LLVM code in ``_simd.py``) silently keeps
the stale machine code. Here every ``cache=True`` function of this package is stamped with a
hash of all the package's ``.py`` files: any edit recompiles everything on next use. Import this
module before defining cached functions. If numba's (private) locator API changes, caching falls
back to numba's default per-file behaviour.
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


def package_stamp() -> bytes:
    """sha256 over every .py file of freetoken_py/kernels (memoised on names, mtimes, sizes) and
    FREETOKEN_INT_ACT / FREETOKEN_BF16_ACT / FREETOKEN_SIMD (envs.int_act, envs.bf16_act, envs.simd), which
    change the int4/int8 and bf16 kernels' code without changing any source."""
    names = sorted(n for n in os.listdir(_PACKAGE_DIR) if n.endswith(".py"))
    stats = tuple((n, *(lambda st: (st.st_mtime_ns, st.st_size))(os.stat(os.path.join(_PACKAGE_DIR, n))))
                  for n in names)
    from freetoken_py.envs import bf16_act, int_act, simd
    return _hash_sources(stats, int_act() + "/" + bf16_act() + "|" + simd())


def _install() -> None:
    try:
        from numba.core import caching
        bases = [caching.UserProvidedCacheLocator, caching.InTreeCacheLocator, caching.UserWideCacheLocator]
        registry = caching.CacheImpl._locator_classes
    except (ImportError, AttributeError):
        return

    def make(base):
        class PackageLocator(base):
            @classmethod
            def from_function(cls, py_func, py_file):
                if os.path.dirname(os.path.abspath(py_file)) != _PACKAGE_DIR:
                    return None
                return super().from_function(py_func, py_file)

            def get_source_stamp(self):
                return package_stamp()

        PackageLocator.__name__ = PackageLocator.__qualname__ = f"FreetokenKernels{base.__name__}"
        return PackageLocator

    if not any(c.__name__.startswith("FreetokenKernels") for c in registry):
        registry[0:0] = [make(b) for b in bases]


_install()
