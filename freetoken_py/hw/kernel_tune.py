"""`freetoken probe`'s one-time autotune of the accelerator's Triton expert kernels (issue 40 item 4).

On a CUDA GPU the probe times each candidate launch configuration of the two expert kernels
(`kernels/gpu_autotune.candidates`, pruned by the static bytes-in-flight model) on synthetic
experts of the shapes in `CASES` and keeps the fastest per (format, group, shape (D, I), tokens a
group, kernel) in the tuning cache beside the machine profile (`<cache>/gpu/expert_kernels.json`,
keyed by the GPU's name, its compute capability and Triton's version: `gpu_autotune.machine`).
It runs before anything captures a CUDA graph (the probe captures none; `gpu_moe` loads the cache
at its first launch, so a run started after the probe uses it). A later probe finds the cases in
the cache and times nothing; `--reprofile` tunes again. Off a GPU, or without Triton, nothing is
timed and the probe says why in one line (`gpu_moe.why_not`); so does a
tuning that fails (a candidate that does not compile or launch on this GPU is skipped inside
`gpu_autotune.tune`; anything else ends the tuning with one line and the default configurations).

The defaults a case starts from are the static ones (`gpu_autotune.default_config`): no GPU run
of these kernels has been recorded yet to seed them from.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

# (format, group size, (hidden D, intermediate I), tokens a group): the decode step of the
# Qwen3-30B-A3B geometry (2048 / 768) in bf16 and int4, one token a group
CASES: tuple[tuple[str, int, tuple[int, int], int], ...] = (
    ("float", 32, (2048, 768), 1),
    ("int4", 32, (2048, 768), 1),
)
_SLOTS = 4          # synthetic experts per case (the step reads each once)


def synthetic_experts(fmt: str, n: int, hidden: int, inter: int, group: int, device) -> list[tuple]:
    """`n` random experts of `fmt` in the expert store's layouts (formats.py) on `device`: the
    kernels' speed does not depend on the values (random codes, small positive scales)."""
    import torch

    g = torch.Generator().manual_seed(0)

    def codes(*shape):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)

    out = []
    for _ in range(n):
        if fmt == "float":
            parts = ((torch.randn(2 * inter, hidden, generator=g) / hidden ** 0.5).bfloat16(),
                     (torch.randn(hidden, inter, generator=g) / inter ** 0.5).bfloat16())
        elif fmt == "int4":
            def sc(r, k):
                return torch.full((r, k // group), 0.02, dtype=torch.float16).view(torch.int16)
            parts = codes(2 * inter, hidden // 2), sc(2 * inter, hidden), codes(hidden, inter // 2), sc(hidden, inter)
        elif fmt == "int8":
            def q8(r, k):
                return codes(r, k).view(torch.int8), torch.full((r, 1), 0.01)
            (a, sa), (b, sb) = q8(2 * inter, hidden), q8(hidden, inter)
            parts = a, sa, b, sb
        elif fmt == "fp8":
            def f8(r, k):                   # (0x7f / 0xff are NaN: one step down)
                c = codes(r, k)
                return torch.where((c & 127) == 127, c - 1, c)
            parts = (f8(2 * inter, hidden), torch.full((2 * inter, -(-hidden // group)), 0.01),
                     f8(hidden, inter), torch.full((hidden, -(-inter // group)), 0.01))
        elif fmt == "nvfp4":
            def nv(r, k):                   # e4m3 1.0 (0x38) per group of 16, then the factor 0.01
                s = torch.full((r, k // 16 + 4), 0x38, dtype=torch.uint8)
                s[:, -4:] = torch.tensor([0.01], dtype=torch.float32).view(torch.uint8)
                return s
            parts = codes(2 * inter, hidden // 2), nv(2 * inter, hidden), codes(hidden, inter // 2), nv(hidden, inter)
        else:
            raise ValueError(f"no synthetic experts for format {fmt!r}")
        out.append(tuple(p.to(device) for p in parts))
    return out


def tune_expert_kernels(device="cuda", cases: Sequence[tuple] = CASES, retune: bool = False,
                        path: Optional[Path] = None, reps: int = 5) -> dict:
    """Tune the cases the cache at `path` (default `gpu_autotune.cache_path()`) lacks for this
    machine (all of them with `retune`). Returns {"status": "tuned" | "cached" | "skipped",
    "line": one line for the report, "path", "tuned": keys timed now, "cached": keys found,
    "timed": configurations timed}."""
    import torch

    from freetoken_py.kernels import gpu_autotune as at
    from freetoken_py.kernels import gpu_moe

    path = Path(path) if path is not None else at.cache_path()
    if not gpu_moe.available(device):
        why = gpu_moe.why_not() or "the Triton expert kernels are not available"
        return {"status": "skipped", "line": f"GPU expert kernels not tuned: {why}", "path": str(path),
                "tuned": [], "cached": [], "timed": 0}
    gpu_moe._load()                     # (loads the cache this machine has, if any)
    at.use_cache(path)
    known = dict(at._active)
    todo, cached = [], []
    for fmt, group, shape, nt in cases:
        keys = [at.key(fmt, group, shape, nt, k) for k in ("gate_up", "down")]
        if retune or not all(k in known for k in keys):
            todo.append((fmt, group, tuple(shape), nt))
        else:
            cached += keys
    tuned, timed = [], 0
    for fmt, group, (hidden, inter), nt in todo:
        experts = synthetic_experts(fmt, _SLOTS, hidden, inter, group, "cpu")
        from freetoken_py.kernels.gpu_slots import build_table

        table = build_table(experts, fmt, group).to_device(device)
        k = _SLOTS // nt if nt > 1 else _SLOTS
        pair_slots = [p % _SLOTS for p in range(nt * k)]
        plan = gpu_moe.prepare(table, pair_slots, device)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(nt, hidden, generator=g).to(device, torch.bfloat16 if fmt == "float" else torch.float32)
        rows = torch.arange(nt, device=device).repeat_interleave(k)
        wts = torch.rand(nt * k, generator=g).to(device)
        scratch = torch.zeros_like(x)

        def time_config(kernel: str, cfg: dict) -> float:
            nonlocal timed
            timed += 1
            return gpu_moe.time_config(scratch, x, rows, wts, plan, kernel, cfg, reps=reps)

        best = at.tune([(fmt, group, (hidden, inter), plan.nt, gpu_moe._rounds(fmt))], time_config, path)
        tuned += sorted(best)
    if tuned:
        line = f"GPU expert kernels tuned for {len(tuned)} kernel shapes ({timed} configurations timed), cached in {path}"
    else:
        line = f"GPU expert kernels: {len(cached)} tuned kernel shapes from {path}"
    return {"status": "tuned" if tuned else "cached", "line": line, "path": str(path), "tuned": tuned,
            "cached": cached, "timed": timed}


def probe_tuning(retune: bool = False, device=None, cases: Sequence[tuple] = CASES,
                 path: Optional[Path] = None, reps: int = 5) -> dict:
    """What `freetoken probe` runs (`tune_expert_kernels`) on this machine's GPU; without a CUDA
    GPU (`device` None: torch's first one if it has one) it is skipped with one line saying why.
    A CPU device is tuned only when `device` names it under Triton's interpreter (the tests)."""
    import os

    import torch

    from freetoken_py.kernels import gpu_moe

    if device is None:
        if not torch.cuda.is_available():
            if os.environ.get("TRITON_INTERPRET") == "1":
                why = "no CUDA GPU (Triton's CPU interpreter is not tuned for)"
            else:
                gpu_moe.available("cpu")
                why = gpu_moe.why_not() or "no CUDA GPU"
            return {"status": "skipped", "line": f"GPU expert kernels not tuned: {why}",
                    "path": None, "tuned": [], "cached": [], "timed": 0}
        device = "cuda"
    try:
        return tune_expert_kernels(device, cases, retune, path, reps)
    except Exception as exc:  # noqa: BLE001  (the probe reports; the launches keep the defaults)
        from freetoken_py.errors import first_line

        return {"status": "failed", "path": str(path) if path else None, "tuned": [], "cached": [], "timed": 0,
                "line": f"GPU expert kernels not tuned ({type(exc).__name__}: {first_line(exc, 160)}); "
                        f"the default configurations are used"}
