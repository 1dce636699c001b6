"""Row-dot building blocks shared by the expert and dense kernels.

Every weight matrix is held as a typed array ``[N, K]`` (float32, uint16 = bf16 bits, int8) or
``uint8 [N, K/2]`` (packed int4) plus scales ``[N, G]`` (float32; int4's fp16 bits as uint16) (G = 0 for fp32/bf16, 1 for int8,
K/group_size for int4). ``row_dot`` picks the dot at compile time from the row's dtype, so each
kernel is compiled once per format (a runtime ``fmt`` branch plus ``ndarray.view`` cost 30-80%
in measurements). Activations are "prepared" once per call; fp32/bf16 weights use ``x`` as is.
For int4 and int8 weights, ``INT_ACT`` (fixed at import) decides how:

- ``"int8"`` (default on x86 with AVX2): each 32-block of ``x`` quantised to int8 with its own
  scale (``quant.q8act``). int4: even and odd elements of each pair of blocks grouped to match
  the nibbles of a 32-byte weight load, plus per-group offset corrections (``prep_q8_row``; the
  dot is ``_simd.q4q8_row_dot``, ~2x cheaper). int8: natural
  order, a partial last block for K % 32 != 0 (``prep_q8n_row``; ``_simd.i8q8_row_dot``).
- ``"fp32"`` (other CPUs, or ``FREETOKEN_INT_ACT=fp32``): int4 ``[x[0::2] | x[1::2]]`` plus
  ``8 * group sums`` (``_simd.q4_row_dot``), int8 ``x`` as is (``dot``): exact fp32 activations.

The dot is picked from the prepared array's dtype, so both can be compiled in one process.

PERF.md: each inner loop lives in its own ``@njit(fastmath=True)`` function called from the
``prange`` body; a loop written directly in the body was not vectorised.
"""
from __future__ import annotations

import platform
import warnings

import numpy as np
from numba import njit, types
from numba.core.errors import NumbaIRAssumptionWarning
from numba.extending import overload

from freetoken_py.envs import bf16_act, int_act, simd
from freetoken_py.kernels import _cache  # noqa: F401  (package-wide cache stamp; before any @njit)
from freetoken_py.quant.fp8 import e4m3_table
from freetoken_py.kernels._simd import (TILE_LANES, r16_kind, HAS_AVX2, HAS_AVX512, HAS_AVX512BF16, HAS_AVX512VBMI, bf16_row_dot, bf16_row_dot4,
                                        bf16f_row_dot, bf16f_row_dot4,
                                        fp8_widen_row, fp8bf_row_dot, fp8bf_row_dot4, fp8f_row_dot,
                                        fp8f_row_dot4, fp8_row_dot4_v, fp8_row_dot_v, i8q8_row_dot, i8q8_row_dot4, i8q8v_row_dot,
                                        i8q8v_row_dot4, nvfp4_row_dot4_v, nvfp4_row_dot_v, q4_row_dot, q4_row_dot4, q4q8_row_dot,
                                        q4q8_row_dot4, q4q8v_row_dot, q4q8v_row_dot4)
from freetoken_py.kernels import _simd

# numba's IR inliner leaves pedantic "variable '..__vphi..' is not in scope" NumbaIRAssumptionWarnings
# on the phis of conditionals it inlines (inline="always": nvfp4_multiplier, nvq8_vec_ok into the
# nvfp4 kernels; the compiled code is right: tests/test_kernels_fp8_nvfp4_dots.py,
# test_formats_nvfp4.py); they printed numba's "please report" text five times on a user's first
# nvfp4 run, so these (and only these) are silenced.
warnings.filterwarnings("ignore", category=NumbaIRAssumptionWarning, message=r"(?s).*variable '[^']*__vphi[^']*' is not in scope")

FORMATS = ("fp32", "bf16", "int8", "int4", "fp8", "nvfp4")
ACT_SILU, ACT_GPTOSS = 0, 1
ACTIVATIONS = {"silu": ACT_SILU, "gptoss": ACT_GPTOSS}
Q8_BLOCK = 32              # activation elements per int8 scale (quant.q8act.BLOCK)


def _int_act_mode() -> str:
    """"int8" or "fp32": FREETOKEN_INT_ACT (old name FREETOKEN_INT4_ACT) if set (part of the kernel
    cache stamp), else by CPU."""
    want = int_act() or ("int8" if HAS_AVX2 else "fp32")
    if want not in ("int8", "fp32"):
        raise ValueError(f"FREETOKEN_INT_ACT (or its old name FREETOKEN_INT4_ACT) must be 'int8' or 'fp32', got {want!r}")
    if want == "int8" and not HAS_AVX2:
        warnings.warn("FREETOKEN_INT_ACT=int8 needs an x86 CPU with AVX2; using fp32 activations", stacklevel=2)
        return "fp32"
    return want


INT_ACT = _int_act_mode()


def _bf16_act_mode() -> str:
    """"bf16" or "fp32": FREETOKEN_BF16_ACT if set (part of the kernel cache stamp), else "bf16"
    where the compile target has AVX512-BF16 and FREETOKEN_SIMD is not "avx2"."""
    want = bf16_act() or ("bf16" if HAS_AVX512BF16 and simd() != "avx2" else "fp32")   # FREETOKEN_SIMD=avx2: AVX2 paths
    if want not in ("bf16", "fp32"):
        raise ValueError(f"FREETOKEN_BF16_ACT must be 'bf16' or 'fp32', got {want!r}")
    if want == "bf16" and not HAS_AVX512BF16:
        warnings.warn("FREETOKEN_BF16_ACT=bf16 needs an x86 CPU with AVX512-BF16; using fp32 activations",
                      stacklevel=2)
        return "fp32"
    return want


BF16_ACT = _bf16_act_mode()
# fp8 weights multiply bf16-rounded activations (the table decode + vdpbf16ps of _simd's "fp8 (e4m3)
# weights x bf16 activations") where bf16 weights do (BF16_ACT) and the target has AVX512-VBMI;
# else, and with FREETOKEN_BF16_ACT=fp32 or FREETOKEN_SIMD=avx2, the exact fp32-activation dots.
FP8_ACT = "bf16" if BF16_ACT == "bf16" and HAS_AVX512VBMI else "fp32"


def widen(v):
    """One weight element as float32 (jitted only): float32 as is, int8 converted, uint16 = bf16
    bits widened by ``uint32(u16) << 16`` viewed as float32."""
    raise NotImplementedError("widen is only callable from numba-compiled code")


@overload(widen, inline="always")
def _widen_impl(v):
    if v == types.uint16:
        return lambda v: np.uint32(np.uint32(v) << np.uint32(16)).view(np.float32)
    if v == types.int8:
        return lambda v: np.float32(v)
    if v == types.float32:
        return lambda v: v
    return None


