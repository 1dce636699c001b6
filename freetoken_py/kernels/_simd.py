"""Hand-written LLVM vector code for the int4 row dot (a numba ``@intrinsic``).

Why not a plain numba loop: numba widens small-int arithmetic to 64 bits (``b >> 4`` became
``vpsrlq`` plus packing), and with 16 bytes per scale group LLVM's loop vectorizer never reaches
its vector body (trip count 16 < VF x interleave), so every numba formulation measured 3-7
Gweights/s per core — compute-bound far below DRAM speed. Here each 16-byte block is one
``<16 x i8>`` load, widened once to ``<16 x i32>``, split into nibbles, converted and multiplied
by the matching 16 even / 16 odd activations; the group scale multiplies a whole vector, and
the only horizontal add is at the end of the row.
"""
from __future__ import annotations

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
            sg = builder.load(builder.gep(sp, [g]))
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


@intrinsic
def q4_row_dot(typingctx, w, s, xv, xg, hb):
    """Dot of one int4 row with a prepared activation; returns float32.

    w   uint8 [K/2]   packed row (low nibble = even column), K/2 a multiple of 16
    s   float32 [G]   group scales, G = K / (2 * hb)
    xv  float32 [K]   activation split as [x[0::2] | x[1::2]]
    xg  float32 [G]   8 * sum of x over each group (removes the +8 offset of the nibbles)
    hb  int           bytes per group = group_size / 2 (a multiple of 16)

    result = sum_g s[g] * (sum_{j in g} lo_j * xe_j + hi_j * xo_j - xg[g])

    (Feeding the whole byte b = lo + 16 hi against x_odd / 16 would save the shift, but LLVM then
    masks the bytes before widening, doubling the widening shuffles: measured 30% slower.)
    """
    return types.float32(w, s, xv, xg, hb), _q4_codegen(1)


@intrinsic
def q4_row_dot4(typingctx, w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb):
    """q4_row_dot of one row with four activations at once -> UniTuple(float32, 4)."""
    sig = types.UniTuple(types.float32, 4)(w, s, x0, x1, x2, x3, g0, g1, g2, g3, hb)
    return sig, _q4_codegen(4)
