"""Hand-written LLVM vector code for the int4 and int8 row dots (numba ``@intrinsic``s).

int4: ``q4_row_dot`` (fp32 activations, any CPU) and ``q4q8_row_dot`` (int8 activations,
x86 AVX2 only, ~2x cheaper; see the section below). int8: ``i8q8_row_dot`` (int8 activations,
AVX2 only; int8 weights with fp32 activations need no intrinsic, see ``_dots.dot``).
``_dots.prepare`` picks the activation form once per process.

Why not a plain numba loop: numba widens small-int arithmetic to 64 bits (``b >> 4`` became
``vpsrlq`` plus packing), and with 16 bytes per scale group LLVM's loop vectorizer never reaches
its vector body (trip count 16 < VF x interleave), so every numba formulation measured 3-7
Gweights/s per core — compute-bound far below DRAM speed. Here each 16-byte block is one
``<16 x i8>`` load, widened once to ``<16 x i32>``, split into nibbles, converted and multiplied
by the matching 16 even / 16 odd activations; the group scale multiplies a whole vector, and
the only horizontal add is at the end of the row.
"""
from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_FAST = ("fast",)
_F32 = ir.FloatType()
_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_LANES = 16


def _hsum(builder, v):
    """Horizontal sum of a float vector by halving shuffles."""
    n = v.type.count
    while n > 1:
        h = n // 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h), list(range(h))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h), list(range(h, n))))
        v = builder.fadd(lo, hi, flags=_FAST)
        n = h
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _splat(builder, val, n):
    vt = ir.VectorType(val.type, n)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), val, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _vload(builder, base, offset, vtype, align):
    ptr = builder.bitcast(builder.gep(base, [offset]), vtype.as_pointer())
    return builder.load(ptr, align=align)


def _half_to_float(builder, bits, lanes):
    """fp16 bits (i16 or <lanes x i16>) -> float. With F16C (`HAS_F16C`) an fpext (vcvtph2ps);
    elsewhere in integer IR, because LLVM lowers fpext of half without F16C on x86 to a call of
    compiler-rt's __extendhfsf2, which numba's JIT does not resolve (the process crashed). The
    integer form puts exponent and mantissa 13 bits up and the sign at bit 31, then multiplies by
    2^112 (127 - 15 exponent bias): exact for normal and subnormal halves (scales are finite)."""
    if HAS_F16C or platform.machine().lower() not in ("x86_64", "amd64"):
        ht, ft = (ir.HalfType(), _F32) if lanes == 1 else (ir.VectorType(ir.HalfType(), lanes), ir.VectorType(_F32, lanes))
        return builder.fpext(builder.bitcast(bits, ht), ft)
    it, ft = (_I32, _F32) if lanes == 1 else (ir.VectorType(_I32, lanes), ir.VectorType(_F32, lanes))

    def c(v):
        return ir.Constant(it, v if lanes == 1 else [v] * lanes)

    w = builder.zext(bits, it)
    f = builder.or_(builder.shl(builder.and_(w, c(0x7FFF)), c(13)), builder.shl(builder.and_(w, c(0x8000)), c(16)))
    scale = ir.Constant(ft, 2.0 ** 112 if lanes == 1 else [2.0 ** 112] * lanes)
    return builder.fmul(builder.bitcast(f, ft), scale)


def _block_span(builder, g, bk, k):
    """(first column, columns) of block g of bk columns in a row of k: a partial last block
    shorter, none past the row's end clamped to 0."""
    start = builder.mul(g, bk)
    rest = builder.sub(k, start)
    n = builder.select(builder.icmp_signed("<", rest, bk), rest, bk)
    return start, builder.select(builder.icmp_signed("<", n, ir.Constant(_I64, 0)), ir.Constant(_I64, 0), n)


def _scale(builder, sp, idx):
    """int4 group scale idx as float: stored as fp16 bits in a uint16 array (_buffers.scale_dtype)."""
    return _half_to_float(builder, builder.load(builder.gep(sp, [idx])), 1)


def _scale2(builder, sp, idx):
    """Scales idx, idx + 1 (idx even) as <2 x float>: one 4-byte load, one convert."""
    return _half_to_float(builder, _vload(builder, sp, idx, ir.VectorType(ir.IntType(16), 2), 2), 2)


def _q4_codegen(num_x):
    """Codegen of the int4 dot of one row with `num_x` activation rows (nibbles unpacked once).

    args: w, s, xv_0..xv_{n-1}, xg_0..xg_{n-1}, hb (see q4_row_dot); returns one float32 per x.
    """
    def codegen(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, v)
                  for t, v in zip(signature.args[:-1], args[:-1])]
        wp, sp = arrays[0].data, arrays[1].data
        xeps = [a.data for a in arrays[2:2 + num_x]]
        xgps = [a.data for a in arrays[2 + num_x:]]
        ngroups = cgutils.unpack_tuple(builder, arrays[1].shape)[0]
        hb64 = context.cast(builder, args[-1], signature.args[-1], types.int64)
        xops = [builder.gep(p, [builder.mul(ngroups, hb64)]) for p in xeps]   # odd halves of xv
        nblocks = builder.lshr(hb64, ir.Constant(_I64, 4))                     # 16-byte blocks per group
        v16f, v16b, v16i = (ir.VectorType(t, _LANES) for t in (_F32, _I8, _I32))
        accs = [cgutils.alloca_once_value(builder, ir.Constant(v16f, None)) for _ in range(num_x)]
        parts = [cgutils.alloca_once(builder, v16f) for _ in range(num_x)]
        corrs = [cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for _ in range(num_x)]
        m15 = ir.Constant(v16i, [15] * _LANES)
        sh4 = ir.Constant(v16i, [4] * _LANES)
        with cgutils.for_range(builder, ngroups) as group:
            g = group.index
            for part in parts:
                builder.store(ir.Constant(v16f, None), part)
            with cgutils.for_range(builder, nblocks) as block:
                off = builder.add(builder.mul(g, hb64), builder.shl(block.index, ir.Constant(_I64, 4)))
                b = builder.zext(_vload(builder, wp, off, v16b, 1), v16i)
                lo = builder.sitofp(builder.and_(b, m15), v16f)
                hi = builder.sitofp(builder.lshr(b, sh4), v16f)
                for part, xep, xop in zip(parts, xeps, xops):
                    t = builder.fadd(builder.fmul(lo, _vload(builder, xep, off, v16f, 4), flags=_FAST),
                                     builder.fmul(hi, _vload(builder, xop, off, v16f, 4), flags=_FAST), flags=_FAST)
                    builder.store(builder.fadd(builder.load(part), t, flags=_FAST), part)
            sg = _scale(builder, sp, g)
            sgv = _splat(builder, sg, _LANES)
            for acc, part, corr, xgp in zip(accs, parts, corrs, xgps):
                scaled = builder.fmul(sgv, builder.load(part), flags=_FAST)
                builder.store(builder.fadd(builder.load(acc), scaled, flags=_FAST), acc)
                xgg = builder.load(builder.gep(xgp, [g]))
                builder.store(builder.fadd(builder.load(corr), builder.fmul(sg, xgg, flags=_FAST), flags=_FAST), corr)
        res = [builder.fsub(_hsum(builder, builder.load(acc)), builder.load(corr), flags=_FAST)
               for acc, corr in zip(accs, corrs)]
        if num_x == 1:
            return res[0]
        return context.make_tuple(builder, signature.return_type, res)

    return codegen


def _check_scales(s):
    if not (isinstance(s, types.Array) and s.dtype == types.uint16):
        raise TypeError(f"int4 scales are fp16 bits in a uint16 array (_buffers.scale_dtype), got {s}")


@intrinsic
def q4_row_dot(typingctx, w, s, xv, xg, hb):
    """Dot of one int4 row with a prepared activation; returns float32.

    w   uint8 [K/2]   packed row (low nibble = even column), K/2 a multiple of 16
    s   uint16 [G]    group scales as fp16 bits, G = K / (2 * hb)
    xv  float32 [K]   activation split as [x[0::2] | x[1::2]]
    xg  float32 [G]   8 * sum of x over each group (removes the +8 offset of the nibbles)
    hb  int           bytes per group = group_size / 2 (a multiple of 16)

    result = sum_g s[g] * (sum_{j in g} lo_j * xe_j + hi_j * xo_j - xg[g])

    (Feeding the whole byte b = lo + 16 hi against x_odd / 16 would save the shift, but LLVM then
    masks the bytes before widening, doubling the widening shuffles: measured 30% slower.)
    """
    _check_scales(s)
    return types.float32(w, s, xv, xg, hb), _q4_codegen(1)


@intrinsic
def q4_row_dot4(typingctx, w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb):
    """q4_row_dot of one row with four activations at once -> UniTuple(float32, 4)."""
    _check_scales(s)
    sig = types.UniTuple(types.float32, 4)(w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb)
    return sig, _q4_codegen(4)


# --- int4 weights x int8 activations (AVX2) -------------------------------------------------------
#
# Per pair of 32-blocks (64 weights, 32 packed bytes, one load): low nibbles (b & 15) are the even
# columns of both blocks, high nibbles ((b >> 4) & 15) the odd ones; prep_q8_row lays the int8
# activations out to match ([even 2p | even 2p+1 | odd 2p | odd 2p+1], x16 each). Two vpmaddubsw
# (lo . q_even, hi . q_odd) -> 16 x i16 each, one vpaddw, one vpmaddwd with ones -> 8 x i32 (lanes
# 0-3 block 2p, 4-7 block 2p+1), one convert, one FMA with [d_2p x4 | d_2p+1 x4], d_b = s_w[group
# of b] * s_x[b]. ~7.5 instructions per 32 weights; one block at a time (16-byte load, shift,
# 128-bit insert, mask, two multiply-adds, scalar scale, broadcast) took ~11 and measured 1.2-1.5x
# slower in L2 (docs/kernels.md). A last unpaired block (odd K / 32) takes the one-block form.
# Overflow: nibbles are q_w + 8 in [1, 15] (q_w in [-7, 7]), q_x in [-127, 127], so a u8 x s8
# pair sum is at most 2 * 15 * 127 = 3810 (pmaddubsw's i16 saturation never triggers), the vpaddw
# of the even and odd halves at most 7620, and a block's i32 sum at most 32 * 15 * 127 = 60960.
# The +8 offset is removed once per group with the precomputed 8 * s_x * sum(q_x) (prep_q8_row).
# Generic LLVM IR (zext/sext, mul, add, shuffles) was tried first: LLVM 22 (llvmlite 0.50)
# matches vpmaddwd but not vpmaddubsw, also with an explicit i16 saturating add (probably because
# known-bits prove the saturation cannot trigger; it emits ~15 widen/pmullw ops), so these are the
# x86 intrinsics, used only when the compile target has AVX2 (`HAS_AVX2`); elsewhere the
# fp32-activation dot above runs.

_I16 = ir.IntType(16)


def _target_has(feature: str) -> bool:
    """True when numba compiles for an x86 CPU with `feature` ("avx2", "f16c"; honours
    NUMBA_CPU_NAME / NUMBA_CPU_FEATURES)."""
    import llvmlite.binding as llvm
    from numba.core import config

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if config.CPU_FEATURES:
        return f"+{feature}" in config.CPU_FEATURES.split(",")
    if config.CPU_NAME and config.CPU_NAME != "host":
        return False        # a named generic target (portable caches): do not assume the feature
    return bool(llvm.get_host_cpu_features().get(feature, False))


HAS_AVX2 = _target_has("avx2")
HAS_F16C = _target_has("f16c")     # half <-> float converts (vcvtph2ps)
# The AVX-512 VNNI dots (section below) compile only for a target with all of these; HAS_AVX512 is
# whether the kernels use them (FREETOKEN_SIMD=avx2 keeps the AVX2 forms, e.g. to compare the two).
TARGET_AVX512 = all(_target_has(f) for f in ("avx512f", "avx512bw", "avx512vl", "avx512vnni"))


def _simd_mode() -> bool:
    from freetoken_py.envs import simd

    want = simd()
    if want not in ("", "avx2", "avx512"):
        raise ValueError(f"FREETOKEN_SIMD must be 'avx2' or 'avx512' (or unset), got {want!r}")
    return TARGET_AVX512 and want != "avx2"


HAS_AVX512 = _simd_mode()


def _pmadd_intrinsics(builder):
    v32b, v16s, v8i = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
    mod = builder.module
    ubsw = cgutils.get_or_insert_function(mod, ir.FunctionType(v16s, [v32b, v32b]), "llvm.x86.avx2.pmadd.ub.sw")
    wd = cgutils.get_or_insert_function(mod, ir.FunctionType(v8i, [v16s, v16s]), "llvm.x86.avx2.pmadd.wd")
    return ubsw, wd


def _pmadd(builder, nib, q):
    """<32 x u8> nib . <32 x i8> q -> <8 x i32> sums of 4 adjacent products (pmaddubsw, pmaddwd)."""
    ubsw, wd = _pmadd_intrinsics(builder)
    return builder.call(wd, [builder.call(ubsw, [nib, q]), ir.Constant(ir.VectorType(_I16, 16), [1] * 16)])


def _nibbles32(builder, wp, off):
    """16 packed bytes at wp + off -> <32 x i8> [low nibbles x16 | high nibbles x16]."""
    v16b = ir.VectorType(_I8, 16)
    b = _vload(builder, wp, off, v16b, 1)
    both = builder.shuffle_vector(b, builder.lshr(b, ir.Constant(v16b, [4] * 16)),
                                  ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    return builder.and_(both, ir.Constant(ir.VectorType(_I8, 32), [15] * 32))


def _q8_block(builder, wp, sg, blk, accs, qps, xsps):
    """One unpaired block (activations [even x16 | odd x16]):
    acc += float(nib_blk . q_blk) * (sg * s_x[blk]) for each activation (accs: one per x)."""
    v8f, v32b = ir.VectorType(_F32, 8), ir.VectorType(_I8, 32)
    nib = _nibbles32(builder, wp, builder.shl(blk, ir.Constant(_I64, 4)))
    for acc, qp, xsp in zip(accs, qps, xsps):
        q = _vload(builder, qp, builder.shl(blk, ir.Constant(_I64, 5)), v32b, 1)
        f = builder.sitofp(_pmadd(builder, nib, q), v8f)
        sc = builder.fmul(sg, builder.load(builder.gep(xsp, [blk])), flags=_FAST)
        t = builder.fmul(f, _splat(builder, sc, 8), flags=_FAST)
        builder.store(builder.fadd(builder.load(acc), t, flags=_FAST), acc)


def _q8_pair(builder, wp, sw2, pair, accs, qps, xsps, corr2s=None, cps=None):
    """Blocks 2 pair and 2 pair + 1 (sw2: <2 x float> their weight scales), see the section notes:
    acc += float(lo . q_even + hi . q_odd) * [s_w s_x of block 2p x4 | of block 2p+1 x4]; with
    corr2s (group size 32: a group per block), also corr2 += sw2 * C[2p : 2p + 2]."""
    v32b, v16s, v8f, v2f = (ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_F32, 8),
                            ir.VectorType(_F32, 2))
    ubsw, wd = _pmadd_intrinsics(builder)
    b = _vload(builder, wp, builder.shl(pair, ir.Constant(_I64, 5)), v32b, 1)
    m15 = ir.Constant(v32b, [15] * 32)
    lo = builder.and_(b, m15)
    hi = builder.and_(builder.lshr(b, ir.Constant(v32b, [4] * 32)), m15)
    base = builder.shl(pair, ir.Constant(_I64, 6))
    expand = ir.Constant(ir.VectorType(_I32, 8), [0, 0, 0, 0, 1, 1, 1, 1])
    for acc, qp, xsp in zip(accs, qps, xsps):
        qe = _vload(builder, qp, base, v32b, 1)
        qo = _vload(builder, qp, builder.add(base, ir.Constant(_I64, 32)), v32b, 1)
        s16 = builder.add(builder.call(ubsw, [lo, qe]), builder.call(ubsw, [hi, qo]))
        f = builder.sitofp(builder.call(wd, [s16, ir.Constant(v16s, [1] * 16)]), v8f)
        d2 = builder.fmul(sw2, _vload(builder, xsp, builder.shl(pair, ir.Constant(_I64, 1)), v2f, 4), flags=_FAST)
        d = builder.shuffle_vector(d2, d2, expand)
        builder.store(builder.fadd(builder.load(acc), builder.fmul(f, d, flags=_FAST), flags=_FAST), acc)
    for corr2, cp in zip(corr2s or (), cps or ()):
        c2 = builder.fmul(sw2, _vload(builder, cp, builder.shl(pair, ir.Constant(_I64, 1)), v2f, 4), flags=_FAST)
        builder.store(builder.fadd(builder.load(corr2), c2, flags=_FAST), corr2)


def _q8_quad(builder, wp, sp, quad, accs, qps, xsps, cps):
    """Pairs 4 quad .. 4 quad + 3, blocks b0 = 8 quad .. b0 + 7, group size 32 (a scale per block).
    Per activation the four pairs' vpmaddwd sums (lanes 0-3 block 2p, 4-7 block 2p + 1) are merged
    by two vphaddd into one <8 x i32> of whole-block sums, lanes [b0, b0+2, b0+4, b0+6, b0+1, b0+3,
    b0+5, b0+7], put back in block order by one permute, then one convert and one FMA with the
    eight blocks' s_w * s_x (one 16-byte scale load and one convert for all eight), less s_w *
    C[b0 : b0 + 8] (the +8 offsets, in the same accumulator). Against four pair steps: one
    convert, FMA and scale product instead of four, and no separate correction sum.
    The i32 block sums are at most 32 * 15 * 127 = 60960, so the horizontal adds cannot overflow."""
    v32b, v16s, v8f, v8i = (ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_F32, 8),
                            ir.VectorType(_I32, 8))
    ubsw, wd = _pmadd_intrinsics(builder)
    hadd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8i, [v8i, v8i]), "llvm.x86.avx2.phadd.d")
    m15, four, ones = ir.Constant(v32b, [15] * 32), ir.Constant(v32b, [4] * 32), ir.Constant(v16s, [1] * 16)
    first = builder.shl(quad, ir.Constant(_I64, 2))
    nibs = []
    for i in range(4):
        b = _vload(builder, wp, builder.shl(builder.add(first, ir.Constant(_I64, i)), ir.Constant(_I64, 5)), v32b, 1)
        nibs.append((builder.and_(b, m15), builder.and_(builder.lshr(b, four), m15)))
    b0 = builder.shl(quad, ir.Constant(_I64, 3))
    sw8 = _half_to_float(builder, _vload(builder, sp, b0, ir.VectorType(_I16, 8), 2), 8)
    order = ir.Constant(ir.VectorType(_I32, 8), [0, 4, 1, 5, 2, 6, 3, 7])
    base = builder.shl(quad, ir.Constant(_I64, 8))          # 256 activation bytes per quad
    for acc, qp, xsp, cp in zip(accs, qps, xsps, cps):
        sums = []
        for i, (lo, hi) in enumerate(nibs):
            off = builder.add(base, ir.Constant(_I64, 64 * i))
            qe = _vload(builder, qp, off, v32b, 1)
            qo = _vload(builder, qp, builder.add(off, ir.Constant(_I64, 32)), v32b, 1)
            s16 = builder.add(builder.call(ubsw, [lo, qe]), builder.call(ubsw, [hi, qo]))
            sums.append(builder.call(wd, [s16, ones]))
        h = builder.call(hadd, [builder.call(hadd, [sums[0], sums[1]]), builder.call(hadd, [sums[2], sums[3]])])
        f = builder.sitofp(builder.shuffle_vector(h, h, order), v8f)
        d = builder.fmul(sw8, _vload(builder, xsp, b0, v8f, 4), flags=_FAST)
        c8 = builder.fmul(sw8, _vload(builder, cp, b0, v8f, 4), flags=_FAST)     # the +8 offsets' share
        a = builder.fadd(builder.load(acc), builder.fmul(f, d, flags=_FAST), flags=_FAST)
        builder.store(builder.fsub(a, c8, flags=_FAST), acc)


