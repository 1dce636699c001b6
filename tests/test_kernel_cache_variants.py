"""numba's disk cache of the kernels package keeps each kernel variant apart.

FREETOKEN_INT_ACT / FREETOKEN_BF16_ACT / FREETOKEN_SIMD change the kernels' code without changing
a source file. numba keeps one index per function and overwrites an index whose stamp differs, so
when the variants shared a directory, a process of one variant wiped the other's kernels and the
next start of the first recompiled everything (the nvfp4 expert kernel alone: 95 s). Reference:
numba's own "numba:compile" events, counted in fresh processes on one empty cache directory; a
kernel served from the disk cache fires none.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

CODE = """
from freetoken_py.hw.measure_dram import compiles_during
from freetoken_py.kernels import _dots
print(compiles_during(lambda: _dots.quad_layout(32)), flush=True)
"""


def compiles(cache_dir, **env_vars) -> int:
    env = {k: v for k, v in os.environ.items()
           if k not in ("FREETOKEN_INT_ACT", "FREETOKEN_INT4_ACT", "FREETOKEN_SIMD")}
    env.update(env_vars, NUMBA_CACHE_DIR=str(cache_dir))
    res = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    return int(res.stdout.split()[-1])


def test_two_variants_do_not_wipe_each_others_kernels(tmp_path):
    assert compiles(tmp_path) >= 1                            # cold: compiled, saved
    assert compiles(tmp_path) == 0                            # served from the cache
    assert compiles(tmp_path, FREETOKEN_INT_ACT="fp32") >= 1  # another variant compiles its own
    assert compiles(tmp_path) == 0                            # ... and left the first one intact
    assert compiles(tmp_path, FREETOKEN_INT_ACT="fp32") == 0
    bf16 = os.environ.get("FREETOKEN_BF16_ACT") or "auto"
    dirs = {p.name for p in tmp_path.rglob("freetoken-int_act-*") if p.is_dir()}
    assert {f"freetoken-int_act-auto-bf16_act-{bf16}-simd-auto",
            f"freetoken-int_act-fp32-bf16_act-{bf16}-simd-auto"} <= dirs, dirs


def test_variant_dir_names_are_plain():
    from freetoken_py.kernels._cache import variant_dir

    assert variant_dir("/|") == "freetoken-int_act-auto-bf16_act-auto-simd-auto"
    assert variant_dir("int8/bf16|avx2") == "freetoken-int_act-int8-bf16_act-bf16-simd-avx2"
    assert variant_dir("../x/..|/").count("/") == 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