@njit(fastmath=True, cache=True)
def dot(w, x):
    """sum_i widen(w[i]) * x[i] for a float32 / bf16-bits / int8 row."""
    acc = np.float32(0.0)
    for i in range(x.shape[0]):
        acc += widen(w[i]) * x[i]
    return acc


E4M3 = e4m3_table()       # fp8 weights: byte -> value (the reference for e4m3_value; tests)


@njit(fastmath=True, cache=True, inline="always")
def e4m3_value(b):
    """An e4m3fn byte's value without a table (vectorises): for a normal (exponent field > 0) its
    7 magnitude bits placed at fp32's exponent / mantissa boundary plus 120 = 127 - 7 added to
    the exponent (integer add: 2^(e-7) * 1.m); a subnormal is m * 2^-9. Exact (0x7f, NaN, reads
    as 480; checkpoints hold none). No multiply by 2^120: under fast-math LLVM moved such a
    constant onto the activation (v * (2^120 * x)), which overflows (found in the vector dots)."""
    u = np.uint32(b)
    m7 = np.uint32(u & np.uint32(0x7F))
    sign = np.uint32(np.uint32(u & np.uint32(0x80)) << np.uint32(24))
    nb = np.uint32(np.uint32(np.uint32(m7 << np.uint32(20)) + np.uint32(120 << 23)) | sign).view(np.float32)
    sub = np.float32(m7) * np.float32(2.0 ** -9)
    return nb if m7 >= np.uint32(8) else (-sub if sign else sub)


@njit(fastmath=True, cache=True, inline="always")
def fp8_row_dot(w, s, x, bk):
    """sum_b s[b] * sum_{j in block b} e4m3(w[j]) * x[j]: e4m3 bytes [K], one scale per bk columns
    (a partial last block), fp32 activations as they are."""
    k = x.shape[0]
    acc = np.float32(0.0)
    for b in range(s.shape[0]):
        a = np.float32(0.0)
        for j in range(b * bk, min(k, (b + 1) * bk)):
            a += e4m3_value(w[j]) * x[j]
        acc += s[b] * a
    return acc


@njit(fastmath=True, cache=True, inline="always")
def fp8_row_dot4(w, s, x0, x1, x2, x3, bk):
    """fp8_row_dot with four activation rows: each byte decoded once."""
    k = x0.shape[0]
    r0 = r1 = r2 = r3 = np.float32(0.0)
    for b in range(s.shape[0]):
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for j in range(b * bk, min(k, (b + 1) * bk)):
            v = e4m3_value(w[j])
            a0 += v * x0[j]
            a1 += v * x1[j]
            a2 += v * x2[j]
            a3 += v * x3[j]
        r0 += s[b] * a0
        r1 += s[b] * a1
        r2 += s[b] * a2
        r3 += s[b] * a3
    return r0, r1, r2, r3


_E2M1_BIAS = np.uint32(126 << 23)     # fp32 exponent field of 2^-1: e2m1's bias (1) less one


@njit(fastmath=True, cache=True, inline="always")
def e2m1_value(n):
    """An e2m1 nibble's value (sign bit 3, 2 exponent bits, 1 mantissa bit) without a table: the
    3 magnitude bits placed at fp32's exponent / mantissa boundary on a 2^-1 bias give 1, 1.5, 2,
    3, 4, 6 for indices 2..7; indices 0 and 1 (0, the subnormal 0.5) are index * 0.5. Exact, and
    no fp32 subnormal is ever formed (those cost a microcode assist per use on x86). NVFP4 and
    (later) MXFP4 share it; only their group-scale decode differs."""
    u = np.uint32(n)
    m = np.uint32(u & np.uint32(7))
    big = np.uint32(np.uint32(m << np.uint32(22)) + _E2M1_BIAS).view(np.float32)
    v = big if m >= np.uint32(2) else np.float32(m) * np.float32(0.5)
    return -v if u & np.uint32(8) else v


@njit(fastmath=True, cache=True, inline="always")
def nvfp4_factor(s, ng):
    """The row factor: the fp32 in bytes ng..ng+3 of an nvfp4 scale row (quant/nvfp4.py)."""
    u = np.uint32(np.uint32(np.uint32(s[ng]) | np.uint32(np.uint32(s[ng + 1]) << np.uint32(8)))
                  | np.uint32(np.uint32(np.uint32(s[ng + 2]) << np.uint32(16))
                              | np.uint32(np.uint32(s[ng + 3]) << np.uint32(24))))
    return u.view(np.float32)


@njit(fastmath=True, cache=True, inline="always")
def nvfp4_multiplier(f):
    """The row factor as a multiplier of the e4m3 group scale (a reciprocal factor inverted once
    per row). The kernels' sums may differ from the exact values in the last bits, as any
    reassociated fp32 dot does; `quant.nvfp4.group_scales` (divide) is the exact dequantisation."""
    return f if f > np.float32(0.0) else np.float32(1.0) / -f


@njit(fastmath=True, cache=True, inline="always")
def nvfp4_row_dot(w, s, x, gs):
    """sum_g eff_g * sum_{j in g} e2m1(w nibble j) * x[j]: codes [K/2] (low nibble = even
    column), scales [K/gs + 4] (e4m3 bytes + the row factor), fp32 activations as they are."""
    ng = x.shape[0] // gs
    mul = nvfp4_multiplier(nvfp4_factor(s, ng))
    half = gs // 2
    acc = np.float32(0.0)
    for g in range(ng):
        a = np.float32(0.0)
        for j in range(g * half, (g + 1) * half):
            b = w[j]
            a += e2m1_value(b & np.uint8(15)) * x[2 * j] + e2m1_value(b >> np.uint8(4)) * x[2 * j + 1]
        acc += e4m3_value(s[g]) * a
    return acc * mul


@njit(fastmath=True, cache=True, inline="always")
def nvfp4_row_dot4(w, s, x0, x1, x2, x3, gs):
    """nvfp4_row_dot with four activation rows: each byte decoded once."""
    ng = x0.shape[0] // gs
    mul = nvfp4_multiplier(nvfp4_factor(s, ng))
    half = gs // 2
    r0 = r1 = r2 = r3 = np.float32(0.0)
    for g in range(ng):
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for j in range(g * half, (g + 1) * half):
            b = w[j]
            lo = e2m1_value(b & np.uint8(15))
            hi = e2m1_value(b >> np.uint8(4))
            a0 += lo * x0[2 * j] + hi * x0[2 * j + 1]
            a1 += lo * x1[2 * j] + hi * x1[2 * j + 1]
            a2 += lo * x2[2 * j] + hi * x2[2 * j + 1]
            a3 += lo * x3[2 * j] + hi * x3[2 * j + 1]
        sc = e4m3_value(s[g])
        r0 += sc * a0
        r1 += sc * a1
        r2 += sc * a2
        r3 += sc * a3
    return r0 * mul, r1 * mul, r2 * mul, r3 * mul


