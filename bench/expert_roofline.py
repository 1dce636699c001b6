"""Expert-kernel roofline per weight format at real expert widths: one JSON line per format.

Each line: the production kernel (`cpu_moe.moe_experts`, batch 1, top-8, SwiGLU) reading a bank of
experts that rotates so no call is served from the cache, at Qwen3-30B-A3B's expert shape (D 2048,
I 768) and DeepSeek-V3 / GLM-5's (D 7168, I 2048), next to the DRAM read rate of the same run
(freetoken_py.hw.measure_dram's all-core sum). Rounds are interleaved (a DRAM sample, then every
format x shape), the figures are medians over rounds, and each kernel's share is of the memory
wall: the larger of the DRAM median and the fastest kernel median of the run (issue 45).

    python bench/expert_roofline.py [--formats bf16,int8,int4,fp8,nvfp4] [--shapes qwen3,dsv3]
                                    [--rounds 7] [--bank-mib 768] [--threads N] [--weights uniform|student-t3]

Formats at the group each ships with: int4 g32, fp8 e4m3 with a scale per 128 columns, nvfp4 e2m1
with an e4m3 scale per 16 and a row factor. MXFP4 (e2m1, e8m0 per 32) loads into the nvfp4 bank
losslessly (its bytes and kernel are nvfp4's), so the nvfp4 line is MXFP4's as well. The
activation path is this process's default (kernels._dots.INT_ACT / BF16_ACT: "act" in each line);
FREETOKEN_INT_ACT=fp32 or FREETOKEN_SIMD=avx2 select the other paths (each its own kernel cache).
Banks take the layout the CPU backend gives them (`cpu_moe.preferred_layout`: int4 / nvfp4 in 16-row
slabs, "r16", with int8 activations on AVX2 and AVX-512 VNNI CPUs, int8 on AVX-512 VNNI, fp8 on
AVX512-BF16 + VBMI with bf16 activations); a format written `int4:rows` forces the row layout, so
`--formats int4,int4:rows` compares the two in one interleaved run ("layout" in each shape).
Weights: uniform in +-0.05 (default; an fp8 bank of them holds almost no subnormal e4m3 codes), or
Student-t with 3 degrees of freedom (heavy tails, as layers with outliers: ~1e-3 of the fp8 codes
subnormal, where a decode that makes fp32 subnormals pays microcode assists on Intel cores).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from freetoken_py.hw.measure_dram import make_buffer, read_samples  # noqa: E402
from freetoken_py.hw.measure_expert import tiled_bank  # noqa: E402
from freetoken_py.kernels import ExpertBank, configure_threads, moe_experts  # noqa: E402
from freetoken_py.kernels.cpu_moe import preferred_layout  # noqa: E402

SHAPES = {"qwen3": (2048, 768), "dsv3": (7168, 2048)}      # (hidden D, expert width I)
GROUP = {"bf16": 32, "fp32": 32, "int8": 32, "int4": 32, "fp8": 128, "nvfp4": 16}
TOP_K = 8
BASE = 2                                                      # experts encoded; the bank repeats them


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def isa() -> str:
    from freetoken_py.kernels import _simd
    return "avx512" if _simd.HAS_AVX512 else ("avx2" if _simd.HAS_AVX2 else "portable")


WEIGHTS = ("uniform", "student-t3")


def _weights(shape, g: torch.Generator, kind: str) -> torch.Tensor:
    if kind == "student-t3":    # t(3) = normal / sqrt(chi2(3) / 3), drawn from `g`
        chi2 = sum(torch.randn(shape, generator=g) ** 2 for _ in range(3))
        return torch.randn(shape, generator=g) / (chi2 / 3).sqrt() * 0.02
    return (torch.rand(shape, generator=g) - 0.5) * 0.1


def _spec(f: str) -> tuple[str, str]:
    """"int4" -> ("int4", "auto"); "int4:rows" -> ("int4", "rows"): a format and its bank layout
    (so one run can hold the layouts side by side)."""
    fmt, _, layout = f.partition(":")
    return fmt, layout or "auto"


def make_bank(fmt: str, hidden: int, inter: int, bank_bytes: int, g: torch.Generator,
              weights: str = "uniform", layout: str = "auto") -> ExpertBank:
    """A bank of ~bank_bytes in `fmt`, in the layout the CPU backend would give it ("auto":
    cpu_moe.preferred_layout) or the one named."""
    gate, up = (_weights((BASE, inter, hidden), g, weights) for _ in range(2))
    down = _weights((BASE, hidden, inter), g, weights)
    if layout == "auto":
        layout = preferred_layout(fmt, inter, hidden, GROUP[fmt])
    base = ExpertBank.from_weights(gate, up, down, fmt=fmt, group_size=GROUP[fmt], layout=layout)
    num = max(math.ceil(bank_bytes / base.bytes_per_expert / TOP_K), 2) * TOP_K
    return tiled_bank(base, num)


class Workload:
    def __init__(self, bank: ExpertBank, g: torch.Generator):
        self.bank = bank
        self.routes = [torch.arange(i, i + TOP_K).view(1, TOP_K) for i in range(0, bank.num_experts, TOP_K)]
        self.x = torch.randn(1, bank.hidden, generator=g)
        self.w = torch.full((1, TOP_K), 1.0 / TOP_K)
        self.next = 0

    def sample(self, min_s: float) -> float:
        """GB/s of consecutive calls (the rotation continued) until min_s has passed, at most one
        pass over the bank."""
        calls, t0 = 0, time.perf_counter()
        while True:
            moe_experts(self.bank, self.x, self.routes[self.next], self.w)
            self.next = (self.next + 1) % len(self.routes)
            calls += 1
            dt = time.perf_counter() - t0
            if dt >= min_s or calls == len(self.routes):
                return calls * TOP_K * self.bank.bytes_per_expert / dt / 1e9


def measure(fmts, shapes, rounds: int = 7, bank_mib: int = 768, sample_s: float = 0.25,
            threads: int | None = None, weights: str = "uniform") -> list[dict]:
    """One dict per format (the JSON lines below); the rounds interleaved as the module doc says.
    "best_share_of_dram": the fastest sample over the fastest DRAM sample (noise only slows a
    sample: what bench/gates.py's expert gate holds)."""
    threads = configure_threads(threads)
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    work = {(f, s): Workload(make_bank(*_spec(f)[:1], *SHAPES[s], bank_mib << 20, g, weights, _spec(f)[1]), g)
            for f in fmts for s in shapes}
    build_s = time.perf_counter() - t0
    dram_buf = make_buffer(1 << 30)
    for w in work.values():                          # compile / cache-load, page in
        w.sample(0.0)
    dram, got = [], {k: [] for k in work}
    for _ in range(rounds):                          # interleaved: DRAM, then every format x shape
        dram.extend(read_samples(dram_buf, threads, reps=2, budget_s=5))
        for k, w in work.items():
            got[k].append(w.sample(sample_s))
    dram.extend(read_samples(dram_buf, threads, reps=2, budget_s=5))
    del dram_buf
    dram_med = float(np.median(dram))
    kern_med = {k: float(np.median(v)) for k, v in got.items()}
    wall = max([dram_med, *kern_med.values()])
    from freetoken_py.kernels import _dots
    common = {"bench": "expert_roofline", "cpu": cpu_name(), "isa": isa(), "threads": threads,
              "dram_gbps": round(dram_med, 1), "dram_samples": [round(v, 1) for v in dram],
              "wall_gbps": round(wall, 1), "rounds": rounds, "load_avg_1m": round(os.getloadavg()[0], 2),
              "build_s": round(build_s, 1), "weights": weights}
    lines = []
    for f in fmts:
        act = {"int8": _dots.INT_ACT, "int4": _dots.INT_ACT, "nvfp4": _dots.INT_ACT,
               "bf16": _dots.BF16_ACT, "fp8": getattr(_dots, "FP8_ACT", "fp32")}.get(_spec(f)[0], "fp32")
        fmt, _ = _spec(f)
        line = {**common, "format": fmt, "group": GROUP[fmt], "act": act, "shapes": {}}
        for s in shapes:
            b = work[(f, s)].bank
            m = kern_med[(f, s)]
            line["shapes"][s] = {"hidden": b.hidden, "inter": b.inter, "layout": b.layout, "bank_mib": b.nbytes >> 20,
                                 "bytes_per_expert": b.bytes_per_expert, "gbps": round(m, 1),
                                 "samples": [round(v, 1) for v in got[(f, s)]],
                                 "share_of_dram": round(m / dram_med, 3), "share_of_wall": round(m / wall, 3),
                                 "best_share_of_dram": round(max(got[(f, s)]) / max(dram), 3)}
        lines.append(line)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bf16,int8,int4,fp8,nvfp4")
    ap.add_argument("--shapes", default="qwen3,dsv3")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--bank-mib", type=int, default=768, help="bytes rotated per format and shape")
    ap.add_argument("--sample-s", type=float, default=0.25)
    ap.add_argument("--threads", type=int, default=None, help="default: all usable cores")
    ap.add_argument("--weights", choices=WEIGHTS, default="uniform", help="the experts' weight distribution")
    args = ap.parse_args()
    for line in measure(args.formats.split(","), args.shapes.split(","), args.rounds, args.bank_mib,
                        args.sample_s, args.threads, args.weights):
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
