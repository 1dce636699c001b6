"""The accelerator tier's decode experts (kernels/gpu_moe.py) timed as the GPU runs them: kernel time
from CUDA-graph replay, against a read roofline, per format, geometry and batch.

    python bench/gpu_moe_kernels.py [--formats bf16,int4,fp8,nvfp4] [--models qwen3-30b-a3b,...]
                                    [--tokens 1,2,4,8] [--replays 20] [--out FILE]
    python bench/gpu_moe_kernels.py --dry-run      # anywhere: the cases, their bytes and slots; no kernels
    python bench/gpu_moe_kernels.py --interpret    # no GPU: Triton's CPU interpreter, tiny sizes, eager only
    python bench/gpu_moe_kernels.py --registers 80,90   # no GPU: compiled registers / spills / 16-byte loads
    ... --tune                                     # tune each case's kernels first (cached for this GPU)

A layer-step: T tokens, each routed to top-k distinct experts, every pair distinct, drawn from a
bank of slots >= 4x the GPU's L2 (so every step reads its experts from VRAM, as in decode). R
steps with different slots (rotating through the bank) are prepared (`gpu_moe.prepare`: the
step's one host->device copy) and captured in one CUDA graph; the graph's replay, timed with
CUDA events, gives the kernels' time per step (`graph_us`). The same steps issued eagerly give
the host cost (`host_us`: prepare + launches, wall clock) and the eager GPU time (`eager_us`).
Efficiency = bytes read (the step's experts: weights and scales) / graph time, against the read
roofline (`_triton_moe.read_kernel` over a buffer >= 4x L2, also from graph replay). Each case's
first step is checked against the torch path the executor takes otherwise (`formats.swiglu` /
`gpu_moe.quant_swiglu` per pair): `agree`. Prints one JSON line; exit status 1 when a case
disagrees. Without a GPU (and without --interpret / --dry-run) it prints {"skipped": true}.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

FORMATS = {"bf16": ("float", 32), "int4": ("int4", 32), "fp8": ("fp8", 128), "nvfp4": ("nvfp4", 16)}
MODELS = ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3")
TINY = (64, 32, 2)                       # --interpret: D, I, top-k
DEFAULT_L2 = 50 << 20                    # (--dry-run: an H100's L2)


def _csv(kind: str, value: str, allowed=None, conv=str) -> list:
    try:
        items = [conv(v) for v in value.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--{kind}: {value!r} is not a comma-separated list") from None
    bad = [v for v in items if allowed is not None and v not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"--{kind}: {bad or value!r} not among {', '.join(map(str, allowed))}")
    return items


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", type=lambda v: _csv("formats", v, FORMATS), default=list(FORMATS))
    ap.add_argument("--models", type=lambda v: _csv("models", v, MODELS), default=list(MODELS))
    ap.add_argument("--tokens", type=lambda v: _csv("tokens", v, range(1, 17), int), default=[1, 2, 4, 8])
    ap.add_argument("--replays", type=int, default=20, help="graph replays timed per case")
    ap.add_argument("--dry-run", action="store_true", help="list the cases, their bytes and slots; run nothing")
    ap.add_argument("--interpret", action="store_true", help="no GPU: Triton's CPU interpreter, tiny sizes")
    ap.add_argument("--tune", action="store_true",
                    help="first tune each case's kernels here (gpu_autotune: a small sweep, cached for this GPU)")
    ap.add_argument("--registers", type=lambda v: _csv("registers", v, (80, 86, 89, 90, 120), int), default=None,
                    metavar="ARCHS", help="instead: compile for these sm archs (no GPU needed) and report registers, "
                                          "spills and 16-byte loads per kernel")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.replays < 1:
        ap.error("--replays must be >= 1")
    return args


def geometry(model: str, interpret: bool) -> tuple[int, int, int]:
    """(D, I, top-k) of a model (residency.profiles.FRONTIER_MODELS), or the tiny interpreter one."""
    if interpret:
        return TINY
    from freetoken_py.residency.profiles import FRONTIER_MODELS

    spec = FRONTIER_MODELS[model]
    return spec.hidden, spec.moe_intermediate, spec.top_k


def expert_bytes(fmt: str, hidden: int, inter: int) -> int:
    """Bytes of one expert in the expert store's layout (weights and scales)."""
    n = 3 * hidden * inter
    return {"bf16": 2 * n, "int4": n // 2 + 2 * n // 32, "fp8": n + 4 * (2 * inter * -(-hidden // 128)
                                                                         + hidden * -(-inter // 128)),
            "nvfp4": n // 2 + n // 16 + 4 * 3 * inter}[fmt]


def plan_case(fmt: str, model: str, tokens: int, l2: int, interpret: bool) -> dict:
    hidden, inter, k = geometry(model, interpret)
    one = expert_bytes(fmt, hidden, inter)
    per_step = tokens * k
    slots = max(2 * per_step, -(-4 * l2 // one))
    return {"format": fmt, "model": model, "tokens": tokens, "hidden": hidden, "inter": inter, "top_k": k,
            "experts_per_step": per_step, "bytes_per_step": per_step * one, "slots": slots,
            "steps_per_graph": min(2, slots) if interpret else -(-slots // per_step)}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"          # before Triton is imported
    if args.registers:
        from freetoken_py.kernels.gpu_compile import compile_kernel

        rows = [compile_kernel(FORMATS[f][0], nt, kernel, arch, group_size=FORMATS[f][1])
                for arch in args.registers for f in args.formats for nt in (1, 8) for kernel in ("gate_up", "down")]
        return common.emit({"bench": "gpu_moe_kernels", "registers": True, "rows": rows,
                            "spills": sum(r["spill_stores"] + r["spill_loads"] for r in rows)}, args.out)
    if args.dry_run:
        cases = [plan_case(f, m, t, DEFAULT_L2, args.interpret) for f in args.formats for m in args.models
                 for t in args.tokens]
        return common.emit({"bench": "gpu_moe_kernels", "dry_run": True, "l2_assumed": DEFAULT_L2, "cases": cases},
                           args.out)
    import torch

    from freetoken_py.kernels import gpu_moe

    cuda = torch.cuda.is_available() and not args.interpret
    dev = torch.device("cuda" if cuda else "cpu")
    if not cuda and not args.interpret:
        return common.emit({"bench": "gpu_moe_kernels", "skipped": True,
                            "reason": "no CUDA GPU here; --interpret runs the kernels in Triton's CPU interpreter, "
                                      "--dry-run lists the cases"}, args.out)
    if not gpu_moe.available(dev):
        return common.emit({"bench": "gpu_moe_kernels", "skipped": True, "reason": gpu_moe.why_not()}, args.out)
    l2 = (getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or DEFAULT_L2) if cuda else 1 << 14
    roof = read_roofline(dev, l2, args.replays) if cuda else None
    rows = []
    models = args.models[:1] if args.interpret else args.models
    for fmt in args.formats:
        for model in models:
            for tokens in args.tokens:
                case = plan_case(fmt, model, tokens, l2, args.interpret)
                row = run_case(case, FORMATS[fmt], dev, args.replays if cuda else 1, cuda, args.tune)
                if roof:
                    row["share_of_roofline"] = round(row["gbps"] / roof, 3)
                rows.append(row)
    result = {"bench": "gpu_moe_kernels", "skipped": False, "comparable": cuda,
              "device": torch.cuda.get_device_name(dev) if cuda else "CPU (Triton interpreter)",
              "capability": ".".join(map(str, torch.cuda.get_device_capability(dev))) if cuda else None,
              "triton": __import__("triton").__version__, "read_roofline_gbps": round(roof, 1) if roof else None,
              "l2_bytes": l2, "agree": all(r["agree"] for r in rows), "rows": rows}
    common.emit(result, args.out)
    return 0 if result["agree"] else 1


def make_bank(fmt: str, slots: int, hidden: int, inter: int, group: int, dev):
    """`slots` random experts of `fmt` in the expert store's layouts, stacked per part on `dev`
    (random codes: decode speed does not depend on the values; small positive scales)."""
    import torch

    g = torch.Generator(device=dev).manual_seed(0)

    def codes(*shape):
        return torch.randint(0, 256, (slots, *shape), generator=g, device=dev, dtype=torch.uint8)

    if fmt == "float":
        return (torch.randn((slots, 2 * inter, hidden), generator=g, device=dev).div_(hidden ** 0.5).bfloat16(),
                torch.randn((slots, hidden, inter), generator=g, device=dev).div_(inter ** 0.5).bfloat16())
    if fmt == "int4":
        def sc(n, k):
            return torch.full((slots, n, k // group), 0.02, dtype=torch.float16, device=dev).view(torch.int16)
        return codes(2 * inter, hidden // 2), sc(2 * inter, hidden), codes(hidden, inter // 2), sc(hidden, inter)
    if fmt == "fp8":
        def fp8(n, k):                       # (0x7f / 0xff are NaN: one step down)
            c = codes(n, k)
            return torch.where((c & 127) == 127, c - 1, c)
        return (fp8(2 * inter, hidden), torch.full((slots, 2 * inter, -(-hidden // group)), 0.01, device=dev),
                fp8(hidden, inter), torch.full((slots, hidden, -(-inter // group)), 0.01, device=dev))

    def nv_scales(n, k):                     # e4m3 1.0 (0x38) per group of 16, then the factor 0.01
        s = torch.full((slots, n, k // 16 + 4), 0x38, dtype=torch.uint8, device=dev)
        s[..., -4:] = torch.tensor([0.01], dtype=torch.float32).view(torch.uint8).to(dev)
        return s
    return codes(2 * inter, hidden // 2), nv_scales(2 * inter, hidden), codes(hidden, inter // 2), nv_scales(hidden, inter)


def run_case(case: dict, spec: tuple, dev, replays: int, cuda: bool, tune: bool = False) -> dict:
    """One (format, model, T) case: graph replay and eager timings, and the torch path's agreement."""
    import torch

    from freetoken_py.kernels import gpu_moe
    from freetoken_py.kernels.gpu_slots import build_table
    from freetoken_py.residency.formats import swiglu

    fmt, group = spec
    hidden, inter, k, tokens = case["hidden"], case["inter"], case["top_k"], case["tokens"]
    slots, steps = case["slots"], case["steps_per_graph"]
    bank = make_bank(fmt, slots, hidden, inter, group, dev)
    experts = [tuple(p[i] for p in bank) for i in range(slots)]
    table = build_table(experts, fmt, group).to_device(dev)
    per = tokens * k

    def pair_slots(i: int) -> list[int]:                 # token t's k experts, all distinct, rotating
        return [(i * per + j) % slots for j in range(per)]

    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=g).to(dev, torch.bfloat16 if fmt == "float" else torch.float32)
    rows = torch.arange(tokens, device=dev).repeat_interleave(k)
    wts = torch.rand(per, generator=g).to(dev)
    out = torch.zeros_like(x)

    # the torch path on step 0 (per pair, fp32 sums), and the kernels' result
    ref = torch.zeros(tokens, hidden, dtype=torch.float32, device=dev)
    for p, s in enumerate(pair_slots(0)):
        t = int(rows[p])
        y = swiglu(x[t:t + 1].float(), *(w.float() for w in experts[s])) if fmt == "float" else \
            gpu_moe.quant_swiglu(x[t:t + 1], experts[s], fmt, group).float()
        ref[t] += wts[p] * y[0]
    gpu_moe.moe_slots(out, x, rows, wts, table, pair_slots(0))
    rel = ((out.float() - ref).abs().max() / ref.abs().max()).item()

    tuned = None
    if tune:                                             # (before any graph capture)
        from freetoken_py.kernels import gpu_autotune

        plan0 = gpu_moe.prepare(table, pair_slots(0), dev)
        scratch = torch.zeros_like(out)
        tuned = gpu_autotune.tune([(fmt, group, (hidden, inter), plan0.nt, gpu_moe._rounds(fmt))],
                                  lambda kernel, cfg: gpu_moe.time_config(scratch, x, rows, wts, plan0, kernel, cfg))

    # eager: prepare + launches per step (host wall clock; GPU time from events)
    plans, host = [], []
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    start = _event(cuda)
    for i in range(steps):
        t0 = time.perf_counter()
        plan = gpu_moe.prepare(table, pair_slots(i), dev)
        gpu_moe.run(out, x, rows, wts, plan)
        host.append(time.perf_counter() - t0)
        plans.append(plan)
    end = _event(cuda)
    sync()
    eager_s = (start.elapsed_time(end) / 1e3 if cuda else sum(host)) / steps
    graph_s = None
    if cuda:                                             # the kernels alone: R steps in one graph, replayed
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for plan in plans[:2]:
                gpu_moe.run(out, x, rows, wts, plan)     # (warm: compiled variants)
            with torch.cuda.graph(graph, stream=stream):
                for plan in plans:
                    gpu_moe.run(out, x, rows, wts, plan)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        sync()
        start, end = _event(cuda), None
        for _ in range(replays):
            graph.replay()
        end = _event(cuda)
        sync()
        graph_s = start.elapsed_time(end) / 1e3 / (replays * steps)
    step_bytes = case["bytes_per_step"]
    t = graph_s or eager_s
    return {**case, "max_rel_diff": rel, "agree": rel <= (2e-2 if fmt == "float" else 2e-3),
            "graph_us": round(graph_s * 1e6, 2) if graph_s else None, "eager_us": round(eager_s * 1e6, 2),
            "host_us": round(1e6 * sorted(host)[len(host) // 2], 1), "launches": gpu_moe.launches(tokens),
            "gbps": round(step_bytes / t / 1e9, 1), "tuned": tuned}


def _event(cuda: bool):
    import torch

    if not cuda:
        return None
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def read_roofline(dev, l2: int, replays: int) -> float:
    """GB/s of `_triton_moe.read_kernel` over max(1 GiB, 8x L2) bytes, from graph replay."""
    import torch

    from freetoken_py.kernels import _triton_moe as k

    words = max(1 << 28, 2 * l2)                         # int32 words: >= 1 GiB
    src = torch.ones(words, dtype=torch.int32, device=dev)
    grid = 8 * torch.cuda.get_device_properties(dev).multi_processor_count
    sink = torch.empty(grid, dtype=torch.int32, device=dev)

    def launch():
        k.read_kernel[(grid,)](src, sink, words, BLOCK=2048, STAGES=4)
    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    graph.replay()
    torch.cuda.synchronize()
    start = _event(True)
    for _ in range(replays):
        graph.replay()
    end = _event(True)
    torch.cuda.synchronize()
    return replays * 4 * words / (start.elapsed_time(end) / 1e3) / 1e9


if __name__ == "__main__":
    sys.exit(main())
