"""CPU expert kernels (freetoken_py.kernels.cpu_moe) against a plain torch reference.

Reference: float64 torch on the bank's own dequantized weights (`bank.dequantized()`, itself
checked against torch's bf16 rounding and the quant references), one expert at a time:
out[t] = sum_j w[t, j] * down_e(act(gate_e x_t) * up_e x_t). Error is relative to the output norm.
int4 and int8 with int8 activations (the AVX2 default, `_dots.INT_ACT`): the reference sees x and h
through the same per-32-block int8 quantiser (`quant.q8act`; int8's odd D / I = 37 / 23 zero-pad
the partial last block as the kernel does), so it stays a 1e-4 check of the
kernel's arithmetic; tests/test_kernels_q8act.py adds the looser check against fp32 activations.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken_py.kernels import ExpertBank, moe_experts
from freetoken_py.kernels._dots import INT_ACT
from freetoken_py.quant import dequantize_act_q8, quantize_act_q8, quantize_int4, quantize_int8

TOL = {"fp32": 1e-5, "bf16": 1e-5, "int8": 1e-4, "int4": 1e-4}


def act_ref(g, u, activation):
    if activation == "silu":
        return torch.nn.functional.silu(g) * u
    g = g.clamp(max=7.0)
    return (u.clamp(-7.0, 7.0) + 1) * g * torch.sigmoid(1.702 * g)


TIE = 1e-4   # |h / s_x - (k + 1/2)| below this: the kernel's fp32 h may round the other way


def seen(v, fmt, q8_act=None):
    """(activation as the kernel multiplies it, slack [same shape]): int8 per 32-block for int4 and
    int8 on the int8 path (a partial last block zero-padded). slack = s_x where v sits within TIE
    of a rounding tie, else 0: the kernel's h is fp32 (~1e-7 off the float64 reference), so there
    q may land one step away."""
    q8_act = (fmt in ("int4", "int8") and INT_ACT == "int8") if q8_act is None else q8_act
    if not q8_act:
        return v, torch.zeros_like(v)
    k = v.shape[-1]
    vp = torch.nn.functional.pad(v, (0, -k % 32))                   # [..., K rounded up to 32]
    q, scale = quantize_act_q8(vp.float())
    step = scale.double().repeat_interleave(32, dim=-1)
    r = vp / torch.where(step > 0, step, 1.0)
    near_tie = ((r - r.floor() - 0.5).abs() < TIE) & (r.abs() < 126.5)
    return dequantize_act_q8(q, scale).double()[..., :k], torch.where(near_tie, step, 0.0)[..., :k]


def moe_ref_slack(bank, x, ids, w, activation, q8_act=None):
    """(reference out [T, D] float64, slack [T, D]: the most a rounding-tie flip of h can move it)."""
    w13, w2 = (t.double() for t in bank.dequantized())
    x, w = seen(torch.as_tensor(x).double(), bank.fmt, q8_act)[0], torch.as_tensor(w).double()
    inter = w13.shape[1] // 2
    out, slack = torch.zeros_like(x), torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e] @ x[t]
            h, h_slack = seen(act_ref(gu[:inter], gu[inter:], activation), bank.fmt, q8_act)
            out[t] += w[t, j] * (w2[e] @ h)
            slack[t] += w[t, j].abs() * (w2[e].abs() @ h_slack)
    return out, slack


def moe_ref(bank, x, ids, w, activation, q8_act=None):
    return moe_ref_slack(bank, x, ids, w, activation, q8_act)[0]


def close_to_ref(out, ref_slack, tol):
    """||out - ref|| <= tol * ||ref|| + ||slack|| (slack is 0 except at rounding ties of h)."""
    ref, slack = ref_slack
    return float((torch.as_tensor(out).double() - ref).norm()) <= tol * float(ref.norm()) + float(slack.norm())


def rel_err(out, ref):
    return float((torch.as_tensor(out).double() - ref).norm() / ref.norm())


def random_experts(num_e, inter, hidden, seed, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_e, inter, hidden, generator=g) * scale,
            torch.randn(num_e, inter, hidden, generator=g) * scale,
            torch.randn(num_e, hidden, inter, generator=g) * scale)


def routing(num_t, num_e, k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_e, generator=g)[:k] for _ in range(num_t)])
    return ids, torch.rand(num_t, k, generator=g)


# (fmt, group_size, E, I, D): odd sizes for the formats that allow them; int4 needs D, I % group == 0
SHAPES = [("fp32", 32, 6, 23, 37), ("bf16", 32, 6, 23, 37), ("int8", 32, 6, 23, 37),
          ("int4", 32, 6, 96, 64), ("int4", 64, 5, 64, 128), ("int4", 128, 4, 128, 256)]


@pytest.mark.parametrize("fmt, group_size, num_e, inter, hidden", SHAPES)
@pytest.mark.parametrize("activation", ["silu", "gptoss"])
@pytest.mark.parametrize("num_t, k", [(1, 1), (1, 4), (3, 2), (37, 3)])
def test_matches_torch_reference(fmt, group_size, num_e, inter, hidden, activation, num_t, k):
    bank = ExpertBank.from_weights(*random_experts(num_e, inter, hidden, seed=num_t), fmt=fmt,
                                   group_size=group_size)
    x = torch.randn(num_t, hidden, generator=torch.Generator().manual_seed(7)) * (8.0 if activation == "gptoss" else 1.0)
    ids, w = routing(num_t, num_e, k, seed=k)
    out = moe_experts(bank, x, ids, w, activation=activation)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and tuple(out.shape) == (num_t, hidden)
    assert close_to_ref(out, moe_ref_slack(bank, x, ids, w, activation), TOL[fmt])


def test_gptoss_clamps_are_exercised():
    """x scaled so gate/up pre-activations pass +-7: silu and gptoss must then differ from the
    unclamped formula, and the kernel must still match the clamped reference."""
    bank = ExpertBank.from_weights(*random_experts(2, 16, 32, seed=3), fmt="fp32")
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1)) * 30.0
    gu = torch.einsum("oi,ti->to", bank.dequantized()[0][0], x)
    assert (gu[:, :16] > 7).any() and (gu[:, 16:].abs() > 7).any()
    ids, w = torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1)
    out = moe_experts(bank, x, ids, w, activation="gptoss")
    assert rel_err(out, moe_ref(bank, x, ids, w, "gptoss")) <= 1e-5


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_duplicate_experts_across_and_within_tokens(fmt):
    bank = ExpertBank.from_weights(*random_experts(4, 32, 64, seed=5), fmt=fmt)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[2, 2, 1]] * 5 + [[2, 0, 3]] * 4)     # expert 2 for every token, twice for some
    w = torch.rand(9, 3, generator=torch.Generator().manual_seed(3))
    assert close_to_ref(moe_experts(bank, x, ids, w), moe_ref_slack(bank, x, ids, w, "silu"), TOL[fmt])


def test_tokens_are_independent_of_batching():
    """Each token's output is the same whether it runs alone (decode) or in a batch (grouped)."""
    bank = ExpertBank.from_weights(*random_experts(8, 64, 96, seed=9), fmt="bf16")
    x = torch.randn(11, 96, generator=torch.Generator().manual_seed(4))
    ids, w = routing(11, 8, 4, seed=4)
    batched = moe_experts(bank, x, ids, w)
    single = torch.cat([moe_experts(bank, x[t:t + 1], ids[t:t + 1], w[t:t + 1]) for t in range(11)])
    assert rel_err(batched, single.double()) <= 1e-6


