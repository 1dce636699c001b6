"""Where a decode MoE call loses to the memory wall: its stages against a dense GEMV over the same bytes.

One JSON line per format at Qwen3-30B-A3B's expert shape (D 2048, I 768), batch 1, top-8, on a
bank that rotates so no call is served from the cache (bench/expert_roofline.py's). Rounds are
interleaved; each figure is a median of GB/s of weights read:

- `dram`: the all-core DRAM read of the same run (freetoken_py.hw.measure_dram);
- `call`: the production call (`cpu_moe.moe_experts`: gate/up, down, combine);
- `gate_up`: its stage 1 alone (the production block function over the call's 8 experts);
- `gate_up_x8`: the same stage for 8 tokens routed to 64 distinct experts (8x the bytes a call,
  so a cost per call shows as `gate_up` below it);
- `gemv_gate_up`: the dense GEMV (`cpu_linear.dense_rows_prepared`; for "r16" banks its slab form)
  over the same 8 experts'
  gate/up rows as one matrix [8 x 2I, D]: equal bytes, one parallel region of 32-row tasks;
- `down`: stage 2 alone (the expert-major down GEMV blocks).

    python bench/expert_roofline.py ...                       # the kernels' shares (issue 45's figure)
    python bench/moe_stages.py [--formats int4,int8] [--rounds 6] [--bank-mib 512] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
from numba import njit, prange

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from expert_roofline import GROUP, SHAPES, TOP_K, _spec, cpu_name, isa, make_bank  # noqa: E402
from freetoken_py.hw.measure_dram import make_buffer, read_samples  # noqa: E402
from freetoken_py.kernels import configure_threads, moe_experts  # noqa: E402
from freetoken_py.kernels._dots import ACT_SILU, prepare  # noqa: E402
from freetoken_py.kernels._moe_kernels import RB_DOWN_FEW, RB_FEW, gate_up_block, group_pairs  # noqa: E402
from freetoken_py.kernels.cpu_linear import dense_rows_prepared, gemv_block  # noqa: E402


@njit(parallel=True, fastmath=True, cache=True)
def _stage1(w13, s13, x, ids, gs, h, ub):
    """moe_rows's stage 1 at decode's row blocks (RB_FEW) for x [T, D] and ids [T, k]."""
    xv, xg = prepare(w13, s13, x, gs)
    inter = w13.shape[1] // 2
    order, eids, off = group_pairs(ids.reshape(-1), w13.shape[0])
    nb = (inter + RB_FEW - 1) // RB_FEW
    for task in prange(eids.shape[0] * nb):
        u, i0 = task // nb, task % nb * RB_FEW
        gate_up_block(w13[eids[u]], s13[eids[u]], xv, xg, order[off[u]:off[u + 1]], ids.shape[1], i0,
                      min(inter, i0 + RB_FEW), ACT_SILU, gs // 2, h, ub[task], np.zeros(0, np.float32))


@njit(parallel=True, fastmath=True, cache=True)
def _stage2(w2, s2, h, ids, gs, y):
    """moe_rows's expert-major down stage (without the combine) for one token's k pairs' h [k, I]."""
    hv, hg = prepare(w2, s2, h, gs)
    eids = ids.reshape(-1)
    hidden = w2.shape[1]
    nb = (hidden + RB_DOWN_FEW - 1) // RB_DOWN_FEW
    for task in prange(eids.shape[0] * nb):
        u, d0 = task // nb, task % nb * RB_DOWN_FEW
        gemv_block(w2[eids[u]], s2[eids[u]], hv[u:u + 1], hg[u:u + 1], gs // 2, d0, min(hidden, d0 + RB_DOWN_FEW),
                   y[u:u + 1])


@njit(cache=True)
def _prepared(w, s, x, gs):
    return prepare(w, s, x, gs)


def gate_up_gemv(bank, x: np.ndarray, k: int):
    """ids [1, k] (consecutive experts) -> their gate/up rows as one dense matrix times x [1, D],
    by the dense GEMV (returns the [1, k 2I] output it writes)."""
    inter, gs = bank.inter, bank.group_size
    rows13 = bank.w13.reshape(-1, bank.w13.shape[-1])        # every expert's gate/up rows, one matrix
    srows13 = bank.s13.reshape(rows13.shape[0], -1)
    xv, xg = _prepared(rows13[:1], srows13[:1], x, gs)
    out = np.empty((1, k * 2 * inter), np.float32)
    span = k * 2 * inter

    def gemv(ids):
        e = int(ids[0, 0]) * 2 * inter
        dense_rows_prepared(rows13[e:e + span], srows13[e:e + span], xv, xg, gs, out)
        return out
    return gemv


