"""Launch configurations of the Triton expert kernels (`_triton_moe`): static defaults, and the
measured choice per GPU once `tune` has run (cached per GPU, capability and Triton version).

A configuration is the tile of one program (BLOCK_N rows by BLOCK_K columns a step), how much of
the reduction is deferred to the epilogue (RED columns summed a step: 1 defers all of it), the
pipeline depth (STAGES) and the warps. The defaults keep 8-16 KB of weights in flight per program
per stage at one token, and shrink the columns as the tokens of a group (NT) grow so that the
[NT, BLOCK_N, BLOCK_K / RED] accumulators stay in registers (the compile checks in
tests/test_triton_compile.py hold them to zero spills).
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Callable

from freetoken_py.errors import first_line
from freetoken_py.kernels.gpu_slots import FORMATS, UNIT

ELEM_BYTES = {"float": 2, "int8": 4, "int4": 4, "fp8": 4, "nvfp4": 4}   # a loaded element (bf16, or a word)
MIN_STAGE, MAX_STAGE = 8 << 10, 32 << 10    # bytes of weights a program has in flight per stage
MAX_ACC_REGS = 64                           # accumulator registers a thread may hold


def default_config(fmt: str, nt: int, kernel: str, rounded: bool) -> dict:
    """The static configuration for format `fmt`, NT tokens a group, `kernel` "gate_up" or "down";
    `rounded`: gate_up rounds h per 32 rows (BLOCK_N a multiple of 32)."""
    unit = UNIT[FORMATS[fmt]]
    if fmt == "float":
        block_n, width, red = 16, 256, 8         # bf16: 8 KB a row set a stage
    elif fmt == "nvfp4":
        block_n, width, red = 32, 32, 1          # (its scale decode: 255 registers at 64 words)
    else:
        block_n, width, red = 32, 64, 1          # 64 words: 8 KB a row set a stage
    if kernel == "down" and fmt != "nvfp4":
        block_n *= 2                             # one row set: twice the rows for the same bytes
    if rounded and kernel == "gate_up":
        block_n = max(block_n, 32)
    width = max(64 if fmt == "float" else 16, width // nt)   # [NT, BLOCK_N, width] products in registers
    if nt > 1:
        red = width                              # per-token sums each step
    return {"BLOCK_N": block_n, "BLOCK_K": width * unit, "RED": min(red, width), "STAGES": 3, "num_warps": 4}


def kernel_config(fmt: str, nt: int, kernel: str, rounded: bool, group_size: int = 32,
                  shape: tuple[int, int] | None = None) -> dict:
    """The configuration a launch uses: this GPU's tuned one for (format, group, shape (D, I), NT,
    kernel) where the loaded cache (`use_cache`) has it, else the default."""
    tuned = _active.get(key(fmt, group_size, shape, nt, kernel)) if shape else None
    return finalize(tuned or default_config(fmt, nt, kernel, rounded), fmt, group_size)


# ---- autotuning: a small sweep, pruned by a static bytes-in-flight model, cached per GPU ---------
class _Configs(dict):
    """The active tuned configurations; `version` changes with every change (launches cache what
    they derive from them: `gpu_moe._launch_plan`)."""
    version = 0

    def _changed(self):
        type(self).version += 1

    def __setitem__(self, k, v):
        super().__setitem__(k, v)
        self._changed()

    def __delitem__(self, k):
        super().__delitem__(k)
        self._changed()

    def clear(self):
        super().clear()
        self._changed()

    def update(self, *args, **kw):
        super().update(*args, **kw)
        self._changed()

    def pop(self, *args):
        out = super().pop(*args)
        self._changed()
        return out


_active: dict = _Configs()


def key(fmt: str, group_size: int, shape, nt: int, kernel: str) -> str:
    return f"{fmt}/g{group_size}/{shape[0]}x{shape[1]}/nt{nt}/{kernel}"


def candidates(fmt: str, nt: int, kernel: str, rounded: bool) -> list[dict]:
    """The sweep: tiles, pipeline depths and warps whose weights in flight per program and stage
    lie in [MIN_STAGE, MAX_STAGE] and whose accumulators fit MAX_ACC_REGS a thread (the static
    model; what is left is timed). The default is always first."""
    sets = 2 if kernel == "gate_up" else 1
    out = [default_config(fmt, nt, kernel, rounded)]
    widths = (64, 128, 256, 512) if fmt == "float" else (16, 32, 64, 128)
    for block_n in (16, 32, 64):
        if rounded and kernel == "gate_up" and block_n % 32:
            continue
        for width in widths:
            bytes_ = sets * block_n * width * ELEM_BYTES[fmt]
            red = 1 if nt == 1 else width
            for warps in (4, 8):
                acc = sets * nt * block_n * (width // red) / (32 * warps)
                products = nt * block_n * width / (32 * warps)
                if not MIN_STAGE <= bytes_ <= MAX_STAGE or acc > MAX_ACC_REGS or products > 2 * MAX_ACC_REGS:
                    continue
                for stages in (2, 4) if (block_n, width) == (16, 64) else (3,):
                    c = {"BLOCK_N": block_n, "BLOCK_K": width * UNIT[FORMATS[fmt]], "RED": red, "STAGES": stages,
                         "num_warps": warps}
                    if c not in out:
                        out.append(c)
    return out


def machine() -> dict:
    """What a tuned configuration is valid for: the GPU, its compute capability, Triton's version."""
    import torch
    import triton

    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        cap = torch.cuda.get_device_capability()
        return {"gpu": torch.cuda.get_device_name(), "capability": f"{cap[0]}.{cap[1]}", "triton": triton.__version__}
    return {"gpu": "Triton interpreter", "capability": "0.0", "triton": triton.__version__}


