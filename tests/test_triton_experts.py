"""The Triton expert kernels (kernels/_triton_moe.py through gpu_moe.moe_slots / moe_pairs*) against a
float64 torch reference, in Triton's CPU interpreter (TRITON_INTERPRET=1, set in a fresh process
before Triton is imported): every format (float fp32 / bf16, int8, int4 g32 / g64, fp8 128-blocks,
nvfp4), odd shapes, T = 1..9 tokens (every T of 1..8 for bf16, int4, fp8 and nvfp4), experts routed by several tokens (one group reads them once;
nine pairs of one expert split into two groups), a slot table over two chunks in shuffled order,
and the kernels' pieces bit for bit: the e4m3 / e2m1 decoders on every code, the activation
rounding against `seen_by_cpu_kernels`. Small shapes: the interpreter runs numpy per op."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r'''
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
import triton
import triton.language as tl
from freetoken_py.kernels import _triton_moe as k, gpu_moe
from freetoken_py.kernels.gpu_slots import build_table
from freetoken_py.quant import quantize_int4, quantize_int8
from freetoken_py.quant.fp8 import expand_block_scales, quantize_fp8_blocks
from freetoken_py.quant.int4 import unpack_int4
from freetoken_py.quant.nvfp4 import group_scales, quantize_nvfp4, unpack_e2m1

g = torch.Generator().manual_seed(0)

# ---- the decoders, bit for bit on every code ------------------------------------------------
@triton.jit
def decode(src, dst, N: tl.constexpr, E4M3: tl.constexpr):
    i = tl.arange(0, N)
    b = tl.load(src + i)
    tl.store(dst + i, k._e4m3(b, False) if E4M3 else k._e2m1(b))

codes = torch.arange(256, dtype=torch.int32)
got = torch.empty(256)
decode[(1,)](codes, got, 256, True)
want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
finite = ~want.isnan()
assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32)), "e4m3 decode"
got16 = torch.empty(16)
decode[(1,)](torch.arange(16, dtype=torch.int32), got16, 16, False)
assert torch.equal(got16, unpack_e2m1(torch.tensor([[0x10 * 0 + c for c in range(16)]], dtype=torch.uint8))[0, 0::2]), got16

# ---- the activation rounding: seen_by_cpu_kernels bit for bit (a zero block, a partial last block)
@triton.jit
def round_rows(src, dst, D, R: tl.constexpr, C: tl.constexpr):
    i = tl.arange(0, R)[:, None] * D + tl.arange(0, C)[None, :]
    m = (tl.arange(0, C) < D)[None, :]
    tl.store(dst + i, k._round32(tl.load(src + i, mask=m, other=0.0), R, C), mask=m)

x = torch.randn(4, 100, generator=g) * torch.tensor([1e-3, 1.0, 300.0, 1.0])[:, None]
x[1, 32:64] = 0
x[3, :32] = torch.arange(32) - 15.5     # with 127 first: scale 1, every other value a .5 tie (to even)
x[3, 0] = 127.0
r = torch.empty(4, 100)
round_rows[(1,)](x, r, 100, 4, 128)
assert torch.equal(r, gpu_moe.seen_by_cpu_kernels(x)), (r - gpu_moe.seen_by_cpu_kernels(x)).abs().max()

# ---- experts in each format and their float64 weights ---------------------------------------
def make(fmt, inter, hidden, group):
    w13 = torch.randn(2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(hidden, inter, generator=g) / inter ** 0.5
    if fmt in ("fp32", "bf16"):
        dt = torch.float32 if fmt == "fp32" else torch.bfloat16
        parts = (w13.to(dt), w2.to(dt))
        return parts, (parts[0].double(), parts[1].double())
    if fmt == "int8":
        (a, sa), (b, sb) = quantize_int8(w13), quantize_int8(w2)
        parts = (a, sa[:, None].contiguous(), b, sb[:, None].contiguous())
        return parts, (a.double() * sa.double()[:, None], b.double() * sb.double()[:, None])
    if fmt == "int4":
        (a, sa), (b, sb) = (quantize_int4(w, group, torch.float16) for w in (w13, w2))
        deq = lambda q, s: (unpack_int4(q).double().view(q.shape[0], -1, group) * s.double()[..., None]).view(q.shape[0], -1)
        return (a, sa.view(torch.int16), b, sb.view(torch.int16)), (deq(a, sa), deq(b, sb))
    if fmt == "fp8":
        out, ref = [], []
        for w in (w13, w2):
            c, grid = quantize_fp8_blocks(w, (group, group))
            rs = expand_block_scales(grid, w.shape[0], group)
            out += [c.view(torch.uint8), rs]
            ref.append(c.double() * rs.double().repeat_interleave(group, dim=1)[:, :w.shape[1]])
        return tuple(out), tuple(ref)
    (a, sa), (b, sb) = (quantize_nvfp4(w, 16) for w in (w13, w2))
    deq = lambda q, s: unpack_e2m1(q).double() * group_scales(s).double().repeat_interleave(16, dim=1)
    return (a, sa, b, sb), (deq(a, sa), deq(b, sb))

def reference(fmt, x, ref):           # float64, activations seen as the CPU kernels see them
    rounds = fmt in ("int8", "int4", "nvfp4")
    seen = (lambda v: gpu_moe.seen_by_cpu_kernels(v.float()).double()) if rounds else (lambda v: v.double())
    gate, up = (seen(x) @ ref[0].T).chunk(2, dim=-1)
    return seen(torch.nn.functional.silu(gate) * up) @ ref[1].T

def check(fmt, tokens, hidden, inter, n_exp, top_k, group=32, route=None):
    experts = [make(fmt, inter, hidden, group) for _ in range(n_exp)]
    # slots: the experts copied into two chunks (their order shuffled), read through one table
    perm = torch.randperm(n_exp, generator=g).tolist()
    half = (n_exp + 1) // 2
    chunks = [[torch.stack([experts[e][0][p] for e in perm[a:b]]) for p in range(len(experts[0][0]))]
              for a, b in ((0, half), (half, n_exp))]
    slot_parts = [tuple(c[p][i] for p in range(len(c))) for c in chunks for i in range(c[0].shape[0])]
    table = build_table(slot_parts, "float" if fmt in ("fp32", "bf16") else fmt, group)
    slot_of = {e: s for s, e in enumerate(perm)}
    if route is None:
        route = [torch.randperm(n_exp, generator=g)[:top_k].tolist() for _ in range(tokens)]
    pairs = [(t, e) for t, es in enumerate(route) for e in es]
    adt = torch.bfloat16 if fmt == "bf16" else torch.float32
    x = torch.randn(tokens, hidden, generator=g).to(adt)
    rows = torch.tensor([t for t, _ in pairs])
    wts = torch.rand(len(pairs), generator=g)
    out = torch.randn(tokens, hidden, generator=g).to(adt)      # added into, not overwritten
    want = out.double().clone()
    for (t, e), w in zip(pairs, wts.tolist()):
        want[t] += w * reference(fmt, x[t:t + 1], experts[e][1])[0]
    gpu_moe.moe_slots(out, x, rows, wts, table, [slot_of[e] for _, e in pairs])
    err = ((out.double() - want).abs().max() / want.abs().max()).item()
    tol = 1e-2 if fmt == "bf16" else 2e-6
    assert err <= tol, (fmt, tokens, hidden, inter, group, err)
    return err

errs = {}
errs["fp32 T1"] = check("fp32", 1, 72, 40, 5, 4)                 # sizes off every tile
errs["bf16 T3"] = check("bf16", 3, 128, 96, 4, 2)
errs["int8 T2"] = check("int8", 2, 72, 44, 4, 2)
errs["int4 T1"] = check("int4", 1, 96, 64, 5, 4)
errs["int4 T5 g64"] = check("int4", 5, 128, 64, 3, 2, group=64)
errs["fp8 T4"] = check("fp8", 4, 136, 72, 4, 3, group=128)      # partial 128-blocks on both axes
errs["fp8 T1"] = check("fp8", 1, 392, 264, 3, 2, group=128)     # (one token: steps of two 128-blocks)
errs["nvfp4 T2"] = check("nvfp4", 2, 80, 48, 4, 2)
errs["nvfp4 T8"] = check("nvfp4", 8, 64, 32, 3, 2)
# nine tokens all routed to expert 0 (two groups of it) and one more each: 18 pairs
errs["int4 T9"] = check("int4", 9, 64, 32, 3, 2, route=[[0, 1 + t % 2] for t in range(9)])
errs["fp32 T7 dup"] = check("fp32", 7, 48, 24, 2, 2)           # every token on both experts
errs["nvfp4 T17"] = check("nvfp4", 17, 32, 32, 2, 1)           # past 16 tokens: the separate per-token sum
# every issue-40 format at every T = 1..8 on sizes off the tiles, expert 0 routed by every token
# (one group reads it once for all of them) and experts 1 / 2 alternating
sweep = {"bf16": (72, 40, 32), "int4": (96, 32, 32), "fp8": (136, 72, 128), "nvfp4": (80, 48, 16)}
for fmt, (hidden, inter, group) in sweep.items():
    for tokens in range(1, 9):
        errs[f"{fmt} T{tokens} sweep"] = check(fmt, tokens, hidden, inter, 3, 2, group=group,
                                               route=[[0, 1 + t % 2] for t in range(tokens)])

# the list API (experts passed per pair) still equals the slot API; a misshapen expert is a ValueError
parts, ref = make("int4", 32, 64, 32)
x = torch.randn(2, 64, generator=g)
out = torch.zeros(2, 64)
gpu_moe.moe_pairs_quant(out, x, torch.tensor([0, 1]), torch.tensor([0.5, 2.0]), [parts, parts], "int4", 32)
want = torch.stack([0.5 * reference("int4", x[:1], ref)[0], 2.0 * reference("int4", x[1:], ref)[0]])
assert (out.double() - want).abs().max() <= 2e-6 * want.abs().max()
try:
    gpu_moe.moe_pairs_quant(out, x, torch.tensor([0]), torch.ones(1), [(parts[0][:, :8], *parts[1:])], "int4", 32)
    raise AssertionError("a misshapen expert was accepted")
except ValueError as exc:
    assert "part 0" in str(exc), exc
print("ok", {k: f"{v:.1e}" for k, v in errs.items()})
'''


def test_triton_experts_equal_a_float64_reference_in_the_interpreter():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.startswith("ok"), proc.stdout
