"""kernels/gpu_autotune.py: the sweep (candidates pruned by the bytes-in-flight model), the cache keyed
by GPU, capability and Triton version, and the fallbacks. Runs the real kernels in Triton's CPU
interpreter (a fresh process: TRITON_INTERPRET before Triton is imported); the timings there are
the interpreter's, so this checks the plumbing and that tuned launches still compute the same
results, not which configuration a GPU prefers."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r'''
import json, os, sys, warnings
os.environ["TRITON_INTERPRET"] = "1"
from pathlib import Path
import torch
from freetoken_py.kernels import gpu_autotune as at, gpu_moe
from freetoken_py.kernels.gpu_slots import build_table
from freetoken_py.quant import quantize_int4

cache = Path(sys.argv[1]) / "gpu" / "expert_kernels.json"
assert at.cache_path() == cache
g = torch.Generator().manual_seed(0)
D, I = 64, 64
experts = []
for _ in range(3):
    (a, sa), (b, sb) = (quantize_int4(torch.randn(*s, generator=g) / 8, 32, torch.float16) for s in ((2 * I, D), (D, I)))
    experts.append((a, sa.view(torch.int16), b, sb.view(torch.int16)))
table = build_table(experts, "int4", 32)
x = torch.randn(1, D, generator=g)
rows, wts = torch.zeros(3, dtype=torch.int64), torch.tensor([0.5, 0.3, 0.2])
plan = gpu_moe.prepare(table, [0, 1, 2], "cpu")

def want():
    return sum(w * gpu_moe.quant_swiglu(x, experts[e], "int4", 32)[0] for e, w in zip(range(3), wts.tolist()))

timed = []
def time_config(kernel, config):
    timed.append((kernel, config))
    return gpu_moe.time_config(torch.zeros(1, D), x, rows, wts, plan, kernel, config, reps=1)

best = at.tune([("int4", 32, (D, I), 1, True)], time_config)
n_gate, n_down = (len(at.candidates("int4", 1, k, True)) for k in ("gate_up", "down"))
assert len(timed) == n_gate + n_down and n_gate >= 2, (len(timed), n_gate, n_down)
data = json.loads(cache.read_text())
assert data["machine"] == at.machine() and data["machine"]["triton"]
assert set(data["configs"]) == {"int4/g32/64x64/nt1/gate_up", "int4/g32/64x64/nt1/down"} == set(best)
assert best["int4/g32/64x64/nt1/gate_up"] in at.candidates("int4", 1, "gate_up", True)
# a launch of that shape now uses the tuned configuration, and still computes the same
assert at.kernel_config("int4", 1, "gate_up", True, 32, (D, I)) == at.finalize(best["int4/g32/64x64/nt1/gate_up"], "int4", 32)
out = torch.zeros(1, D)
gpu_moe.moe_slots(out, x, rows, wts, table, [0, 1, 2])
assert (out[0] - want()).abs().max() <= 1e-5 * want().abs().max()

# a cache from another GPU / Triton: one line, the defaults
data["machine"] = {"gpu": "NVIDIA H200", "capability": "9.0", "triton": "3.1.0"}
cache.write_text(json.dumps(data))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert at.use_cache() == 0
msg = [str(w.message) for w in caught]
assert len(msg) == 1 and "is for NVIDIA H200" in msg[0] and "default configurations" in msg[0] and "\n" not in msg[0], msg
assert at.kernel_config("int4", 1, "gate_up", True, 32, (D, I)) == at.finalize(at.default_config("int4", 1, "gate_up", True), "int4", 32)
cache.write_text("{not json")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert at.use_cache() == 0
assert len(caught) == 1 and "unreadable" in str(caught[0].message)
# a candidate that does not compile or launch on this GPU (Triton's own OutOfResources, as a GPU with
# less shared memory raises it) is skipped with one warning line; a kernel none of whose candidates
# ran keeps the default (no cache entry), and nothing crashes
from triton.runtime.errors import OutOfResources
cache.unlink()
def picky(kernel, config):
    if kernel == "down" or config["num_warps"] == 8:
        raise OutOfResources(10 ** 6, 232448, "shared memory")
    return time_config(kernel, config)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    best = at.tune([("int4", 32, (D, I), 1, True)], picky)
msg = [str(w.message) for w in caught]
n_fail = n_down + sum(c["num_warps"] == 8 for c in at.candidates("int4", 1, "gate_up", True))
assert len(msg) == 1 and f"{n_fail} candidate configurations failed" in msg[0] and "OutOfResources" in msg[0] \
    and "\n" not in msg[0], msg
assert set(best) == {"int4/g32/64x64/nt1/gate_up"} and best["int4/g32/64x64/nt1/gate_up"]["num_warps"] == 4, best
assert at.kernel_config("int4", 1, "down", True, 32, (D, I)) == at.finalize(at.default_config("int4", 1, "down", True), "int4", 32)
# every candidate the static model keeps has 8-32 KB of weights in flight a program and stage
for fmt in ("float", "int4", "fp8", "nvfp4"):
    for nt in (1, 8):
        for kernel in ("gate_up", "down"):
            for c in at.candidates(fmt, nt, kernel, fmt != "float")[1:]:
                sets = 2 if kernel == "gate_up" else 1
                b = sets * c["BLOCK_N"] * c["BLOCK_K"] // {"float": 1, "int4": 8, "fp8": 4, "nvfp4": 8}[fmt] * at.ELEM_BYTES[fmt]
                assert at.MIN_STAGE <= b <= at.MAX_STAGE, (fmt, nt, kernel, c)
print("ok")
'''


def test_tuning_caches_per_machine_and_falls_back_on_a_foreign_cache(tmp_path):
    env = {**os.environ, "FREETOKEN_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok"), proc.stdout


def test_no_gpu_is_a_one_line_reason_and_the_torch_path():
    """Without TRITON_INTERPRET, a CPU device is not for these kernels: False and one line saying why."""
    code = ("import os; os.environ.pop('TRITON_INTERPRET', None)\n"
            "from freetoken_py.kernels import gpu_moe\n"
            "assert gpu_moe.available('cpu') is False\n"
            "why = gpu_moe.why_not(); assert why and '\\n' not in why and 'not a CUDA GPU' in why, why\n"
            "print('ok')")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_a_triton_that_does_not_import_is_a_one_line_reason_and_the_probe_says_it():
    """Triton missing (or broken) where the kernels would run: available() is False with one line
    naming Triton, and the probe's tuning skips with that line (no crash, no traceback)."""
    code = ("import os, sys; os.environ['TRITON_INTERPRET'] = '1'\n"
            "sys.modules['triton'] = None            # as if it were not installed: import raises\n"
            "from freetoken_py.kernels import gpu_moe\n"
            "assert gpu_moe.available('cpu') is False\n"
            "why = gpu_moe.why_not(); assert why and '\\n' not in why and 'Triton is not usable' in why, why\n"
            "from freetoken_py.hw.kernel_tune import tune_expert_kernels\n"
            "r = tune_expert_kernels('cpu', reps=1)\n"
            "assert r['status'] == 'skipped' and r['timed'] == 0 and 'Triton is not usable' in r['line'], r\n"
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
