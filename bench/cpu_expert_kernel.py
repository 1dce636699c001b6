"""CPU expert-kernel bandwidth: decode (T=1) and grouped (T=64/512) MoE layers, dense GEMV.

Shape: one ~0.5B qwen3_moe layer (hidden 1024, 64 experts, top-8, expert width 256), with
`--layers` banks (default 8, >> L3 in every format) rotated so each call reads experts that are
not in cache. A DRAM reference (numba prange sum over 1 GiB, freetoken_py.hw.measure_dram) is
sampled between rounds, so every figure has a roofline next to it. Prints ONE JSON line.

    python bench/cpu_expert_kernel.py [--quick] [--formats bf16,int8,int4,fp32] [--threads N]

With more than one thread, decode and dense are also timed with one thread against a one-thread
DRAM sample ("one_thread"): on a machine where another process keeps a core busy, one thread
avoids the parallel region's barrier waiting for a descheduled worker.

"decode_in_cache": the compute ceiling, the same 8 experts of one bank called repeatedly (min
over calls; 4 MB int4 .. 25 MB fp32, in L2/L3), as Gweights/s per thread setting. "int_act" says
which activations the int4 and int8 dots multiplied (kernels._dots.INT_ACT); for an A/B against
the fp32-activation dots run the same command again with FREETOKEN_INT_ACT=fp32 and its own
NUMBA_CACHE_DIR (docs/kernels.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from freetoken_py.hw.measure_dram import make_buffer, read_samples  # noqa: E402
from freetoken_py.kernels import DenseWeight, ExpertBank, configure_threads, dense_linear, moe_experts, warmup  # noqa: E402
from freetoken_py.kernels._buffers import aligned_empty  # noqa: E402

HIDDEN, EXPERTS, TOP_K, INTER, VOCAB = 1024, 64, 8, 256, 32000
GROUP_SIZE = 32


def clone_bank(bank: ExpertBank) -> ExpertBank:
    """Same weights at new (page-aligned) addresses: another layer as far as caches are concerned."""
    def copy(a):
        b = aligned_empty(a.shape, a.dtype)
        b[...] = a
        return b
    return dataclasses.replace(bank, w13=copy(bank.w13), s13=copy(bank.s13), w2=copy(bank.w2), s2=copy(bank.s2))


def make_banks(fmt: str, layers: int, g: torch.Generator) -> list[ExpertBank]:
    gate, up = (torch.randn(EXPERTS, INTER, HIDDEN, generator=g) * 0.05 for _ in range(2))
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.05
    first = ExpertBank.from_weights(gate, up, down, fmt=fmt, group_size=GROUP_SIZE)
    return [first] + [clone_bank(first) for _ in range(layers - 1)]


def random_routes(num_t: int, calls: int, g: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Distinct top-k experts per token (uniform), renormalised random weights."""
    out = []
    for _ in range(calls):
        ids = torch.rand(num_t, EXPERTS, generator=g).argsort(dim=1)[:, :TOP_K]
        w = torch.rand(num_t, TOP_K, generator=g)
        out.append((ids, w / w.sum(dim=1, keepdim=True)))
    return out


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def in_cache_gweights(bank, x, w, calls: int = 200) -> float:
    """Weights per second of the fastest of `calls` decode calls on experts 0..7 (cache-resident)."""
    ids = torch.arange(TOP_K).view(1, TOP_K)
    for _ in range(10):
        moe_experts(bank, x, ids, w)
    best = min(timed(lambda: moe_experts(bank, x, ids, w)) for _ in range(calls))
    return TOP_K * 3 * INTER * HIDDEN / best / 1e9


def decode_cycle(banks, x, w) -> float:
    """Seconds per call, over one pass that reads every expert of every bank once."""
    calls = [(b, torch.arange(i, i + TOP_K).view(1, TOP_K)) for i in range(0, EXPERTS, TOP_K) for b in banks]
    return timed(lambda: [moe_experts(b, x, ids, w) for b, ids in calls]) / len(calls)


def grouped_call(banks, xs, routes, i) -> float:
    ids, w = routes[i % len(routes)]
    return timed(lambda: moe_experts(banks[i % len(banks)], xs, ids, w))


def dense_cycle(weights, x) -> float:
    return timed(lambda: [dense_linear(dw, x) for dw in weights]) / len(weights)


def med(v):
    return float(np.median(v))


def streaming_round(threads, dram_buf, banks, dense, x1, w1, samples) -> None:
    """One interleaved round at `threads`: a DRAM sample, then decode and dense GEMV per format."""
    configure_threads(threads)
    samples.setdefault("dram", []).extend(read_samples(dram_buf, threads, reps=1, budget_s=10))
    for f in banks:
        samples.setdefault(("decode", f), []).append(decode_cycle(banks[f], x1, w1))
        for name, ws in dense.get(f, {}).items():
            samples.setdefault(("dense", f, name), []).append(dense_cycle(ws, x1))