def _q8_codegen(num_x):
    """Codegen of the int4 x int8 dot of one row with `num_x` activation rows (see q4q8_row_dot).

    Pairs of blocks alternate between two accumulators per activation (one FMA chain is
    latency-bound); every other pair (one per 64-byte line) prefetches PF_DIST ahead (from DRAM
    the expert kernel measured 1.2-1.35x faster with it, 2048-4096 B alike). Group size 32 (a
    scale per block, the common case): a loop over quads of pairs (`_q8_quad`: eight blocks'
    integer sums merged by horizontal adds, one convert and one FMA with the eight scales, the
    offset corrections in the same FMA chain; 1.1-1.35x the pair loop's rate measured at 2
    threads, docs/kernels.md), then the remaining pairs (the two fp16 scales one 4-byte load and
    one convert, the offset corrections in two lanes alongside) and an odd last block; larger
    groups (an even number of blocks each, so a pair never straddles two) loop over groups with
    the scale splatted, the corrections once per group (a separate scalar loop over groups cost
    ~4 instructions per block).
    """
    def codegen(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, v)
                  for t, v in zip(signature.args[:-1], args[:-1])]
        wp, sp = arrays[0].data, arrays[1].data
        qps = [a.data for a in arrays[2:2 + num_x]]
        xsps = [a.data for a in arrays[2 + num_x:]]                         # s_x[b] first in xg
        ngroups = cgutils.unpack_tuple(builder, arrays[1].shape)[0]
        hb64 = context.cast(builder, args[-1], signature.args[-1], types.int64)
        bpg = builder.lshr(hb64, ir.Constant(_I64, 4))                         # 32-blocks per group
        nb = builder.mul(ngroups, bpg)
        cps = [builder.gep(p, [nb]) for p in xsps]                            # then C[g]
        v8f, v2f = ir.VectorType(_F32, 8), ir.VectorType(_F32, 2)
        one = ir.Constant(_I64, 1)
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(v8f, None)) for _ in range(num_x)] for _ in range(2)]
        corr2s = [[cgutils.alloca_once_value(builder, ir.Constant(v2f, None)) for _ in range(num_x)] for _ in range(2)]
        corrs = [cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for _ in range(num_x)]
        npairs = builder.lshr(nb, one)

        def flat_pair(pair, acc_set):
            _q8_pair(builder, wp, _scale2(builder, sp, builder.shl(pair, one)), pair, accs[acc_set], qps, xsps,
                     corr2s[acc_set], cps)

        def add_corr(g):
            sg = _scale(builder, sp, g)
            for corr, cp in zip(corrs, cps):
                c = builder.fmul(sg, builder.load(builder.gep(cp, [g])), flags=_FAST)
                builder.store(builder.fadd(builder.load(corr), c, flags=_FAST), corr)

        with builder.if_else(builder.icmp_unsigned("==", bpg, one)) as (flat, nested):
            with flat:     # offset corrections ride along in vectors (C[b] is per block here)
                two = ir.Constant(_I64, 2)
                nquads = builder.lshr(npairs, two)
                with cgutils.for_range(builder, nquads) as loop:       # four pairs a step, then the rest
                    pair = builder.shl(loop.index, two)
                    _prefetch(builder, wp, builder.shl(pair, ir.Constant(_I64, 5)))   # one per 64-byte line
                    _prefetch(builder, wp, builder.shl(builder.add(pair, two), ir.Constant(_I64, 5)))
                    _q8_quad(builder, wp, sp, loop.index, accs[0], qps, xsps, cps)
                done = builder.shl(nquads, two)
                with cgutils.for_range(builder, builder.lshr(builder.sub(npairs, done), one)) as loop:
                    pair = builder.add(done, builder.shl(loop.index, one))
                    _prefetch(builder, wp, builder.shl(pair, ir.Constant(_I64, 5)))   # one per 64-byte line
                    flat_pair(pair, 0)
                    flat_pair(builder.add(pair, one), 1)
                with builder.if_then(builder.trunc(builder.sub(npairs, done), ir.IntType(1))):    # odd number of pairs
                    flat_pair(builder.sub(npairs, one), 0)
                with builder.if_then(builder.trunc(nb, ir.IntType(1))):        # odd number of blocks
                    last = builder.sub(nb, one)
                    _q8_block(builder, wp, _scale(builder, sp, last), last, accs[1], qps, xsps)
                    add_corr(last)
            with nested:
                ppg = builder.lshr(bpg, one)
                with cgutils.for_range(builder, ngroups) as group:
                    sw2 = _splat(builder, _scale(builder, sp, group.index), 2)
                    first = builder.mul(group.index, ppg)
                    with cgutils.for_range(builder, builder.lshr(ppg, one)) as loop:
                        pair = builder.add(first, builder.shl(loop.index, one))
                        _prefetch(builder, wp, builder.shl(pair, ir.Constant(_I64, 5)))
                        _q8_pair(builder, wp, sw2, pair, accs[0], qps, xsps)
                        _q8_pair(builder, wp, sw2, builder.add(pair, one), accs[1], qps, xsps)
                    with builder.if_then(builder.trunc(ppg, ir.IntType(1))):    # odd pairs per group
                        pair = builder.sub(builder.add(first, ppg), one)
                        _prefetch(builder, wp, builder.shl(pair, ir.Constant(_I64, 5)))   # g = 64: the only one
                        _q8_pair(builder, wp, sw2, pair, accs[0], qps, xsps)
                    add_corr(group.index)
        for j, corr in enumerate(corrs):
            c2 = builder.fadd(builder.load(corr2s[0][j]), builder.load(corr2s[1][j]), flags=_FAST)
            tot = builder.fadd(builder.extract_element(c2, ir.Constant(_I32, 0)),
                               builder.extract_element(c2, ir.Constant(_I32, 1)), flags=_FAST)
            builder.store(builder.fadd(builder.load(corr), tot, flags=_FAST), corr)
        res = []
        for a0, a1, corr in zip(accs[0], accs[1], corrs):
            acc = builder.fadd(builder.load(a0), builder.load(a1), flags=_FAST)
            res.append(builder.fsub(_hsum(builder, acc), builder.load(corr), flags=_FAST))
        if num_x == 1:
            return res[0]
        return context.make_tuple(builder, signature.return_type, res)

    return codegen


def _check_avx2():
    if not HAS_AVX2:
        raise TypeError("q4q8 dots need an x86 CPU with AVX2 (prepare() picks the fp32 path elsewhere)")


@intrinsic
def q4q8_row_dot(typingctx, w, s, xq, xg, hb):
    """Dot of one int4 row with an int8-quantised activation (prep_q8_row); returns float32.

    w   uint8 [K/2]        packed row (low nibble = even column), K a multiple of 32
    s   uint16 [G]         group scales as fp16 bits, G = K / (2 * hb)
    xq  int8 [K]           q_x per 32-block, in prep_q8_row's pair layout
    xg  float32 [NB + G]   s_x[b] for the NB = K/32 blocks, then C[g] = 8 * sum_{b in g} s_x[b] * sum(q_x[b])
    hb  int                bytes per group = group_size / 2 (a multiple of 16)

    result = sum_g s[g] * (sum_{b in g} s_x[b] * (nib_b . q_x[b]) - C[g])
    """
    _check_avx2()
    _check_scales(s)
    return types.float32(w, s, xq, xg, hb), _q8_codegen(1)


@intrinsic
def q4q8_row_dot4(typingctx, w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb):
    """q4q8_row_dot of one row with four activations at once (nibbles split once) -> UniTuple(float32, 4)."""
    _check_avx2()
    _check_scales(s)
    sig = types.UniTuple(types.float32, 4)(w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb)
    return sig, _q8_codegen(4)


# --- int8 weights x int8 activations (AVX2) -------------------------------------------------------
#
# Per 32 weights (llama.cpp's q8_0 x q8_0 dot): |w| (vpabsb), q_x given w's sign (vpsignb: q_x *
# sign(w), 0 where w = 0), vpmaddubsw(|w| as u8, sign(w) q_x as s8) = w * q_x in pairs -> 16 x i16,
# vpmaddwd with ones -> 8 x i32, one convert, one FMA with s_x[block]; the row scale multiplies once
# at the end (in _dots.row_dot). Activations in natural order (prep_q8n_row), not [even | odd].
# Overflow: quantize_int8 scales by max / 127 and clamps to [-127, 127], so w = -128 never occurs
# (|w| fits u8 and vpabsb has no -128 corner), and q_x is clamped to [-127, 127] as well, so
# vpsignb cannot overflow either; a u8 x s8 pair sum is at most 2 * 127 * 127 = 32258 < 32767, so
# vpmaddubsw's i16 saturation never triggers, and a block's i32 sum is at most 32 * 127^2 = 516128.
# The same llvm.x86.avx2 intrinsics as above, for the same reason (generic IR gets no vpmaddubsw).


def _i8_block(builder, wp, blk, accs, qps, xsps):
    """acc += float(w_blk . q_blk) * s_x[blk] for each activation (w loaded and |w| taken once)."""
    v8f, v32b, off = ir.VectorType(_F32, 8), ir.VectorType(_I8, 32), builder.shl(blk, ir.Constant(_I64, 5))
    w = _vload(builder, wp, off, v32b, 1)
    absf = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32b, [v32b, ir.IntType(1)]), "llvm.abs.v32i8")
    sign = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32b, [v32b, v32b]), "llvm.x86.avx2.psign.b")
    wabs = builder.call(absf, [w, ir.Constant(ir.IntType(1), 0)])
    for acc, qp, xsp in zip(accs, qps, xsps):                 # |w| . (sign(w) q_x) = w . q_x, 4 per i32 lane
        qs = builder.call(sign, [_vload(builder, qp, off, v32b, 1), w])
        f = builder.sitofp(_pmadd(builder, wabs, qs), v8f)
        t = builder.fmul(f, _splat(builder, builder.load(builder.gep(xsp, [blk])), 8), flags=_FAST)
        builder.store(builder.fadd(builder.load(acc), t, flags=_FAST), acc)


def _i8_tail(builder, wp, k, nb, qps, xsps):
    """Per activation: s_x[nb] * sum_{i >= 32 nb} w[i] q_x[i], the partial last block (0.0 if none)."""
    sums = [cgutils.alloca_once_value(builder, ir.Constant(_I32, 0)) for _ in qps]
    start = builder.shl(nb, ir.Constant(_I64, 5))
    with cgutils.for_range(builder, builder.sub(k, start)) as loop:          # K % 32 scalar steps
        i = builder.add(start, loop.index)
        wi = builder.sext(builder.load(builder.gep(wp, [i])), _I32)
        for acc, qp in zip(sums, qps):
            prod = builder.mul(wi, builder.sext(builder.load(builder.gep(qp, [i])), _I32))
            builder.store(builder.add(builder.load(acc), prod), acc)
    has_tail = builder.icmp_unsigned("!=", start, k)
    res = []
    for acc, xsp in zip(sums, xsps):
        idx = builder.select(has_tail, nb, ir.Constant(_I64, 0))              # s_x[nb] exists only then
        scaled = builder.fmul(builder.sitofp(builder.load(acc), _F32), builder.load(builder.gep(xsp, [idx])), flags=_FAST)
        res.append(builder.select(has_tail, scaled, ir.Constant(_F32, 0.0)))
    return res


UNROLL_1 = 4        # blocks per loop trip (and FMA chains) of the one-activation dot: 2 -> 4 measured +5-20 % in cache
# Software prefetch this many bytes ahead, one per 64-byte line (it may run past the row or array:
# prefetches never fault). With the hardware prefetcher alone the int8 x int8 lm_head GEMV streamed
# at 1.03-1.1x the fp32-activation dot's GB/s; with 4096 B, 1.17-1.34x and 17.2-17.4 GB/s on 2
# threads (docs/kernels.md). 1024 / 2048 B measured in between.
PF_DIST = 4096


def _prefetch(builder, wp, off):
    i8p = _I8.as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
                                        "llvm.prefetch.p0")
    addr = builder.bitcast(builder.gep(wp, [builder.add(off, ir.Constant(_I64, PF_DIST))]), i8p)
    builder.call(fn, [addr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])   # read, keep, data


def _i8q8_codegen(num_x):
    """int8 x int8 dot of one row with `num_x` activations: the K // 32 whole blocks rotate over 4
    (one activation) or 2 (four) accumulators each (one FMA chain is latency-bound), prefetching
    PF_DIST ahead; then the K % 32 tail in scalar integers (tiny test models have such widths)."""
    def codegen(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args)]
        wp = arrays[0].data
        qps = [a.data for a in arrays[1:1 + num_x]]
        xsps = [a.data for a in arrays[1 + num_x:]]
        k = cgutils.unpack_tuple(builder, arrays[0].shape)[0]
        nb = builder.lshr(k, ir.Constant(_I64, 5))
        unroll = UNROLL_1 if num_x == 1 else 2
        v8f = ir.VectorType(_F32, 8)
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(v8f, None)) for _ in range(num_x)] for _ in range(unroll)]
        u64 = ir.Constant(_I64, unroll)
        with cgutils.for_range(builder, builder.udiv(nb, u64)) as loop:
            for u in range(unroll):
                blk = builder.add(builder.mul(loop.index, u64), ir.Constant(_I64, u))
                if u % 2 == 0:                                                # one per 64-byte line
                    _prefetch(builder, wp, builder.shl(blk, ir.Constant(_I64, 5)))
                _i8_block(builder, wp, blk, accs[u], qps, xsps)
        rest = builder.urem(nb, u64)
        with cgutils.for_range(builder, rest) as loop:                        # nb % unroll last blocks
            _i8_block(builder, wp, builder.add(builder.sub(nb, rest), loop.index), accs[0], qps, xsps)
        tails = _i8_tail(builder, wp, k, nb, qps, xsps)
        res = []
        for j, tail in enumerate(tails):
            acc = builder.load(accs[0][j])
            for u in range(1, unroll):
                acc = builder.fadd(acc, builder.load(accs[u][j]), flags=_FAST)
            res.append(builder.fadd(_hsum(builder, acc), tail, flags=_FAST))
        if num_x == 1:
            return res[0]
        return context.make_tuple(builder, signature.return_type, res)

    return codegen


@intrinsic
def i8q8_row_dot(typingctx, w, xq, xs):
    """sum over the 32-blocks b of s_x[b] * (w_b . q_x[b]), float32 (without the row scale).

    w   int8 [K]       weight row, values in [-127, 127] (quant.int8), any K
    xq  int8 [K]       activation quantised per 32-block, natural order (prep_q8n_row)
    xs  float32 [NB]   s_x[b], NB = ceil(K / 32) (the last block may be partial)
    """
    _check_avx2()
    return types.float32(w, xq, xs), _i8q8_codegen(1)


@intrinsic
def i8q8_row_dot4(typingctx, w, x0, x1, x2, x3, s0, s1, s2, s3):
    """i8q8_row_dot of one row with four activations at once (|w| taken once) -> UniTuple(float32, 4)."""
    _check_avx2()
    return types.UniTuple(types.float32, 4)(w, x0, x1, x2, x3, s0, s1, s2, s3), _i8q8_codegen(4)


# --- int4 / int8 weights x int8 activations (AVX-512 VNNI) ---------------------------------------
#
# The same arithmetic as the AVX2 dots above with 512-bit vectors and vpdpbusd (u8 x s8, four
# adjacent products summed into each i32 lane and added to the accumulator, no saturation: one
# instruction for AVX2's vpmaddubsw + vpmaddwd + add). Zen 5 (this project's AVX-512 box) runs
# 512-bit ops at full width, so per weight this is about half the instructions. Chosen when the
# compile target has avx512f/bw/vl/vnni (`TARGET_AVX512`) unless FREETOKEN_SIMD=avx2 (`HAS_AVX512`).
#
# int4 (`q4q8v_row_dot`): per **quad** of 32-blocks (128 weights, one 64-byte load of packed
# bytes) the low nibbles are the even columns of blocks 4q..4q+3 (16 each), the high nibbles the odd
# ones; prep_q8_row (quad=True) lays the activations out as [even 4q | .. | even 4q+3 | odd 4q | .. |
# odd 4q+3] (x16 each, 128 bytes), so two vpdpbusd (lo . q_even, then hi . q_odd into the same
# accumulator) leave block 4q+r's sum in lanes 4r..4r+3: one convert, one FMA with
# [d_4q x4 | .. | d_4q+3 x4], d_b = s_w[group of b] * s_x[b]. The blocks after the last whole quad
# (K / 32 % 4 of them) keep the AVX2 pair / single layout and the AVX2 code (256-bit, VEX). Group
# sizes: 32 (a scale per block: the four fp16 scales one 8-byte load and one vcvtph2ps), 64 (two per
# quad) and multiples of 128 (whole quads per group, the scale splatted); other multiples of 64 (192,
# 320, ...) would split a quad between groups: `quad_layout` sends those to the AVX2 form. Overflow:
# nibbles in [1, 15] x q_x in [-127, 127], at most 32 * 15 * 127 = 60960 per block, i32.
#
# int8 (`i8q8v_row_dot`): per pair of 32-blocks (64 weights, one 64-byte load): |w| (vpabsb) as u8,
# q_x negated where w < 0 (AVX-512 has no vpsignb: a compare into a mask register and a masked
# subtract), one vpdpbusd -> lanes 0-7 block 2p, 8-15 block 2p+1, convert, FMA with
# [s_x[2p] x8 | s_x[2p+1] x8]. Each i32 lane sums the same four products as the AVX2 form's
# vpmaddubsw + vpmaddwd lane, so the two agree to the order of the fp32 sums. An odd last block
# and the K % 32 tail as in the AVX2 form. Same ranges as there (|w|, |q_x| <= 127).
#
# Generic LLVM IR does not produce vpdpbusd either (as with vpmaddubsw), hence the intrinsic. Its
# old <16 x i32> operand form is used: LLVM 22 upgrades it, older LLVMs only know it.


def _check_avx512():
    if not TARGET_AVX512:
        raise TypeError("the VNNI dots need an x86 CPU with AVX-512 F/BW/VL/VNNI (the AVX2 forms run elsewhere)")


def _dpbusd(builder, acc, u8, s8):
    """acc (<16 x i32> or <8 x i32>) + sums of 4 adjacent u8 x s8 products of the byte vectors."""
    n = acc.type.count
    vi = ir.VectorType(_I32, n)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vi, [vi, vi, vi]),
                                        f"llvm.x86.avx512.vpdpbusd.{32 * n}")
    return builder.call(fn, [acc, builder.bitcast(u8, vi), builder.bitcast(s8, vi)])


