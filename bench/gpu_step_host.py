"""The host's work to set up one decode step of the accelerator's Triton experts (everything but
the launches), per-call table against the executor's persistent one.

    python bench/gpu_step_host.py [--pairs 8] [--calls 2000] [--rounds 3] [--model qwen3-30b-a3b]

`per_call_table`: what `gpu_moe.moe_pairs` does for its caller (and what the residency executor
did before 2026-12-07): the pairs' rows and weights sent from pinned staging, a `SlotTable` of the
step's experts built and checked on the host, the inputs validated, then `gpu_moe.prepare` (its
plan sent, the scratch taken). `persistent_table`: what the executor does now: the plan packed
against the slot cache's table (built once, rebuilt only when the cache's chunks change), the
rows, weights and plan in one copy from pinned staging, `gpu_moe.step_plan` (pooled scratch).
Both on this machine's CPU (no GPU needed: the launches are not timed; on a GPU the old path's
`pin_memory` per call adds more), interleaved in rounds, medians of `--calls` each.

`--executor` adds the whole decode layer-step on the host (`executor_us`: the residency
executor's call, median over the decode steps, the Triton launches replaced by no-ops; the
emulated accelerator, so the device's ops are the CPU's) on the bench's Qwen3-MoE 0.5B checkpoint
(bench/_work, built once), all experts resident (policy static) and mixed (lru, the RTX 5090
profile's slots): the proxy for issue 40's host microseconds per MoE layer (Triton's own launch
overhead, ~20 us a launch on a GPU host, comes on top). One JSON line.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

GEOMETRY = {"qwen3-30b-a3b": (2048, 768), "qwen3-235b-a22b": (4096, 1536), "deepseek-v3": (7168, 2048)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(GEOMETRY))
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--executor", action="store_true", help="also time the executor's decode layer-steps")
    ap.add_argument("--decode-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    import torch

    from freetoken_py.kernels import gpu_moe
    from freetoken_py.kernels.gpu_slots import build_table, packed_plan
    from freetoken_py.residency.slots import SlotCache
    from freetoken_py.residency.transfers import Transfers

    torch.set_num_threads(1)
    hidden, inter = GEOMETRY[args.model]
    cache = SlotCache(args.slots, [((2 * inter, hidden), torch.bfloat16), ((hidden, inter), torch.bfloat16)])
    transfers = Transfers("cpu")
    table = build_table([cache.views(s) for s in range(args.slots)], "float").to_device("cpu")
    step = torch.randperm(args.slots)[:args.pairs].tolist()       # distinct experts, one token (decode)
    x = torch.randn(1, hidden, dtype=torch.bfloat16)
    out = torch.zeros_like(x)
    rows, wts = torch.zeros(args.pairs, dtype=torch.long), torch.rand(args.pairs)

    def per_call_table():
        rows_d, wts_d = transfers.to_device([rows, wts], "pairs")
        unique, pair_slots = gpu_moe._pair_slots([cache.views(s) for s in step])
        t = build_table(unique, "float")
        gpu_moe._prepare(out, x, rows_d, wts_d, args.pairs, t.hidden, "moe_pairs")
        return gpu_moe.prepare(t, pair_slots, x.device)

    plans: dict = {}

    def persistent_table():          # (as `ResidencyExecutor._run_fused` does it)
        host_plan, groups, nt = packed_plan(step, table)
        _, _, plan = transfers.to_device([rows, wts, host_plan], "fused", keep=True)
        key = (plan.data_ptr(), groups, nt, args.pairs)
        if key not in plans:
            plans[key] = gpu_moe.step_plan(table, plan, groups, nt, args.pairs)
        return plans[key]

    cases = {"per_call_table": per_call_table, "persistent_table": persistent_table}
    got: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            times = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            got[name].append(statistics.median(times) * 1e6)
    executor = _executor_us(args.decode_tokens) if args.executor else None
    row = {"bench": "gpu_step_host", **common.cpu_fields(), "model": args.model, "hidden": hidden, "inter": inter,
           "pairs": args.pairs, "threads": 1,
           **{f"{name}_us": [round(v, 1) for v in vals] for name, vals in got.items()},
           "ratio": round(statistics.median(got["per_call_table"]) / statistics.median(got["persistent_table"]), 2),
           "executor_us": executor}
    return common.emit(row, args.out)


def _executor_us(tokens: int) -> dict:
    """Median host microseconds of the executor's decode layer-steps with the Triton experts,
    their launches no-ops, per placement (see the module docstring)."""
    import torch

    from freetoken_py.core import SamplingParams
    from freetoken_py.kernels import gpu_moe
    from freetoken_py.llm import LLM

    class _NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    class _Kernels:
        gate_up_kernel = down_kernel = combine_kernel = _NoLaunch()

    gpu_moe._load = lambda: _Kernels
    path = common.build_qwen3_moe(Path(__file__).resolve().parent / "_work" / "qwen3moe-0.5b-bf16")
    got = {}
    for name, kw in (("all_resident", dict(residency_policy="static", vram_budget_bytes=10 ** 12)),
                     ("mixed_lru", dict(residency_policy="lru", residency_profile="rtx5090"))):
        llm = LLM(str(path), show_progress=False, residency="emulate", **kw)
        ex, times = llm.residency, []
        ex.fused_accel = True

        def observed(layer, x, ids, weights, ex=ex, times=times):
            t0 = time.perf_counter()
            out = ex(layer, x, ids, weights)
            if x.shape[0] == 1:
                times.append(time.perf_counter() - t0)
            return out

        llm.model.experts = observed
        prompt = common.random_prompt(llm.args.vocab_size, 16)
        for n in (8, tokens):                  # (a warm-up, then the measured decode)
            times.clear()
            req = llm.add_request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            while not req.finished:
                llm.step()
        got[name] = round(statistics.median(times) * 1e6, 1)
        del llm
        torch.set_num_threads(1)
    return got


if __name__ == "__main__":
    sys.exit(main())
