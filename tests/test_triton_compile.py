"""The Triton expert kernels compiled for GPUs that are not here (kernels/gpu_compile.py: Triton's
own pipeline to a cubin for sm_80, sm_86, sm_89, sm_90 and sm_120, then its ptxas with -v): every
format's gate/up and down kernels, at one token a group and at eight, with their default launch
configurations, use no spill stores or loads and read the weights in 16-byte loads (16-byte
`cp.async` copies of the pipelined loop, or ld.global.v4). A change that makes a kernel spill, or
that loses the vector loads, fails here without a GPU."""
from __future__ import annotations

import shutil

import pytest

pytest.importorskip("triton")

from freetoken_py.kernels.gpu_compile import ARCHS  # noqa: E402
from freetoken_py.kernels.gpu_slots import FORMATS  # noqa: E402


def _compile(*args, **kw):
    from freetoken_py.kernels.gpu_compile import compile_kernel

    try:
        return compile_kernel(*args, **kw)
    except FileNotFoundError as exc:           # (a Triton without its bundled ptxas)
        pytest.skip(f"no ptxas for this Triton: {exc}")


@pytest.mark.parametrize("arch", ARCHS)
def test_expert_kernels_compile_without_spills_and_with_16_byte_weight_loads(arch):
    bad = []
    for fmt in FORMATS:
        for nt in (1, 8):
            for kernel in ("gate_up", "down"):
                r = _compile(fmt, nt, kernel, arch)
                if r["spill_stores"] or r["spill_loads"] or r["wide_loads"] == 0:
                    bad.append(r)
    assert not bad, bad


@pytest.mark.parametrize("arch", (80, 90))
def test_split_k_gate_up_compiles_without_spills_and_with_16_byte_weight_loads(arch):
    """The gate_up kernel's split-K variant (gpu_moe.split_k: grids short of a wave at one token)."""
    from freetoken_py.kernels.gpu_autotune import default_config

    bad = []
    for fmt in FORMATS:
        cfg = {**default_config(fmt, 1, "gate_up", fmt in ("int8", "int4", "nvfp4")), "SPLIT": 2}
        r = _compile(fmt, 1, "gate_up", arch, config=cfg)
        if r["spill_stores"] or r["spill_loads"] or r["wide_loads"] == 0 or r["config"]["SPLIT"] != 2:
            bad.append(r)
    assert not bad, bad


def test_the_checks_can_fail():
    """The detectors on the compiled code: an oversized tile (a [64, 512] fp32 accumulator a
    program) spills, and rows not known to be 16-byte aligned are read in narrower loads."""
    spilling = _compile("float", 1, "down", 80, config={"BLOCK_N": 64, "BLOCK_K": 512, "RED": 1, "STAGES": 2,
                                                        "num_warps": 4})
    assert spilling["spill_stores"] > 0 and spilling["spill_loads"] > 0, spilling
    unaligned = _compile("float", 1, "down", 80, aligned=False)
    assert unaligned["wide_loads"] == 0 and unaligned["spill_stores"] == 0, unaligned


def test_native_fp8_decode_is_used_where_the_arch_has_it():
    """sm_89+ decode e4m3 with the hardware's conversion (cvt from e4m3x2); sm_80 / sm_86 with the
    arithmetic emulation (the interpreter tests check it bit for bit)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from freetoken_py.kernels import _triton_moe as k
    from freetoken_py.kernels.gpu_autotune import default_config, finalize
    from freetoken_py.kernels.gpu_compile import signature

    def ptx(arch: int) -> str:
        cfg = finalize(default_config("fp8", 1, "down", False), "fp8", 128)
        warps = cfg.pop("num_warps")
        consts = {"FMT": 3, "G": 128, "NT": 1, "UNIT": 4, "NATIVE": arch >= 89, "ALIGN": 4, "TB": 1, **cfg}
        src = ASTSource(fn=k.down_kernel, signature=signature("fp8", "down"), constexprs=consts)
        return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps}).asm["ptx"]

    assert re.search(r"cvt\.rn\.f16x2\.e4m3x2", ptx(89))
    assert not re.search(r"e4m3x2", ptx(80))


def test_ptxas_is_the_one_triton_uses():
    """(ptxas_usage runs Triton's own ptxas for the arch, so the counts are what a launch gets.)"""
    from triton.backends.nvidia.compiler import get_ptxas

    assert shutil.which(get_ptxas(90).path) or get_ptxas(90).path