def _c64(v):
    return ir.Constant(_I64, v)


def _q8v_quad(builder, wp, sw4, quad, accs, qps, xsps):
    """Blocks 4 quad .. 4 quad + 3 (sw4: <4 x float> their weight scales): for each activation
    acc (<16 x float>) += float(lo . q_even + hi . q_odd) * [s_w s_x of each block x4]."""
    v64b, v16i, v16f, v4f = (ir.VectorType(_I8, 64), ir.VectorType(_I32, 16), ir.VectorType(_F32, 16),
                             ir.VectorType(_F32, 4))
    b = _vload(builder, wp, builder.shl(quad, _c64(6)), v64b, 1)
    m15 = ir.Constant(v64b, [15] * 64)
    lo = builder.and_(b, m15)
    hi = builder.and_(builder.lshr(b, ir.Constant(v64b, [4] * 64)), m15)
    base = builder.shl(quad, _c64(7))
    spread = ir.Constant(ir.VectorType(_I32, 16), [i // 4 for i in range(16)])
    zero = ir.Constant(v16i, None)
    for acc, qp, xsp in zip(accs, qps, xsps):
        qe = _vload(builder, qp, base, v64b, 1)
        qo = _vload(builder, qp, builder.add(base, _c64(64)), v64b, 1)
        f = builder.sitofp(_dpbusd(builder, _dpbusd(builder, zero, lo, qe), hi, qo), v16f)
        d4 = builder.fmul(sw4, _vload(builder, xsp, builder.shl(quad, _c64(2)), v4f, 4), flags=_FAST)
        d = builder.shuffle_vector(d4, d4, spread)
        builder.store(builder.fadd(builder.load(acc), builder.fmul(f, d, flags=_FAST), flags=_FAST), acc)


Q8V_SETS_1 = 2      # accumulator sets (FMA chains) of the one-activation VNNI int4 dot's flat loop (4 measured 10-25 % slower at K = 768 / 2048)


def _q8v_codegen(num_x):
    """Codegen of the AVX-512 int4 x int8 dot of one row with `num_x` activations (q4q8v_row_dot).

    Three loops by blocks per group (bpg, fixed per call): 1 (g = 32) and 2 (g = 64) walk the quads
    flat, two per trip into two accumulator sets, computing the quad's four weight scales and its
    offset corrections alongside (4 or 2 lanes); bpg % 4 == 0 walks groups, the scale splatted and
    the correction added once per group. One prefetch PF_DIST ahead per quad (64 bytes)."""
    def codegen(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:-1], args[:-1])]
        wp, sp = arrays[0].data, arrays[1].data
        qps = [a.data for a in arrays[2:2 + num_x]]
        xsps = [a.data for a in arrays[2 + num_x:]]
        ngroups = cgutils.unpack_tuple(builder, arrays[1].shape)[0]
        hb64 = context.cast(builder, args[-1], signature.args[-1], types.int64)
        bpg = builder.lshr(hb64, _c64(4))
        nb = builder.mul(ngroups, bpg)
        cps = [builder.gep(p, [nb]) for p in xsps]
        nquads = builder.lshr(nb, _c64(2))
        v16f, v8f, v4f, v2f = (ir.VectorType(_F32, n) for n in (16, 8, 4, 2))
        one = _c64(1)
        sets = Q8V_SETS_1 if num_x == 1 else 2
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(v16f, None)) for _ in range(num_x)] for _ in range(sets)]
        acc8s = [cgutils.alloca_once_value(builder, ir.Constant(v8f, None)) for _ in range(num_x)]
        corr4s = [cgutils.alloca_once_value(builder, ir.Constant(v4f, None)) for _ in range(num_x)]
        corr2s = [cgutils.alloca_once_value(builder, ir.Constant(v2f, None)) for _ in range(num_x)]
        corrs = [cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for _ in range(num_x)]

        def add_corr(g):
            sg = _scale(builder, sp, g)
            for corr, cp in zip(corrs, cps):
                c = builder.fmul(sg, builder.load(builder.gep(cp, [g])), flags=_FAST)
                builder.store(builder.fadd(builder.load(corr), c, flags=_FAST), corr)

        def add_vec(dst, val):
            builder.store(builder.fadd(builder.load(dst), val, flags=_FAST), dst)

        def flat_quad(quad, acc_set, per_block):
            _prefetch(builder, wp, builder.shl(quad, _c64(6)))
            if per_block:        # g = 32: four scales, four corrections C[4q .. 4q + 3]
                sw4 = _half_to_float(builder, _vload(builder, sp, builder.shl(quad, _c64(2)),
                                                     ir.VectorType(_I16, 4), 2), 4)
                for corr4, cp in zip(corr4s, cps):
                    add_vec(corr4, builder.fmul(sw4, _vload(builder, cp, builder.shl(quad, _c64(2)), v4f, 4),
                                                flags=_FAST))
            else:                # g = 64: groups 2q, 2q + 1
                sw2 = _scale2(builder, sp, builder.shl(quad, one))
                sw4 = builder.shuffle_vector(sw2, sw2, ir.Constant(ir.VectorType(_I32, 4), [0, 0, 1, 1]))
                for corr2, cp in zip(corr2s, cps):
                    add_vec(corr2, builder.fmul(sw2, _vload(builder, cp, builder.shl(quad, one), v2f, 4), flags=_FAST))
            _q8v_quad(builder, wp, sw4, quad, accs[acc_set], qps, xsps)

        def flat(per_block):
            nset = _c64(sets)
            with cgutils.for_range(builder, builder.udiv(nquads, nset)) as loop:
                quad = builder.mul(loop.index, nset)
                for u in range(sets):
                    flat_quad(builder.add(quad, _c64(u)), u, per_block)
            rest = builder.urem(nquads, nset)
            with cgutils.for_range(builder, rest) as loop:
                flat_quad(builder.add(builder.sub(nquads, rest), loop.index), 0, per_block)
            pair = builder.shl(nquads, one)               # blocks after the last whole quad: AVX2 forms
            with builder.if_then(builder.icmp_unsigned("!=", builder.and_(nb, _c64(2)), _c64(0))):
                if per_block:
                    _q8_pair(builder, wp, _scale2(builder, sp, builder.shl(pair, one)), pair, acc8s, qps, xsps,
                             corr2s, cps)
                else:                                      # the pair is group `pair`
                    _q8_pair(builder, wp, _splat(builder, _scale(builder, sp, pair), 2), pair, acc8s, qps, xsps)
                    add_corr(pair)
            if per_block:
                with builder.if_then(builder.trunc(nb, ir.IntType(1))):
                    last = builder.sub(nb, one)
                    _q8_block(builder, wp, _scale(builder, sp, last), last, acc8s, qps, xsps)
                    add_corr(last)

        with builder.if_else(builder.icmp_unsigned("<=", bpg, _c64(2))) as (small, nested):
            with small:
                with builder.if_else(builder.icmp_unsigned("==", bpg, one)) as (g32, g64):
                    with g32:
                        flat(True)
                    with g64:
                        flat(False)
            with nested:
                qpg = builder.lshr(bpg, _c64(2))
                with cgutils.for_range(builder, ngroups) as group:
                    sw4 = _splat(builder, _scale(builder, sp, group.index), 4)
                    first = builder.mul(group.index, qpg)
                    with cgutils.for_range(builder, builder.lshr(qpg, one)) as loop:
                        quad = builder.add(first, builder.shl(loop.index, one))
                        _prefetch(builder, wp, builder.shl(quad, _c64(6)))
                        _q8v_quad(builder, wp, sw4, quad, accs[0], qps, xsps)
                        quad1 = builder.add(quad, one)
                        _prefetch(builder, wp, builder.shl(quad1, _c64(6)))
                        _q8v_quad(builder, wp, sw4, quad1, accs[1], qps, xsps)
                    with builder.if_then(builder.trunc(qpg, ir.IntType(1))):
                        quad = builder.sub(builder.add(first, qpg), one)
                        _prefetch(builder, wp, builder.shl(quad, _c64(6)))
                        _q8v_quad(builder, wp, sw4, quad, accs[0], qps, xsps)
                    add_corr(group.index)
        res = []
        widen = {n: ir.Constant(ir.VectorType(_I32, 16), list(range(n)) + [n] * (16 - n)) for n in (8, 4, 2)}

        def to16(v, n):      # <n x float> -> <16 x float>, zeros above (one shuffle)
            return builder.shuffle_vector(v, ir.Constant(v.type, None), widen[n])

        for j in range(num_x):   # one horizontal sum: the tail and the corrections folded into the accumulator first
            acc = to16(builder.load(acc8s[j]), 8)
            for acc_set in accs:
                acc = builder.fadd(acc, builder.load(acc_set[j]), flags=_FAST)
            corr = builder.fadd(to16(builder.load(corr4s[j]), 4), to16(builder.load(corr2s[j]), 2), flags=_FAST)
            res.append(builder.fsub(_hsum(builder, builder.fsub(acc, corr, flags=_FAST)), builder.load(corrs[j]),
                                    flags=_FAST))
        if num_x == 1:
            return res[0]
        return context.make_tuple(builder, signature.return_type, res)

    return codegen


def _q8_auto_codegen(num_x):
    """The VNNI codegen for group sizes 32, 64 and multiples of 128 (bpg = group / 32 in {1, 2} or
    a multiple of 4), the AVX2 one (pair layout) otherwise: a branch on hb per call, so one
    intrinsic serves every group size and the caller needs no branch of its own."""
    vnni, avx2 = _q8v_codegen(num_x), _q8_codegen(num_x)

    def codegen(context, builder, signature, args):
        bpg = builder.lshr(context.cast(builder, args[-1], signature.args[-1], types.int64), _c64(4))
        ok = builder.or_(builder.icmp_unsigned("<=", bpg, _c64(2)),
                         builder.icmp_unsigned("==", builder.and_(bpg, _c64(3)), _c64(0)))
        res = cgutils.alloca_once(builder, context.get_value_type(signature.return_type))
        with builder.if_else(ok) as (quads, pairs):
            with quads:
                builder.store(vnni(context, builder, signature, args), res)
            with pairs:
                builder.store(avx2(context, builder, signature, args), res)
        return builder.load(res)

    return codegen


@intrinsic
def q4q8v_row_dot(typingctx, w, s, xq, xg, hb):
    """q4q8_row_dot with AVX-512 VNNI. xq in prep_q8_row's quad layout for group sizes 32, 64 and
    multiples of 128 (`_dots.quad_layout`), which take the VNNI loops; other group sizes (192, 320,
    ...) read the pair layout and run the AVX2 form."""
    _check_avx512()
    _check_scales(s)
    return types.float32(w, s, xq, xg, hb), _q8_auto_codegen(1)


@intrinsic
def q4q8v_row_dot4(typingctx, w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb):
    """q4q8v_row_dot of one row with four activations at once -> UniTuple(float32, 4)."""
    _check_avx512()
    _check_scales(s)
    sig = types.UniTuple(types.float32, 4)(w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb)
    return sig, _q8_auto_codegen(4)


def _i8v_pair(builder, wp, pair, accs, qps, xsps):
    """Blocks 2 pair, 2 pair + 1: acc (<16 x float>) += float(|w| . (q_x negated where w < 0)) * [s_x x8 | s_x x8]."""
    v64b, v16i, v16f, v2f = (ir.VectorType(_I8, 64), ir.VectorType(_I32, 16), ir.VectorType(_F32, 16),
                             ir.VectorType(_F32, 2))
    off = builder.shl(pair, _c64(6))
    w = _vload(builder, wp, off, v64b, 1)
    absf = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v64b, [v64b, ir.IntType(1)]), "llvm.abs.v64i8")
    wabs = builder.call(absf, [w, ir.Constant(ir.IntType(1), 0)])
    zero8 = ir.Constant(v64b, None)
    neg = builder.icmp_signed("<", w, zero8)
    spread = ir.Constant(ir.VectorType(_I32, 16), [0] * 8 + [1] * 8)
    for acc, qp, xsp in zip(accs, qps, xsps):
        q = _vload(builder, qp, off, v64b, 1)
        qs = builder.select(neg, builder.sub(zero8, q), q)
        f = builder.sitofp(_dpbusd(builder, ir.Constant(v16i, None), wabs, qs), v16f)
        d2 = _vload(builder, xsp, builder.shl(pair, _c64(1)), v2f, 4)
        d = builder.shuffle_vector(d2, d2, spread)
        builder.store(builder.fadd(builder.load(acc), builder.fmul(f, d, flags=_FAST), flags=_FAST), acc)


def _i8q8v_codegen(num_x):
    """AVX-512 int8 x int8 dot of one row with `num_x` activations: the K // 64 pairs of blocks rotate
    over 4 (one activation) or 2 (four) accumulators, one prefetch PF_DIST ahead per pair; an odd
    last block by the AVX2 form, then the K % 32 tail in scalar integers."""
    def codegen(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args)]
        wp = arrays[0].data
        qps = [a.data for a in arrays[1:1 + num_x]]
        xsps = [a.data for a in arrays[1 + num_x:]]
        k = cgutils.unpack_tuple(builder, arrays[0].shape)[0]
        nb = builder.lshr(k, _c64(5))
        npairs = builder.lshr(nb, _c64(1))
        unroll = 4 if num_x == 1 else 2
        v16f, v8f = ir.VectorType(_F32, 16), ir.VectorType(_F32, 8)
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(v16f, None)) for _ in range(num_x)] for _ in range(unroll)]
        acc8s = [cgutils.alloca_once_value(builder, ir.Constant(v8f, None)) for _ in range(num_x)]
        u64 = _c64(unroll)
        with cgutils.for_range(builder, builder.udiv(npairs, u64)) as loop:
            for u in range(unroll):
                pair = builder.add(builder.mul(loop.index, u64), _c64(u))
                _prefetch(builder, wp, builder.shl(pair, _c64(6)))
                _i8v_pair(builder, wp, pair, accs[u], qps, xsps)
        rest = builder.urem(npairs, u64)
        with cgutils.for_range(builder, rest) as loop:
            _i8v_pair(builder, wp, builder.add(builder.sub(npairs, rest), loop.index), accs[0], qps, xsps)
        with builder.if_then(builder.trunc(nb, ir.IntType(1))):
            _i8_block(builder, wp, builder.sub(nb, _c64(1)), acc8s, qps, xsps)
        tails = _i8_tail(builder, wp, k, nb, qps, xsps)
        res = []
        for j, tail in enumerate(tails):
            acc = builder.load(accs[0][j])
            for u in range(1, unroll):
                acc = builder.fadd(acc, builder.load(accs[u][j]), flags=_FAST)
            acc8 = builder.shuffle_vector(builder.load(acc8s[j]), ir.Constant(v8f, None),
                                          ir.Constant(ir.VectorType(_I32, 16), list(range(8)) + [8] * 8))
            res.append(builder.fadd(_hsum(builder, builder.fadd(acc, acc8, flags=_FAST)), tail, flags=_FAST))
        if num_x == 1:
            return res[0]
        return context.make_tuple(builder, signature.return_type, res)

    return codegen


@intrinsic
def i8q8v_row_dot(typingctx, w, xq, xs):
    """i8q8_row_dot with AVX-512 VNNI (same arguments, same activation layout)."""
    _check_avx512()
    return types.float32(w, xq, xs), _i8q8v_codegen(1)


@intrinsic
def i8q8v_row_dot4(typingctx, w, x0, x1, x2, x3, s0, s1, s2, s3):
    """i8q8v_row_dot of one row with four activations at once -> UniTuple(float32, 4)."""
    _check_avx512()
    return types.UniTuple(types.float32, 4)(w, x0, x1, x2, x3, s0, s1, s2, s3), _i8q8v_codegen(4)


# --- int4 / nvfp4 weights in 16-row interleaved slabs x int8 activations (AVX-512 VNNI) -----------
#
# The row dots above spend most of their instructions per weight on bookkeeping of one row: a quad
# of 128 weights costs two vpdpbusd but ~15 more instructions for the nibble split, the four block
# scales, the activation scales, their spread over the lanes and the offset correction. With the
# lanes holding rows instead of columns (llama.cpp's repacked Q4_0x8 idea, our own layout), one
# 64-byte load serves 16 rows x 8 columns, the activations are dword broadcasts in their natural
# order, and the scales are one 16-lane vector per block for all 16 rows.
#
# Layout (`_buffers.r16_pack`, bank / dense layout "r16"): rows in slabs of 16 (a slab is the same 16 x
# K/2 bytes and 16 x G scales as in the row layout, permuted within itself). Weight bytes per
# 32-column block b: 4 chunks c of 64 bytes; byte 4r + j of chunk c holds row r's columns
# 32b + 8c + j (low nibble, value + 8) and 32b + 8c + 4 + j (high nibble). Scales [G, 16]: the 16
# rows' fp16 scale of group g side by side, held as int16 (the dtype that tells the kernels the layout).
# Per chunk: lo = b & 15, hi = (b >> 4) & 15, vpdpbusd(lo, q[32b + 8c .. +3] broadcast) and
# vpdpbusd(hi, q[32b + 8c + 4 .. +7] broadcast) into two i32 chains; per block: one convert, then
# acc += (dot * s_x[b] - 8 s_x[b] sum(q_b)) * s_w[rows, b // bpg] (the nibble offset removed per
# block, `prep_q8r_rows` gives s_x and the correction side by side). Same ranges as the row form:
# nibbles in [1, 15], |q| <= 127, |a block's sum| <= 60960.
# nvfp4 (e2m1, e4m3 scale per 16 columns, a fp32 factor per row; MXFP4 loads into it) in the same
# weight slabs: the nibbles through the 16-entry table to 2 e2m1 + 12 (u8 in [0, 24]: vpermb for
# the low ones, vpshufb for the high ones, as the row form), each group of 16 columns (two chunks)
# its own convert, offset 12 s_x sum(q_g) (`prep_q8r_nv_rows`) and e4m3 scale vector (16 bytes, by
# bit placement to fp16: value / 2^8, exact); the scales held as int8 [K/16, 16] per slab, then the
# 16 rows' fp32 factors (64 bytes), applied once per slab with the 2^7 (a multiplier f > 0, or
# 1 / -f). |a group's sum| <= 16 * 24 * 127 = 48768.
# One Zen 4 core (2048 columns, in L2 / L3): 53 / 57 GB/s against 31 / 31 for q4q8v_row_dot; from
# DRAM one thread 27.5 against 21.6 GB/s (docs/kernels.md "int4 in 16-row slabs").

# The slab dots prefetch PF_DIST ahead, one per 64-byte chunk (for them 2048 B read less, 8192 / 16384 B
# the same as 4096 within noise: docs/kernels.md). Rows per slab: _buffers.R16_ROWS.


_R16_KINDS = {(types.uint8, types.int16): "int4", (types.uint8, types.int8): "nvfp4",
              (types.uint8, types.int32): "fp8", (types.int8, types.int32): "int8"}


def r16_kind(w, s):
    """Typing time: the format of rows (w, s) held in the "r16" slab layout, from the weights' and
    scales' dtypes (int4: uint8 + int16, nvfp4: uint8 + int8, fp8: uint8 + int32, int8: int8 +
    int32), or None for any other pair (the row layout)."""
    return _R16_KINDS.get((w.dtype, s.dtype))