@settings(max_examples=25, deadline=None)
@given(num_t=st.integers(1, 12), k=st.integers(1, 4), inter=st.integers(1, 40), hidden=st.integers(1, 40),
       seed=st.integers(0, 1000))
def test_random_shapes_bf16(num_t, k, inter, hidden, seed):
    num_e = 5
    bank = ExpertBank.from_weights(*random_experts(num_e, inter, hidden, seed), fmt="bf16")
    x = torch.randn(num_t, hidden, generator=torch.Generator().manual_seed(seed))
    ids = torch.randint(0, num_e, (num_t, k), generator=torch.Generator().manual_seed(seed + 1))
    w = torch.rand(num_t, k)
    out, ref = moe_experts(bank, x, ids, w), moe_ref(bank, x, ids, w, "silu")
    # relative to a sum of |terms|, not |ref|: a tiny D can cancel (D = 1, I = 20 once summed to 3e-8
    # with fp32 rounding 1e-4 of it). h's rounding is ~eps * G * U (G, U = |w_gate|, |w_up| @ |x|).
    w13, w2 = (t.double().abs() for t in bank.dequantized())
    gu = torch.einsum("tjod,td->tjo", w13[ids], x.double().abs())          # [T, k, 2I]
    mag = torch.einsum("tj,tjdi,tji->td", w.double(), w2[ids], gu[..., :inter] * gu[..., inter:])
    assert float((out.double() - ref).norm()) <= 1e-5 * float(ref.norm() + mag.norm())


