"""Split-K in the gate_up kernel (kernels/_triton_moe.py, gpu_moe.split_k): where a decode step's
grid is short of a wave, the columns (D) are split across programs whose partial dot products
the last one of each row block sums in a fixed order. In Triton's CPU interpreter (a fresh
process) against the float64 reference of tests/test_triton_experts.py: every format, D spanning
several BLOCK_K steps with a ragged last share, T = 1 and several tokens a group, shares left
empty (SPLIT above the steps), repeated launches (the counters reset themselves). And the rule:
split only where the grid is short, never below MIN_SPLIT_STEPS steps a share."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
TESTS = Path(__file__).resolve().parent

SCRIPT = r'''
import os, re, sys
os.environ["TRITON_INTERPRET"] = "1"
src = open(sys.argv[1]).read()
script = re.search(r"SCRIPT = r\'\'\'(.*?)\'\'\'", src, re.S).group(1)
exec(script[:script.index("errs = {}")])          # make / reference / check, the experts' float64 reference
from freetoken_py.kernels import gpu_moe
errs = {}
for split in (2, 3, 8):
    gpu_moe.split_k_override = split
    errs[f"fp32 T1 /{split}"] = check("fp32", 1, 600, 40, 3, 2)             # 3 steps of 256 columns
    errs[f"bf16 T3 /{split}"] = check("bf16", 3, 520, 48, 3, 2)
    errs[f"int8 T2 /{split}"] = check("int8", 2, 600, 44, 3, 2)
    errs[f"int4 T1 /{split}"] = check("int4", 1, 1088, 64, 4, 3)            # 512-column steps, the last partial
    errs[f"int4 T5 g64 /{split}"] = check("int4", 5, 1152, 64, 3, 2, group=64)
    errs[f"fp8 T1 /{split}"] = check("fp8", 1, 392, 72, 3, 2, group=128)    # partial 128-blocks
    errs[f"nvfp4 T2 /{split}"] = check("nvfp4", 2, 528, 48, 3, 2)
gpu_moe.split_k_override = None
print("ok", max(errs.values()))
'''


def test_split_k_equals_the_float64_reference_in_the_interpreter():
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(TESTS / "test_triton_experts.py")], capture_output=True,
                          text=True, timeout=900, env=env, cwd=TESTS)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.strip().startswith("ok"), proc.stdout


def test_split_only_where_the_grid_is_short_of_a_wave():
    from freetoken_py.kernels.gpu_moe import MAX_SPLIT, MIN_SPLIT_STEPS, split_for_wave

    wave = 132 * 4                                   # an H100: 132 SMs x 4 programs of 4 warps
    # Qwen3-30B-A3B decode, gate_up: 8 experts x 768 / 32 rows = 192 programs, D 2048 in 8 steps of 256
    assert split_for_wave(192, 8, wave) == 2
    # DeepSeek-V3: 8 x 2048 / 32 = 512 programs, most of a wave already: no split
    assert split_for_wave(512, 14, wave) == 1
    # a tiny grid on a wide D: split as far as the wave and the steps allow
    assert split_for_wave(8, 64, wave) == MAX_SPLIT
    assert split_for_wave(8, 2 * MIN_SPLIT_STEPS - 1, wave) == 1     # too few steps to share
    assert split_for_wave(8, 4 * MIN_SPLIT_STEPS, wave) == 4