def _check_r16(w, s, xqs, xgs, outs):
    """r16_kind of these arrays (which slab dot they are for), checked against this target."""
    if w.ndim != 2 or s.ndim != 2 or any(o.dtype != types.float32 or o.ndim != 1 for o in outs):
        raise TypeError("r16_dot takes 2-D slabs and scales and writes float32 outputs (1-D float32 arrays)")
    fmt = r16_kind(w, s)
    if fmt == "fp8":
        _check_avx512()
        if not (HAS_AVX512BF16 and HAS_AVX512VBMI):
            raise TypeError("fp8 slabs need AVX512-BF16 and AVX512-VBMI")
        if any(x.dtype != types.uint16 or x.ndim != 1 for x in xqs):
            raise TypeError("the fp8 slab dot takes bf16 activations (uint16 [K], natural order)")
        return fmt
    if fmt is None:
        raise TypeError("r16_dot takes slabs of 16 rows and their scales as r16 holds them (int4: uint8 [R, K/2] with "
                        "int16 fp16 bits; nvfp4: uint8 [R, K/2] with int8 e4m3 bytes + row factors; fp8: uint8 [R, K] "
                        "with int32 fp32 bits; int8: int8 [R, K] with int32 fp32 row-scale bits)")
    if any(x.dtype != types.int8 or x.ndim != 1 for x in xqs) or any(g.dtype != types.float32 or g.ndim != 1 for g in xgs):
        raise TypeError("r16_dot takes int8 activations [K] and their float32 (s_x, corrections) rows")
    if fmt == "int8" or HAS_AVX512:
        _check_avx512()            # int8 slabs: VNNI only (vpmaddubsw's pairs of u8 x s8 saturate int16)
    else:
        _check_avx2()
    return fmt


def _blocks_in_pairs(builder, nb, visit):
    """visit(b, chain) for the nb blocks: two per trip into chains 0 and 1 (one FMA chain per block
    is latency-bound), an odd last block into chain 0."""
    with cgutils.for_range(builder, builder.lshr(nb, _c64(1))) as loop:
        b0 = builder.shl(loop.index, _c64(1))
        visit(b0, 0)
        visit(builder.add(b0, _c64(1)), 1)
    with builder.if_then(builder.trunc(nb, ir.IntType(1))):
        visit(builder.sub(nb, _c64(1)), 0)


def _r16_arrays(context, builder, signature, args, num_x):
    """(w, s, activation rows, their xg rows, outputs) data pointers of an r16_dot / r16_dot4 call."""
    arrays = [context.make_array(t)(context, builder, v) if isinstance(t, types.Array) else None
              for t, v in zip(signature.args, args)]
    return (arrays, arrays[0].data, arrays[1].data, [a.data for a in arrays[2:2 + num_x]],
            [a.data for a in arrays[2 + num_x:2 + 2 * num_x]], [a.data for a in arrays[3 + 2 * num_x:]])


def _r16_nibble_args(context, builder, signature, args, num_x):
    """An int4 / nvfp4 r16_dot call's pointers (as _r16_arrays), then bpg, rows, K/2, the scale
    columns and K/32."""
    arrays, wp0, sp0, qps, xgps, outps = _r16_arrays(context, builder, signature, args, num_x)
    bpg = context.cast(builder, args[2 + 2 * num_x], signature.args[2 + 2 * num_x], types.int64)
    rows, half_k = cgutils.unpack_tuple(builder, arrays[0].shape)
    groups = cgutils.unpack_tuple(builder, arrays[1].shape)[1]
    return wp0, sp0, qps, xgps, outps, bpg, rows, half_k, groups, builder.lshr(half_k, _c64(4))


def _nv_row_mult(builder, sp, half_k, first, lanes):
    """The nvfp4 slab's row factors first .. first + lanes - 1 (after its K/16 x 16 scale bytes) as
    multipliers: f (f > 0) or the reciprocal 1 / -f, times 2^7 (the e4m3 / 2^8 scales, 2 e2m1 codes)."""
    vf = ir.VectorType(_F32, lanes)
    off = builder.add(builder.shl(builder.lshr(half_k, _c64(3)), _c64(4)), _c64(4 * first))
    f = builder.load(builder.bitcast(builder.gep(sp, [off]), vf.as_pointer()), align=1)
    mult = builder.select(builder.fcmp_ordered(">", f, ir.Constant(vf, None)), f,
                          builder.fdiv(ir.Constant(vf, [1.0] * lanes), builder.fneg(f)))
    return builder.fmul(mult, ir.Constant(vf, [128.0] * lanes))


def _r16_codegen(num_x, fmt):
    """Codegen of r16_dot / r16_dot4: rows in whole slabs of 16 x num_x activations -> out[j][0:rows],
    one slab after the other in one loop (no call per slab). fmt "int4": the nibbles as codes q + 8,
    the offset 8 s_x sum(q) per block, fp16 scales per group of bpg blocks. fmt "nvfp4": the nibbles
    through the 16-entry table to 2 e2m1 + 12 (u8 in [0, 24]), the offset 12 s_x sum(q) per group
    of 16 columns, e4m3 scales per group, the row factors at the end (section notes)."""
    nv = fmt == "nvfp4"

    def codegen(context, builder, signature, args):
        wp0, sp0, qps, xgps, outps, bpg, rows, half_k, groups, nb = _r16_nibble_args(context, builder, signature,
                                                                                 args, num_x)
        v64b, v16i, v16f = ir.VectorType(_I8, 64), ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)
        v16h, v16b = ir.VectorType(_I16, 16), ir.VectorType(_I8, 16)
        m15, s4 = ir.Constant(v64b, [15] * 64), ir.Constant(v64b, [4] * 64)
        zero = ir.Constant(v16i, None)
        accs = [[cgutils.alloca_once(builder, v16f) for _ in range(num_x)] for _ in range(2)]

        def bcast(qp, off):        # 4 activation bytes splat over the 16 dword lanes
            p = builder.bitcast(builder.gep(qp, [off]), _I32.as_pointer())
            return builder.bitcast(_splat(builder, builder.load(p, align=1), 16), v64b)

        def codes(v):
            if nv:
                return _nv_lookup512(builder, v)
            return builder.and_(v, m15), builder.and_(builder.lshr(v, s4), m15)

        def chunks(wp, b, cs):
            """int32 sums over chunks cs of block b, per activation (two chains added)."""
            base = builder.shl(b, _c64(8))
            ia = [[zero, zero] for _ in range(num_x)]
            for c in cs:
                off = builder.add(base, _c64(64 * c))
                _prefetch(builder, wp, off)
                lo, hi = codes(_vload(builder, wp, off, v64b, 1))
                xo = builder.add(builder.shl(b, _c64(5)), _c64(8 * c))
                xo4 = builder.add(xo, _c64(4))
                for j in range(num_x):
                    ia[j][0] = _dpbusd(builder, ia[j][0], lo, bcast(qps[j], xo))
                    ia[j][1] = _dpbusd(builder, ia[j][1], hi, bcast(qps[j], xo4))
            return [builder.sitofp(builder.add(a, c), v16f) for a, c in ia]

        def accumulate(aset, fs, b, corr_idx, sw):
            for j in range(num_x):
                xs = _splat(builder, builder.load(builder.gep(xgps[j], [b])), 16)
                xc = _splat(builder, builder.load(builder.gep(xgps[j], [builder.add(nb, corr_idx)])), 16)
                t = builder.fsub(builder.fmul(fs[j], xs, flags=_FAST), xc, flags=_FAST)
                a = accs[aset][j]
                builder.store(builder.fadd(builder.load(a), builder.fmul(t, sw, flags=_FAST), flags=_FAST), a)

        def block(wp, sp, b, sidx, aset):
            if nv:        # two groups of 16 columns: chunks 0-1 and 2-3, each its e4m3 scales and offset
                for half in range(2):
                    g = builder.add(builder.shl(b, _c64(1)), _c64(half))
                    fs = chunks(wp, b, (2 * half, 2 * half + 1))
                    sw = _e4m3_half(builder, _vload(builder, sp, builder.shl(g, _c64(4)), v16b, 1), 16)
                    accumulate(aset, fs, b, g, sw)
            else:
                fs = chunks(wp, b, range(4))
                sw = _half_to_float(builder, _vload(builder, sp, builder.shl(sidx, _c64(4)), v16h, 2), 16)
                accumulate(aset, fs, b, b, sw)

        def walk(wp, sp, sidx_of):
            _blocks_in_pairs(builder, nb, lambda b, chain: block(wp, sp, b, sidx_of(b), chain))

        with cgutils.for_range(builder, builder.lshr(rows, _c64(4))) as slabs:
            slab = slabs.index
            wp = builder.gep(wp0, [builder.mul(slab, builder.shl(half_k, _c64(4)))])
            sp = builder.gep(sp0, [builder.mul(slab, builder.shl(groups, _c64(4)))])
            for aset in accs:
                for a in aset:
                    builder.store(ir.Constant(v16f, None), a)
            if nv:
                walk(wp, sp, lambda b: b)
                mult = _nv_row_mult(builder, sp, half_k, 0, 16)
            else:
                with builder.if_else(builder.icmp_unsigned("==", bpg, _c64(1))) as (g32, wider):
                    with g32:
                        walk(wp, sp, lambda b: b)
                    with wider:
                        walk(wp, sp, lambda b: builder.udiv(b, bpg))
            for j in range(num_x):
                r = builder.fadd(builder.load(accs[0][j]), builder.load(accs[1][j]), flags=_FAST)
                if nv:
                    r = builder.fmul(r, mult, flags=_FAST)
                op = builder.gep(outps[j], [builder.shl(slab, _c64(4))])
                builder.store(r, builder.bitcast(op, v16f.as_pointer()), align=4)
        return context.get_dummy_value()

    return codegen


# fp8 (e4m3, fp32 scale per block of 32 bpg columns) in the same slabs of 16 rows (scales int32: the
# fp32 bits, [G, 16] per slab). Per 4-column unit one 64-byte chunk (_buffers._FP8_SLOT): the two
# vpermi2b + vpternlog table decode of the row form (`_e4m3_bf16_bytes`), then the byte unpacks
# leave row r's columns (4u, 4u + 1) in dword lane r of the first word vector and (4u + 2, 4u + 3)
# in the second, so each is one vdpbf16ps against a dword broadcast of the natural-order bf16
# activations (a memory operand): no activation vector, no per-row reduction, and one FMA with the
# 16 rows' block scales per block instead of one per row. Exact weights as in the row form; the
# only rounding the activations' to bf16 (prep_bf16_rows, as bf16 weights take them).


def _r16_fp8_codegen(num_x):
    """Codegen of r16_dot / r16_dot4 for fp8 slabs: w uint8 [R, K], s int32 [R, G], x_j uint16 [K]
    (bf16 bits, natural order), g_j (unused), bpg (block = 32 bpg columns), out_j [R]."""
    def codegen(context, builder, signature, args):
        arrays, wp0, sp0, xps, _, outps = _r16_arrays(context, builder, signature, args, num_x)
        bpg = context.cast(builder, args[2 + 2 * num_x], signature.args[2 + 2 * num_x], types.int64)
        rows, k = cgutils.unpack_tuple(builder, arrays[0].shape)
        groups = cgutils.unpack_tuple(builder, arrays[1].shape)[1]
        v64b, v32s, v16f = ir.VectorType(_I8, 64), ir.VectorType(_I16, 32), ir.VectorType(_F32, 16)
        v32bf = ir.VectorType(_BFloat(), 32)
        dp = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16f, [v16f, v32bf, v32bf]),
                                            "llvm.x86.avx512bf16.dpbf16ps.512")
        sh_lo = ir.Constant(ir.VectorType(_I32, 64), _UNPACK_LO)
        sh_hi = ir.Constant(ir.VectorType(_I32, 64), _UNPACK_HI)
        upb = builder.shl(bpg, _c64(3))                       # 4-column units per block: 32 bpg / 4
        nunits = builder.lshr(k, _c64(2))
        zero = ir.Constant(v16f, None)
        accs = [cgutils.alloca_once(builder, v16f) for _ in range(num_x)]
        parts = [[cgutils.alloca_once(builder, v16f) for _ in range(4)] for _ in range(num_x)]

        def bcast(xp, u, half):     # bf16 activations 4u + 2 half, + 1 as one dword over 16 lanes
            col = builder.add(builder.shl(u, _c64(2)), _c64(2 * half))
            p = builder.bitcast(builder.gep(xp, [col]), _I32.as_pointer())
            return builder.bitcast(_splat(builder, builder.load(p, align=2), 16), v32bf)

        def units(wp, us):
            for i, u in enumerate(us):
                off = builder.shl(u, _c64(6))
                _prefetch(builder, wp, off)
                hi, lo = _e4m3_bf16_bytes(builder, _vload(builder, wp, off, v64b, 1))
                ws = [builder.bitcast(builder.bitcast(builder.shuffle_vector(hi, lo, sh), v32s), v32bf)
                      for sh in (sh_lo, sh_hi)]
                for ps, xp in zip(parts, xps):
                    for h in range(2):
                        part = ps[2 * i + h]
                        builder.store(builder.call(dp, [builder.load(part), ws[h], bcast(xp, u, h)]), part)

        with cgutils.for_range(builder, builder.lshr(rows, _c64(4))) as slabs:
            slab = slabs.index
            wp = builder.gep(wp0, [builder.mul(slab, builder.shl(k, _c64(4)))])
            sp = builder.bitcast(builder.gep(sp0, [builder.mul(slab, builder.shl(groups, _c64(4)))]), _F32.as_pointer())
            for a in accs:
                builder.store(zero, a)
            with cgutils.for_range(builder, groups) as grp:
                g = grp.index
                u0 = builder.mul(g, upb)
                n = builder.sub(builder.select(builder.icmp_unsigned("<", builder.add(u0, upb), nunits),
                                               builder.add(u0, upb), nunits), u0)
                for ps in parts:
                    for part in ps:
                        builder.store(zero, part)
                with cgutils.for_range(builder, builder.lshr(n, _c64(1))) as pair:
                    u = builder.add(u0, builder.shl(pair.index, _c64(1)))
                    units(wp, [u, builder.add(u, _c64(1))])
                with builder.if_then(builder.trunc(n, ir.IntType(1))):
                    units(wp, [builder.sub(builder.add(u0, n), _c64(1))])
                sv = _vload(builder, sp, builder.shl(g, _c64(4)), v16f, 4)
                for a, ps in zip(accs, parts):
                    tot = builder.fadd(builder.fadd(builder.load(ps[0]), builder.load(ps[1]), flags=_FAST),
                                       builder.fadd(builder.load(ps[2]), builder.load(ps[3]), flags=_FAST), flags=_FAST)
                    builder.store(builder.fadd(builder.load(a), builder.fmul(tot, sv, flags=_FAST), flags=_FAST), a)
            for j in range(num_x):
                op = builder.gep(outps[j], [builder.shl(slab, _c64(4))])
                builder.store(builder.load(accs[j]), builder.bitcast(op, v16f.as_pointer()), align=4)
        return context.get_dummy_value()

    return codegen


# int8 (one fp32 scale per row) in the same slabs (weights int8, scales int32: the 16 rows' fp32
# scale bits per slab): per 4-column unit one 64-byte chunk, byte 4r + j = row r's column 4u + j,
# so one vpdpbusd against the dword broadcast of q[4u .. 4u + 3] sums 16 rows' 4 products. vpdpbusd
# multiplies unsigned by signed bytes: the weights are flipped to w + 128 (one xor per chunk) and
# 128 s_x sum(q) is removed per 32-column block (`prep_q8r_rows_as(x, 32, 128)`), as int4 removes its
# nibble offset; the row scales multiply once per slab. |a block's sum| <= 32 * 255 * 127.


def _r16_i8_codegen(num_x):
    """Codegen of r16_dot / r16_dot4 for int8 slabs: w int8 [R, K], s int32 [R, 1], x_j int8 [K]
    (natural order), g_j float32 [2 K/32] (s_x per block, then 128 s_x sum(q) per block), out_j [R]."""
    def codegen(context, builder, signature, args):
        arrays, wp0, sp0, qps, xgps, outps = _r16_arrays(context, builder, signature, args, num_x)
        rows, k = cgutils.unpack_tuple(builder, arrays[0].shape)
        nb = builder.lshr(k, _c64(5))
        v64b, v16i, v16f = ir.VectorType(_I8, 64), ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)
        flip = ir.Constant(v64b, [-128] * 64)
        zero = ir.Constant(v16i, None)
        accs = [[cgutils.alloca_once(builder, v16f) for _ in range(num_x)] for _ in range(2)]

        def bcast(qp, off):
            p = builder.bitcast(builder.gep(qp, [off]), _I32.as_pointer())
            return builder.bitcast(_splat(builder, builder.load(p, align=1), 16), v64b)

        def block(wp, b, aset):
            base = builder.shl(b, _c64(9))                      # 8 chunks of 64 bytes per 32 columns
            ia = [[zero, zero] for _ in range(num_x)]
            for c in range(8):
                off = builder.add(base, _c64(64 * c))
                _prefetch(builder, wp, off)
                u = builder.xor(_vload(builder, wp, off, v64b, 1), flip)
                xo = builder.add(builder.shl(b, _c64(5)), _c64(4 * c))
                for j in range(num_x):
                    ia[j][c % 2] = _dpbusd(builder, ia[j][c % 2], u, bcast(qps[j], xo))
            for j in range(num_x):
                f = builder.sitofp(builder.add(ia[j][0], ia[j][1]), v16f)
                xs = _splat(builder, builder.load(builder.gep(xgps[j], [b])), 16)
                xc = _splat(builder, builder.load(builder.gep(xgps[j], [builder.add(nb, b)])), 16)
                a = accs[aset][j]
                builder.store(builder.fadd(builder.load(a), builder.fsub(builder.fmul(f, xs, flags=_FAST), xc,
                                                                       flags=_FAST), flags=_FAST), a)

        with cgutils.for_range(builder, builder.lshr(rows, _c64(4))) as slabs:
            slab = slabs.index
            wp = builder.gep(wp0, [builder.mul(slab, builder.shl(k, _c64(4)))])
            sp = builder.bitcast(builder.gep(sp0, [builder.shl(slab, _c64(4))]), _F32.as_pointer())
            for aset in accs:
                for a in aset:
                    builder.store(ir.Constant(v16f, None), a)
            _blocks_in_pairs(builder, nb, lambda b, chain: block(wp, b, chain))
            sv = _vload(builder, sp, _c64(0), v16f, 4)
            for j in range(num_x):
                r = builder.fadd(builder.load(accs[0][j]), builder.load(accs[1][j]), flags=_FAST)
                op = builder.gep(outps[j], [builder.shl(slab, _c64(4))])
                builder.store(builder.fmul(r, sv, flags=_FAST), builder.bitcast(op, v16f.as_pointer()), align=4)
        return context.get_dummy_value()

    return codegen


