"""int4, nvfp4 and int8 weights in 16-row slabs (layout "r16", _simd "int4 / nvfp4 weights in 16-row
interleaved slabs"): the layout's byte placement and round trip (any CPU), the slab dot against
float64 on the format's own dequantisation (int4 / nvfp4: AVX-512 VNNI here, the AVX2 form in a
forced-AVX2 child compiled for a Zen 3 target; int8: AVX-512 VNNI), whole expert calls against the
row layout and against float64 in every stage form (decode expert-major, few pairs, prefill row
blocks, biases, GPT-OSS's activation, int4 groups 32 / 64 / 128, nvfp4 with multiplier and
reciprocal row factors), dense weights, the choice of layout per process (forced AVX2: int4 / nvfp4
slabs, int8 rows; fp32 activations: rows), and the expert store's own cache file for it."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from numba import njit
from r16_util import assert_dense_slabs_equal_rows, assert_slabs_match

from freetoken_py.kernels import ExpertBank, moe_experts
from freetoken_py.kernels._buffers import R16_SCALES, decode_rows, r16_fits, r16_pack, r16_unpack
from freetoken_py.kernels._dots import R16_I8_OK, R16_OK, prep_q8r_nv_rows, prep_q8r_rows, r16_ok
from freetoken_py.kernels._simd import HAS_AVX512
from freetoken_py.kernels.cpu_moe import preferred_layout, r16_layout_fits

needs_r16 = pytest.mark.skipif(not R16_OK, reason="the int4 / nvfp4 slab kernels run with int8 activations (AVX2 or "
                                                  "AVX-512 VNNI) only")


def need(fmt: str) -> None:
    if not r16_ok(fmt):
        pytest.skip(f"this process runs no {fmt} slab kernel (int8: AVX-512 VNNI only)")

if R16_OK:
    from freetoken_py.kernels._simd import r16_dot, r16_dot4

    @njit(fastmath=True)
    def slab_mv(w, s, xq, xg, bpg, step):
        """[R, N]: w's rows against each activation row (R = 1 or 4), `step` rows (whole slabs) a call."""
        r = xq.shape[0]
        out = np.zeros((r, w.shape[0]), np.float32)
        for n in range(0, w.shape[0], step):
            if r == 4:
                r16_dot4(w[n:n + step], s[n:n + step], xq[0], xq[1], xq[2], xq[3], xg[0], xg[1], xg[2], xg[3], bpg,
                           out[0, n:n + step], out[1, n:n + step], out[2, n:n + step], out[3, n:n + step])
            else:
                r16_dot(w[n:n + step], s[n:n + step], xq[0], xg[0], bpg, out[0, n:n + step])
        return out