def cache_path() -> Path:
    from freetoken_py.envs import cache_dir

    return cache_dir() / "gpu" / "expert_kernels.json"


def use_cache(path: Path | None = None) -> int:
    """Load the tuned configurations at `path` for launches on this machine; returns how many.
    A cache from another GPU, capability or Triton version is a one-line warning and the
    defaults (re-tune); an unreadable one too."""
    path = path or cache_path()
    _active.clear()
    if not path.exists():
        return 0
    try:
        data = json.loads(path.read_text())
        mine, theirs = machine(), data["machine"]
        configs = data["configs"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"GPU kernel tuning cache {path} is unreadable ({type(exc).__name__}); using the default "
                      f"configurations", RuntimeWarning, stacklevel=2)
        return 0
    if theirs != mine:
        warnings.warn(f"GPU kernel tuning cache {path} is for {theirs.get('gpu')} (sm {theirs.get('capability')}, "
                      f"Triton {theirs.get('triton')}), this is {mine['gpu']} (sm {mine['capability']}, Triton "
                      f"{mine['triton']}): using the default configurations until it is re-tuned",
                      RuntimeWarning, stacklevel=2)
        return 0
    _active.update(configs)
    return len(configs)


def tune(cases: list[tuple], time_config: Callable[[str, dict], float], path: Path | None = None) -> dict:
    """For each case (fmt, group, (D, I), nt, rounded): time every candidate of both kernels with
    `time_config(kernel, config)` (seconds, e.g. CUDA-graph replay of that case's step) and keep
    the fastest; merged into the cache at `path` for this machine and made active. Returns
    {key: config}."""
    path = path or cache_path()
    best, failed = {}, []
    for fmt, group, shape, nt, rounded in cases:
        for kernel in ("gate_up", "down"):
            timed = []
            for i, c in enumerate(candidates(fmt, nt, kernel, rounded)):
                seconds = _time_or_none(time_config, kernel, c, failed)
                if seconds is not None:
                    timed.append((seconds, i, c))
            if timed:       # (none timed: no entry, so the launches keep the default)
                best[key(fmt, group, shape, nt, kernel)] = min(timed, key=lambda t: (t[0], t[1]))[2]
    if failed:
        warnings.warn(f"GPU kernel tuning: {len(failed)} candidate configurations failed on this GPU and were "
                      f"skipped (first: {failed[0]})", RuntimeWarning, stacklevel=2)
    old = {}
    if path.exists():
        try:
            data = json.loads(path.read_text())
            old = data["configs"] if data.get("machine") == machine() else {}
        except (OSError, ValueError, KeyError, TypeError):
            old = {}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), "configs": {**old, **best}}, indent=1, sort_keys=True))
    use_cache(path)
    return best


def _time_or_none(time_config: Callable[[str, dict], float], kernel: str, cfg: dict, failed: list):
    """`time_config(kernel, cfg)`, or None where that configuration does not compile or launch on
    this GPU (e.g. Triton's OutOfResources for shared memory on a smaller GPU): one line of why
    goes into `failed`, and the sweep goes on."""
    try:
        return float(time_config(kernel, cfg))
    except Exception as exc:  # noqa: BLE001  (any compile or launch error of one candidate)
        failed.append(f"{kernel} {cfg}: {type(exc).__name__}: {first_line(exc, 160)}")
        return None


def group_words(fmt: str, group_size: int) -> int:
    """Words of one scale group where the kernels scale per group (int4: g / 8, nvfp4: 2), else 1."""
    return {"int4": group_size // 8, "nvfp4": 2}.get(fmt, 1)


def finalize(cfg: dict, fmt: str, group_size: int) -> dict:
    """`cfg` made valid for the group size: BLOCK_K whole scale groups, RED at most the accumulator's
    columns (a power of two), GW set."""
    unit, gw = UNIT[FORMATS[fmt]], group_words(fmt, group_size)
    out = dict(cfg)
    out["BLOCK_K"] = max(out["BLOCK_K"], gw * unit)
    cols = out["BLOCK_K"] // unit // gw
    out["RED"] = min(out["RED"], cols)
    out["GW"] = gw
    return out