def streaming_report(samples, banks, dense) -> dict:
    dram = med(samples["dram"])
    out = {"dram_gbps": {"median": round(dram, 1), "samples": [round(v, 1) for v in samples["dram"]]},
           "decode": {}, "dense": {}}
    for f, bl in banks.items():
        nbytes = TOP_K * bl[0].bytes_per_expert
        dt = med(samples[("decode", f)])
        out["decode"][f] = {"us_per_call": round(dt * 1e6, 1), "gbps": round(nbytes / dt / 1e9, 1),
                            "ratio_to_dram": round(nbytes / dt / 1e9 / dram, 2), "bytes_per_call": nbytes}
        for name, ws in dense.get(f, {}).items():
            dt = med(samples[("dense", f, name)])
            gbps = ws[0].nbytes / dt / 1e9
            out["dense"].setdefault(f, {})[f"{name}_{ws[0].out_features}x{ws[0].in_features}"] = {
                "us_per_call": round(dt * 1e6, 1), "gbps": round(gbps, 1), "ratio_to_dram": round(gbps / dram, 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer layers and rounds")
    ap.add_argument("--formats", default="bf16,int8,int4,fp32")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="default: all usable cores")
    args = ap.parse_args()
    fmts = args.formats.split(",")
    rounds = args.rounds or (3 if args.quick else 7)
    layers = args.layers or (4 if args.quick else 8)
    threads = configure_threads(args.threads)
    compile_s = warmup(fmts)
    g = torch.Generator().manual_seed(0)

    banks = {f: make_banks(f, layers, g) for f in fmts}
    lm_w = torch.randn(VOCAB, HIDDEN, generator=g) * 0.05
    attn_w = torch.randn(HIDDEN, HIDDEN, generator=g) * 0.05
    dense = {f: {"lm_head": [DenseWeight.from_tensor(lm_w, f)],                # 64-131 MB: > L3 alone
                 "attn": [DenseWeight.from_tensor(attn_w, f) for _ in range(64)]}  # 64-256 MB rotated
             for f in fmts if f != "int4"}
    dram_buf = make_buffer(1 << 30)
    x1, w1 = torch.randn(1, HIDDEN, generator=g), torch.full((1, TOP_K), 1.0 / TOP_K)
    xs = {t: torch.randn(t, HIDDEN, generator=g) for t in (64, 512)}
    routes = {t: random_routes(t, 4, g) for t in xs}

    settings = [threads, 1] if threads > 1 else [threads]
    samples = {n: {} for n in settings}
    grouped = {(f, t): [] for f in fmts for t in xs}
    for f in fmts:                                                      # warm pages and pools
        decode_cycle(banks[f], x1, w1)
    for r in range(rounds):                                             # interleaved A B A B ...
        for n in settings:
            streaming_round(n, dram_buf, banks, dense, x1, w1, samples[n])
        configure_threads(threads)
        for f in fmts:
            for t in xs:
                grouped[(f, t)].append(grouped_call(banks[f], xs[t], routes[t], r))

    in_cache = {}
    for n in settings:
        configure_threads(n)
        in_cache[f"threads{n}"] = {f: round(in_cache_gweights(banks[f][0], x1, w1), 1) for f in fmts}
    configure_threads(threads)

    from freetoken_py.kernels._dots import INT_ACT
    result = {"bench": "cpu_expert_kernel", "threads": threads, "int_act": INT_ACT,
              "compile_or_cache_load_s": round(compile_s, 2),
              "shape": {"hidden": HIDDEN, "experts": EXPERTS, "top_k": TOP_K, "inter": INTER,
                        "layers_rotated": layers, "group_size_int4": GROUP_SIZE,
                        "bank_mib_total": {f: round(layers * banks[f][0].nbytes / 2**20) for f in fmts}},
              "rounds": rounds, "load_avg_1m": round(os.getloadavg()[0], 2)}
    result["decode_in_cache_gweights"] = in_cache
    result.update(streaming_report(samples[threads], banks, dense))
    if threads > 1:
        result["one_thread"] = streaming_report(samples[1], banks, dense)
    result["grouped"] = {f: {f"T{t}": {"ms_per_call": round(med(grouped[(f, t)]) * 1e3, 2),
                                      "tok_per_s": round(t / med(grouped[(f, t)])),
                                      "expert_gflops": round(t * TOP_K * 6 * INTER * HIDDEN / med(grouped[(f, t)]) / 1e9, 1)}
                             for t in xs} for f in fmts}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