def int4_rows(n: int, k: int, g: int, seed: int):
    """Random int4 rows in the row layout (packed, fp16-bit scales) and their float64 values."""
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    w[w & 15 == 0] |= 1                      # codes q + 8 in [1, 15], as quantize_int4 writes them
    w[w >> 4 == 0] |= 16
    s = (rng.random((n, k // g)) * 0.02 + 1e-3).astype(np.float16).view(np.uint16)
    ref = decode_rows(w, s, "int4", g).double().numpy()
    return w, s, ref


def test_pack_places_each_nibble_and_scale_and_unpack_inverts_it():
    n, k, g = 32, 96, 32
    w, s, _ = int4_rows(n, k, g, 0)
    q = np.empty((n, k), np.uint8)
    q[:, 0::2], q[:, 1::2] = w & 15, w >> 4
    wr, sr = r16_pack(w, s)
    assert wr.shape == w.shape and sr.shape == s.shape
    assert sr.dtype == np.int16                                   # the dtype that tells the kernels the layout
    flat, sflat = wr.reshape(n // 16, -1), sr.view(np.uint16).reshape(n // 16, -1)
    for slab in range(n // 16):
        for r in range(16):
            for col in range(k):
                b, c, j, high = col // 32, (col % 32) // 8, col % 4, (col % 8) >= 4
                byte = flat[slab, 256 * b + 64 * c + 4 * r + j]
                assert (byte >> 4 if high else byte & 15) == q[16 * slab + r, col]
            for grp in range(k // g):
                assert sflat[slab, 16 * grp + r] == s[16 * slab + r, grp]
    back_w, back_s = r16_unpack(wr, sr)
    assert np.array_equal(back_w, w) and np.array_equal(back_s, s) and back_s.dtype == np.uint16
    e3 = np.stack([w, w ^ 0x11, w])                                 # leading (expert) dims
    s3 = np.stack([s, s, s ^ 1])
    wr3, sr3 = r16_pack(e3, s3)
    assert np.array_equal(wr3[1], r16_pack(e3[1], s3[1])[0]) and np.array_equal(sr3[2], r16_pack(e3[2], s3[2])[1])
    assert all(np.array_equal(a, b) for a, b in zip(r16_unpack(wr3, sr3), (e3, s3)))
    assert np.array_equal(wr3[1], r16_pack(e3[1], s3[1])[0])


def test_which_widths_and_formats_take_the_layout():
    assert r16_fits("int4", 32, 64, 32) and not r16_fits("int4", 24, 64, 32) and not r16_fits("int4", 32, 48, 16)
    assert r16_fits("int8", 32, 64, 32) and not r16_fits("int8", 32, 48, 32) and not r16_fits("bf16", 32, 64, 32)
    assert r16_layout_fits("int4", 768, 2048, 32) and r16_layout_fits("int4", 64, 64, 64)
    assert not r16_layout_fits("int4", 48, 64, 32)           # the up half would start inside a slab
    assert not r16_layout_fits("int4", 40, 64, 32)           # I not whole 32-blocks (the down rows' K)
    assert preferred_layout("int8", 768, 2048, 32) == ("r16" if R16_I8_OK else "rows")
    assert preferred_layout("int4", 48, 64, 32) == "rows" and preferred_layout("int8", 40, 64, 32) == "rows"
    assert preferred_layout("nvfp4", 768, 2048, 16) == ("r16" if R16_OK else "rows")
    assert preferred_layout("bf16", 768, 2048, 32) == "rows"      # fp8: tests/test_kernels_r16_fp8.py
    assert preferred_layout("int4", 768, 2048, 32) == ("r16" if R16_OK else "rows")
    with pytest.raises(ValueError, match="layout"):
        ExpertBank.empty("int4", 2, 64, 64, 32, layout="cols")
    if R16_OK:
        with pytest.raises(ValueError, match="r16 layout runs int4"):
            ExpertBank.empty("bf16", 2, 64, 64, 32, layout="r16")


@pytest.mark.parametrize("env", [{"FREETOKEN_SIMD": "avx2"}, {"FREETOKEN_INT_ACT": "fp32"}])
def test_forced_avx2_and_fp32_activations_choose_their_layouts(env):
    """FREETOKEN_SIMD=avx2 (the AVX2 kernels on an AVX-512 machine): int4 / nvfp4 banks take the
    slabs (the AVX2 slab dot), int8 stays in rows and an int8 bank claiming slabs is refused.
    FREETOKEN_INT_ACT=fp32: every bank stays in rows and an int4 bank claiming slabs is refused.
    Either way the expert call equals float64 on the bank's dequantisation (activations as that
    process's dot quantises them)."""
    code = """
import torch, numpy as np
from freetoken_py.kernels import ExpertBank, moe_experts
from freetoken_py.kernels._dots import INT_ACT, R16_I8_OK, R16_OK
from freetoken_py.kernels.cpu_moe import preferred_layout
avx2 = INT_ACT == "int8"
assert R16_OK == avx2 and not R16_I8_OK
assert preferred_layout("int4", 64, 128, 32) == preferred_layout("nvfp4", 64, 128, 16) == ("r16" if avx2 else "rows")
assert preferred_layout("int8", 64, 128, 32) == "rows"
g = torch.Generator().manual_seed(0)
gate, up, down = torch.randn(4, 64, 128, generator=g), torch.randn(4, 64, 128, generator=g), torch.randn(4, 128, 64, generator=g)
refused = ExpertBank.from_weights(gate, up, down, "int8" if avx2 else "int4", 32)
assert refused.layout == "rows"
try:
    ExpertBank(refused.fmt, refused.group_size, refused.w13, refused.s13.view(np.int32 if avx2 else np.int16),
               refused.w2, refused.s2.view(np.int32 if avx2 else np.int16))
    raise SystemExit("a slab bank was accepted without its kernels")
except ValueError as e:
    assert "r16 layout runs" in str(e)
bank = ExpertBank.from_weights(gate, up, down, "int4", 32, layout=preferred_layout("int4", 64, 128, 32))
assert bank.layout == ("r16" if avx2 else "rows")
x = torch.randn(3, 128, generator=g)
ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
out = moe_experts(bank, x, ids, torch.full((3, 2), 0.5))
# float64 on the bank's own dequantisation, activations as this process's int4 dot sees them
from freetoken_py.quant import roundtrip_act_q8
q = (lambda v: roundtrip_act_q8(v.float()).double()) if avx2 else (lambda v: v.double())
w13, w2 = (t.double() for t in bank.dequantized())
ref = torch.zeros(3, 128, dtype=torch.float64)
for t in range(3):
    for e in ids[t].tolist():
        gu = w13[e] @ q(x[t:t + 1])[0]
        h = torch.nn.functional.silu(gu[:64]) * gu[64:]
        ref[t] += 0.5 * (w2[e] @ q(h[None])[0])
err = float((out.double() - ref).abs().max() / ref.abs().max())
assert err <= 5e-3, err
print("ok")
"""
    env = dict(os.environ, **env)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


ZEN3_FEATURES = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+fxsr,+lzcnt,+mmx,+movbe,+popcnt,+sse,+sse2,+sse3,"
                 "+sse4.1,+sse4.2,+ssse3")


@pytest.mark.skipif(not (R16_OK and HAS_AVX512), reason="the AVX-512 process runs the AVX2 slab dot in a child")
def test_the_avx2_slab_dot_in_a_forced_avx2_process(tmp_path):
    """This module's int4 / nvfp4 slab-dot tests again in a FREETOKEN_SIMD=avx2 child (the AVX2
    form of the slab dot, as a Zen 3 runs it): against float64 at K 32 .. 2048, groups 32 / 64 /
    128, nvfp4's multiplier and reciprocal factors, 1 and 4 activations, a call per slab and all
    rows in one; and dense weights. The expert call in slabs (the stage forms are the same code on
    either instruction set) runs in that process in
    `test_forced_avx2_and_fp32_activations_choose_their_layouts`; every stage form here (VNNI).
    Expert calls are left out of the child for CI time (each format's expert kernel is a cold
    compile of ~30-60 s in a new kernel-cache variant)."""
    # compiled for a Zen 3 (AVX2 / FMA / F16C / BMI2, no AVX-512, no GFNI) in its own kernel cache: an
    # encoding a Zen 3 lacks cannot slip into the AVX2 form unnoticed
    zen3 = dict(NUMBA_CPU_NAME="znver3", NUMBA_CACHE_DIR=str(tmp_path / "numba"), NUMBA_CPU_FEATURES=ZEN3_FEATURES)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "(slab_dot or dense) and not int8 and not avx2"],
                       env=dict(os.environ, FREETOKEN_SIMD="avx2", **zen3), capture_output=True, text=True, timeout=900)
    tail = r.stdout[-3000:]
    assert r.returncode == 0, tail
    import re
    passed = int(re.search(r"(\d+) passed", tail).group(1))
    assert passed >= 29 and "failed" not in tail, tail


@needs_r16
@pytest.mark.parametrize("k,g", [(32, 32), (96, 32), (160, 32), (2048, 32), (128, 64), (192, 64), (384, 128)])
@pytest.mark.parametrize("rows", [1, 4])
def test_slab_dot_equals_float64(k, g, rows):
    n = 48
    w, s, ref = int4_rows(n, k, g, k + g)
    wr, sr = r16_pack(w, s)
    x = np.random.default_rng(k).standard_normal((rows, k)).astype(np.float32) * 3
    xq, xg = prep_q8r_rows(x)
    nb = k // 32
    xs = xg[:, :nb].astype(np.float64)
    assert np.allclose(xg[:, nb:], 8 * xg[:, :nb] * xq.reshape(rows, nb, 32).sum(-1), rtol=1e-6)
    xdq = (xq.reshape(rows, nb, 32).astype(np.float64) * xs[:, :, None]).reshape(rows, k)
    assert_slabs_match(xdq @ ref.T, lambda step, ok: slab_mv(wr if ok else w, sr if ok else s.view(np.int16), xq, xg,
                                                             g // 32, step), n)


def expert_weights(e, i, d, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, i, d, generator=g) * 0.1, torch.randn(e, i, d, generator=g) * 0.1,
            torch.randn(e, d, i, generator=g) * 0.1)


def reference(bank: ExpertBank, x, ids, wts, activation="silu"):
    """float64 on the bank's dequantised weights and the int8-quantised activations of each stage."""
    from freetoken_py.quant import roundtrip_act_q8
    w13, w2 = (t.double() for t in bank.dequantized())
    inter = bank.inter
    out = torch.zeros(x.shape, dtype=torch.float64)
    xr = roundtrip_act_q8(x).double()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e] @ xr[t]
            if bank.b13.shape[0]:
                gu = gu + torch.from_numpy(bank.b13[e]).double()
            gt, u = gu[:inter], gu[inter:]
            if activation == "silu":
                h = torch.nn.functional.silu(gt) * u
            else:
                gt, u = gt.clamp(max=7.0), u.clamp(-7.0, 7.0)
                h = (u + 1) * gt * torch.sigmoid(1.702 * gt)
            y = w2[e] @ roundtrip_act_q8(h.float()[None])[0].double()
            if bank.b2.shape[0]:
                y = y + torch.from_numpy(bank.b2[e]).double()
            out[t] += float(wts[t, j]) * y
    return out


@needs_r16
@pytest.mark.parametrize("fmt,tokens,e,i,d,g,topk", [
    ("int4", 1, 8, 768, 2048, 32, 8),      # decode at Qwen3-30B-A3B widths: expert-major down stage
    ("int4", 1, 8, 64, 576, 32, 8),        # expert-major with a short last down block (576 = 2 x 256 + 64)
    ("int4", 1, 8, 64, 128, 32, 4),        # decode, short rows: the row-block down stage
    ("int4", 3, 8, 96, 256, 32, 2),        # a few tokens: 1-4 pairs per expert
    ("int4", 40, 4, 128, 256, 64, 2),      # prefill: 20 pairs per expert, row blocks of 16
    ("int4", 9, 6, 128, 384, 128, 3),      # group 128
    ("nvfp4", 1, 8, 768, 2048, 16, 8), ("nvfp4", 3, 8, 96, 256, 16, 2), ("nvfp4", 40, 4, 128, 256, 16, 2),
    ("int8", 1, 8, 768, 2048, 32, 8), ("int8", 1, 8, 64, 576, 32, 8), ("int8", 3, 8, 96, 256, 32, 2),
    ("int8", 40, 4, 128, 256, 32, 2),
])
def test_expert_call_equals_rows_and_float64(fmt, tokens, e, i, d, g, topk):
    need(fmt)
    gate, up, down = expert_weights(e, i, d, tokens + i)
    rows = ExpertBank.from_weights(gate, up, down, fmt, g)
    slabs = ExpertBank.from_weights(gate, up, down, fmt, g, layout="r16")
    assert rows.layout == "rows" and slabs.layout == "r16" and not np.array_equal(slabs.w13, rows.w13)
    assert slabs.s13.dtype == R16_SCALES[fmt]
    assert all(torch.equal(a, b) for a, b in zip(rows.dequantized(), slabs.dequantized()))
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, d, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:topk] for _ in range(tokens)])
    wts = torch.rand(tokens, topk, generator=gen)
    a, b = moe_experts(rows, x, ids, wts), moe_experts(slabs, x, ids, wts)
    scale = float(a.abs().max())
    assert float((a - b).abs().max()) <= 1e-5 * scale
    ref = reference(slabs, x, ids, wts)
    assert float((b.double() - ref).abs().max()) <= 5e-3 * float(ref.abs().max())