@njit(cache=True, inline="always")
def fp8bf_index(c, k):
    """Position of column c's bf16 activation in prep_fp8bf_row's layout: per whole 64-column unit
    the unpack order of _simd.fp8bf_row_dot ([16L + p] then [16L + 8 + p], L < 4, p < 8); a last
    partial unit in natural order."""
    base = (c >> 6) << 6
    if base + 64 > k:
        return c
    r = c - base
    return base + ((r >> 3) & 1) * 32 + (r >> 4) * 8 + (r & 7)


@njit(fastmath=False, cache=True)
def prep_fp8bf_rows(x):
    """x [R, K] float32 -> uint16 [R, K]: bf16_bits of each element (as prep_bf16_rows) at
    fp8bf_index: the activations of the fp8 x bf16 dots."""
    k = x.shape[1]
    out = np.empty(x.shape, np.uint16)
    for r in range(x.shape[0]):
        for j in range(k):
            out[r, fp8bf_index(j, k)] = bf16_bits(x[r, j])
    return out


# Where the vector forms below apply (one rule each, used by the per-row dispatchers and by the
# kernels' once-per-block test, `vec_rows`): fp8 (bf16 or fp32 activations) K and the column block
# multiples of 64; nvfp4 group 16 and K % 64 == 0 with int8 activations, K % 32 == 0 with fp32.
@njit(cache=True, inline="always")
def fp8_vec_ok(bk, k):
    return bk % 64 == 0 and k % 64 == 0


@njit(cache=True, inline="always")
def nvq8_vec_ok(gs, k):
    return gs == 16 and k % 64 == 0


@njit(cache=True, inline="always")
def nvf_vec_ok(gs, k):
    return gs == 16 and k % 32 == 0


# fp8 rows with prepared bf16 activations xb (FP8_ACT "bf16"; prepare also passes the fp32 rows xf as
# the "xg" argument): the vdpbf16ps dot where K and the block are multiples of 64 (every real FP8
# checkpoint: block 128), else the exact fp32-activation dots on xf (fp8_dot: vector forms for
# multiples of 16, a loop otherwise), not a scalar bf16 loop (a 32-column block took it in the probe).
@njit(fastmath=True, cache=True, inline="always")
def fp8bf_dot(w, s, xb, xf, bk):
    if fp8_vec_ok(bk, xb.shape[0]):
        return fp8bf_row_dot(w, s, xb, bk)
    return fp8_dot(w, s, xf, bk)


@njit(fastmath=True, cache=True, inline="always")
def fp8bf_dot4(w, s, x0, x1, x2, x3, f0, f1, f2, f3, bk):
    if fp8_vec_ok(bk, x0.shape[0]):
        return fp8bf_row_dot4(w, s, x0, x1, x2, x3, bk)
    return fp8_dot4(w, s, f0, f1, f2, f3, bk)


# The vector forms (_simd: fp8_row_dot_v, nvfp4_row_dot_v) where the shape allows, else the loops
# above: fp8 needs K and the column block multiples of 16; nvfp4 group 16, K % 32 == 0, and x86
# (pshufb; the choice is made here at import, so other CPUs never type the intrinsic).
_NVFP4_SIMD = platform.machine().lower() in ("x86_64", "amd64")


# inline="always" on these per-row dispatchers and on the plain loops they fall back to: a call of
# a separate @njit function costs ~70 ns per row (a 2048 x 2048 fp8 matvec 247 vs 119 us, the same
# vector dot inside), and ~30 ns even as a branch not taken (256 x 256: 10.1 vs 2.6 us; docs/kernels.md)
@njit(fastmath=True, cache=True, inline="always")
def fp8_dot(w, s, x, bk):
    # (a fourth branch, the 64-lane unfolded dot, made every row 4x slower at K = 256 even untaken)
    if fp8_vec_ok(bk, x.shape[0]):
        return fp8f_row_dot(w, s, x, bk)
    if bk % 16 == 0 and x.shape[0] % 16 == 0:
        return fp8_row_dot_v(w, s, x, bk)
    return fp8_row_dot(w, s, x, bk)


@njit(fastmath=True, cache=True, inline="always")
def fp8_dot4(w, s, x0, x1, x2, x3, bk):
    if fp8_vec_ok(bk, x0.shape[0]):
        return fp8f_row_dot4(w, s, x0, x1, x2, x3, bk)
    if bk % 16 == 0 and x0.shape[0] % 16 == 0:
        return fp8_row_dot4_v(w, s, x0, x1, x2, x3, bk)
    return fp8_row_dot4(w, s, x0, x1, x2, x3, bk)