# The AVX2 form of the int4 / nvfp4 slab dot (CPUs without AVX-512 VNNI: Zen 3, Intel client
# cores; FREETOKEN_SIMD=avx2): the same slabs and activations, each 64-byte chunk taken as two
# 32-byte halves — rows 0-7 (bytes 0-31) and rows 8-15 (bytes 32-63), dword lane r of a half
# holding its row r's four columns. Per half and chunk: the nibbles (and / shift / and, nvfp4: two
# vpshufb through the e2m1 table), two vpmaddubsw against the dword broadcasts of the chunk's 4 + 4
# activation codes, summed in int16 over the block (int4: 8 products of pairs, |sum| <= 8 x 2 x 15
# x 127 = 30480) or the group of 16 columns (nvfp4: 4, <= 4 x 2 x 24 x 127 = 24384), then one
# vpmaddwd with ones to the 8 rows' int32 sums and the row form's per-block scaling on 8 lanes
# (`accumulate`), no per-row reduction. One activation: both halves per chunk (the broadcasts
# shared, one prefetch per 64 bytes, two 8-lane FMA chains per half); four: one half after the
# other over the slab (fewer live registers: AVX2 has 16), the second pass reading the slab from
# L1 / L2.


def _r16_avx2_codegen(num_x, fmt):
    """Codegen of r16_dot / r16_dot4 for int4 / nvfp4 slabs on AVX2 (same arguments as _r16_codegen)."""
    nv = fmt == "nvfp4"

    def codegen(context, builder, signature, args):
        wp0, sp0, qps, xgps, outps, bpg, rows, half_k, groups, nb = _r16_nibble_args(context, builder, signature,
                                                                                 args, num_x)
        v32b, v16s, v8f = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_F32, 8)
        ubsw, wd = _pmadd_intrinsics(builder)
        ones = ir.Constant(v16s, [1] * 16)
        m15, s4 = ir.Constant(v32b, [15] * 32), ir.Constant(v32b, [4] * 32)
        together = num_x == 1
        nsets = 2 if together else 1
        accs = [[[cgutils.alloca_once(builder, v8f) for _ in range(num_x)] for _ in range(nsets)] for _ in range(2)]

        def bcast(qp, off):        # 4 activation bytes splat over the 8 dword lanes
            p = builder.bitcast(builder.gep(qp, [off]), _I32.as_pointer())
            return builder.bitcast(_splat(builder, builder.load(p, align=1), 8), v32b)

        def codes(v):
            if nv:
                return _nv_lookup(builder, v, 32)
            return builder.and_(v, m15), builder.and_(builder.lshr(v, s4), m15)

        def chunks(wp, b, cs, hs):
            """int32 sums [h][j] over chunks cs of block b for halves hs (int16 within the span)."""
            base = builder.shl(b, _c64(8))
            s16 = {(h, j): None for h in hs for j in range(num_x)}
            for c in cs:
                off = builder.add(base, _c64(64 * c))
                if hs[0] == 0:
                    _prefetch(builder, wp, off)
                xo = builder.add(builder.shl(b, _c64(5)), _c64(8 * c))
                bx = [(bcast(qp, xo), bcast(qp, builder.add(xo, _c64(4)))) for qp in qps]
                for h in hs:
                    lo, hi = codes(_vload(builder, wp, builder.add(off, _c64(32 * h)), v32b, 1))
                    for j, (bl, bh) in enumerate(bx):
                        t = builder.add(builder.call(ubsw, [lo, bl]), builder.call(ubsw, [hi, bh]))
                        s16[h, j] = t if s16[h, j] is None else builder.add(s16[h, j], t)
            return {key: builder.sitofp(builder.call(wd, [v, ones]), v8f) for key, v in s16.items()}

        def accumulate(aset, fs, hs, b, corr_idx, sws):
            for j in range(num_x):
                xs = _splat(builder, builder.load(builder.gep(xgps[j], [b])), 8)
                xc = _splat(builder, builder.load(builder.gep(xgps[j], [builder.add(nb, corr_idx)])), 8)
                for h in hs:
                    t = builder.fsub(builder.fmul(fs[h, j], xs, flags=_FAST), xc, flags=_FAST)
                    a = accs[h][aset][j]
                    builder.store(builder.fadd(builder.load(a), builder.fmul(t, sws[h], flags=_FAST), flags=_FAST), a)

        def block(wp, sp, b, sidx, aset, hs):
            if nv:        # two groups of 16 columns: chunks 0-1 and 2-3, each its e4m3 scales and offset
                for half in range(2):
                    g = builder.add(builder.shl(b, _c64(1)), _c64(half))
                    fs = chunks(wp, b, (2 * half, 2 * half + 1), hs)
                    sws = {h: _e4m3_half(builder, _vload(builder, sp, builder.add(builder.shl(g, _c64(4)), _c64(8 * h)),
                                                         ir.VectorType(_I8, 8), 1), 8) for h in hs}
                    accumulate(aset, fs, hs, b, g, sws)
            else:
                fs = chunks(wp, b, range(4), hs)
                sws = {h: _half_to_float(builder, _vload(builder, sp, builder.add(builder.shl(sidx, _c64(4)), _c64(8 * h)),
                                                         ir.VectorType(_I16, 8), 2), 8) for h in hs}
                accumulate(aset, fs, hs, b, b, sws)

        def walk(wp, sp, sidx_of, hs):
            if nsets == 1:
                with cgutils.for_range(builder, nb) as loop:
                    block(wp, sp, loop.index, sidx_of(loop.index), 0, hs)
                return
            _blocks_in_pairs(builder, nb, lambda b, chain: block(wp, sp, b, sidx_of(b), chain, hs))

        with cgutils.for_range(builder, builder.lshr(rows, _c64(4))) as slabs:
            slab = slabs.index
            wp = builder.gep(wp0, [builder.mul(slab, builder.shl(half_k, _c64(4)))])
            sp = builder.gep(sp0, [builder.mul(slab, builder.shl(groups, _c64(4)))])
            for hs in ([0, 1],) if together else ([0], [1]):
                for h in hs:
                    for aset in accs[h]:
                        for a in aset:
                            builder.store(ir.Constant(v8f, None), a)
                if nv:
                    walk(wp, sp, lambda b: b, hs)
                else:
                    with builder.if_else(builder.icmp_unsigned("==", bpg, _c64(1))) as (g32, wider):
                        with g32:
                            walk(wp, sp, lambda b: b, hs)
                        with wider:
                            walk(wp, sp, lambda b: builder.udiv(b, bpg), hs)
                for h in hs:
                    mult = _nv_row_mult(builder, sp, half_k, 8 * h, 8) if nv else None
                    for j in range(num_x):
                        r = builder.load(accs[h][0][j])
                        if nsets == 2:
                            r = builder.fadd(r, builder.load(accs[h][1][j]), flags=_FAST)
                        if nv:
                            r = builder.fmul(r, mult, flags=_FAST)
                        op = builder.gep(outps[j], [builder.add(builder.shl(slab, _c64(4)), _c64(8 * h))])
                        builder.store(r, builder.bitcast(op, v8f.as_pointer()), align=4)
        return context.get_dummy_value()

    return codegen


def _r16_codegen_for(num_x, fmt):
    if fmt == "int8":
        return _r16_i8_codegen(num_x)
    if fmt == "fp8":
        return _r16_fp8_codegen(num_x)
    return _r16_codegen(num_x, fmt) if HAS_AVX512 else _r16_avx2_codegen(num_x, fmt)


@intrinsic
def r16_dot(typingctx, w, s, xq, xg, bpg, out):
    """out[0:R] = R int4 or nvfp4 rows in whole slabs (w uint8 [R, K/2], s [R, G] as r16 holds them:
    int16 for int4, int8 for nvfp4; R % 16 == 0, both C-contiguous) . the int8 activation xq [K]
    (natural order, K % 32 == 0), xg = prep_q8r_rows' (int4) / prep_q8r_nv_rows' (nvfp4) s_x and
    offsets; bpg = int4's group size / 32 (nvfp4: unused). AVX-512 VNNI, or the AVX2 form
    (_r16_avx2_codegen) where this process runs AVX2; int8 slabs AVX-512 VNNI only, fp8 AVX512-BF16 + VBMI."""
    fmt = _check_r16(w, s, (xq,), (xg,), (out,))
    return types.void(w, s, xq, xg, bpg, out), _r16_codegen_for(1, fmt)


@intrinsic
def r16_dot4(typingctx, w, s, x0, x1, x2, x3, g0, g1, g2, g3, bpg, o0, o1, o2, o3):
    """r16_dot with four activations at once (each slab read once), oj[0:R] each."""
    fmt = _check_r16(w, s, (x0, x1, x2, x3), (g0, g1, g2, g3), (o0, o1, o2, o3))
    return types.void(w, s, x0, x1, x2, x3, g0, g1, g2, g3, bpg, o0, o1, o2, o3), _r16_codegen_for(4, fmt)


# --- vector exp (the decode softmax) ---------------------------------------------------------------
#
# numba's np.exp is a scalar libm call per element (no SVML here): ~14 cycles each, and decode
# takes ~50K of them per token (16 heads x context per layer, plus the experts' SiLU). Here: x
# clamped to [-87, 88] (so 2^n stays a normal float), n = round(x log2 e), r = x - n ln 2 in two
# parts (Cody-Waite), e^r by Cephes' expf polynomial, times 2^n built from its exponent bits;
# 8 lanes per step, the tail as 1-lane vectors of the same code. Within 4e-7 relative (~3 ulp) of exp for
# x >= -87 on targets with FMA (tests/test_kernels_exp.py; ~11 ulp without), below that exact 0 is
# replaced by e^-87 ~ 1.6e-38, which a softmax sum cannot tell from 0. A softmax helper, not a
# general exp: the clamps turn NaN and +inf into e^88 and -inf into e^-87.

_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _vexp(builder, x, lanes):
    """e^x for a <lanes x float> value."""
    vf = ir.VectorType(_F32, lanes)
    vi = ir.VectorType(_I32, lanes)

    def c(v):
        return ir.Constant(vf, [v] * lanes)

    mod = builder.module
    fmin = cgutils.get_or_insert_function(mod, ir.FunctionType(vf, [vf, vf]), f"llvm.minnum.v{lanes}f32")
    fmax = cgutils.get_or_insert_function(mod, ir.FunctionType(vf, [vf, vf]), f"llvm.maxnum.v{lanes}f32")
    x = builder.call(fmax, [builder.call(fmin, [x, c(88.0)]), c(-87.0)])
    # n = round(x log2 e): x log2 e + 128.5 is in [3, 256), so truncating it is flooring it (llvm.rint
    # would be a libm call per lane on x86 targets without SSE4.1; adding and removing 1.5 * 2^23 was
    # folded away under numba's fast-math)
    ni = builder.sub(builder.fptosi(builder.fadd(builder.fmul(x, c(1.44269504088896341), flags=_FAST), c(128.5),
                                                 flags=_FAST), vi), ir.Constant(vi, [128] * lanes))
    n = builder.sitofp(ni, vf)
    r = builder.fsub(x, builder.fmul(n, c(0.693359375)))             # ln 2 = 0.693359375 - 2.12194440e-4
    r = builder.fsub(r, builder.fmul(n, c(-2.12194440e-4)))
    p = c(_EXP_POLY[0])
    for coef in _EXP_POLY[1:]:
        p = builder.fadd(builder.fmul(p, r, flags=_FAST), c(coef), flags=_FAST)
    p = builder.fadd(builder.fadd(builder.fmul(p, builder.fmul(r, r, flags=_FAST), flags=_FAST), r, flags=_FAST),
                     c(1.0), flags=_FAST)
    bits = builder.shl(builder.add(ni, ir.Constant(vi, [127] * lanes)), ir.Constant(vi, [23] * lanes))
    return builder.fmul(p, builder.bitcast(bits, vf), flags=_FAST)


def _exp_shift_sum_codegen(context, builder, signature, args):
    arr = context.make_array(signature.args[0])(context, builder, args[0])
    xp = arr.data
    n = cgutils.unpack_tuple(builder, arr.shape)[0]
    m = context.cast(builder, args[1], signature.args[1], types.float32)
    total = cgutils.alloca_once_value(builder, ir.Constant(ir.VectorType(_F32, 8), None))
    tail = cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0))
    for lanes, count, first in ((8, builder.lshr(n, ir.Constant(_I64, 3)), None), (1, None, None)):
        vf = ir.VectorType(_F32, lanes)
        if lanes == 8:
            loop_n, start = count, ir.Constant(_I64, 0)
        else:
            start = builder.and_(n, ir.Constant(_I64, ~7))
            loop_n = builder.sub(n, start)
        with cgutils.for_range(builder, loop_n) as loop:
            off = builder.add(start, builder.mul(loop.index, ir.Constant(_I64, lanes)))
            ptr = builder.bitcast(builder.gep(xp, [off]), vf.as_pointer())
            e = _vexp(builder, builder.fsub(builder.load(ptr, align=4), _splat(builder, m, lanes), flags=_FAST), lanes)
            builder.store(e, ptr, align=4)
            if lanes == 8:
                builder.store(builder.fadd(builder.load(total), e, flags=_FAST), total)
            else:
                builder.store(builder.fadd(builder.load(tail), builder.extract_element(e, ir.Constant(_I32, 0)),
                                           flags=_FAST), tail)
    return builder.fadd(_hsum(builder, builder.load(total)), builder.load(tail), flags=_FAST)


@intrinsic
def exp_shift_sum(typingctx, x, m):
    """x[i] = exp(x[i] - m) in place for a contiguous 1-D float32 array; returns the sum (float32):
    a softmax's numerator with m its max (finite inputs; see the section notes for the clamps)."""
    if not (isinstance(x, types.Array) and x.ndim == 1 and x.dtype == types.float32 and x.layout == "C"):
        raise TypeError("exp_shift_sum needs a contiguous 1-D float32 array")
    return types.float32(x, m), _exp_shift_sum_codegen


def _swiglu_codegen(context, builder, signature, args):
    gp, up, op = (context.make_array(t)(context, builder, v).data for t, v in zip(signature.args, args))
    n = cgutils.unpack_tuple(builder, context.make_array(signature.args[2])(context, builder, args[2]).shape)[0]
    for lanes in (8, 1):
        vf = ir.VectorType(_F32, lanes)
        start = ir.Constant(_I64, 0) if lanes == 8 else builder.and_(n, ir.Constant(_I64, ~7))
        count = builder.lshr(n, ir.Constant(_I64, 3)) if lanes == 8 else builder.sub(n, start)
        with cgutils.for_range(builder, count) as loop:
            off = builder.add(start, builder.mul(loop.index, ir.Constant(_I64, lanes)))
            g = _vload(builder, gp, off, vf, 4)
            u = _vload(builder, up, off, vf, 4)
            den = builder.fadd(_vexp(builder, builder.fneg(g), lanes), ir.Constant(vf, [1.0] * lanes), flags=_FAST)
            h = builder.fmul(builder.fdiv(g, den, flags=_FAST), u, flags=_FAST)
            builder.store(h, builder.bitcast(builder.gep(op, [off]), vf.as_pointer()), align=4)
    return context.get_dummy_value()


@intrinsic
def swiglu(typingctx, g, u, out):
    """out[i] = silu(g[i]) * u[i] = g[i] / (1 + e^-g[i]) * u[i] for i < len(out): contiguous 1-D
    float32 arrays, g and u at least as long as out (out may be g). 8 lanes of the softmax's vector
    exp (its clamps: e^-g is e^88 below g = -88, so silu there is ~g * 6e-39, not 0); numba's np.exp
    is a scalar libm call per element (docs/kernels.md, "Path tags and vector SwiGLU")."""
    for a in (g, u, out):
        if not (isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.float32 and a.layout == "C"):
            raise TypeError("swiglu needs contiguous 1-D float32 arrays")
    return types.none(g, u, out), _swiglu_codegen


# --- fp8 (e4m3) and nvfp4 (e2m1) weights x fp32 activations ---------------------------------------
#
# Both keep the checkpoint's values exactly: an e4m3 byte becomes its fp32 value by bit placement
# (7 magnitude bits at fp32's exponent/mantissa boundary, the sign at bit 31, times 2^120 =
# 2^(127 - 7): exact for normals and subnormals; that multiply carries no fast-math flags so it is
# never reassociated into the activation product). An nvfp4 byte's two e2m1 nibbles become 2 x
# their value, the integers {0, 1, 2, 3, 4, 6, 8, 12} with the sign of bit 3, by one table shuffle
# each (pshufb, SSSE3: x86 only); the group's e4m3 scale is decoded by bit placement with the 1/2
# folded into the 2^119 rebase, and (2 x e2m1) * (scale / 2) is exact in fp32 (<= 8 significant
# bits). Activations stay fp32, as they are. The products with the activations carry only
# `contract` (FMA): with full fast-math LLVM rewrote (v * 2^120) * x as v * (2^120 * x), which
# overflows for |x| > 2^8 (seen in the assembly); the sums keep full fast-math.

_CONTRACT = ("contract",)

def _e4m3_to_float(builder, b8, lanes, rebase):
    """<lanes x i8> e4m3 bytes -> <lanes x float> value * rebase / 2^120 (rebase = 2^120: the value)."""
    vi, vf = ir.VectorType(_I32, lanes), ir.VectorType(_F32, lanes)
    # sign-extended and shifted 20 up: bit 31 is the sign, bits 20-26 the magnitude, bits 27-30
    # copies of the sign (cleared): 3 integer ops instead of 6
    bits = builder.and_(builder.shl(builder.sext(b8, vi), ir.Constant(vi, [20] * lanes)),
                        ir.Constant(vi, [0x87FFFFFF - (1 << 32)] * lanes))
    return builder.fmul(builder.bitcast(bits, vf), ir.Constant(vf, [rebase] * lanes))   # no fast flags: exact


HAS_AVX512VBMI = _target_has("avx512vbmi")


def _fp8_bf16_tables():
    """(hi, lo): the high / low byte of the bf16 bits of each e4m3 magnitude 0..127, as the value
    _dots.e4m3_value gives (0x7f, e4m3fn's NaN, reads as 480 there too)."""
    import numpy as np

    mags = np.arange(128, dtype=np.uint32)
    normal = ((mags << 20) + (120 << 23)).view(np.float32)
    value = np.where(mags >= 8, normal, mags.astype(np.float32) * np.float32(2.0 ** -9)).astype(np.float32)
    bits = (value.view(np.uint32) >> 16).astype(np.uint16)
    assert np.array_equal((bits.astype(np.uint32) << 16).view(np.float32), value)   # exact in bf16
    return [int(b >> 8) for b in bits], [int(b & 0xFF) for b in bits]


_FP8_HI, _FP8_LO = _fp8_bf16_tables()
# word j of the unpacklo (unpackhi) result = byte 16 (j // 8) + j % 8 (+ 8) of the 64 loaded
_UNPACK_LO = [i for L in range(4) for p in range(8) for i in (64 + 16 * L + p, 16 * L + p)]
_UNPACK_HI = [i for L in range(4) for p in range(8) for i in (64 + 16 * L + 8 + p, 16 * L + 8 + p)]


def _c8(vals):
    return ir.Constant(ir.VectorType(_I8, len(vals)), [v - 256 if v > 127 else v for v in vals])