@needs_r16
@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("tokens,e,d,topk,threads", [(1, 4, 128, 2, 2), (6, 4, 128, 2, 2), (1, 8, 576, 8, 2),
                                                     (1, 8, 576, 5, 2)])
def test_biases_and_gptoss_activation_in_slabs(fmt, tokens, e, d, topk, threads):
    """Biased experts (gpt-oss) in slabs against rows and float64: the row-block form (4 experts),
    whole experts per worker (8 hit over 2 workers) and the staged expert-major form (5 hit); the
    block plan's thread count is passed, so the path is the same on any CPU."""
    need(fmt)
    from freetoken_py.kernels._dots import ACTIVATIONS
    from freetoken_py.kernels._moe_kernels import down_expert_major, group_pairs, moe_rows, whole_experts
    i = 64
    gate, up, down = expert_weights(e, i, d, 7)
    g = torch.Generator().manual_seed(8)
    b13, b2 = torch.randn(e, 2 * i, generator=g), torch.randn(e, d, generator=g)
    rows = ExpertBank.from_weights(gate, up, down, fmt, 32).with_biases(b13, b2)
    slabs = ExpertBank.from_weights(gate, up, down, fmt, 32, layout="r16").with_biases(b13, b2)
    assert slabs.layout == "r16"
    x = torch.randn(tokens, d, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(tokens)])
    wts = torch.rand(tokens, topk, generator=g)
    off = group_pairs(ids.reshape(-1).numpy().astype(np.int64), e)[2]
    assert whole_experts(off, d, threads) == (topk == 8)
    assert down_expert_major(off, d, threads) == (d == 576)
    for act in ("silu", "gptoss"):
        outs = []
        for bank in (rows, slabs):
            out = np.zeros((tokens, d), np.float32)
            moe_rows(bank.w13, bank.s13, bank.w2, bank.s2, x.numpy(), ids.numpy().astype(np.int64),
                     wts.numpy().astype(np.float32), ACTIVATIONS[act], bank.group_size, threads, out, bank.b13, bank.b2)
            outs.append(torch.from_numpy(out))
        a, b = outs
        assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max()), act
        ref = reference(slabs, x, ids, wts, act)
        assert float((b.double() - ref).abs().max()) <= 5e-3 * float(ref.abs().max()), act