def _rate(fn, calls: list, nbytes: int) -> float:
    """GB/s of one pass of fn over `calls` (each reading `nbytes`)."""
    t0 = time.perf_counter()
    for c in calls:
        fn(c)
    return len(calls) * nbytes / (time.perf_counter() - t0) / 1e9


def measure(spec: str, rounds: int, bank_mib: int, threads: int) -> dict:
    """spec: a format, or format:layout ("int4:rows": the row layout where the CPU would take r16)."""
    fmt, layout = _spec(spec)
    g = torch.Generator().manual_seed(0)
    hidden, inter = SHAPES["qwen3"]
    gs = GROUP[fmt]
    bank = make_bank(fmt, hidden, inter, bank_mib << 20, g, layout=layout)
    n = bank.num_experts
    per13 = (bank.w13.nbytes + bank.s13.nbytes) // n
    per2 = (bank.w2.nbytes + bank.s2.nbytes) // n
    x = torch.randn(1, hidden, generator=g).numpy()
    x8 = torch.randn(8, hidden, generator=g).numpy()
    wts = np.full((1, TOP_K), 1.0 / TOP_K, np.float32)
    h = (torch.randn(TOP_K, inter, generator=g) * 0.1).numpy()
    one = [np.arange(e, e + TOP_K).reshape(1, TOP_K) for e in range(0, n - TOP_K + 1, TOP_K)]
    wide = [np.arange(e, e + 8 * TOP_K).reshape(8, TOP_K) for e in range(0, n - 8 * TOP_K + 1, 8 * TOP_K)]
    tasks = 8 * TOP_K * -(-inter // RB_FEW)                  # stage 1's tasks for 64 experts
    hbuf, ubuf = np.empty((8 * TOP_K, inter), np.float32), np.empty((tasks, 4, RB_FEW), np.float32)
    y = np.empty((TOP_K, hidden), np.float32)
    gemv = gate_up_gemv(bank, x, TOP_K)

    runs = {
        "call": (lambda ids: moe_experts(bank, x, ids, wts), one, TOP_K * bank.bytes_per_expert),
        "gate_up": (lambda ids: _stage1(bank.w13, bank.s13, x, ids, gs, hbuf, ubuf), one, TOP_K * per13),
        "gate_up_x8": (lambda ids: _stage1(bank.w13, bank.s13, x8, ids, gs, hbuf, ubuf), wide, 8 * TOP_K * per13),
        "gemv_gate_up": (gemv, one, TOP_K * per13),
        "down": (lambda ids: _stage2(bank.w2, bank.s2, h, ids, gs, y), one, TOP_K * per2),
    }
    for fn, calls, _ in runs.values():          # compile, page in
        fn(calls[0])
    buf = make_buffer(1 << 30)
    got = {k: [] for k in ["dram", *runs]}
    for _ in range(rounds):
        got["dram"].append(float(np.median(read_samples(buf, threads, reps=2, budget_s=3))))
        for name, (fn, calls, nbytes) in runs.items():
            got[name].append(_rate(fn, calls, nbytes))
    med = {k: float(np.median(v)) for k, v in got.items()}
    return {"bench": "moe_stages", "cpu": cpu_name(), "isa": isa(), "threads": threads, "format": fmt, "group": gs,
            "layout": bank.layout,
            "hidden": hidden, "inter": inter, "top_k": TOP_K, "rounds": rounds, "bank_mib": bank.nbytes >> 20,
            "gbps": {k: round(v, 1) for k, v in med.items()},
            "share_of_dram": {k: round(v / med["dram"], 3) for k, v in med.items() if k != "dram"},
            "samples": {k: [round(v, 1) for v in vs] for k, vs in got.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="int4,int8")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--bank-mib", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None, help="default: all usable cores")
    args = ap.parse_args()
    threads = configure_threads(args.threads)
    for fmt in args.formats.split(","):
        print(json.dumps(measure(fmt, args.rounds, args.bank_mib, threads)), flush=True)


if __name__ == "__main__":
    main()