def _e4m3_bf16_bytes(builder, b):
    """<64 x i8> e4m3 bytes -> (high, low) bytes of their exact bf16 bits: two vpermi2b on the
    128-entry tables (AVX512-VBMI; the index's bit 7 ignored), the sign put back by one vpternlog."""
    v64b = ir.VectorType(_I8, 64)
    perm = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v64b, [v64b, v64b, v64b]),
                                          "llvm.x86.avx512.vpermi2var.qi.512")
    hi = builder.or_(builder.call(perm, [_c8(_FP8_HI[:64]), b, _c8(_FP8_HI[64:])]), builder.and_(b, _c8([0x80] * 64)))
    return hi, builder.call(perm, [_c8(_FP8_LO[:64]), b, _c8(_FP8_LO[64:])])


# The 4 x 4 transpose of the 64 bytes' 4-byte chunks (chunk 4L + q <- chunk 4q + L: one vpermd),
# after which the byte and word unpacks (within 128-bit lanes) leave the 64 weights in their order.
_CHUNK_T = [16 * q + 4 * L + p for L in range(4) for q in range(4) for p in range(4)]
_WORDS_TO_F32 = [[i for L in range(4) for p in range(4) for i in (0, 32 + 8 * L + 4 * h + p)] for h in range(2)]


def _e4m3_f32x64(builder, b):
    """<64 x i8> e4m3 bytes -> four <16 x float> of their exact values, in order (weights 16q ..
    16q + 15 in vector q): the chunk transpose, the bf16 table lookup (`_e4m3_bf16_bytes`), the
    bytes unpacked into bf16 words and the words (with zero below) into fp32: 9 shuffle-port uops
    and one vpternlog per 64 weights, and no fp32 subnormal (e4m3's subnormals are normal fp32)."""
    v32s, vf = ir.VectorType(_I16, 32), ir.VectorType(_F32, 16)
    c32 = lambda v: ir.Constant(ir.VectorType(_I32, len(v)), v)       # noqa: E731
    hi, lo = _e4m3_bf16_bytes(builder, builder.shuffle_vector(b, b, c32(_CHUNK_T)))
    out = []
    for sh in (_UNPACK_LO, _UNPACK_HI):
        words = builder.bitcast(builder.shuffle_vector(hi, lo, c32(sh)), v32s)
        out += [builder.bitcast(builder.shuffle_vector(ir.Constant(v32s, None), words, c32(wd)), vf)
                for wd in _WORDS_TO_F32]
    return out


def _fp8_codegen(num_x, lanes=_LANES):
    """fp8 dot of one row with `num_x` activation rows. args: w u8 [K], s f32 [G], x_0.., bk
    (K and bk multiples of `lanes`; a partial last block of any multiple of it). With one
    activation row the 16-lane loop is latency-bound on its two add chains (~13 Gweights/s
    per core); 64 lanes keep 8 chains in flight."""
    def codegen(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:-1], args[:-1])]
        wp, sp = arrays[0].data, arrays[1].data
        xps = [a.data for a in arrays[2:2 + num_x]]
        ngroups = cgutils.unpack_tuple(builder, arrays[1].shape)[0]
        k = cgutils.unpack_tuple(builder, arrays[2].shape)[0]
        bk = context.cast(builder, args[-1], signature.args[-1], types.int64)
        v16f, v16b = ir.VectorType(_F32, lanes), ir.VectorType(_I8, lanes)
        accs = [cgutils.alloca_once_value(builder, ir.Constant(v16f, None)) for _ in range(num_x)]
        parts = [cgutils.alloca_once(builder, v16f) for _ in range(num_x)]
        with cgutils.for_range(builder, ngroups) as group:
            g = group.index
            start, n = _block_span(builder, g, bk, k)
            nvec = builder.udiv(n, ir.Constant(_I64, lanes))
            for part in parts:
                builder.store(ir.Constant(v16f, None), part)
            with cgutils.for_range(builder, nvec) as blk:
                off = builder.add(start, builder.mul(blk.index, ir.Constant(_I64, lanes)))
                v = _e4m3_to_float(builder, _vload(builder, wp, off, v16b, 1), lanes, 2.0 ** 120)
                for part, xp in zip(parts, xps):
                    t = builder.fmul(v, _vload(builder, xp, off, v16f, 4), flags=_CONTRACT)
                    builder.store(builder.fadd(builder.load(part), t, flags=_FAST), part)
            sgv = _splat(builder, builder.load(builder.gep(sp, [g])), lanes)
            for acc, part in zip(accs, parts):
                builder.store(builder.fadd(builder.load(acc), builder.fmul(sgv, builder.load(part), flags=_FAST),
                                           flags=_FAST), acc)
        res = [_hsum(builder, builder.load(acc)) for acc in accs]
        if num_x == 1:
            return res[0]
        return context.make_tuple(builder, signature.return_type, res)

    return codegen


def _check_fp8(w, s):
    if not (isinstance(w, types.Array) and w.dtype == types.uint8 and isinstance(s, types.Array)
            and s.dtype == types.float32):
        raise TypeError(f"fp8 rows are uint8 e4m3 bytes with float32 block scales, got {w}, {s}")


@intrinsic
def fp8_row_dot_v(typingctx, w, s, x, bk):
    """sum_b s[b] * sum_{j in block b} e4m3(w[j]) * x[j]; w u8 [K], s f32 [ceil(K/bk)], x f32 [K];
    K and bk multiples of 16 (_dots.fp8_dot checks, else the plain loop)."""
    _check_fp8(w, s)
    return types.float32(w, s, x, bk), _fp8_codegen(1)


@intrinsic
def fp8_row_dot4_v(typingctx, w, s, x0, x1, x2, x3, bk):
    """fp8_row_dot_v with four activation rows -> UniTuple(float32, 4)."""
    _check_fp8(w, s)
    return types.UniTuple(types.float32, 4)(w, s, x0, x1, x2, x3, bk), _fp8_codegen(4)


@intrinsic
def fp8_row_dot_v64(typingctx, w, s, x, bk):
    """fp8_row_dot_v for K and bk multiples of 64: 64 lanes (8 independent add chains)."""
    _check_fp8(w, s)
    return types.float32(w, s, x, bk), _fp8_codegen(1, 64)



# fp8 with the block scale folded into the decode (`_dots.fp8_dot`'s first choice: K and the block
# multiples of 64): per block b the rebase multiply becomes a multiply by s_b * 2^120 (a block with
# |s_b| >= 2^7, where that would overflow, multiplies by 2^120 and then by s_b: a branch per block,
# never taken in real checkpoints), and the products go straight into the accumulators:
# per 16 weights sign-extend, shift, mask, multiply, FMA, and no per-block partial sums to scale and
# reset (the loop above spends ~1.5 FP ops per 16 weights on those). 1.1x the 64-lane loop's speed
# in L2 (2048 x 256 rows, one thread). The weight times its scale is rounded once to fp32, where the
# loop above scales the block's sum; both are within fp32 rounding of the exact dot. Tried and not
# kept: decoding through fp16 bits (`_e4m3_half`, vcvtph2ps) in this loop: 1.2x slower with one
# activation row, even with four. A software prefetch per step (PF_DIST ahead) measured no gain
# from DRAM on Zen 5 (one thread, 64 MB rotated: 27.7 vs 29.4 GB/s median) but 1.6x on the Xeon 6
# VM of issue 45 (one thread, real expert widths: 0.45 -> 0.70-0.88 of the DRAM read, AVX-512 and
# AVX2 forms; docs/kernels.md), so it is there.
#
# On CPUs with AVX512-VBMI (Ice Lake, Zen 4 / 5, Sapphire Rapids) the decode is instead the exact
# table of the fp8 x bf16 dots below (`_e4m3_f32x64`: e4m3 -> bf16 bytes by two vpermi2b, then
# unpacked to fp32 in column order), times the block scale, one FMA per 16: the same products as the
# bit placement (the value times the scale, rounded once), but no e4m3 subnormal ever becomes an
# fp32 subnormal. With bit placement it does (exponent field 0) and the rebase multiply then takes
# a microcode assist on Intel cores (docs/kernels.md "fp8 by table on AVX512-VBMI").


def _fp8f_codegen(num_x):
    """Folded-scale fp8 dot of one row with `num_x` activations. Lanes per step: 64 with AVX-512
    (4 x 16-lane FMA chains); with AVX2's 16 vector registers, 32 (4 x 8-lane chains) for one
    activation row and 16 for four: at 64 the accumulators, the decoded weights and the scale
    spilled to the stack every step (measured on Zen 3, 2 threads: a [32768, 2048] matvec 12.4 ->
    16.0 GB/s at 32 lanes, the 64-token product 37 -> 44 GFLOP/s; docs/kernels.md)."""
    lanes = 64 if HAS_AVX512 else (32 if num_x == 1 else 16)
    table = HAS_AVX512 and HAS_AVX512VBMI

    def codegen(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:-1], args[:-1])]
        wp, sp = arrays[0].data, arrays[1].data
        xps = [a.data for a in arrays[2:2 + num_x]]
        ngroups = cgutils.unpack_tuple(builder, arrays[1].shape)[0]
        bk = context.cast(builder, args[-1], signature.args[-1], types.int64)
        vf, vb, vi = ir.VectorType(_F32, lanes), ir.VectorType(_I8, lanes), ir.VectorType(_I32, lanes)
        accs = [] if table else [cgutils.alloca_once_value(builder, ir.Constant(vf, None)) for _ in range(num_x)]
        acc16 = [[cgutils.alloca_once_value(builder, ir.Constant(ir.VectorType(_F32, 16), None)) for _ in range(4)]
                 for _ in range(num_x)] if table else []
        k = cgutils.unpack_tuple(builder, arrays[2].shape)[0]
        fabs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32]), "llvm.fabs.f32")
        with cgutils.for_range(builder, ngroups) as group:
            g = group.index
            start, n = _block_span(builder, g, bk, k)
            nvec = builder.udiv(n, ir.Constant(_I64, lanes))
            s_b = builder.load(builder.gep(sp, [g]))

            def table_loop():
                """The exact values by table (VBMI), each times the block scale, one FMA per 16."""
                sgv = _splat(builder, s_b, 16)
                with cgutils.for_range(builder, nvec) as blk:
                    off = builder.add(start, builder.mul(blk.index, ir.Constant(_I64, lanes)))
                    _prefetch(builder, wp, off)
                    for q, v in enumerate(_e4m3_f32x64(builder, _vload(builder, wp, off, ir.VectorType(_I8, 64), 1))):
                        v = builder.fmul(v, sgv, flags=_CONTRACT)
                        o = builder.add(off, ir.Constant(_I64, 16 * q))
                        for acc, xp in zip(acc16, xps):
                            t = builder.fmul(v, _vload(builder, xp, o, ir.VectorType(_F32, 16), 4), flags=_CONTRACT)
                            builder.store(builder.fadd(builder.load(acc[q]), t, flags=_FAST), acc[q])

            def block_loop(folded):
                sgv = _splat(builder, builder.fmul(s_b, ir.Constant(_F32, 2.0 ** 120)) if folded else s_b, lanes)
                with cgutils.for_range(builder, nvec) as blk:
                    off = builder.add(start, builder.mul(blk.index, ir.Constant(_I64, lanes)))
                    _prefetch(builder, wp, off)   # PF_DIST ahead: one per 64-byte line with AVX-512, 2-4 with AVX2
                    bits = builder.and_(builder.shl(builder.sext(_vload(builder, wp, off, vb, 1), vi),
                                                    ir.Constant(vi, [20] * lanes)),
                                        ir.Constant(vi, [0x87FFFFFF - (1 << 32)] * lanes))
                    v = builder.bitcast(bits, vf)
                    if not folded:        # |s| >= 2^7: s * 2^120 would overflow; the exact value first
                        v = builder.fmul(v, ir.Constant(vf, [2.0 ** 120] * lanes))
                    v = builder.fmul(v, sgv, flags=_CONTRACT)
                    for acc, xp in zip(accs, xps):
                        t = builder.fmul(v, _vload(builder, xp, off, vf, 4), flags=_CONTRACT)
                        builder.store(builder.fadd(builder.load(acc), t, flags=_FAST), acc)

            if table:
                table_loop()
            else:
                fold = builder.fcmp_ordered("<", builder.call(fabs, [s_b]), ir.Constant(_F32, 128.0))
                with builder.if_else(fold) as (then, otherwise):
                    with then:
                        block_loop(True)
                    with otherwise:
                        block_loop(False)
        if table:       # each activation row's four 16-lane chains
            res = []
            for a16 in acc16:
                tot = builder.load(a16[0])
                for a in a16[1:]:
                    tot = builder.fadd(tot, builder.load(a), flags=_FAST)
                res.append(_hsum(builder, tot))
        else:
            res = [_hsum(builder, builder.load(acc)) for acc in accs]
        if num_x == 1:
            return res[0]
        return context.make_tuple(builder, signature.return_type, res)

    return codegen


@intrinsic
def fp8f_row_dot(typingctx, w, s, x, bk):
    """fp8_row_dot_v with the block scale folded into the decode: K and bk multiples of 64."""
    _check_fp8(w, s)
    return types.float32(w, s, x, bk), _fp8f_codegen(1)


@intrinsic
def fp8f_row_dot4(typingctx, w, s, x0, x1, x2, x3, bk):
    """fp8f_row_dot with four activation rows -> UniTuple(float32, 4)."""
    _check_fp8(w, s)
    return types.UniTuple(types.float32, 4)(w, s, x0, x1, x2, x3, bk), _fp8f_codegen(4)

_E2M1_X2 = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]   # 2 * e2m1(nibble), as int8