if _NVFP4_SIMD:
    @njit(fastmath=True, cache=True, inline="always")
    def nvfp4_vec(w, s, x):
        """The vector form alone (group 16, K % 32 == 0)."""
        return nvfp4_row_dot_v(w, s, x) * nvfp4_multiplier(nvfp4_factor(s, x.shape[0] // 16))

    @njit(fastmath=True, cache=True, inline="always")
    def nvfp4_vec4(w, s, x0, x1, x2, x3):
        mul = nvfp4_multiplier(nvfp4_factor(s, x0.shape[0] // 16))
        a0, a1, a2, a3 = nvfp4_row_dot4_v(w, s, x0, x1, x2, x3)
        return a0 * mul, a1 * mul, a2 * mul, a3 * mul

    @njit(fastmath=True, cache=True, inline="always")
    def nvfp4_dot(w, s, x, gs):
        if nvf_vec_ok(gs, x.shape[0]):
            return nvfp4_vec(w, s, x)
        return nvfp4_row_dot(w, s, x, gs)

    @njit(fastmath=True, cache=True, inline="always")
    def nvfp4_dot4(w, s, x0, x1, x2, x3, gs):
        if nvf_vec_ok(gs, x0.shape[0]):
            return nvfp4_vec4(w, s, x0, x1, x2, x3)
        return nvfp4_row_dot4(w, s, x0, x1, x2, x3, gs)
else:
    nvfp4_dot, nvfp4_dot4 = nvfp4_row_dot, nvfp4_row_dot4


# nvfp4 x int8 activations (INT_ACT == "int8"; _simd's "nvfp4 (e2m1) weights x int8 activations"):
# the AVX-512 VNNI form where the target has it and FREETOKEN_SIMD does not force AVX2, else AVX2;
# group 16 and K % 64 == 0, else the plain loop below on the same prepared activations (so the
# numerics never depend on the shape: tiny models' 48-wide experts take it).
NV_WIDE = HAS_AVX512
_E2M1_X2_INT = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int32)


@njit(cache=True, inline="always")
def nv8_index(c, k):
    """Position of column c's int8 activation in prep_nv8_row's layout: per 128-column unit (a last
    shorter one of n columns) [q of the even columns | q of the odd ones]."""
    base = (c >> 7) << 7
    n = min(128, k - base)
    r = c - base
    return base + (r >> 1) + (n >> 1) * (r & 1)


# fastmath=False: x / scale rounds as quant.q8act's torch reference does (see prep_q8_row)
@njit(fastmath=False, cache=True, inline="always")
def q8_block_scale(x, x0, x1):
    """(s_x, divisor) of the activation block x[x0:x1]: s_x = max|x| / 127, the divisor s_x or 1
    for an all-zero block (the int8 activation rule of quant.q8act, shared by every prep below)."""
    amax = np.float32(0.0)
    for j in range(x0, x1):
        amax = max(amax, abs(x[j]))
    scale = amax / np.float32(127.0)
    return scale, (scale if scale > np.float32(0.0) else np.float32(1.0))


@njit(fastmath=False, cache=True, inline="always")
def q8_code(v, div):
    """rint(v / div) clamped to [-127, 127] (half to even, like torch.round), as a float32."""
    return min(max(np.rint(v / div), np.float32(-127.0)), np.float32(127.0))


@njit(fastmath=False, cache=True)
def prep_nv8_row(x, xq, xg):
    """x [K] (K even) -> xq int8 [K] (int8 per 32-block as prep_q8n_row, a partial last block as if
    zero-padded; nv8_index layout), xg int32 [2L], L = ceil(K/8): per lane l (columns 8l..8l+7)
    xg[l] = the float32 bits of its block's s_x, xg[L + l] = -12 * sum of its q (the nibble offset)."""
    k = x.shape[0]
    nl = (k + 7) // 8
    for l in range(nl):
        xg[nl + l] = 0
    for b in range((k + Q8_BLOCK - 1) // Q8_BLOCK):
        x0 = b * Q8_BLOCK
        x1 = min(x0 + Q8_BLOCK, k)
        scale, div = q8_block_scale(x, x0, x1)
        for j in range(x0, x1):
            q = np.int8(q8_code(x[j], div))
            xq[nv8_index(j, k)] = q
            xg[nl + j // 8] -= 12 * np.int32(q)
        for l in range(x0 // 8, (x1 + 7) // 8):
            xg[l] = np.float32(scale).view(np.int32)


@njit(fastmath=True, cache=True)
def prep_nv8_rows(x):
    """x [R, K] -> (xq int8 [R, K], xg int32 [R, 2 ceil(K/8)]): prep_nv8_row for every row."""
    nl = (x.shape[1] + 7) // 8
    xq = np.empty(x.shape, np.int8)
    xg = np.empty((x.shape[0], 2 * nl), np.int32)
    for r in range(x.shape[0]):
        prep_nv8_row(x[r], xq[r], xg[r])
    return xq, xg


@njit(fastmath=True, cache=True)
def nvfp4q8_row_dot(w, s, xq, xg, gs):
    """The nvfp4 x int8 dot in plain loops, any shape: per run of columns sharing a group and a
    32-block, s_g * s_x * the integer sum of 2 e2m1 * q_x; times the row factor / 2."""
    k = xq.shape[0]
    ng = k // gs
    acc = np.float32(0.0)
    for g in range(ng):
        sg = e4m3_value(s[g])
        j = g * gs
        end = (g + 1) * gs
        while j < end:
            je = min(end, (j // Q8_BLOCK + 1) * Q8_BLOCK)
            isum = 0
            for c in range(j, je):
                b = w[c >> 1]
                nib = (b >> np.uint8(4)) if c & 1 else (b & np.uint8(15))
                isum += _E2M1_X2_INT[nib] * np.int32(xq[nv8_index(c, k)])
            acc += sg * np.int32(xg[j // 8]).view(np.float32) * np.float32(isum)
            j = je
    return acc * nvfp4_multiplier(nvfp4_factor(s, ng)) * np.float32(0.5)


@njit(fastmath=True, cache=True)
def nvfp4q8_row_dot4(w, s, x0, x1, x2, x3, g0, g1, g2, g3, gs):
    return (nvfp4q8_row_dot(w, s, x0, g0, gs), nvfp4q8_row_dot(w, s, x1, g1, gs),
            nvfp4q8_row_dot(w, s, x2, g2, gs), nvfp4q8_row_dot(w, s, x3, g3, gs))


if INT_ACT == "int8":
    _nv1, _nv4 = ((_simd.nvfp4q8v_row_dot, _simd.nvfp4q8v_row_dot4) if NV_WIDE else
                  (_simd.nvfp4q8_row_dot, _simd.nvfp4q8_row_dot4))

    @njit(fastmath=True, cache=True, inline="always")
    def nvfp4q8_vec(w, s, xq, xg):
        """The vector form alone (group 16, K % 64 == 0)."""
        return _nv1(w, s, xq, xg) * (nvfp4_multiplier(nvfp4_factor(s, xq.shape[0] // 16)) * np.float32(128.0))

    @njit(fastmath=True, cache=True, inline="always")
    def nvfp4q8_vec4(w, s, x0, x1, x2, x3, g0, g1, g2, g3):
        m = nvfp4_multiplier(nvfp4_factor(s, x0.shape[0] // 16)) * np.float32(128.0)
        a0, a1, a2, a3 = _nv4(w, s, x0, x1, x2, x3, g0, g1, g2, g3)
        return a0 * m, a1 * m, a2 * m, a3 * m

    @njit(fastmath=True, cache=True, inline="always")
    def nvfp4q8_dot(w, s, xq, xg, gs):
        if nvq8_vec_ok(gs, xq.shape[0]):
            return nvfp4q8_vec(w, s, xq, xg)
        return nvfp4q8_row_dot(w, s, xq, xg, gs)

    @njit(fastmath=True, cache=True, inline="always")
    def nvfp4q8_dot4(w, s, x0, x1, x2, x3, g0, g1, g2, g3, gs):
        if nvq8_vec_ok(gs, x0.shape[0]):
            return nvfp4q8_vec4(w, s, x0, x1, x2, x3, g0, g1, g2, g3)
        return nvfp4q8_row_dot4(w, s, x0, x1, x2, x3, g0, g1, g2, g3, gs)
else:
    nvfp4q8_dot, nvfp4q8_dot4 = nvfp4q8_row_dot, nvfp4q8_row_dot4


@njit(fastmath=True, cache=True)
def dot4(w, x0, x1, x2, x3):
    """dot of one row with four activation rows: each weight is loaded and widened once."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for i in range(x0.shape[0]):
        wi = widen(w[i])
        a0 += wi * x0[i]
        a1 += wi * x1[i]
        a2 += wi * x2[i]
        a3 += wi * x3[i]
    return a0, a1, a2, a3


# int4 / int8 x int8 activations: the AVX-512 VNNI forms (_simd, "AVX-512 VNNI") where the compile target
# has them and FREETOKEN_SIMD does not force AVX2 (HAS_AVX512, fixed at import like INT_ACT), else AVX2.
# int4's AVX-512 form needs the quad activation layout, which prep_q8_rows writes exactly when
# quad_layout(gs) holds, and the dot itself takes its VNNI loops for exactly those group sizes
# (q4q8v_row_dot branches on hb), so the layout and the dot always agree.
@njit(cache=True)
def quad_layout(gs):
    """True when int4 rows of group size gs use the AVX-512 dot (and its quad activation layout)."""
    return HAS_AVX512 and (gs <= 64 or gs % 128 == 0)


if HAS_AVX512:
    q4q8_dot, q4q8_dot4, i8q8_dot, i8q8_dot4 = q4q8v_row_dot, q4q8v_row_dot4, i8q8v_row_dot, i8q8v_row_dot4
else:
    q4q8_dot, q4q8_dot4, i8q8_dot, i8q8_dot4 = q4q8_row_dot, q4q8_row_dot4, i8q8_row_dot, i8q8_row_dot4


def row_dot(w, s, xv, xg, hb):
    """Dot of one weight row with a prepared activation row (jitted code only).

    Dispatches at compile time on the row's dtype: uint16 = bf16 bits, float32, int8 (times the
    row scale s[0]), uint8 = packed int4 (group scales s, prepared xv/xg, hb bytes per group).
    """
    raise NotImplementedError("row_dot is only callable from numba-compiled code")


@overload(row_dot, jit_options={"fastmath": True}, inline="always")
def _row_dot_impl(w, s, xv, xg, hb):
    dtype = w.dtype
    if dtype == types.uint16 and xv.dtype == types.uint16:     # bf16 x bf16 (prep_bf16_rows)
        return lambda w, s, xv, xg, hb: bf16_row_dot(w, xv)
    if dtype == types.uint16 and xv.dtype == types.float32:    # bf16 x fp32 (_simd bf16f_row_dot)
        return lambda w, s, xv, xg, hb: bf16f_row_dot(w, xv)
    if dtype == types.float32:    # (bf16 rows: the two forms above, by activation dtype)
        return lambda w, s, xv, xg, hb: dot(w, xv)
    if dtype == types.uint8 and s.dtype == types.float32 and xv.dtype == types.uint16:   # fp8 x bf16 (prep_fp8bf_rows)
        return lambda w, s, xv, xg, hb: fp8bf_dot(w, s, xv, xg, 2 * hb)
    if dtype == types.uint8 and s.dtype == types.float32:     # fp8: e4m3 bytes, float32 block scales
        return lambda w, s, xv, xg, hb: fp8_dot(w, s, xv, 2 * hb)
    if dtype == types.uint8 and s.dtype == types.uint8 and xv.dtype == types.int8:   # nvfp4 x int8 activations
        return lambda w, s, xv, xg, hb: nvfp4q8_dot(w, s, xv, xg, 2 * hb)
    if dtype == types.uint8 and s.dtype == types.uint8:       # nvfp4: e2m1 nibbles, e4m3 bytes + row factor
        return lambda w, s, xv, xg, hb: nvfp4_dot(w, s, xv, 2 * hb)
    if dtype == types.int8 and xv.dtype == types.int8:
        return lambda w, s, xv, xg, hb: s[0] * i8q8_dot(w, xv, xg)
    if dtype == types.int8:
        return lambda w, s, xv, xg, hb: s[0] * dot(w, xv)
    if dtype == types.uint8 and xv.dtype == types.int8:
        return lambda w, s, xv, xg, hb: q4q8_dot(w, s, xv, xg, hb)
    if dtype == types.uint8:
        return lambda w, s, xv, xg, hb: q4_row_dot(w, s, xv, xg, hb)
    return None


def row_dot4(w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb):
    """row_dot of one weight row with four activation rows, reading the row once (jitted only)."""
    raise NotImplementedError("row_dot4 is only callable from numba-compiled code")


@overload(row_dot4, jit_options={"fastmath": True}, inline="always")
def _row_dot4_impl(w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb):
    dtype = w.dtype
    if dtype == types.uint16 and x0.dtype == types.uint16:
        return lambda w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb: bf16_row_dot4(w, x0, x1, x2, x3)
    if dtype == types.uint16 and x0.dtype == types.float32:
        return lambda w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb: bf16f_row_dot4(w, x0, x1, x2, x3)
    if dtype == types.float32:    # (bf16 rows: the two forms above, by activation dtype)
        return lambda w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb: dot4(w, x0, x1, x2, x3)
    if dtype == types.uint8 and s.dtype == types.float32 and x0.dtype == types.uint16:
        return lambda w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb: fp8bf_dot4(w, s, x0, x1, x2, x3, g0, g1, g2, g3, 2 * hb)
    if dtype == types.uint8 and s.dtype == types.float32:
        return lambda w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb: fp8_dot4(w, s, x0, x1, x2, x3, 2 * hb)
    if dtype == types.uint8 and s.dtype == types.uint8 and x0.dtype == types.int8:
        return lambda w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb: nvfp4q8_dot4(w, s, x0, x1, x2, x3, g0, g1, g2, g3, 2 * hb)
    if dtype == types.uint8 and s.dtype == types.uint8:
        return lambda w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb: nvfp4_dot4(w, s, x0, x1, x2, x3, 2 * hb)
    if dtype == types.int8 and x0.dtype == types.int8:
        def impl_q8(w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb):
            a0, a1, a2, a3 = i8q8_dot4(w, x0, x1, x2, x3, g0, g1, g2, g3)
            return s[0] * a0, s[0] * a1, s[0] * a2, s[0] * a3
        return impl_q8
    if dtype == types.int8:
        def impl(w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb):
            a0, a1, a2, a3 = dot4(w, x0, x1, x2, x3)
            return s[0] * a0, s[0] * a1, s[0] * a2, s[0] * a3
        return impl
    if dtype == types.uint8 and x0.dtype == types.int8:
        return lambda w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb: q4q8_dot4(w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb)
    if dtype == types.uint8:
        return lambda w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb: q4_row_dot4(w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb)
    return None


# Path tags. The per-row dispatchers above test the row's shape on every call and fall back to a
# plain loop; inside a kernel's row loop that untaken fallback still costs (measured on a Zen 4, one
# core, in cache: an nvfp4 expert's gate / up rows 95-115 us with two dispatched dots per loop trip,
# 73 us with the test made once before the loop; fp8 similar; docs/kernels.md, "Path tags and
# vector SwiGLU"). So the kernels make the test once per block of rows (`vec_rows`) and run their row loop with a tag,
# VEC or ANY, that `pdot` / `pdot4` resolve at compile time: VEC the vector dot alone, ANY row_dot's
# own dispatch. Formats without a fallback (fp32, bf16, int8, int4: their dots take any shape) are
# always VEC, where pdot is row_dot.
VEC = np.zeros(0, np.int8)
ANY = np.zeros(0, np.int16)


def vec_rows(w, s, xv, hb):
    """True where rows like w (scales s) with prepared activations xv [T, K] and hb (half the
    group / block size) take the vector dot alone (jitted only)."""
    raise NotImplementedError("vec_rows is only callable from numba-compiled code")


def _vec_form(w, s, xv):
    """The vector-only dots (one row, four rows) for rows like w with activations like xv, or None
    where row_dot has no fallback to leave out (typing time)."""
    if w.dtype == types.uint8 and s.dtype == types.float32 and xv.dtype == types.uint16:
        return "fp8bf"
    if w.dtype == types.uint8 and s.dtype == types.float32 and xv.dtype == types.float32:
        return "fp8f"
    if w.dtype == types.uint8 and s.dtype == types.uint8 and xv.dtype == types.int8 and INT_ACT == "int8":
        return "nvq8"
    if w.dtype == types.uint8 and s.dtype == types.uint8 and xv.dtype == types.float32 and _NVFP4_SIMD:
        return "nvf"
    return None


@overload(vec_rows, jit_options={"fastmath": True}, inline="always")
def _vec_rows_impl(w, s, xv, hb):
    form = _vec_form(w, s, xv)
    if form in ("fp8bf", "fp8f"):
        return lambda w, s, xv, hb: fp8_vec_ok(2 * hb, xv.shape[-1])
    if form == "nvq8":
        return lambda w, s, xv, hb: nvq8_vec_ok(2 * hb, xv.shape[-1])
    if form == "nvf":
        return lambda w, s, xv, hb: nvf_vec_ok(2 * hb, xv.shape[-1])
    return lambda w, s, xv, hb: True   # no fallback to leave out: pdot on VEC is row_dot


def pdot(path, w, s, xv, xg, hb):
    """row_dot on a path tag (VEC or ANY, see above; jitted only)."""
    raise NotImplementedError("pdot is only callable from numba-compiled code")


@overload(pdot, jit_options={"fastmath": True}, inline="always")
def _pdot_impl(path, w, s, xv, xg, hb):
    form = _vec_form(w, s, xv) if path.dtype == types.int8 else None
    if form == "fp8bf":
        return lambda path, w, s, xv, xg, hb: fp8bf_row_dot(w, s, xv, 2 * hb)
    if form == "fp8f":
        return lambda path, w, s, xv, xg, hb: fp8f_row_dot(w, s, xv, 2 * hb)
    if form == "nvq8":
        return lambda path, w, s, xv, xg, hb: nvfp4q8_vec(w, s, xv, xg)
    if form == "nvf":
        return lambda path, w, s, xv, xg, hb: nvfp4_vec(w, s, xv)
    return lambda path, w, s, xv, xg, hb: row_dot(w, s, xv, xg, hb)


def pdot4(path, w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb):
    """row_dot4 on a path tag (jitted only)."""
    raise NotImplementedError("pdot4 is only callable from numba-compiled code")


@overload(pdot4, jit_options={"fastmath": True}, inline="always")
def _pdot4_impl(path, w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb):
    form = _vec_form(w, s, x0) if path.dtype == types.int8 else None
    if form == "fp8bf":
        return lambda path, w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb: fp8bf_row_dot4(w, s, x0, x1, x2, x3, 2 * hb)
    if form == "fp8f":
        return lambda path, w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb: fp8f_row_dot4(w, s, x0, x1, x2, x3, 2 * hb)
    if form == "nvq8":
        return lambda path, w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb: nvfp4q8_vec4(w, s, x0, x1, x2, x3,
                                                                                   g0, g1, g2, g3)
    if form == "nvf":
        return lambda path, w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb: nvfp4_vec4(w, s, x0, x1, x2, x3)
    return lambda path, w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb: row_dot4(w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb)


# Prefill tiles (_simd "Prefill tiles"): rows the 4 x 4 fp32 register blocks take, widened once
# to fp32 per block of rows: fp8 and bf16 weights with fp32 activations (on CPUs with
# AVX512-BF16 their default dots take bf16 activations, and those stay). int4 / int8 / nvfp4
# multiply int8 activations with integer dots, already several x the FMA rate: no tiles.
def tile_rows(w, s, xv, hb):
    """True where rows like w (scales s) with prepared activations xv [T, K] take the prefill
    tiles (jitted only; the kernels test it once per block of rows, as vec_rows)."""
    raise NotImplementedError("tile_rows is only callable from numba-compiled code")


def tile_form(w, s, xv):
    """"fp8" / "bf16" where rows like w with activations like xv can take the tiles, else None
    (typing time: a caller compiles the tile code only for these)."""
    if xv.dtype != types.float32:
        return None
    if w.dtype == types.uint8 and s.dtype == types.float32:
        return "fp8"
    if w.dtype == types.uint16:
        return "bf16"
    return None


@njit(cache=True, inline="always")
def tile_ok(bk, k):
    return k % TILE_LANES == 0 and bk % TILE_LANES == 0


@overload(tile_rows, jit_options={"fastmath": True}, inline="always")
def _tile_rows_impl(w, s, xv, hb):
    form = tile_form(w, s, xv)
    if form == "fp8":
        return lambda w, s, xv, hb: tile_ok(2 * hb, xv.shape[-1])
    if form == "bf16":
        return lambda w, s, xv, hb: tile_ok(TILE_LANES, xv.shape[-1])
    return lambda w, s, xv, hb: False


def widen_row(w, s, hb, out):
    """out [K] = one row's weights as fp32, scaled (rows tile_rows takes; jitted only)."""
    raise NotImplementedError("widen_row is only callable from numba-compiled code")


@overload(widen_row, jit_options={"fastmath": True}, inline="always")
def _widen_row_impl(w, s, hb, out):
    if w.dtype == types.uint8 and s.dtype == types.float32:
        return lambda w, s, hb, out: fp8_widen_row(w, s, out, 2 * hb)
    if w.dtype == types.uint16:
        def impl(w, s, hb, out):
            for j in range(out.shape[0]):
                out[j] = widen(w[j])
        return impl
    return None


@njit(fastmath=True, cache=True)
def act(kind, g, u):
    """SwiGLU (silu(g) * u) or GPT-OSS's clamped variant."""
    # exponents capped at 80 so fastmath never sees inf (the result is ~0 there anyway)
    if kind == ACT_SILU:
        return g / (np.float32(1.0) + np.exp(min(-g, np.float32(80.0)))) * u
    g = min(g, np.float32(7.0))
    u = max(min(u, np.float32(7.0)), np.float32(-7.0))
    return (u + np.float32(1.0)) * (g / (np.float32(1.0) + np.exp(min(np.float32(-1.702) * g, np.float32(80.0)))))


@njit(fastmath=True, cache=True)
def prep_q4_row(x, gs, xv, xg):
    """x [K] -> xv [K] = [x[0::2] | x[1::2]], xg [K/gs] = 8 * group sums."""
    half = x.shape[0] // 2
    for j in range(half):
        xv[j] = x[2 * j]
        xv[half + j] = x[2 * j + 1]
    for g in range(xg.shape[0]):
        xg[g] = np.float32(8.0) * np.sum(x[g * gs:(g + 1) * gs])


@njit(fastmath=True, cache=True)
def prep_q4_rows(x, gs):
    """x [R, K] -> (xv [R, K], xg [R, K/gs]): prep_q4_row for every row."""
    xv = np.empty_like(x)
    xg = np.empty((x.shape[0], x.shape[1] // gs), np.float32)
    for r in range(x.shape[0]):
        prep_q4_row(x[r], gs, xv[r], xg[r])
    return xv, xg


# fastmath=False explicitly (numba lets an unset flag inherit the fastmath caller's): x / scale must
# round exactly as the torch reference (quant.q8act) does, not as x * (1 / scale).
@njit(fastmath=False, cache=True)
def prep_q8_row(x, gs, xq, xg, quad):
    """x [K] -> xq int8 [K] in the pair (or with `quad`, quad) layout below, xg [NB + G] = (s_x, C).

    s_x[b] = max|x_b| / 127, q = rint(x / s_x) (half to even, like torch.round); C[g] = 8 * sum
    over the blocks of group g of s_x[b] * sum(q_b): the +8 nibble offset, removed once per group.

    Layout (what _simd.q4q8_row_dot reads): blocks 2p and 2p + 1 share 64 bytes as
    [q(even of 2p) x16 | q(even of 2p+1) x16 | q(odd of 2p) x16 | q(odd of 2p+1) x16], matching
    the low and high nibbles of one 32-byte load of their packed weights; a last unpaired block
    (odd NB) is [q(even) x16 | q(odd) x16].

    Quad layout (_simd.q4q8v_row_dot, AVX-512; `quad_layout`): the first 4 * (NB // 4) blocks in
    128-byte quads [q(even of 4q) x16 | .. | q(even of 4q+3) x16 | q(odd of 4q) x16 | .. | q(odd of
    4q+3) x16] (the low / high nibbles of one 64-byte load), the rest as above.
    """
    nb = x.shape[0] // Q8_BLOCK
    bpg = gs // Q8_BLOCK
    paired = nb - nb % 2
    quads = 4 * (nb // 4) if quad else 0
    for g in range(nb // bpg):
        xg[nb + g] = np.float32(0.0)
    for b in range(nb):
        x0 = b * Q8_BLOCK
        # even elements at 64p + 16r, odd ones 32 further (b = 2p + r); an unpaired last block [even | odd]
        if b < quads:
            ev = (b // 4) * 4 * Q8_BLOCK + (b % 4) * 16
            od = ev + 2 * Q8_BLOCK
        else:
            ev = (b // 2) * 2 * Q8_BLOCK + (b % 2) * 16 if b < paired else x0
            od = ev + (Q8_BLOCK if b < paired else Q8_BLOCK // 2)
        scale, div = q8_block_scale(x, x0, x0 + Q8_BLOCK)
        qsum = 0
        for j in range(Q8_BLOCK // 2):
            qe = q8_code(x[x0 + 2 * j], div)
            qo = q8_code(x[x0 + 2 * j + 1], div)
            xq[ev + j] = np.int8(qe)
            xq[od + j] = np.int8(qo)
            qsum += np.int32(qe) + np.int32(qo)
        xg[b] = scale
        xg[nb + b // bpg] += np.float32(8.0) * scale * np.float32(qsum)


@njit(fastmath=False, cache=True)
def prep_q8n_row(x, xq, xs):
    """x [K] -> xq int8 [K] in natural order, xs [ceil(K/32)] = s_x per 32-block; rounding as in
    prep_q8_row. A partial last block is quantised as if zero-padded (padding changes neither its
    max nor its q values), so quant.quantize_act_q8 of the zero-padded row is the reference."""
    for b in range(xs.shape[0]):
        x0 = b * Q8_BLOCK
        x1 = min(x0 + Q8_BLOCK, x.shape[0])
        scale, div = q8_block_scale(x, x0, x1)
        for j in range(x0, x1):
            xq[j] = np.int8(q8_code(x[j], div))
        xs[b] = scale


@njit(fastmath=True, cache=True)
def prep_q8n_rows(x):
    """x [R, K] -> (xq int8 [R, K], xs float32 [R, ceil(K/32)]): prep_q8n_row for every row."""
    xq = np.empty(x.shape, np.int8)
    xs = np.empty((x.shape[0], (x.shape[1] + Q8_BLOCK - 1) // Q8_BLOCK), np.float32)
    for r in range(x.shape[0]):
        prep_q8n_row(x[r], xq[r], xs[r])
    return xq, xs


@njit(fastmath=False, cache=True)
def prep_q8r_rows_as(x, cols, offset):
    """x [R, K] (K % 32 == 0) -> (xq int8 [R, K] natural order, xg float32 [R, K/32 + K/cols]): xg[b]
    = s_x[b] per 32-block, then per `cols` columns (32 or 16) offset x s_x x sum(q): the code offset
    the slab dot removes (_simd.r16_dot). Rounding as prep_q8_row."""
    nb = x.shape[1] // Q8_BLOCK
    per = Q8_BLOCK // cols
    xq = np.empty(x.shape, np.int8)
    xg = np.empty((x.shape[0], nb + nb * per), np.float32)
    for r in range(x.shape[0]):
        for b in range(nb):
            x0 = b * Q8_BLOCK
            scale, div = q8_block_scale(x[r], x0, x0 + Q8_BLOCK)
            xg[r, b] = scale
            for part in range(per):
                qsum = np.int32(0)
                for j in range(x0 + cols * part, x0 + cols * part + cols):
                    q = q8_code(x[r, j], div)
                    xq[r, j] = np.int8(q)
                    qsum += np.int32(q)
                xg[r, nb + per * b + part] = np.float32(offset) * scale * np.float32(qsum)
    return xq, xg


@njit(fastmath=False, cache=True)
def prep_q8r_rows(x):
    """The activations of the "r16" int4 slabs: the nibble offset 8 per 32-block (xg [R, 2 K/32])."""
    return prep_q8r_rows_as(x, 32, 8.0)


@njit(fastmath=False, cache=True)
def prep_q8r_nv_rows(x):
    """The activations of the "r16" nvfp4 slabs: the e2m1 table's offset 12 per group of 16
    columns (xg [R, 3 K/32]: s_x per block, then group 2b and 2b + 1's offsets)."""
    return prep_q8r_rows_as(x, 16, 12.0)


R16_OK = HAS_AVX2 and INT_ACT == "int8"   # this process runs int4 / nvfp4 rows in the "r16" layout (_simd: VNNI or AVX2 form)
R16_I8_OK = HAS_AVX512 and INT_ACT == "int8"   # ... int8 rows (AVX-512 VNNI only)
R16_FP8_OK = HAS_AVX512 and FP8_ACT == "bf16"   # ... and fp8 rows (AVX512-BF16 + VBMI, bf16 activations)


def r16_ok(fmt: str) -> bool:
    """True where this process's kernels run `fmt` rows in the "r16" slab layout."""
    return {"fp8": R16_FP8_OK, "int8": R16_I8_OK, "int4": R16_OK, "nvfp4": R16_OK}.get(fmt, False)


_R16_NEEDS = {"fp8": "AVX512-BF16 / VBMI kernels with bf16 activations", "int8": "AVX-512 VNNI kernels",
              "int4": "int8-activation kernels (AVX2)", "nvfp4": "int8-activation kernels (AVX2)"}


def by_layout(stub, slab, rows):
    """Overload `stub` (jitted only; its first two arguments a weight block and its scales) to run
    `slab` for rows in the "r16" layout and `rows` otherwise, picked at compile time from the
    weights' and scales' dtypes (_simd.r16_kind); r16 arrays in a process that cannot run them
    (r16_ok) are a typing error."""
    @overload(stub, jit_options={"fastmath": True})
    def _impl(*args):
        kind = r16_kind(args[0], args[1])
        if kind is None:
            return lambda *args: rows(*args)
        if not r16_ok(kind):
            raise TypeError(f"{kind} rows in the r16 layout need this process's {_R16_NEEDS[kind]}")
        return lambda *args: slab(*args)


def r16_cols(w, s):
    """The columns K of rows (w, s) in the "r16" layout: 2 x the row bytes for int4 / nvfp4, the
    row bytes for fp8 and int8 (int32 scales; jitted only)."""
    raise NotImplementedError("r16_cols is only callable from numba-compiled code")


@overload(r16_cols, inline="always")
def _r16_cols_impl(w, s):
    if s.dtype == types.int32:
        return lambda w, s: w.shape[w.ndim - 1]
    return lambda w, s: 2 * w.shape[w.ndim - 1]


@njit(fastmath=True, cache=True)
def prep_q8_rows_as(x, gs, quad):
    """x [R, K] -> (xq int8 [R, K], xg float32 [R, K/32 + K/gs]): prep_q8_row for every row."""
    xq = np.empty(x.shape, np.int8)
    xg = np.empty((x.shape[0], x.shape[1] // Q8_BLOCK + x.shape[1] // gs), np.float32)
    for r in range(x.shape[0]):
        prep_q8_row(x[r], gs, xq[r], xg[r], quad)
    return xq, xg


@njit(fastmath=True, cache=True)
def prep_q8_rows(x, gs):
    """prep_q8_rows_as in the layout this process's int4 dot reads (quad_layout(gs))."""
    return prep_q8_rows_as(x, gs, quad_layout(gs))


@njit(fastmath=False, cache=True, inline="always")
def bf16_bits(v):
    """float32 -> bf16 bits (uint16), round-to-nearest-even; an fp32 subnormal becomes a signed
    zero (vdpbf16ps reads subnormal inputs as zero; the flush keeps the scalar tail and the torch
    reference in step with it). Finite inputs (the activations of a forward pass)."""
    u = np.float32(v).view(np.uint32)
    if u & np.uint32(0x7F800000) == np.uint32(0):
        return np.uint16(np.uint32(u >> np.uint32(16)) & np.uint32(0x8000))
    r = np.uint32(u + np.uint32(0x7FFF) + np.uint32(np.uint32(u >> np.uint32(16)) & np.uint32(1)))
    return np.uint16(r >> np.uint32(16))


@njit(fastmath=False, cache=True)
def prep_bf16_rows(x):
    """x [R, K] float32 -> uint16 [R, K] bf16 bits (bf16_bits per element): the activations of a
    bf16 x bf16 dot (_simd.bf16_row_dot)."""
    out = np.empty(x.shape, np.uint16)
    for r in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[r, j] = bf16_bits(x[r, j])
    return out


def prepare(w, s, x, gs):
    """(xv, xg): activation rows x [R, K] as row_dot wants them for weights like (w, s) (jitted only)."""
    raise NotImplementedError("prepare is only callable from numba-compiled code")


@overload(prepare, jit_options={"fastmath": True})
def _prepare_impl(w, s, x, gs):
    kind = r16_kind(w, s)
    if kind == "int4":     # in 16-row slabs: natural-order int8, (s_x, offset) per block
        return lambda w, s, x, gs: prep_q8r_rows(x)
    if kind == "int8":     # in slabs: natural-order int8, (s_x, 128 s_x sum(q)) per block
        return lambda w, s, x, gs: prep_q8r_rows_as(x, 32, 128.0)
    if kind == "fp8":      # in slabs: natural-order bf16 (the fp32 rows unused)
        return lambda w, s, x, gs: (prep_bf16_rows(x), np.zeros((x.shape[0], 1), np.float32))
    if kind == "nvfp4":    # in slabs: (s_x per block, offset per 16 columns)
        return lambda w, s, x, gs: prep_q8r_nv_rows(x)
    if w.dtype == types.uint8 and s.dtype == types.uint8 and INT_ACT == "int8":   # nvfp4 x int8 activations
        return lambda w, s, x, gs: prep_nv8_rows(x)
    if w.dtype == types.uint8 and s.dtype == types.float32 and FP8_ACT == "bf16":   # fp8 x bf16 activations
        return lambda w, s, x, gs: (prep_fp8bf_rows(x), x)   # x: fp8bf_dot's exact fallback
    if w.dtype == types.uint8 and s.dtype in (types.float32, types.uint8):   # fp8 (nvfp4 with INT_ACT fp32): fp32 as is
        return lambda w, s, x, gs: (x, np.zeros((x.shape[0], 1), np.float32))
    if w.dtype == types.uint8 and INT_ACT == "int8":
        return lambda w, s, x, gs: prep_q8_rows(x, gs)
    if w.dtype == types.int8 and INT_ACT == "int8":
        return lambda w, s, x, gs: prep_q8n_rows(x)
    if w.dtype == types.uint8:
        return lambda w, s, x, gs: prep_q4_rows(x, gs)
    if w.dtype == types.uint16 and BF16_ACT == "bf16":
        return lambda w, s, x, gs: (prep_bf16_rows(x), np.zeros((x.shape[0], 1), np.float32))
    return lambda w, s, x, gs: (x, np.zeros((x.shape[0], 1), np.float32))
