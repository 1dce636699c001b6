"""bf16 decode/prefill pieces of an MLA (DeepSeek-V3-width) layer, old vs new kernel, interleaved.

    python bench/bf16_dots.py [--threads 1] [--rounds 7] [--ctx 544] [--prefill-tokens 64] [--small]

Per piece of one decode token (random bf16 weights at DeepSeek-V3's real widths: q_a, q_b, kv_a,
o_proj, the shared expert, 8 routed experts at T = 1, the lm_head, and the absorbed attention over
--ctx cached latents), A B A B ... in one process: "fp32" = bf16 weights widened to fp32 times fp32
activations (the AVX2 path, FREETOKEN_BF16_ACT=fp32), "bf16" = vdpbf16ps with activations rounded
to bf16 (the AVX512-BF16 default). Then the prefill GEMMs at --prefill-tokens rows: ours (both
forms) against torch's bf16 matmul (oneDNN; bf16 output). Prints one JSON line: per piece the
median ms of each form, new/old speed-up, and each piece's share of the old and new token.
On a shared machine read the ratios and shares, not the absolute times.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from numba import njit, prange

from freetoken_py.kernels import DenseWeight, configure_threads
from freetoken_py.kernels import _dots
from freetoken_py.kernels._moe_kernels import RB1, RB2, _down_block, _gate_up_block, group_pairs
from freetoken_py.kernels._simd import HAS_AVX512BF16
from freetoken_py.kernels.cpu_linear import dense_rows_prepared
from freetoken_py.kernels.cpu_mla import mla_decode

D, H, QL, R, DN, DR, DV, I, E, V = 7168, 128, 1536, 512, 128, 64, 128, 2048, 8, 32000


@njit(parallel=True, fastmath=True, cache=False)
def _moe(w13, s13, w2, s2, xv, xg, ids, wts, kind, round_h, out):
    """_moe_kernels.moe_rows with the activation form chosen by the caller (xv fp32 or bf16 bits;
    round_h: the hidden rows rounded to bf16 for the down projection too)."""
    k = ids.shape[1]
    fid = ids.reshape(-1)
    fw = wts.reshape(-1)
    inter, hidden = w13.shape[1] // 2, w2.shape[1]
    order, eids, off = group_pairs(fid, w13.shape[0])
    h = np.empty((fid.shape[0], inter), np.float32)
    nb1 = (inter + RB1 - 1) // RB1
    ub = np.empty((eids.shape[0] * nb1, 4, RB1), np.float32)
    for task in prange(eids.shape[0] * nb1):
        u = task // nb1
        i0 = (task - u * nb1) * RB1
        _gate_up_block(w13[eids[u]], s13[eids[u]], xv, xg, order[off[u]:off[u + 1]], k, i0, min(inter, i0 + RB1),
                       kind, 16, h, ub[task], np.zeros(0, np.float32))
    nb2 = (hidden + RB2 - 1) // RB2
    hg = np.zeros((h.shape[0], 1), np.float32)
    if round_h:
        hb = _dots.prep_bf16_rows(h)
        for task in prange(nb2):
            _down_block(w2, s2, hb, hg, order, eids, off, fw, k, task * RB2, min(hidden, task * RB2 + RB2), 16, out)
    else:
        for task in prange(nb2):
            _down_block(w2, s2, h, hg, order, eids, off, fw, k, task * RB2, min(hidden, task * RB2 + RB2), 16, out)


def rand_bf16(rows: int, cols: int, g: torch.Generator, scale: float = 0.02) -> np.ndarray:
    out = np.empty((rows, cols), np.uint16)
    for r in range(0, rows, 2048):
        t = (torch.randn(min(2048, rows - r), cols, generator=g) * scale).bfloat16()
        out[r:r + t.shape[0]] = t.view(torch.int16).numpy().view(np.uint16)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ctx", type=int, default=544)
    ap.add_argument("--prefill-tokens", type=int, default=64)
    ap.add_argument("--small", action="store_true", help="1/8 of every width (a seconds-long smoke run)")
    args = ap.parse_args()
    if not HAS_AVX512BF16:
        raise SystemExit("bench/bf16_dots.py compares the AVX512-BF16 dot with the fp32 one: this CPU has no AVX512-BF16")
    configure_threads(args.threads)
    d, h, ql, i, v = (D // 8, H // 8, QL // 8, I // 8, V // 8) if args.small else (D, H, QL, I, V)
    g = torch.Generator().manual_seed(0)
    shapes = {"q_a": (ql, d), "q_b": (h * (DN + DR), ql), "kv_a": (R + DR, d), "o_proj": (d, h * DV),
              "shared13": (2 * i, d), "shared2": (d, i), "lm_head": (v, d)}
    dense = {n: rand_bf16(*s, g) for n, s in shapes.items()}
    w13 = np.stack([rand_bf16(2 * i, d, g) for _ in range(E)])
    w2 = np.stack([rand_bf16(d, i, g) for _ in range(E)])
    s13, s2 = np.zeros((E, 2 * i, 0), np.float32), np.zeros((E, d, 0), np.float32)
    kv_b = rand_bf16(h * (DN + DV), R, g, 0.05).reshape(h, DN + DV, R)
    kc = rand_bf16(args.ctx + 8, R, g, 1.0).reshape(-1, 1, R)
    vc = rand_bf16(args.ctx + 8, DR, g, 1.0).reshape(-1, 1, DR)
    ctx = np.arange(args.ctx, dtype=np.int64)
    ctx_off = np.array([0, args.ctx], np.int64)
    q_nope = torch.randn(1, h, DN, generator=g).numpy()
    q_rope = torch.randn(1, h, DR, generator=g).numpy()
    ex_c, ex_r = np.zeros((1, R), np.float32), np.zeros((1, DR), np.float32)
    lut = np.ones(1, np.float32)
    attn = np.empty((1, h * DV), np.float32)
    ids = np.arange(E, dtype=np.int64).reshape(1, E)
    wts = np.full((1, E), 1.0 / E, np.float32)
    xg = np.zeros((args.prefill_tokens, 1), np.float32)

    def x_for(k: int, t: int = 1) -> np.ndarray:
        return torch.randn(t, k, generator=g).numpy()

    def dense_call(name: str, form: str, t: int = 1):
        w = dense[name]
        x = x_for(w.shape[1], t)
        out = np.empty((t, w.shape[0]), np.float32)
        s = np.zeros((w.shape[0], 0), np.float32)
        if form == "torch":
            wt, xt = torch.from_numpy(w.view(np.int16)).view(torch.bfloat16), torch.from_numpy(x)
            return lambda: (xt.bfloat16() @ wt.T).float()
        if form == "bf16":
            return lambda: dense_rows_prepared(w, s, _dots.prep_bf16_rows(x), xg, 32, out)
        return lambda: dense_rows_prepared(w, s, x, xg, 32, out)

    def experts_call(form: str):
        x = x_for(d)
        out = np.zeros((1, d), np.float32)
        if form == "bf16":
            return lambda: _moe(w13, s13, w2, s2, _dots.prep_bf16_rows(x), xg, ids, wts, 0, True, out)
        return lambda: _moe(w13, s13, w2, s2, x, xg, ids, wts, 0, False, out)

    def attn_call(_form: str):
        return lambda: mla_decode(q_nope, q_rope, kv_b, kc, vc, 1.0, 1.0, lut, ex_c, ex_r, False, ctx, ctx_off,
                                  0.1, attn)

    pieces = {n: (lambda f, n=n: dense_call(n, f)) for n in shapes}
    pieces["experts_top8"] = experts_call
    pieces["absorbed_attention"] = attn_call        # not a bf16-activation piece: the same code both ways
    per_layer = {"q_a", "q_b", "kv_a", "o_proj", "shared13", "shared2", "experts_top8", "absorbed_attention"}
    calls = {(n, f): make(f) for n, make in pieces.items() for f in ("fp32", "bf16")}
    for fn in calls.values():
        fn()                                         # compile / warm
    times = {key: [] for key in calls}
    for _ in range(args.rounds):
        for key, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    med = {key: statistics.median(v) * 1e3 for key, v in times.items()}
    layers = 2
    tot = {f: sum(med[(n, f)] * (layers if n in per_layer else 1) for n in pieces) for f in ("fp32", "bf16")}
    decode = {n: {"fp32_ms": round(med[(n, "fp32")], 3), "bf16_ms": round(med[(n, "bf16")], 3),
                  "speedup": round(med[(n, "fp32")] / med[(n, "bf16")], 3),
                  "share_fp32": round(med[(n, "fp32")] * (layers if n in per_layer else 1) / tot["fp32"], 3),
                  "share_bf16": round(med[(n, "bf16")] * (layers if n in per_layer else 1) / tot["bf16"], 3)}
              for n in pieces}
    t = args.prefill_tokens
    pre_calls = {(n, f): dense_call(n, f, t) for n in ("shared13", "q_b") for f in ("fp32", "bf16", "torch")}
    for fn in pre_calls.values():
        fn()
    pt = {key: [] for key in pre_calls}
    for _ in range(max(3, args.rounds // 2)):
        for key, fn in pre_calls.items():
            t0 = time.perf_counter()
            fn()
            pt[key].append(time.perf_counter() - t0)
    # the routed experts at prefill size (every expert gets all t tokens): numba both forms vs
    # cpu_moe's torch bf16 path (what moe_experts runs there in bf16 mode)
    from freetoken_py.kernels.cpu_moe import ExpertBank, _add_experts_torch_bf16
    bank = ExpertBank("bf16", 32, w13, s13, w2, s2)
    xp = x_for(d, t)
    idp = np.tile(np.arange(E, dtype=np.int64), (t, 1))
    wtp = np.full((t, E), 1.0 / E, np.float32)
    op = np.zeros((t, d), np.float32)
    xgp = np.zeros((t, 1), np.float32)
    ex_calls = {"fp32": lambda: _moe(w13, s13, w2, s2, xp, xgp, idp, wtp, 0, False, op),
                "bf16": lambda: _moe(w13, s13, w2, s2, _dots.prep_bf16_rows(xp), xgp, idp, wtp, 0, True, op),
                "torch": lambda: _add_experts_torch_bf16(bank, xp, idp, wtp, op)}
    for fn in ex_calls.values():
        fn()
    et = {f: [] for f in ex_calls}
    for _ in range(max(3, args.rounds // 2)):
        for f, fn in ex_calls.items():
            t0 = time.perf_counter()
            fn()
            et[f].append(time.perf_counter() - t0)
    em = {f: statistics.median(v) for f, v in et.items()}
    eflop = 2 * t * E * 3 * i * d
    prefill = {"experts_top8": {f"{f}_gflops": round(eflop / em[f] / 1e9, 1) for f in em}}
    prefill["experts_top8"].update(bf16_vs_fp32=round(em["fp32"] / em["bf16"], 3),
                                   bf16_vs_torch=round(em["torch"] / em["bf16"], 3))
    for n in ("shared13", "q_b"):
        m = {f: statistics.median(pt[(n, f)]) for f in ("fp32", "bf16", "torch")}
        flop = 2 * t * shapes[n][0] * shapes[n][1]
        prefill[n] = {f"{f}_gflops": round(flop / m[f] / 1e9, 1) for f in m}
        prefill[n].update(bf16_vs_fp32=round(m["fp32"] / m["bf16"], 3), bf16_vs_torch=round(m["torch"] / m["bf16"], 3))
    print(json.dumps({"bench": "bf16_dots", "threads": args.threads, "rounds": args.rounds, "ctx": args.ctx,
                      "small": args.small, "layers_counted": layers,
                      "token_ms": {f: round(v, 2) for f, v in tot.items()},
                      "token_speedup": round(tot["fp32"] / tot["bf16"], 3), "decode": decode,
                      "prefill_tokens": t, "prefill": prefill}))


if __name__ == "__main__":
    main()
