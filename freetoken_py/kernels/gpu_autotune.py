"""Launch configurations of the Triton expert kernels (`_triton_moe`): static defaults, and the
measured choice per GPU once `tune` has run (no Triton import here).

A configuration is the tile of one program (BLOCK_N rows by BLOCK_K columns a step), how much of
the reduction is deferred to the epilogue (RED columns summed a step: 1 defers all of it), the
pipeline depth (STAGES) and the warps. The defaults keep 8-16 KB of weights in flight per program
per stage at one token, and shrink the columns as the tokens of a group (NT) grow so that the
[NT, BLOCK_N, BLOCK_K / RED] accumulators stay in registers (the compile checks in
tests/test_triton_compile.py hold them to zero spills).
"""
from __future__ import annotations

from freetoken_py.kernels.gpu_slots import FORMATS, UNIT


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


def kernel_config(fmt: str, nt: int, kernel: str, rounded: bool, group_size: int = 32) -> dict:
    """The configuration a launch uses: this GPU's tuned one where the cache has it, else the default."""
    return finalize(default_config(fmt, nt, kernel, rounded), fmt, group_size)


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
