"""`freetoken probe`'s one-time tuning of the Triton expert kernels (hw/kernel_tune.py), run in
Triton's CPU interpreter on a tiny shape (a fresh process: TRITON_INTERPRET before Triton is
imported). The interpreter's timings say nothing about a GPU; this checks the probe's path: the
first probe times every candidate and writes the cache for this machine, the next one finds it
and times nothing, launches of that shape then use the tuned configuration and still compute
what the float64 reference does; off a GPU the probe skips it with one line."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = str(Path(__file__).resolve().parents[1])

SCRIPT = r'''
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
from pathlib import Path
import torch
from freetoken_py.hw.kernel_tune import probe_tuning, synthetic_experts
from freetoken_py.kernels import gpu_autotune as at, gpu_moe
from freetoken_py.kernels.gpu_slots import build_table

cache = Path(sys.argv[1]) / "gpu" / "expert_kernels.json"
case = ("int4", 32, (64, 96), 1)
first = probe_tuning(device="cpu", cases=[case], reps=1)
n = sum(len(at.candidates("int4", 1, k, gpu_moe._rounds("int4"))) for k in ("gate_up", "down"))
assert first["status"] == "tuned" and first["timed"] == n and n >= 4, first
keys = {"int4/g32/64x96/nt1/gate_up", "int4/g32/64x96/nt1/down"}
assert set(first["tuned"]) == keys and first["path"] == str(cache), first
data = json.loads(cache.read_text())
assert data["machine"] == at.machine() and keys <= set(data["configs"])
at._active.clear()                      # (a new process: nothing loaded yet)
again = probe_tuning(device="cpu", cases=[case], reps=1)
assert again["status"] == "cached" and again["timed"] == 0 and set(again["cached"]) == keys, again
assert "\n" not in again["line"] and str(cache) in again["line"]
tuned = at.kernel_config("int4", 1, "gate_up", gpu_moe._rounds("int4"), 32, (64, 96))
assert tuned == at.finalize(data["configs"]["int4/g32/64x96/nt1/gate_up"], "int4", 32)
# a launch of that shape (tuned configurations) against the float64 reference
experts = synthetic_experts("int4", 3, 64, 96, 32, "cpu")
g = torch.Generator().manual_seed(2)
x = torch.randn(1, 64, generator=g)
rows, wts = torch.zeros(3, dtype=torch.int64), torch.tensor([0.5, 0.3, 0.2])
out = torch.zeros(1, 64)
gpu_moe.moe_slots(out, x, rows, wts, build_table(experts, "int4", 32), [0, 1, 2])
from freetoken_py.quant.int4 import dequantize_int4
def deq(q, s, k):                       # the format's own decoder (fp16 scales held as int16)
    return dequantize_int4(q, s.view(torch.float16), 32).double()
xv = gpu_moe.seen_by_cpu_kernels(x.float()).double()
want = torch.zeros(1, 64, dtype=torch.float64)
for e, w in zip(range(3), wts.tolist()):
    q13, s13, q2, s2 = experts[e]
    gu = xv @ deq(q13, s13, 64).T
    h = torch.nn.functional.silu(gu[:, :96]) * gu[:, 96:]
    h = gpu_moe.seen_by_cpu_kernels(h.float()).double()
    want += w * (h @ deq(q2, s2, 96).T)
err = (out.double() - want).abs().max().item()
assert err <= 1e-4 * want.abs().max().item(), err
# retune: timed again
assert probe_tuning(retune=True, device="cpu", cases=[case], reps=1)["timed"] == n
# a tuning that fails (here: a format with no synthetic experts) is one line, not a crash
bad = probe_tuning(device="cpu", cases=[("int3", 32, (64, 96), 1)], reps=1)
assert bad["status"] == "failed" and "\n" not in bad["line"] and "ValueError" in bad["line"] \
    and "default configurations" in bad["line"], bad
print("ok")
'''


def test_probe_tunes_once_then_uses_the_cache(tmp_path):
    env = {**os.environ, "FREETOKEN_CACHE_DIR": str(tmp_path), "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok"), proc.stdout


def test_off_a_gpu_the_probe_says_why_in_one_line(tmp_path):
    code = ("from freetoken_py.hw.kernel_tune import probe_tuning\n"
            "import torch; assert not torch.cuda.is_available()\n"
            "r = probe_tuning()\n"
            "assert r['status'] == 'skipped' and r['timed'] == 0, r\n"
            "print(r['line'])")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(FREETOKEN_CACHE_DIR=str(tmp_path), PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    if "assert not torch.cuda" in proc.stderr:
        pytest.skip("a CUDA GPU is present")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "GPU expert kernels not tuned: cpu is not a CUDA GPU"
    assert not (tmp_path / "gpu").exists()