@needs_r16
def test_expert_store_keeps_r16_banks_in_their_own_cache_file(checkpoint_factory, tmp_path):
    import shutil

    from freetoken_py.engine import expert_store as es
    from freetoken_py.models.loader import load_model

    src = checkpoint_factory("qwen3_moe_step2")                   # I = 64, D = 64: r16 fits
    path = tmp_path / src.name
    shutil.copytree(src, path, ignore=shutil.ignore_patterns("freetoken-experts-*"))
    model = load_model(path, "auto", show_progress=False, experts="skip")
    args, dtype = model.args, model.dtype
    rows = es.open_expert_store(path, args, dtype, "int4", 32, show_progress=False)
    built = es.open_expert_store(path, args, dtype, "int4", 32, show_progress=False, layout="auto")
    assert built.path != rows.path and "-r16-" in built.path.name
    count = es.LAYER_BUILDS
    cached = es.open_expert_store(path, args, dtype, "int4", 32, show_progress=False, layout="auto")
    assert cached.source == "cache" and es.LAYER_BUILDS == count
    for a, b, c in zip(rows.banks, built.banks, cached.banks):
        if a is None:
            continue
        assert a.layout == "rows" and b.layout == c.layout == "r16"
        assert np.array_equal(b.w13, c.w13) and np.array_equal(b.s2, c.s2)
        assert all(torch.equal(u, v) for u, v in zip(a.dequantized(), c.dequantized()))
    # a header from before the layout key reads as rows: refused for r16, taken for rows
    from freetoken_py.engine import expert_cache as fc
    header = fc.read_header(built.path)
    assert header["layout"] == "r16"
    old = {k: v for k, v in header.items() if k != "layout"}
    with pytest.raises(fc.CacheInvalid, match="layout"):
        fc.check_header(old, header, built.path)
    fc.check_header(old, dict(header, layout="rows"), built.path)
    # a rows file renamed to the r16 name is refused by its header and rebuilt
    shutil.copy(rows.path, built.path)
    with pytest.warns(es.ExpertCacheWarning, match="layout"):
        again = es.open_expert_store(path, args, dtype, "int4", 32, show_progress=False, layout="auto")
    assert all(b is None or b.layout == "r16" for b in again.banks)


