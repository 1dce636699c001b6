"""The accelerator tier's decode experts: the Triton kernels (kernels/gpu_moe.py) against torch's
one-expert-at-a-time path, on one layer-step of a frontier model's geometry, on this GPU.

    python bench/gpu_moe_kernels.py [--model qwen3-30b-a3b] [--iters 50] [--no-int4] [--out FILE]
    python bench/gpu_moe_kernels.py --interpret      # no GPU: Triton's CPU interpreter, tiny sizes

One token, top-k distinct experts drawn from a bank of slots larger than the GPU's L2 cache (so
every layer-step reads its experts from VRAM, as in decode), bf16. Each path is timed with CUDA
events over --iters layer-steps (median); both paths' outputs are compared first. Prints one JSON
line: ms per layer-step and achieved GB/s of expert weights for each path, the ratio, and the
roofline (this machine's VRAM copy bandwidth from `freetoken probe`'s cache, else measured here).
Then the same for int4 experts (`--expert-dtype int4` in the tiers: g = 32, 4.5 bits per
weight), under `"int4"`: the quantised Triton kernels (`moe_pairs_quant`) against the torch path
(`ExpertFormat.compute`: dequantise, then two GEMVs), GB/s of int4 bytes.
Exit status 1 when the two paths' outputs disagree (beyond bf16 rounding; 1e-4 for int4).

Without a GPU it prints {"skipped": true, ...}. `--interpret` runs the same code in Triton's CPU
interpreter on a tiny geometry: it checks the script and the kernels' agreement, and its times
are not a GPU's (`comparable: false`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b", help="geometry from residency.profiles.FRONTIER_MODELS")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--interpret", action="store_true", help="no GPU: Triton's CPU interpreter, tiny sizes")
    ap.add_argument("--no-int4", action="store_true", help="only the bf16 experts")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"          # before Triton is imported
    import torch

    from freetoken_py.kernels import gpu_moe
    from freetoken_py.residency.formats import swiglu as _swiglu
    from freetoken_py.residency.profiles import FRONTIER_MODELS

    if args.model not in FRONTIER_MODELS:
        ap.error(f"unknown --model {args.model!r}; choose one of {', '.join(FRONTIER_MODELS)}")
    cuda = torch.cuda.is_available() and not args.interpret
    dev = "cuda" if cuda else "cpu"
    if not cuda and not args.interpret:
        return common.emit({"bench": "gpu_moe_kernels", "skipped": True,
                      "reason": "no CUDA GPU here; --interpret runs the kernels in Triton's CPU interpreter"}, args.out)
    if not gpu_moe.available(dev):
        return common.emit({"bench": "gpu_moe_kernels", "skipped": True, "reason": "Triton is not installed"},
                           args.out)
    spec = FRONTIER_MODELS[args.model]
    hidden, inter, k = (64, 32, 4) if args.interpret else (spec.hidden, spec.moe_intermediate, spec.top_k)
    dtype = torch.bfloat16
    expert_bytes = 3 * hidden * inter * 2
    l2 = (getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 64 << 20) if cuda else 1 << 20
    slots = max(2 * k, -(-4 * l2 // expert_bytes))        # the bank: 4x L2, at least two layer-steps
    iters = min(args.iters, 3) if args.interpret else args.iters
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(slots, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dev, dtype)
    w2 = (torch.randn(slots, hidden, inter, generator=g) / inter ** 0.5).to(dev, dtype)
    x = torch.randn(1, hidden, generator=g).to(dev, dtype)
    wts = torch.rand(k, generator=g).to(dev)
    rows = torch.zeros(k, dtype=torch.long, device=dev)

    def pick(i: int) -> list[int]:                      # k distinct slots, rotating through the bank
        return [(i * k + j) % slots for j in range(k)]

    def triton_step(i: int) -> torch.Tensor:
        out = torch.zeros_like(x)
        s = pick(i)
        gpu_moe.moe_pairs(out, x, rows, wts, [w13[e] for e in s], [w2[e] for e in s])
        return out

    def torch_step(i: int) -> torch.Tensor:             # the executor's torch path, expert by expert
        out = torch.zeros_like(x)
        for j, e in enumerate(pick(i)):
            y = _swiglu(x[rows[j:j + 1]], w13[e], w2[e])
            out.index_add_(0, rows[j:j + 1], y * wts[j:j + 1].to(out.dtype)[:, None])
        return out

    a, b = triton_step(0).float(), torch_step(0).float()
    rel = ((a - b).abs().max() / b.abs().max()).item()
    times = {name: _time(step, iters, cuda) for name, step in (("triton", triton_step), ("torch", torch_step))}
    roof = _vram_gbps() if cuda else None
    gbps = {name: k * expert_bytes / t / 1e9 for name, t in times.items()}
    row = {"bench": "gpu_moe_kernels", "skipped": False, "comparable": cuda,
           "device": torch.cuda.get_device_name(0) if cuda else "CPU (Triton interpreter)",
           "model": args.model if cuda else f"tiny (interpreter): D={hidden}, I={inter}, k={k}",
           "hidden": hidden, "inter": inter, "top_k": k, "slots": slots, "expert_mb": round(expert_bytes / 1e6, 3),
           "max_rel_diff": rel, "agree": rel <= 2e-2,
           "ms_per_layer_step": {n: round(t * 1e3, 4) for n, t in times.items()},
           "gbps": {n: round(v, 1) for n, v in gbps.items()},
           "triton_over_torch_speed": round(times["torch"] / times["triton"], 2),
           "vram_roofline_gbps": round(roof, 1) if roof else None,
           "triton_share_of_roofline": round(gbps["triton"] / roof, 3) if roof else None}
    if not args.no_int4:
        row["int4"] = _int4(hidden, inter, k, l2, iters, dev, cuda, roof)
    common.emit(row, args.out)
    agree = row["agree"] and (args.no_int4 or row["int4"]["agree"])
    return 0 if agree else 1          # the two paths disagree: a failed step, not just a field


def _int4(hidden: int, inter: int, k: int, l2: int, iters: int, dev: str, cuda: bool, roof) -> dict:
    """The int4 experts' layer-step: Triton (`moe_pairs_quant`) against torch (`ExpertFormat.compute`)."""
    import torch

    from freetoken_py.kernels import ExpertBank, gpu_moe
    from freetoken_py.residency.formats import ExpertFormat, bank_parts

    g = torch.Generator().manual_seed(1)
    one = ExpertBank.empty("int4", 1, inter, hidden).bytes_per_expert
    slots = max(2 * k, -(-4 * l2 // one))
    # a few random experts quantised on the host, tiled to the bank's size on the device
    base = ExpertBank.from_weights(*(torch.randn(2, *shape, generator=g) / 8 for shape in
                                     ((inter, hidden), (inter, hidden), (hidden, inter))), fmt="int4")
    fmt = ExpertFormat.of_bank(base)
    bank = [t.to(dev).repeat(-(-slots // 2), *([1] * (t.dim() - 1)))[:slots].contiguous() for t in bank_parts(base)]
    x = torch.randn(1, hidden, generator=g).to(dev)
    wts = torch.rand(k, generator=g).to(dev)
    rows = torch.zeros(k, dtype=torch.long, device=dev)

    def experts(i: int) -> list[tuple]:
        return [tuple(t[(i * k + j) % slots] for t in bank) for j in range(k)]

    def triton_step(i: int) -> torch.Tensor:
        out = torch.zeros_like(x)
        gpu_moe.moe_pairs_quant(out, x, rows, wts, experts(i), "int4", 32)
        return out

    def torch_step(i: int) -> torch.Tensor:
        out = torch.zeros_like(x)
        for j, parts in enumerate(experts(i)):
            out += wts[j] * fmt.compute(x, parts)
        return out

    a, b = triton_step(0), torch_step(0)
    rel = ((a - b).abs().max() / b.abs().max()).item()
    times = {name: _time(step, iters, cuda) for name, step in (("triton", triton_step), ("torch", torch_step))}
    gbps = {name: k * one / t / 1e9 for name, t in times.items()}
    return {"expert_mb": round(one / 1e6, 3), "slots": slots, "max_rel_diff": rel, "agree": rel <= 1e-4,
            "ms_per_layer_step": {n: round(t * 1e3, 4) for n, t in times.items()},
            "gbps": {n: round(v, 1) for n, v in gbps.items()},
            "triton_over_torch_speed": round(times["torch"] / times["triton"], 2),
            "triton_share_of_roofline": round(gbps["triton"] / roof, 3) if roof else None}


def _time(step, iters: int, cuda: bool) -> float:
    """Median seconds of `step(i)` over `iters` calls after two warm-up calls (CUDA events on a GPU)."""
    import torch

    step(1), step(2)
    got = []
    for i in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(3 + i)
            end.record()
            end.synchronize()
            got.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step(3 + i)
            got.append(time.perf_counter() - t0)
    return statistics.median(got)


def _vram_gbps() -> float:
    """This GPU's device-to-device copy bandwidth: the figure in `freetoken probe`'s cache for this
    machine (read only: nothing is profiled here), else measured now (a 1 GiB copy five times,
    read + write counted)."""
    import torch

    try:
        from freetoken_py.hw.profile import PROFILE_VERSION, HardwareProfile, load_profile, profile_path
        from freetoken_py.hw.sysinfo import collect_cpu, collect_gpus, collect_memory

        base = HardwareProfile(version=PROFILE_VERSION, cpu=collect_cpu(), memory=collect_memory(),
                               gpu=collect_gpus(), figures={}, created_at=0.0)
        cached = load_profile(profile_path(base.key))
        got = cached.gbps("vram_d2d") if cached is not None and cached.key == base.key else None
        if got:
            return got
    except Exception:                    # no usable cache: measure
        pass
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 5 * 2 * a.numel() / (start.elapsed_time(end) / 1e3) / 1e9


if __name__ == "__main__":
    sys.exit(main())