def _nvfp4_codegen(num_x):
    """nvfp4 dot (group 16) of one row with `num_x` activation rows, the row factor left out.
    args: w u8 [K/2] (low nibble = even column), s u8 [K/16 + 4], x_0.. f32 [K]; K % 32 == 0.
    Per 16 packed bytes (32 weights, 2 groups): two pshufb give 2 x e2m1 of the even / odd
    columns, one interleave puts them in column order, <32 x float> times [s_g/2 x16 | s_g+1/2 x16]
    (exact), then multiplied into the natural-order activations."""
    def codegen(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args)]
        wp, sp = arrays[0].data, arrays[1].data
        xps = [a.data for a in arrays[2:2 + num_x]]
        k = cgutils.unpack_tuple(builder, arrays[2].shape)[0]
        v16b, v32b, v32f = ir.VectorType(_I8, 16), ir.VectorType(_I8, 32), ir.VectorType(_F32, 32)
        pshufb = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16b, [v16b, v16b]),
                                                "llvm.x86.ssse3.pshuf.b.128")
        table = ir.Constant(v16b, [v & 0xFF for v in _E2M1_X2])
        m15 = ir.Constant(v16b, [15] * 16)
        inter = ir.Constant(ir.VectorType(_I32, 32), [i // 2 + 16 * (i % 2) for i in range(32)])
        spread = ir.Constant(ir.VectorType(_I32, 32), [0] * 16 + [1] * 16)
        accs = [cgutils.alloca_once_value(builder, ir.Constant(v32f, None)) for _ in range(num_x)]
        with cgutils.for_range(builder, builder.lshr(k, ir.Constant(_I64, 5))) as it:
            i = it.index
            b = _vload(builder, wp, builder.shl(i, ir.Constant(_I64, 4)), v16b, 1)
            lo = builder.call(pshufb, [table, builder.and_(b, m15)])
            hi = builder.call(pshufb, [table, builder.and_(builder.lshr(b, ir.Constant(v16b, [4] * 16)), m15)])
            wf = builder.sitofp(builder.shuffle_vector(lo, hi, inter), v32f)
            sc2 = _e4m3_to_float(builder, _vload(builder, sp, builder.shl(i, ir.Constant(_I64, 1)),
                                                 ir.VectorType(_I8, 2), 1), 2, 2.0 ** 119)
            scv = builder.shuffle_vector(sc2, sc2, spread)
            ws = builder.fmul(wf, scv)          # exact: 2 * e2m1 times s_g / 2
            off = builder.shl(i, ir.Constant(_I64, 5))
            for acc, xp in zip(accs, xps):
                t = builder.fmul(ws, _vload(builder, xp, off, v32f, 4), flags=_CONTRACT)
                builder.store(builder.fadd(builder.load(acc), t, flags=_FAST), acc)
        res = [_hsum(builder, builder.load(acc)) for acc in accs]
        if num_x == 1:
            return res[0]
        return context.make_tuple(builder, signature.return_type, res)

    return codegen


def _check_nvfp4(w, s):
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise TypeError("nvfp4_row_dot_v needs x86 (pshufb); _dots uses the plain loop elsewhere")
    if not (isinstance(w, types.Array) and w.dtype == types.uint8 and isinstance(s, types.Array)
            and s.dtype == types.uint8):
        raise TypeError(f"nvfp4 rows are uint8 nibbles with uint8 e4m3 scales, got {w}, {s}")


@intrinsic
def nvfp4_row_dot_v(typingctx, w, s, x):
    """sum_g e4m3(s[g]) * sum_{j in g} e2m1(nibble j) * x[j] over groups of 16 (the row factor is
    applied by the caller, _dots.nvfp4_dot); K % 32 == 0."""
    _check_nvfp4(w, s)
    return types.float32(w, s, x), _nvfp4_codegen(1)


@intrinsic
def nvfp4_row_dot4_v(typingctx, w, s, x0, x1, x2, x3):
    """nvfp4_row_dot_v with four activation rows -> UniTuple(float32, 4)."""
    _check_nvfp4(w, s)
    return types.UniTuple(types.float32, 4)(w, s, x0, x1, x2, x3), _nvfp4_codegen(4)


# --- nvfp4 (e2m1) weights x int8 activations (AVX-512 VNNI, AVX2) --------------------------------
#
# 2 x e2m1 is an integer (0, 1, 2, 3, 4, 6, 8, 12 with the sign of bit 3), so a group's dot with
# int8 activations is an integer dot. Each nibble becomes 2 x e2m1 + 12 in [0, 24] (unsigned, for
# vpdpbusd / vpmaddubsw's u8 operand) by one table shuffle; the +12 is removed in integers: each
# i32 lane (8 columns) starts from corr = -12 x the sum of its 8 q_x, precomputed per activation
# row (`_dots.prep_nv8_row`). Activations: int8 per 32-block, scale s_x (quant.q8act's rule), laid
# out per 128-column unit as [q of the 64 even columns | q of the 64 odd columns] (a last 64-column
# unit: [even x32 | odd x32]) so the low / high nibbles of the unit's 64 bytes (one zmm; AVX2: two
# 32-byte halves) meet their activations. Either way i32 lane L covers columns 8L..8L+7, group g
# (16 columns) lanes 2g and 2g + 1: one convert, then one FMA with [s_g x2 | ...] * s_x per lane
# (s_x per lane precomputed as well). The e4m3 group scales are decoded as fp16 bits (`_e4m3_half`:
# exact, subnormals included) with vcvtph2ps (AVX2), or by bit placement into fp32 (AVX-512:
# `_nv_group_scales512`, the same value / 256, 3 uops fewer per 128 weights); the result leaves out
# a factor 128 (1/2 for 2 x e2m1, 256 for the rebase) and the row factor, which `_dots.nvfp4q8_dot` applies.
# Ranges: u8 <= 24, |q_x| <= 127: a vpmaddubsw pair <= 6096 and the sum of the low and high
# nibbles' pairs <= 12192 (no i16 saturation), an i32 lane <= 24384 + 12192.

_NV_OFF = 12
_NV_TABLE = [v + _NV_OFF for v in _E2M1_X2]          # 2 x e2m1 + 12 per nibble, u8 in [0, 24]


def _e4m3_half(builder, b8, lanes):
    """<lanes x i8> e4m3 bytes -> <lanes x float> value / 256, exact: the byte sign-extended to 16
    bits and shifted 7 up puts the sign at bit 15 and the 7 magnitude bits at fp16's exponent /
    mantissa boundary (bit 14, a copy of the sign, cleared): an fp16 of value e4m3 / 2^8, e4m3
    subnormals becoming fp16 subnormals, which vcvtph2ps (fpext) converts exactly."""
    vs = ir.VectorType(_I16, lanes)
    bits = builder.and_(builder.shl(builder.sext(b8, vs), ir.Constant(vs, [7] * lanes)),
                        ir.Constant(vs, [0xBF80 - (1 << 16)] * lanes))
    return _half_to_float(builder, bits, lanes)


def _nv_lookup(builder, b, n):
    """<n x i8> packed bytes -> (2 e2m1 + 12 of the low nibbles, of the high nibbles) by pshufb."""
    vb = ir.VectorType(_I8, n)
    name = {16: "llvm.x86.ssse3.pshuf.b.128", 32: "llvm.x86.avx2.pshuf.b", 64: "llvm.x86.avx512.pshuf.b.512"}[n]
    shuf = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vb, [vb, vb]), name)
    table = ir.Constant(vb, [v for _ in range(n // 16) for v in _NV_TABLE])
    m15 = ir.Constant(vb, [15] * n)
    lo = builder.call(shuf, [table, builder.and_(b, m15)])
    hi = builder.call(shuf, [table, builder.and_(builder.lshr(b, ir.Constant(vb, [4] * n)), m15)])
    return lo, hi


def _nv_group_scales(builder, sp, g0, ngroups):
    """e4m3 group scales g0 .. g0 + ngroups - 1 -> <2 ngroups x float> [s_g0 x2 | s_g0+1 x2 | ...] / 256."""
    b = _vload(builder, sp, g0, ir.VectorType(_I8, ngroups), 1)
    dup = builder.shuffle_vector(b, b, ir.Constant(ir.VectorType(_I32, 2 * ngroups), [i // 2 for i in range(2 * ngroups)]))
    return _e4m3_half(builder, dup, 2 * ngroups)


def _nv_half(builder, wp, sp, wbyte, qe, qo, lane, accs, qps, sxps, cps):
    """32 packed bytes at wbyte (64 columns, 4 groups; AVX2): acc (<8 x float>) += float(corr +
    lo . q_even + hi . q_odd) * [s_g x2 ..] * s_x, q_even at qe, q_odd at qo, lanes from `lane`."""
    v32b, v16s, v8i, v8f = (ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8),
                            ir.VectorType(_F32, 8))
    ubsw, wd = _pmadd_intrinsics(builder)
    lo, hi = _nv_lookup(builder, _vload(builder, wp, wbyte, v32b, 1), 32)
    sc = _nv_group_scales(builder, sp, builder.lshr(wbyte, ir.Constant(_I64, 3)), 4)
    for acc, qp, sxp, cp in zip(accs, qps, sxps, cps):
        s16 = builder.add(builder.call(ubsw, [lo, _vload(builder, qp, qe, v32b, 1)]),
                          builder.call(ubsw, [hi, _vload(builder, qp, qo, v32b, 1)]))
        a = builder.add(builder.call(wd, [s16, ir.Constant(v16s, [1] * 16)]), _vload(builder, cp, lane, v8i, 4))
        d = builder.fmul(sc, _vload(builder, sxp, lane, v8f, 4), flags=_FAST)
        builder.store(builder.fadd(builder.load(acc), builder.fmul(builder.sitofp(a, v8f), d, flags=_FAST),
                                   flags=_FAST), acc)


def _nv_lookup512(builder, b):
    """<64 x i8> packed bytes -> (2 e2m1 + 12 of the low nibbles, of the high nibbles): the low
    nibbles by one vpermb on a 64-entry table (its index bits 4-5 ignored by repeating the 16
    entries: no mask), the high ones by one vpshufb of (b >> 4) & 15 (one vgf2p8affineqb)."""
    v64b = ir.VectorType(_I8, 64)
    if not HAS_AVX512VBMI:        # vpermb is AVX512-VBMI (not on Skylake-X / Cascade Lake): both by vpshufb
        return _nv_lookup(builder, b, 64)
    permb = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v64b, [v64b, v64b]),
                                           "llvm.x86.avx512.permvar.qi.512")
    lo = builder.call(permb, [_c8(_NV_TABLE * 4), b])
    _, hi = _nv_lookup(builder, b, 64)
    return lo, hi


def _nv_group_scales512(builder, sp, g0):
    """e4m3 group scales g0 .. g0 + 7 -> <16 x float> [s_g0 x2 | ...] / 256 without vcvtph2ps: one
    byte permute puts scale g at the top byte of dwords 2g, 2g + 1 (zeros below), an arithmetic
    shift by 4 and a mask leave the sign at bit 31 and the 7 magnitude bits at fp32's exponent /
    mantissa boundary (value / 2^120; an e4m3 subnormal an fp32 subnormal), and a multiply by
    2^112 (no fast-math flags: exact) gives value / 256, as `_nv_group_scales`."""
    v64b, v16i, v16f = ir.VectorType(_I8, 64), ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)
    b = _vload(builder, sp, g0, ir.VectorType(_I8, 8), 1)
    wide = builder.shuffle_vector(b, ir.Constant(b.type, None),
                                  ir.Constant(ir.VectorType(_I32, 64), [(i // 8) if i % 4 == 3 else 8 for i in range(64)]))
    bits = builder.and_(builder.ashr(builder.bitcast(wide, v16i), ir.Constant(v16i, [4] * 16)),
                        ir.Constant(v16i, [0x87FFFFFF - (1 << 32)] * 16))
    return builder.fmul(builder.bitcast(bits, v16f), ir.Constant(v16f, [2.0 ** 112] * 16))


def _nv_unit512(builder, wp, sp, unit, accs, qps, sxps, cps):
    """One 128-column unit (64 packed bytes, 8 groups; AVX-512): acc (<16 x float>) += float(corr +
    lo . q_even + hi . q_odd) * [s_g x2 ..] * s_x (two vpdpbusd into the corrections)."""
    v64b, v16i, v16f = ir.VectorType(_I8, 64), ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)
    wbyte = builder.shl(unit, ir.Constant(_I64, 6))
    _prefetch(builder, wp, wbyte)
    lo, hi = _nv_lookup512(builder, _vload(builder, wp, wbyte, v64b, 1))
    sc = _nv_group_scales512(builder, sp, builder.shl(unit, ir.Constant(_I64, 3)))
    col = builder.shl(unit, ir.Constant(_I64, 7))
    lane = builder.shl(unit, ir.Constant(_I64, 4))
    for acc, qp, sxp, cp in zip(accs, qps, sxps, cps):
        a = _dpbusd(builder, _vload(builder, cp, lane, v16i, 4), lo, _vload(builder, qp, col, v64b, 1))
        a = _dpbusd(builder, a, hi, _vload(builder, qp, builder.add(col, ir.Constant(_I64, 64)), v64b, 1))
        d = builder.fmul(sc, _vload(builder, sxp, lane, v16f, 4), flags=_FAST)
        builder.store(builder.fadd(builder.load(acc), builder.fmul(builder.sitofp(a, v16f), d, flags=_FAST),
                                   flags=_FAST), acc)


def _nvq8_codegen(num_x, wide):
    """nvfp4 (group 16) x int8 dot of one row with `num_x` activations, K % 64 == 0 (see the section
    notes). args: w u8 [K/2], s u8 [K/16 + 4], xq_0.. i8 [K], xg_0.. i32 [2 ceil(K/8)] (s_x per lane
    as float bits, then the lane corrections). `wide`: the 128-column units by AVX-512 VNNI, two
    per trip into two accumulators (one FMA chain per unit is latency-bound), else by AVX2 halves;
    a last 64-column unit by the AVX2 half either way."""
    def codegen(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args)]
        wp, sp = arrays[0].data, arrays[1].data
        qps = [a.data for a in arrays[2:2 + num_x]]
        xgps = [a.data for a in arrays[2 + num_x:]]
        k = cgutils.unpack_tuple(builder, arrays[2].shape)[0]
        nlanes = builder.lshr(builder.add(k, ir.Constant(_I64, 7)), ir.Constant(_I64, 3))
        sxps = [builder.bitcast(p, _F32.as_pointer()) for p in xgps]
        cps = [builder.gep(p, [nlanes]) for p in xgps]
        nunits = builder.lshr(k, ir.Constant(_I64, 7))
        c = lambda v: ir.Constant(_I64, v)       # noqa: E731
        v16f, v8f = ir.VectorType(_F32, 16), ir.VectorType(_F32, 8)
        acc8s = [cgutils.alloca_once_value(builder, ir.Constant(v8f, None)) for _ in range(num_x)]
        acc16s = [[cgutils.alloca_once_value(builder, ir.Constant(v16f, None)) for _ in range(num_x)] for _ in range(2)]
        if wide:
            with cgutils.for_range(builder, builder.lshr(nunits, c(1))) as loop:
                unit = builder.shl(loop.index, c(1))
                _nv_unit512(builder, wp, sp, unit, acc16s[0], qps, sxps, cps)
                _nv_unit512(builder, wp, sp, builder.add(unit, c(1)), acc16s[1], qps, sxps, cps)
            with builder.if_then(builder.trunc(nunits, ir.IntType(1))):
                _nv_unit512(builder, wp, sp, builder.sub(nunits, c(1)), acc16s[0], qps, sxps, cps)
        else:
            with cgutils.for_range(builder, nunits) as loop:
                col = builder.shl(loop.index, c(7))
                wbyte = builder.shl(loop.index, c(6))
                lane = builder.shl(loop.index, c(4))
                _prefetch(builder, wp, wbyte)
                for h in range(2):
                    _nv_half(builder, wp, sp, builder.add(wbyte, c(32 * h)), builder.add(col, c(32 * h)),
                             builder.add(col, c(64 + 32 * h)), builder.add(lane, c(8 * h)), acc8s, qps, sxps, cps)
        with builder.if_then(builder.trunc(builder.lshr(k, c(6)), ir.IntType(1))):     # a last 64-column unit
            col = builder.shl(nunits, c(7))
            _nv_half(builder, wp, sp, builder.shl(nunits, c(6)), col, builder.add(col, c(32)),
                     builder.shl(nunits, c(4)), acc8s, qps, sxps, cps)
        res = []
        for j in range(num_x):
            tot = _hsum(builder, builder.load(acc8s[j]))
            if wide:
                a16 = builder.fadd(builder.load(acc16s[0][j]), builder.load(acc16s[1][j]), flags=_FAST)
                tot = builder.fadd(tot, _hsum(builder, a16), flags=_FAST)
            res.append(tot)
        if num_x == 1:
            return res[0]
        return context.make_tuple(builder, signature.return_type, res)

    return codegen


def _check_nvq8(w, s, xq, xg, wide):
    _check_avx2()
    if wide:
        _check_avx512()
    _check_nvfp4(w, s)
    if not (isinstance(xq, types.Array) and xq.dtype == types.int8 and isinstance(xg, types.Array)
            and xg.dtype == types.int32):
        raise TypeError(f"nvfp4 x int8 dots take int8 activations and int32 lane data (prep_nv8_row), got {xq}, {xg}")



def _nvq8_intrinsics(wide):
    @intrinsic
    def one(typingctx, w, s, xq, xg):
        _check_nvq8(w, s, xq, xg, wide)
        return types.float32(w, s, xq, xg), _nvq8_codegen(1, wide)

    @intrinsic
    def four(typingctx, w, s, x0, x1, x2, x3, g0, g1, g2, g3):
        _check_nvq8(w, s, x0, g0, wide)
        return types.UniTuple(types.float32, 4)(w, s, x0, x1, x2, x3, g0, g1, g2, g3), _nvq8_codegen(4, wide)

    return one, four


# sum_g (e4m3(s[g]) / 256) * sum_{j in g} 2 e2m1(nibble j) * q_x[j] * s_x[j / 32]: times 128 and the
# row factor it is the dot of the row with the dequantised activations. w u8 [K/2], s u8 [K/16 + 4],
# xq i8 [K] and xg i32 [2 ceil(K/8)] from _dots.prep_nv8_row, K % 64 == 0 (_dots.nvfp4q8_dot checks).
nvfp4q8_row_dot, nvfp4q8_row_dot4 = _nvq8_intrinsics(False)          # AVX2
nvfp4q8v_row_dot, nvfp4q8v_row_dot4 = _nvq8_intrinsics(True)         # AVX-512 VNNI


# --- bf16 weights x bf16 activations (AVX512-BF16: vdpbf16ps) --------------------------------------
#
# llama.cpp's bf16 dot on CPUs with AVX512-BF16: the activation row is rounded to bf16 once
# (_dots.prep_bf16_row: round-to-nearest-even, fp32 subnormals flushed to signed zero, as the
# instruction would read them), then each 32 weights are one 64-byte load and one vdpbf16ps per
# activation row: 16 fp32 lanes += w[2i] * x[2i] + w[2i + 1] * x[2i + 1] (bf16 x bf16 products are
# exact in fp32; the instruction rounds to nearest-even, reads subnormal inputs as zero and
# flushes subnormal results, MXCSR aside). Against the widen-to-fp32 dot (`_dots.dot`: zero-extend,
# shift, FMA per 16 weights) it is one instruction per 32 weights instead of ~4 per 16. A K % 32
# tail takes a scalar widened loop (subnormals there are not flushed: |w x| < 1e-38 either way).
# One activation row: 4 accumulators (one dependency chain per 32 weights would be latency-bound);
# four rows: one accumulator each. llvmlite has no bfloat type: `_BFloat` prints LLVM's `bfloat`.
# Used only when the compile target has AVX512-BF16 (`HAS_AVX512BF16`); elsewhere, or with
# FREETOKEN_BF16_ACT=fp32, the exact fp32-activation dot runs.

HAS_AVX512BF16 = _target_has("avx512bf16")


class _BFloat(ir.types._BaseFloatType):
    null = "0.0"
    intrinsic_name = "bf16"

    def __str__(self):
        return "bfloat"


_BFloat._create_instance()
_BF16_UNROLL = 4      # 32-weight blocks per iteration with one activation row


def _check_bf16(*arrays):
    if not HAS_AVX512BF16:
        raise TypeError("bf16_row_dot needs AVX512-BF16 (vdpbf16ps); _dots uses the fp32-activation dot elsewhere")
    for a in arrays:
        if not (isinstance(a, types.Array) and a.dtype == types.uint16 and a.ndim == 1 and a.layout == "C"):
            raise TypeError(f"bf16 rows are contiguous 1-D uint16 arrays of bf16 bits, got {a}")


def _bf16_widen(builder, bits):
    """One bf16 (i16 bits) -> float: the bits 16 places up."""
    return builder.bitcast(builder.shl(builder.zext(bits, _I32), ir.Constant(_I32, 16)), _F32)


def _bf16_codegen(num_x):
    def codegen(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args)]
        wp = arrays[0].data
        xps = [a.data for a in arrays[1:]]
        k = cgutils.unpack_tuple(builder, arrays[0].shape)[0]
        v32s, v16f = ir.VectorType(_I16, 32), ir.VectorType(_F32, 16)
        v32bf = ir.VectorType(_BFloat(), 32)
        dp = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16f, [v16f, v32bf, v32bf]),
                                            "llvm.x86.avx512bf16.dpbf16ps.512")
        unroll = _BF16_UNROLL if num_x == 1 else 1
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(v16f, None)) for _ in range(num_x)]
                for _ in range(unroll)]

        def block(blk, acc_set):
            off = builder.shl(blk, ir.Constant(_I64, 5))
            w = builder.bitcast(_vload(builder, wp, off, v32s, 2), v32bf)
            for acc, xp in zip(acc_set, xps):
                x = builder.bitcast(_vload(builder, xp, off, v32s, 2), v32bf)
                builder.store(builder.call(dp, [builder.load(acc), x, w]), acc)

        nblk = builder.lshr(k, ir.Constant(_I64, 5))
        nmain = builder.udiv(nblk, ir.Constant(_I64, unroll))
        with cgutils.for_range(builder, nmain) as loop:
            first = builder.mul(loop.index, ir.Constant(_I64, unroll))
            for u in range(unroll):
                block(builder.add(first, ir.Constant(_I64, u)), accs[u])
        done = builder.mul(nmain, ir.Constant(_I64, unroll))
        with cgutils.for_range(builder, builder.sub(nblk, done)) as loop:
            block(builder.add(done, loop.index), accs[0])
        return _bf16_finish(context, builder, signature, wp, xps, accs, builder.shl(nblk, ir.Constant(_I64, 5)), k, True)

    return codegen


def _bf16_finish(context, builder, signature, wp, xps, accs, start, k, x_bf16):
    """The bf16 dots' end: columns start..k in scalar (activations bf16 bits where x_bf16, else
    fp32), the accumulators accs [unroll][num_x] summed, one float per activation row returned."""
    num_x = len(xps)
    tails = [cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for _ in range(num_x)]
    with cgutils.for_range(builder, builder.sub(k, start)) as loop:
        j = builder.add(start, loop.index)
        wj = _bf16_widen(builder, builder.load(builder.gep(wp, [j])))
        for tail, xp in zip(tails, xps):
            xj = builder.load(builder.gep(xp, [j]))
            if x_bf16:
                xj = _bf16_widen(builder, xj)
            builder.store(builder.fadd(builder.load(tail), builder.fmul(wj, xj, flags=_FAST), flags=_FAST), tail)
    res = []
    for j in range(num_x):
        acc = builder.load(accs[0][j])
        for more in accs[1:]:
            acc = builder.fadd(acc, builder.load(more[j]), flags=_FAST)
        res.append(builder.fadd(_hsum(builder, acc), builder.load(tails[j]), flags=_FAST))
    if num_x == 1:
        return res[0]
    return context.make_tuple(builder, signature.return_type, res)


@intrinsic
def bf16_row_dot(typingctx, w, x):
    """sum_i bf16(w[i]) * bf16(x[i]) in fp32 (vdpbf16ps): w, x uint16 [K] bf16 bits, any K (the
    activation already rounded and flushed by _dots.prep_bf16_row)."""
    _check_bf16(w, x)
    return types.float32(w, x), _bf16_codegen(1)


@intrinsic
def bf16_row_dot4(typingctx, w, x0, x1, x2, x3):
    """bf16_row_dot of one row with four activation rows (the row loaded once) -> UniTuple(float32, 4)."""
    _check_bf16(w, x0, x1, x2, x3)
    return types.UniTuple(types.float32, 4)(w, x0, x1, x2, x3), _bf16_codegen(4)