def nvfp4_rows(n: int, k: int, seed: int, positive_factor: bool):
    """Random nvfp4 rows in the row layout (codes, e4m3 group scales, a row factor: a multiplier
    when positive, a reciprocal when negative, as quant/nvfp4.py stores them) and their values."""
    from freetoken_py.quant.nvfp4 import exec_scales
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    e4m3 = torch.from_numpy((rng.random((n, k // 16)) * 3 + 0.01).astype(np.float32)).to(torch.float8_e4m3fn)
    f = torch.from_numpy(rng.random(n).astype(np.float32) * 0.5 + 0.01)
    s = exec_scales(e4m3, f if positive_factor else -1.0 / f).numpy()
    return w, s, decode_rows(w, s, "nvfp4", 16).double().numpy()


def test_nvfp4_pack_places_scales_and_factors():
    n, k = 32, 64
    w, s, _ = nvfp4_rows(n, k, 3, True)
    wr, sr = r16_pack(w, s)
    assert sr.dtype == np.int8 and sr.shape == s.shape and np.array_equal(wr, r16_pack(w, s.view(np.uint8))[0])
    flat = sr.view(np.uint8).reshape(n // 16, -1)
    ng = k // 16
    for slab in range(n // 16):
        for r in range(16):
            for g in range(ng):
                assert flat[slab, 16 * g + r] == s[16 * slab + r, g]
            assert np.array_equal(flat[slab, 16 * ng + 4 * r:16 * ng + 4 * r + 4], s[16 * slab + r, ng:])
    back_w, back_s = r16_unpack(wr, sr)
    assert np.array_equal(back_w, w) and np.array_equal(back_s, s) and back_s.dtype == np.uint8


@needs_r16
@pytest.mark.parametrize("k", [32, 96, 2048])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("positive_factor", [True, False])
def test_nvfp4_slab_dot_equals_float64(k, rows, positive_factor):
    n = 32
    w, s, ref = nvfp4_rows(n, k, k + rows, positive_factor)
    wr, sr = r16_pack(w, s)
    x = np.random.default_rng(k).standard_normal((rows, k)).astype(np.float32)
    xq, xg = prep_q8r_nv_rows(x)
    nb = k // 32
    q = xq.reshape(rows, nb, 2, 16).astype(np.float64)
    assert np.allclose(xg[:, nb:].reshape(rows, nb, 2), 12 * xg[:, :nb, None] * q.sum(-1), rtol=1e-6)
    xdq = (xq.reshape(rows, nb, 32).astype(np.float64) * xg[:, :nb, None].astype(np.float64)).reshape(rows, k)
    assert_slabs_match(xdq @ ref.T, lambda step, ok: slab_mv(wr if ok else w, sr if ok else s.view(np.int8), xq, xg,
                                                             0, step), n)


@needs_r16
@pytest.mark.parametrize("fmt,g", [("int4", 32), ("int4", 128), ("nvfp4", 16), ("int8", 32)])
def test_dense_weights_take_the_slabs_and_equal_rows(fmt, g):
    need(fmt)
    assert_dense_slabs_equal_rows(fmt, g)


def int8_rows(n: int, k: int, seed: int):
    """Random int8 rows (codes in [-127, 127], one fp32 scale per row) and their float64 values."""
    rng = np.random.default_rng(seed)
    w = rng.integers(-127, 128, (n, k)).astype(np.int8)
    s = (rng.random((n, 1)) * 0.02 + 1e-3).astype(np.float32)
    return w, s, w.astype(np.float64) * s.astype(np.float64)


def test_int8_pack_places_each_byte_and_scale():
    n, k = 32, 96
    w, s, _ = int8_rows(n, k, 1)
    wr, sr = r16_pack(w, s)
    assert wr.dtype == np.int8 and sr.dtype == np.int32 and wr.shape == w.shape and sr.shape == s.shape
    flat, sflat = wr.reshape(n // 16, -1), sr.view(np.float32).reshape(n // 16, 16)
    for slab in range(n // 16):
        for r in range(16):
            for col in range(k):
                assert flat[slab, 64 * (col // 4) + 4 * r + col % 4] == w[16 * slab + r, col]
            assert sflat[slab, r] == s[16 * slab + r, 0]
    back_w, back_s = r16_unpack(wr, sr)
    assert np.array_equal(back_w, w) and np.array_equal(back_s, s) and back_s.dtype == np.float32


@pytest.mark.skipif(not R16_I8_OK, reason="the int8 slab kernel runs on AVX-512 VNNI only")
@pytest.mark.parametrize("k", [32, 96, 2048, 7168])
@pytest.mark.parametrize("rows", [1, 4])
def test_int8_slab_dot_equals_float64(k, rows):
    """The xor-flipped codes (w + 128) and the 128 s_x sum(q) removed per block give the signed
    products: against float64 on the codes times the row scale, the activations as quantised."""
    from freetoken_py.kernels._dots import prep_q8r_rows_as
    n = 48
    w, s, ref = int8_rows(n, k, k + rows)
    wr, sr = r16_pack(w, s)
    x = np.random.default_rng(k).standard_normal((rows, k)).astype(np.float32) * 3
    xq, xg = prep_q8r_rows_as(x, 32, 128.0)
    nb = k // 32
    assert np.allclose(xg[:, nb:], 128 * xg[:, :nb] * xq.reshape(rows, nb, 32).sum(-1), rtol=1e-6)
    xdq = (xq.reshape(rows, nb, 32).astype(np.float64) * xg[:, :nb, None].astype(np.float64)).reshape(rows, k)
    assert_slabs_match(xdq @ ref.T, lambda step, ok: slab_mv(wr if ok else w, sr if ok else s.view(np.int32), xq, xg,
                                                             1, step), n)
