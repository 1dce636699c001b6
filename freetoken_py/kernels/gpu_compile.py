"""Compile the Triton expert kernels for a GPU that is not here, and read what the compiler made.

Triton's whole pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin through its bundled ptxas) runs
without a GPU given a `GPUTarget`; `compile_kernel` does so with the specialisation a launch on
real shapes gives (16-divisible sizes and 16-byte-aligned pointers), then runs the same ptxas
with `-v` on the PTX to read the registers and spills (the metadata's n_regs / n_spills are
only filled in when a GPU loads the cubin), and counts the 16-byte global loads in the PTX.
Used by tests/test_triton_compile.py (zero spills, 16-byte weight loads, for sm_80 .. sm_120) and
by the GPU session's register report.
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

from freetoken_py.kernels.gpu_autotune import default_config, finalize
from freetoken_py.kernels.gpu_slots import FORMATS, UNIT

ARCHS = (80, 86, 89, 90, 120)
_SCALE = {"float": "*bf16", "int8": "*fp32", "int4": "*i16", "fp8": "*fp32", "nvfp4": "*u8"}
_DIVISIBLE = ("stride_x", "stride_out", "KW", "N_OUT")       # row lengths of real geometries: multiples of 16


def signature(fmt: str, kernel: str) -> dict:
    """The kernel's argument types for `fmt` (float: bf16 weights and activations)."""
    q = "*bf16" if fmt == "float" else "*i32"
    act = "*bf16" if fmt == "float" else "*fp32"
    head = {"x_ptr": act, "stride_x": "i32", "rows_ptr": "*i64"} if kernel == "gate_up" else \
        {"h_ptr": "*fp32", "wts_ptr": "*fp32"}
    body = {"plan_ptr": "*i64", "slots_ptr": "*i64", "table_ptr": "*i64", "n_slots": "i32", "q_base": q,
            "s_base": _SCALE[fmt], ("h_ptr" if kernel == "gate_up" else "y_ptr"): "*fp32", "KW": "i32",
            "SROW": "i32", "N_OUT": "i32", "G_COLS": "i32"}
    if kernel == "down":
        body.update({"out_ptr": act, "stride_out": "i32", "rows_ptr": "*i64", "T": "i32", "P": "i32",
                     "counter_ptr": "*i32"})
    else:
        body.update({"part_ptr": "*fp32", "cnt_ptr": "*i32"})      # (split-K's partials and counters)
    consts = ["FMT", "G", "NT", "BLOCK_N", "BLOCK_K", "UNIT", "GW", "RED", "STAGES"] + \
        (["ROUND"] if kernel == "gate_up" else []) + ["NATIVE", "ALIGN"] + \
        (["TB"] if kernel == "down" else ["SPLIT"])
    return {**head, **body, **{c: "constexpr" for c in consts}}


def compile_kernel(fmt: str, nt: int, kernel: str, arch: int, aligned: bool = True, config: dict | None = None,
                   group_size: int | None = None) -> dict:
    """Compile `kernel` ("gate_up" / "down") of format `fmt` for NT tokens a group and sm_`arch`:
    {"regs", "spill_stores", "spill_loads", "v4_loads", "loads", "config", ...}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from freetoken_py.kernels import _triton_moe as k

    fid = FORMATS[fmt]
    rounded = kernel == "gate_up" and fmt in ("int8", "int4", "nvfp4")
    g = group_size or {"int4": 32, "fp8": 128, "nvfp4": 16}.get(fmt, 32)
    cfg = finalize(config or default_config(fmt, nt, kernel, rounded), fmt, g)
    warps, cfg_consts = cfg.pop("num_warps", 4), {kk: v for kk, v in cfg.items() if kk.isupper()}
    sig = signature(fmt, kernel)
    consts = {"FMT": fid, "G": g, "NT": nt, "UNIT": UNIT[fid], "NATIVE": fmt in ("fp8", "nvfp4") and arch >= 89,
              "ALIGN": (8 if fmt == "float" else 4) if aligned else 1, **cfg_consts}
    if kernel == "gate_up":
        consts["ROUND"] = rounded
        consts.setdefault("SPLIT", 1)
    else:
        consts["TB"] = 1 if nt == 1 else 8          # (one token at decode; eight with NT = 8)
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if sig[n].startswith("*") or n in _DIVISIBLE}
    fn = k.gate_up_kernel if kernel == "gate_up" else k.down_kernel
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    ptx = compiled.asm["ptx"]
    regs, stores, loads = ptxas_usage(ptx, arch)
    wide, narrow = global_loads(ptx)
    return {"fmt": fmt, "nt": nt, "kernel": kernel, "arch": arch, "regs": regs, "spill_stores": stores,
            "spill_loads": loads, "wide_loads": wide, "narrow_loads": narrow,
            "config": {**cfg_consts, "num_warps": warps}, "cubin_bytes": len(compiled.asm["cubin"])}


def global_loads(ptx: str) -> tuple[int, int]:
    """(16-byte, narrower) global loads in the PTX: `ld.global[.nc].v4.b32` and the pipelined
    loop's 16-byte `cp.async` copies into shared memory, against every other global load."""
    wide = narrow = 0
    for op, rest in re.findall(r"(ld\.global[.\w]*|cp\.async\.c[ag]\.shared\.global)([^;]*);", ptx):
        if op.startswith("cp.async"):
            big = re.search(r",\s*(0x10|16)\s*(,|$)", rest) is not None
        else:
            big = ".v4.b32" in op or ".v2.b64" in op
        wide, narrow = wide + big, narrow + (not big)
    return wide, narrow


def ptxas_usage(ptx: str, arch: int) -> tuple[int, int, int]:
    """(registers, spill-store bytes, spill-load bytes) of the PTX's kernel, from the ptxas Triton
    uses for `arch`, run with -v."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={sm_arch_from_capability(arch)}",
                               str(src), "-o", str(Path(tmp) / "k.o")], capture_output=True, text=True, check=True)
    log = proc.stdout + proc.stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return regs, int(spill.group(1)), int(spill.group(2))