def test_numpy_in_numpy_out_and_empty_batch():
    bank = ExpertBank.from_weights(*random_experts(3, 16, 32, seed=1), fmt="int8")
    x = np.random.default_rng(0).standard_normal((2, 32)).astype(np.float32)
    ids, w = np.array([[0, 2], [1, 1]]), np.full((2, 2), 0.5, np.float32)
    out = moe_experts(bank, x, ids, w)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    assert rel_err(out, moe_ref(bank, x, torch.from_numpy(ids), w, "silu")) <= 1e-4
    empty = moe_experts(bank, torch.zeros(0, 32), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert tuple(empty.shape) == (0, 32)


def test_bank_layout_and_contents():
    gate, up, down = random_experts(3, 64, 96, seed=2)
    for fmt, dtype, per_expert in [("fp32", np.float32, 3 * 64 * 96 * 4), ("bf16", np.uint16, 3 * 64 * 96 * 2),
                                   ("int8", np.int8, 3 * 64 * 96 + (128 + 96) * 4),
                                   ("int4", np.uint8, 3 * 64 * 96 // 2 + (128 * 96 // 32 + 96 * 64 // 32) * 2)]:  # fp16 scales
        bank = ExpertBank.from_weights(gate.bfloat16(), up.bfloat16(), down.bfloat16(), fmt=fmt)
        assert bank.fmt == fmt and bank.w13.dtype == dtype and bank.w2.dtype == dtype
        assert bank.bytes_per_expert == per_expert and bank.nbytes == 3 * per_expert
        for a in (bank.w13, bank.s13, bank.w2, bank.s2):
            assert a.flags.c_contiguous and (a.size == 0 or a.ctypes.data % 4096 == 0)
        w13, w2 = bank.dequantized()
        assert tuple(w13.shape) == (3, 128, 96) and tuple(w2.shape) == (3, 96, 64)
    fused = torch.cat([gate, up], dim=1)
    bf16 = ExpertBank.from_weights(gate, up, down, fmt="bf16").dequantized()
    assert torch.equal(bf16[0], fused.bfloat16().float()) and torch.equal(bf16[1], down.bfloat16().float())
    int4 = ExpertBank.from_weights(gate, up, down, fmt="int4", group_size=32)
    packed, scales = quantize_int4(fused, 32, scale_dtype=torch.float16)
    assert int4.s13.dtype == np.uint16                                  # fp16 bits
    assert np.array_equal(int4.w13, packed.numpy()) and np.array_equal(int4.s13.view(np.float16), scales.numpy())
    int8 = ExpertBank.from_weights(gate, up, down, fmt="int8")
    q, s = quantize_int8(down)
    assert np.array_equal(int8.w2, q.numpy()) and np.array_equal(int8.s2[..., 0], s.numpy())


def test_bad_inputs_raise_clear_errors():
    gate, up, down = random_experts(2, 48, 64, seed=0)
    with pytest.raises(ValueError, match="format"):
        ExpertBank.from_weights(gate, up, down, fmt="fp6")
    with pytest.raises(ValueError, match="divisible"):
        ExpertBank.from_weights(gate, up, down, fmt="int4", group_size=32)     # I = 48
    with pytest.raises(ValueError, match="gate/up"):
        ExpertBank.from_weights(gate, up, down[:, :, :8], fmt="bf16")
    bank = ExpertBank.from_weights(gate, up, down, fmt="bf16")
    x, w = torch.zeros(1, 64), torch.ones(1, 1)
    with pytest.raises(ValueError, match="activation"):
        moe_experts(bank, x, torch.zeros(1, 1, dtype=torch.long), w, activation="gelu")
    with pytest.raises(ValueError, match="out of range"):
        moe_experts(bank, x, torch.full((1, 1), 2), w)
    with pytest.raises(ValueError, match="shape"):
        moe_experts(bank, torch.zeros(1, 63), torch.zeros(1, 1, dtype=torch.long), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bank_view_shares_memory_and_matches_a_built_bank(dtype):
    """ExpertBank.view_of (the residency CPU tier's bank over the streamer's host weights) reads
    the torch tensors in place and computes what a bank built by from_weights computes."""
    g = torch.Generator().manual_seed(3)
    w13 = torch.randn(4, 2 * 64, 96, generator=g).to(dtype)
    w2 = torch.randn(4, 96, 64, generator=g).to(dtype)
    view = ExpertBank.view_of(w13, w2)
    built = ExpertBank.from_weights(w13[:, :64], w13[:, 64:], w2, fmt=view.fmt)
    x = torch.randn(5, 96, generator=g)
    ids = torch.tensor([[0, 3], [1, 2], [3, 3], [2, 0], [1, 1]])
    wts = torch.rand(5, 2, generator=g)
    assert torch.equal(moe_experts(view, x, ids, wts), moe_experts(built, x, ids, wts))
    w13[1].zero_()                                  # the view sees the change: no copy was made
    w2[1].zero_()
    assert moe_experts(view, x[1:2], ids[1:2, :1], wts[1:2, :1]).abs().max() == 0
    with pytest.raises(ValueError, match="bf16 or fp32"):
        ExpertBank.view_of(w13.half(), w2.half())
    with pytest.raises(ValueError, match="expected w13"):
        ExpertBank.view_of(w13, w2[:, :, :32].contiguous())


def test_row_blocks_follow_pairs_per_expert():
    """Decode-like routing (<= 4 pairs per expert) takes the long row blocks while each stage keeps
    >= 4 tasks per thread; prefill-like routing, or too few tasks, keeps the prefill blocks."""
    from freetoken_py.kernels._moe_kernels import RB1, RB2, RB_FEW, row_blocks

    few = np.array([0, 1, 2, 4, 8], np.int64)               # 4 experts hit by 1, 1, 2, 4 pairs
    many = np.array([0, 1, 6, 7], np.int64)                 # one expert hit by 5 pairs
    assert row_blocks(few, 768, 2048, 2) == (RB_FEW, RB_FEW)
    assert row_blocks(many, 768, 2048, 2) == (RB1, RB2)
    assert row_blocks(few, 768, 2048, 12) == (RB_FEW, RB2)  # 4 x 12 = 48 stage-1 tasks >= 4 x 12, 32 stage-2 < 48
    assert row_blocks(few, 64, 256, 2) == (RB1, RB2)         # 4 x 1 and 4 tasks: fewer than 8


@pytest.mark.parametrize("fmt, group_size", [("fp32", 32), ("int4", 32), ("fp8", 128)])
@pytest.mark.parametrize("num_t, k", [(1, 4), (2, 3)])
def test_decode_row_blocks_match_reference(fmt, group_size, num_t, k):
    """Widths where decode takes RB_FEW-row tasks (a partial last block in both stages: I = 160,
    D = 1088 = 17 x 64) give the reference's result."""
    from freetoken_py.kernels._moe_kernels import RB_FEW, group_pairs, row_blocks
    from freetoken_py.kernels.threads import configured_threads

    num_e, inter, hidden = 6, 160, 1088
    ids, w = routing(num_t, num_e, k, seed=11)
    off = group_pairs(ids.reshape(-1).numpy().astype(np.int64), num_e)[2]
    threads = min(configured_threads(), 4)
    assert row_blocks(off, inter, hidden, threads) == (RB_FEW, RB_FEW)
    bank = ExpertBank.from_weights(*random_experts(num_e, inter, hidden, seed=4), fmt=fmt, group_size=group_size)
    x = torch.randn(num_t, hidden, generator=torch.Generator().manual_seed(5))
    out = moe_experts(bank, x, ids, w)
    assert close_to_ref(out, moe_ref_slack(bank, x, ids, w, "silu"), TOL.get(fmt, 1e-4))


@functools.lru_cache(maxsize=None)
def _row_block_form():
    """moe_rows with stage 2 always in the row-block form (_down_block): the reference for the
    expert-major decode stage, which must add the same products in the same order."""
    from numba import njit, prange

    from freetoken_py.kernels._dots import prepare
    from freetoken_py.kernels._moe_kernels import _down_block, _gate_up_block, group_pairs, row_blocks

    @njit(parallel=True, fastmath=True)
    def run(w13, s13, w2, s2, x, topk_ids, topk_weights, kind, gs, threads, out, b13, b2):
        k = topk_ids.shape[1]
        ids, wts = topk_ids.reshape(-1), topk_weights.reshape(-1)
        xv, xg = prepare(w13, s13, x, gs)
        inter, hidden = w13.shape[1] // 2, w2.shape[1]
        order, eids, off = group_pairs(ids, w13.shape[0])
        rb1, rb2 = row_blocks(off, inter, hidden, threads)
        h = np.empty((ids.shape[0], inter), np.float32)
        nb1 = (inter + rb1 - 1) // rb1
        ub = np.empty((eids.shape[0] * nb1, 4, rb1), np.float32)
        for task in prange(eids.shape[0] * nb1):
            u = task // nb1
            i0 = (task - u * nb1) * rb1
            e = eids[u]
            _gate_up_block(w13[e], s13[e], xv, xg, order[off[u]:off[u + 1]], k, i0, min(inter, i0 + rb1), kind,
                           gs // 2, h, ub[task], b13[e] if b13.shape[0] else np.zeros(0, np.float32))
        hv, hg = prepare(w2, s2, h, gs)
        for task in prange((hidden + rb2 - 1) // rb2):
            _down_block(w2, s2, hv, hg, order, eids, off, wts, k, task * rb2, min(hidden, task * rb2 + rb2), gs // 2, out)
        if b2.shape[0]:
            for p in range(ids.shape[0]):
                for d in range(hidden):
                    out[p // k, d] += wts[p] * b2[ids[p], d]
    return run


def test_whole_experts_decision():
    """A decode call runs whole experts per worker where the experts deal evenly over the workers
    or number >= 4 per worker (and the expert-major conditions hold), else the staged form."""
    from freetoken_py.kernels._moe_kernels import whole_experts

    eight = np.arange(9, dtype=np.int64)            # 8 experts, one pair each
    assert whole_experts(eight, 2048, 1) and whole_experts(eight, 2048, 2) and whole_experts(eight, 2048, 4)
    assert not whole_experts(eight, 2048, 3)         # 3 + 3 + 2: a worker would idle a third of the call
    assert not whole_experts(eight, 2048, 16)        # fewer experts than workers
    assert whole_experts(np.arange(14, dtype=np.int64), 2048, 3)     # 13 experts >= 4 per worker
    assert not whole_experts(np.array([0, 5, 6], np.int64), 2048, 2)  # 5 pairs on one expert: prefill form


@pytest.mark.parametrize("fmt, group_size", [("fp32", 32), ("int8", 32), ("int4", 32), ("fp8", 128), ("nvfp4", 16),
                                             ("bf16", 32)])
@pytest.mark.parametrize("threads", [2, 3])
def test_whole_expert_decode_equals_the_row_block_form(fmt, group_size, threads):
    """One decode token, top-8 of 9 experts: 2 workers run whole experts (`_experts_whole`), 3 the
    staged expert-major form; each equals the row-block form (1e-6) — the same dots, summed in the
    same order."""
    from freetoken_py.kernels._dots import ACTIVATIONS
    from freetoken_py.kernels._moe_kernels import group_pairs, moe_rows, whole_experts

    num_e, inter, hidden = 9, 128, 576
    ids, w = routing(1, num_e, 8, seed=21)
    off = group_pairs(ids.reshape(-1).numpy().astype(np.int64), num_e)[2]
    assert whole_experts(off, hidden, threads) == (threads != 3)
    bank = ExpertBank.from_weights(*random_experts(num_e, inter, hidden, seed=6), fmt=fmt, group_size=group_size)
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(7))
    xs, idn, wn = x.numpy(), ids.numpy().astype(np.int64), w.numpy().astype(np.float32)
    new, old = np.zeros((1, hidden), np.float32), np.zeros((1, hidden), np.float32)
    args = (bank.w13, bank.s13, bank.w2, bank.s2, xs, idn, wn, ACTIVATIONS["silu"], bank.group_size, threads)
    moe_rows(*args, new, bank.b13, bank.b2)
    _row_block_form()(*args, old, bank.b13, bank.b2)
    assert rel_err(new, torch.from_numpy(old).double()) <= 1e-6


@pytest.mark.parametrize("fmt, group_size", [("fp32", 32), ("int8", 32), ("int4", 32), ("fp8", 128), ("nvfp4", 16)])
@pytest.mark.parametrize("num_t, k, biased, whole", [(1, 8, False, True), (2, 3, False, True), (3, 4, True, True),
                                                     (1, 3, False, False), (1, 5, True, False)])
def test_expert_major_down_stage_equals_the_row_block_form(fmt, group_size, num_t, k, biased, whole):
    """Decode routing (<= 4 pairs per expert) at a hidden width with a partial last expert-major
    block (D = 576 = 2 x 256 + 64) takes the expert-major down stage: whole experts per worker
    where the 6 or 8 experts hit deal evenly over the 2 workers, the staged form (stage 1, stage 2',
    the combine) where 3 or 5 do. Its output equals the row-block form's (the same dots, the same
    products added in the same order; fast-math may contract the multiply-add differently in the
    two, so to 1e-6 rather than bit for bit) and, for the unbiased experts, the float64 reference
    (gpt-oss's biases: tests/test_gpt_oss.py)."""
    from freetoken_py.kernels._dots import ACTIVATIONS
    from freetoken_py.kernels._moe_kernels import down_expert_major, group_pairs, moe_rows, whole_experts

    num_e, inter, hidden = 9, 128, 576
    ids, w = routing(num_t, num_e, k, seed=3 + num_t)
    off = group_pairs(ids.reshape(-1).numpy().astype(np.int64), num_e)[2]
    threads = 2   # the block plan's thread count (the kernel runs on all of numba's): the same path on any CPU
    assert down_expert_major(off, hidden, threads)                     # the path under test
    assert whole_experts(off, hidden, threads) == whole
    assert not down_expert_major(np.array([0, 5], np.int64), hidden, threads)   # 5 pairs: the row-block form
    bank = ExpertBank.from_weights(*random_experts(num_e, inter, hidden, seed=2), fmt=fmt, group_size=group_size)
    activation = "silu"
    if biased:
        g = torch.Generator().manual_seed(9)
        bank = bank.with_biases(torch.randn(num_e, 2 * inter, generator=g) * 0.1, torch.randn(num_e, hidden, generator=g) * 0.1)
        activation = "gptoss"
    x = torch.randn(num_t, hidden, generator=torch.Generator().manual_seed(5))
    xs, idn, wn = x.numpy(), ids.numpy().astype(np.int64), w.numpy().astype(np.float32)
    new, old = np.zeros((num_t, hidden), np.float32), np.zeros((num_t, hidden), np.float32)
    args = (bank.w13, bank.s13, bank.w2, bank.s2, xs, idn, wn, ACTIVATIONS[activation], bank.group_size, threads)
    moe_rows(*args, new, bank.b13, bank.b2)
    _row_block_form()(*args, old, bank.b13, bank.b2)
    assert rel_err(new, torch.from_numpy(old).double()) <= 1e-6
    if not biased and fmt != "nvfp4":   # nvfp4's int8 activation blocks: tests/test_formats_nvfp4.py
        q8 = fmt in ("int4", "int8") and INT_ACT == "int8"
        assert close_to_ref(new, moe_ref_slack(bank, x, ids, w, activation, q8), TOL.get(fmt, 1e-4))