# bf16 weights x fp32 activations (CPUs without AVX512-BF16, or FREETOKEN_BF16_ACT=fp32): per
# 16 weights (8 with AVX2) one zero-extend, one shift and one FMA per activation row, with 4
# accumulators for one row (numba's loop over `_dots.dot` compiled to one 8-lane FMA chain,
# latency-bound) and one each for four. Exact products, fp32 sums; a K % (lanes x unroll) tail
# in scalar. One Ice Lake core, a 1024 x 2048 matrix in L3, the other core busy: one row 17.4-18.5
# -> 24.5 GB/s, four rows 7.7-7.9 -> 14.0-14.3 (docs/kernels.md "Prefill tiles and a bf16 x fp32 dot").


def _bf16f_codegen(num_x):
    lanes = 16 if HAS_AVX512 else 8
    unroll = 4 if num_x == 1 else 1

    def codegen(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args)]
        wp = arrays[0].data
        xps = [a.data for a in arrays[1:]]
        k = cgutils.unpack_tuple(builder, arrays[0].shape)[0]
        vs, vi, vf = ir.VectorType(_I16, lanes), ir.VectorType(_I32, lanes), ir.VectorType(_F32, lanes)
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(vf, None)) for _ in range(num_x)] for _ in range(unroll)]
        step = lanes * unroll
        nmain = builder.udiv(k, ir.Constant(_I64, step))
        with cgutils.for_range(builder, nmain) as loop:
            base = builder.mul(loop.index, ir.Constant(_I64, step))
            for u in range(unroll):
                off = builder.add(base, ir.Constant(_I64, u * lanes))
                w = builder.bitcast(builder.shl(builder.zext(_vload(builder, wp, off, vs, 2), vi),
                                                ir.Constant(vi, [16] * lanes)), vf)
                for acc, xp in zip(accs[u], xps):
                    t = builder.fmul(w, _vload(builder, xp, off, vf, 4), flags=_CONTRACT)
                    builder.store(builder.fadd(builder.load(acc), t, flags=_FAST), acc)
        return _bf16_finish(context, builder, signature, wp, xps, accs, builder.mul(nmain, ir.Constant(_I64, step)), k, False)

    return codegen


def _check_bf16f(w, *xs):
    if not (isinstance(w, types.Array) and w.dtype == types.uint16 and w.ndim == 1):
        raise TypeError(f"bf16 rows are 1-D uint16 arrays of bf16 bits, got {w}")
    _check_f32_rows(*xs)


@intrinsic
def bf16f_row_dot(typingctx, w, x):
    """sum_i bf16(w[i]) * x[i] in fp32: w uint16 [K] bf16 bits, x float32 [>= K], any K."""
    _check_bf16f(w, x)
    return types.float32(w, x), _bf16f_codegen(1)


@intrinsic
def bf16f_row_dot4(typingctx, w, x0, x1, x2, x3):
    """bf16f_row_dot of one row with four activation rows -> UniTuple(float32, 4)."""
    _check_bf16f(w, x0, x1, x2, x3)
    return types.UniTuple(types.float32, 4)(w, x0, x1, x2, x3), _bf16f_codegen(4)


# --- fp8 (e4m3) weights x bf16 activations (AVX512-BF16 + AVX512-VBMI) ---------------------------
#
# The fp32-activation fp8 dots above spend ~5 port-0/5 uops per 16 weights on the decode and the
# FMA (sign-extend, shift, mask, scale multiply, FMA): ~15 Gweights/s per core on a Xeon 6 VM,
# below one core's DRAM read (~19 GB/s; docs/kernels.md "fp8 and nvfp4 at the memory wall").
# Here the decode is a table: e4m3's 128 magnitudes have exact bf16 values (3 mantissa bits,
# exponents 2^-9 .. 2^8, subnormals included), so per 64 weights (one 64-byte load) two vpermi2b
# (AVX512-VBMI: a 128-entry byte table in two zmm, the index's bit 7 ignored) give the high and
# the low byte of each weight's bf16 bits, one vpternlog puts the sign bit into the high byte, two
# unpacks (vpunpcklbw / vpunpckhbw, within 128-bit lanes) make 2 x 32 bf16 words, and two
# vdpbf16ps multiply them with the activations, rounded to bf16 once per row as the bf16-weight
# path does (`_dots.prep_fp8bf_row`, laid out per 64-column unit in the unpacks' order: words
# [16L + p for L < 4, p < 8] then [16L + 8 + p]). The block's fp32 sum is scaled once per block:
# for blocks of 128 (every FP8 checkpoint) one loop trip per block, whose ~36 instructions per 128
# weights left the loop bookkeeping behind (vdpbf16ps, ~2 cycles per zmm here, is the floor).
# The weights are exact (no rebase: bf16 has fp32's exponent range); the only rounding beyond an
# fp32 dot's is the activation's to bf16 (vdpbf16ps reads subnormal inputs as zero, and a product
# below 2^-126 is flushed: |w x| < 1e-38, nothing a sum of a layer can see).
# Used where BF16_ACT is "bf16" and the target has VBMI (`_dots.FP8_ACT`), for K and the block
# multiples of 64 (other shapes: the exact fp32 dots above on the same call's fp32 rows, see
# _dots.fp8bf_dot); FREETOKEN_BF16_ACT=fp32 keeps the exact fp32 dots above everywhere.

def _fp8bf_codegen(num_x):
    """fp8 x bf16 dot of one row with `num_x` activation rows. args: w u8 [K], s f32 [G],
    x_0.. u16 [K] (prep_fp8bf_row's layout), bk; K and bk multiples of 64 (a partial last block
    of any multiple of 64)."""
    def codegen(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:-1], args[:-1])]
        wp, sp = arrays[0].data, arrays[1].data
        xps = [a.data for a in arrays[2:2 + num_x]]
        ngroups = cgutils.unpack_tuple(builder, arrays[1].shape)[0]
        k = cgutils.unpack_tuple(builder, arrays[2].shape)[0]
        bk = context.cast(builder, args[-1], signature.args[-1], types.int64)
        v64b, v32s, v16f = ir.VectorType(_I8, 64), ir.VectorType(_I16, 32), ir.VectorType(_F32, 16)
        v32bf = ir.VectorType(_BFloat(), 32)
        mod = builder.module
        dp = cgutils.get_or_insert_function(mod, ir.FunctionType(v16f, [v16f, v32bf, v32bf]),
                                            "llvm.x86.avx512bf16.dpbf16ps.512")
        sh_lo = ir.Constant(ir.VectorType(_I32, 64), _UNPACK_LO)
        sh_hi = ir.Constant(ir.VectorType(_I32, 64), _UNPACK_HI)
        nchain = 4 if num_x == 1 else 2
        accs = [cgutils.alloca_once_value(builder, ir.Constant(v16f, None)) for _ in range(num_x)]
        parts = [[cgutils.alloca_once(builder, v16f) for _ in range(nchain)] for _ in range(num_x)]
        def decode(offs):
            """The 64 weights at each of offs as 2 x 32 bf16 words each (the table decode)."""
            ws = []
            for off in offs:
                _prefetch(builder, wp, off)               # one 64-byte line per unit, PF_DIST ahead
                hi, lo = _e4m3_bf16_bytes(builder, _vload(builder, wp, off, v64b, 1))
                ws += [builder.bitcast(builder.bitcast(builder.shuffle_vector(hi, lo, sh), v32s), v32bf)
                       for sh in (sh_lo, sh_hi)]
            return ws

        def xload(xp, off, col):
            return builder.bitcast(_vload(builder, xp, builder.add(off, ir.Constant(_I64, col)), v32s, 2), v32bf)

        def flat():
            """Blocks of 128 (every FP8 checkpoint) and K % 128 == 0: one trip per block, its two
            units' four vdpbf16ps in two chains from zero, one FMA with the splatted block scale."""
            with cgutils.for_range(builder, builder.lshr(k, ir.Constant(_I64, 7))) as loop:
                off = builder.shl(loop.index, ir.Constant(_I64, 7))
                ws = decode([off, builder.add(off, ir.Constant(_I64, 64))])
                sgv = _splat(builder, builder.load(builder.gep(sp, [loop.index])), 16)
                for acc, xp in zip(accs, xps):
                    pa = builder.call(dp, [ir.Constant(v16f, None), ws[0], xload(xp, off, 0)])
                    pb = builder.call(dp, [ir.Constant(v16f, None), ws[1], xload(xp, off, 32)])
                    pa = builder.call(dp, [pa, ws[2], xload(xp, off, 64)])
                    pb = builder.call(dp, [pb, ws[3], xload(xp, off, 96)])
                    tot = builder.fadd(pa, pb, flags=_FAST)
                    builder.store(builder.fadd(builder.load(acc), builder.fmul(sgv, tot, flags=_FAST), flags=_FAST), acc)

        def units(offs):
            """64 weights at each of offs into parts[.][2i], parts[.][2i + 1] (the general loop)."""
            ws = decode(offs)
            for i, off in enumerate(offs):
                for ps, xp in zip(parts, xps):
                    for h in range(2):
                        part = ps[(2 * i + h) % nchain]
                        builder.store(builder.call(dp, [builder.load(part), ws[2 * i + h], xload(xp, off, 32 * h)]), part)

        def general():
            """Any bk and K multiples of 64: per block a loop over pairs of units (parts reset per
            block), then acc += scale * the parts' sum."""
            with cgutils.for_range(builder, ngroups) as group:
                g = group.index
                start, n = _block_span(builder, g, bk, k)
                nunits = builder.lshr(n, ir.Constant(_I64, 6))
                for ps in parts:
                    for part in ps:
                        builder.store(ir.Constant(v16f, None), part)
                with cgutils.for_range(builder, builder.lshr(nunits, ir.Constant(_I64, 1))) as pair:
                    off = builder.add(start, builder.shl(pair.index, ir.Constant(_I64, 7)))
                    units([off, builder.add(off, ir.Constant(_I64, 64))])
                with builder.if_then(builder.trunc(nunits, ir.IntType(1))):
                    last = builder.shl(builder.sub(nunits, ir.Constant(_I64, 1)), ir.Constant(_I64, 6))
                    units([builder.add(start, last)])
                sgv = _splat(builder, builder.load(builder.gep(sp, [g])), 16)
                for acc, ps in zip(accs, parts):
                    tot = builder.load(ps[0])
                    for part in ps[1:]:
                        tot = builder.fadd(tot, builder.load(part), flags=_FAST)
                    builder.store(builder.fadd(builder.load(acc), builder.fmul(sgv, tot, flags=_FAST), flags=_FAST), acc)

        is_flat = builder.and_(builder.icmp_unsigned("==", bk, ir.Constant(_I64, 128)),
                               builder.icmp_unsigned("==", builder.and_(k, ir.Constant(_I64, 127)), ir.Constant(_I64, 0)))
        with builder.if_else(is_flat) as (then, otherwise):
            with then:
                flat()
            with otherwise:
                general()
        res = [_hsum(builder, builder.load(acc)) for acc in accs]
        if num_x == 1:
            return res[0]
        return context.make_tuple(builder, signature.return_type, res)

    return codegen


def _check_fp8bf(w, s, *xs):
    _check_fp8(w, s)
    if not (HAS_AVX512BF16 and HAS_AVX512VBMI):
        raise TypeError("fp8bf_row_dot needs AVX512-BF16 and AVX512-VBMI; _dots uses the fp32-activation dot elsewhere")
    for a in xs:
        if not (isinstance(a, types.Array) and a.dtype == types.uint16 and a.ndim == 1):
            raise TypeError(f"bf16 activation rows are 1-D uint16 arrays of bf16 bits, got {a}")


@intrinsic
def fp8bf_row_dot(typingctx, w, s, x, bk):
    """sum_b s[b] * sum_{j in block b} e4m3(w[j]) * bf16(x[j]) (vdpbf16ps); w u8 [K], s f32
    [ceil(K/bk)], x u16 [K] bf16 bits in _dots.prep_fp8bf_row's layout; K, bk multiples of 64."""
    _check_fp8bf(w, s, x)
    return types.float32(w, s, x, bk), _fp8bf_codegen(1)


@intrinsic
def fp8bf_row_dot4(typingctx, w, s, x0, x1, x2, x3, bk):
    """fp8bf_row_dot with four activation rows -> UniTuple(float32, 4)."""
    _check_fp8bf(w, s, x0, x1, x2, x3)
    return types.UniTuple(types.float32, 4)(w, s, x0, x1, x2, x3, bk), _fp8bf_codegen(4)


# --- Prefill tiles: fp32 rows x fp32 activations, 4 x 4 register blocks ---------------------------
#
# Where an expert is hit by many tokens (prefill) and its rows carry fp8 or bf16 weights with fp32
# activations (CPUs without AVX512-BF16: Zen 3, Ice Lake; or FREETOKEN_BF16_ACT=fp32), the dots
# above decode every row once per 4 tokens and run one FMA per decoded vector and token: ~5 uops
# per 16 weights of decode against 4 FMAs (fp8). Instead `_moe_kernels` widens a block's rows once
# into an fp32 tile (`fp8_widen_row`: the same folded value w * s as `fp8f_row_dot`, rounded once
# to fp32) and `tile_dot44` multiplies 4 tile rows with 4 activation rows: per 16 columns 8 loads
# and 16 FMAs into 16 accumulators (4 rows x 4 tokens), one horizontal sum each at the end. With
# AVX2's 16 registers the 4 tokens go in two passes of 2 (8 accumulators of 8 lanes). Measured on
# one Ice Lake core (fp8, an expert's 2 x 768 gate/up rows x 2048, 32 tokens, in cache): 1.8x the
# 4-token fp8 dot for the products alone, a whole MoE layer 1.3-1.5x (docs/kernels.md "Prefill tiles").

TILE_LANES = 16       # K must be a multiple of this (the callers check: `_dots.tile_ok`)


def _tile_codegen(rows, cols, lanes, col_passes):
    def codegen(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args)]
        ws = [a.data for a in arrays[:rows]]
        xs = [a.data for a in arrays[rows:rows + cols]]
        k = cgutils.unpack_tuple(builder, arrays[0].shape)[0]
        vf = ir.VectorType(_F32, lanes)
        nvec = builder.udiv(k, ir.Constant(_I64, lanes))
        res = [None] * (rows * cols)
        per = cols // col_passes
        for cp in range(col_passes):
            cs = list(range(cp * per, (cp + 1) * per))
            accs = {(r, c): cgutils.alloca_once_value(builder, ir.Constant(vf, None)) for r in range(rows) for c in cs}
            with cgutils.for_range(builder, nvec) as blk:
                off = builder.mul(blk.index, ir.Constant(_I64, lanes))
                wv = [_vload(builder, p, off, vf, 4) for p in ws]
                for c in cs:
                    xv = _vload(builder, xs[c], off, vf, 4)
                    for r in range(rows):
                        t = builder.fmul(wv[r], xv, flags=_CONTRACT)
                        builder.store(builder.fadd(builder.load(accs[r, c]), t, flags=_FAST), accs[r, c])
            for (r, c), acc in accs.items():
                res[r * cols + c] = _hsum(builder, builder.load(acc))
        return context.make_tuple(builder, signature.return_type, res)

    return codegen


def _check_f32_rows(*arrays):
    for a in arrays:
        if not (isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 1):
            raise TypeError(f"tile rows are 1-D float32 arrays, got {a}")


@intrinsic
def tile_dot44(typingctx, w0, w1, w2, w3, x0, x1, x2, x3):
    """(w_r . x_c for r < 4, c < 4) as UniTuple(float32, 16), index 4 r + c: float32 rows of K
    (w0's length; a multiple of TILE_LANES, every row at least that long)."""
    _check_f32_rows(w0, w1, w2, w3, x0, x1, x2, x3)
    lanes, passes = (16, 1) if HAS_AVX512 else (8, 2)
    return (types.UniTuple(types.float32, 16)(w0, w1, w2, w3, x0, x1, x2, x3),
            _tile_codegen(4, 4, lanes, passes))


def _fp8_widen_codegen(context, builder, signature, args):
    arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:3], args[:3])]
    wp, sp, op = arrays[0].data, arrays[1].data, arrays[2].data
    ngroups = cgutils.unpack_tuple(builder, arrays[1].shape)[0]
    k = cgutils.unpack_tuple(builder, arrays[2].shape)[0]
    bk = context.cast(builder, args[3], signature.args[3], types.int64)
    lanes = 16
    vf, vb, vi = ir.VectorType(_F32, lanes), ir.VectorType(_I8, lanes), ir.VectorType(_I32, lanes)
    fabs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32]), "llvm.fabs.f32")
    with cgutils.for_range(builder, ngroups) as group:
        g = group.index
        start, n = _block_span(builder, g, bk, k)
        s_b = builder.load(builder.gep(sp, [g]))
        fold = builder.fcmp_ordered("<", builder.call(fabs, [s_b]), ir.Constant(_F32, 128.0))
        # as fp8f_row_dot: (v / 2^120) * (s * 2^120) where s * 2^120 is finite, else the exact value first
        pre = builder.select(fold, ir.Constant(_F32, 1.0), ir.Constant(_F32, 2.0 ** 120))
        post = builder.select(fold, builder.fmul(s_b, ir.Constant(_F32, 2.0 ** 120)), s_b)
        prev, postv = _splat(builder, pre, lanes), _splat(builder, post, lanes)
        first = start
        if HAS_AVX512 and HAS_AVX512VBMI:    # whole 64s by the exact table (as fp8f_row_dot: no assists)
            sv = _splat(builder, s_b, lanes)
            with cgutils.for_range(builder, builder.udiv(n, ir.Constant(_I64, 64))) as unit:
                off = builder.add(start, builder.mul(unit.index, ir.Constant(_I64, 64)))
                for q, v in enumerate(_e4m3_f32x64(builder, _vload(builder, wp, off, ir.VectorType(_I8, 64), 1))):
                    ptr = builder.bitcast(builder.gep(op, [builder.add(off, ir.Constant(_I64, 16 * q))]), vf.as_pointer())
                    builder.store(builder.fmul(v, sv), ptr, align=4)       # no fast flags: rounded once
            done = builder.mul(builder.udiv(n, ir.Constant(_I64, 64)), ir.Constant(_I64, 64))
            first, n = builder.add(start, done), builder.sub(n, done)
        with cgutils.for_range(builder, builder.udiv(n, ir.Constant(_I64, lanes))) as blk:
            off = builder.add(first, builder.mul(blk.index, ir.Constant(_I64, lanes)))
            bits = builder.and_(builder.shl(builder.sext(_vload(builder, wp, off, vb, 1), vi),
                                            ir.Constant(vi, [20] * lanes)),
                                ir.Constant(vi, [0x87FFFFFF - (1 << 32)] * lanes))
            v = builder.fmul(builder.fmul(builder.bitcast(bits, vf), prev), postv)   # no fast flags: exact
            ptr = builder.bitcast(builder.gep(op, [off]), vf.as_pointer())
            builder.store(v, ptr, align=4)
    return context.get_dummy_value()


@intrinsic
def fp8_widen_row(typingctx, w, s, out, bk):
    """out[j] = e4m3(w[j]) * s[j // bk] as fp32 (the folded value fp8f_row_dot multiplies): w u8 [K],
    s f32 [ceil(K / bk)], out f32 [K]; K and bk multiples of 16."""
    _check_fp8(w, s)
    _check_f32_rows(out)
    return types.none(w, s, out, bk), _fp8_widen_codegen
