"""The residency tiers' expert formats (residency/formats.py): the accelerator tier's compute of a
quantised expert, its cuts along the intermediate dimension, and the slot cache and streamer
moving multi-part experts.

References: float64 torch on the bank's own dequantised weights with the activations through the
quantiser the CPU kernels use (`test_kernels_moe.moe_ref_slack`, itself checked against the
quant references), the numba kernels on the same bank, and byte equality for every copy.
"""
from __future__ import annotations

import pytest
import torch
from test_kernels_moe import close_to_ref, moe_ref_slack

from freetoken_py.kernels import ExpertBank, moe_experts
from freetoken_py.kernels._dots import INT_ACT
from freetoken_py.quant import roundtrip_act_q8
from freetoken_py.kernels.gpu_moe import seen_by_cpu_kernels
from freetoken_py.residency.formats import ExpertFormat, bank_parts
from freetoken_py.residency.slots import SlotCache
from freetoken_py.residency.streamer import Streamer

FORMATS = [("int8", 32), ("int4", 32), ("int4", 64), ("int4", 128), ("fp8", 16), ("fp8", 128), ("bf16", 32),
           ("fp32", 32)]
QUANT = ("int8", "int4", "fp8")


def bank_of(fmt: str, group: int, experts: int = 5, inter: int = 0, hidden: int = 128, seed: int = 0):
    """Random experts in `fmt`; I = two scale groups or 128 columns, whichever is wider (room to cut)."""
    inter = inter or max(128, 2 * group)
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(experts, inter, hidden, generator=g) * 0.1 for _ in range(2))
    down = torch.randn(experts, hidden, inter, generator=g) * 0.1
    return ExpertBank.from_weights(gate, up, down, fmt=fmt, group_size=group)


def one(parts, e: int) -> tuple:
    return tuple(p[e] for p in parts)


@pytest.mark.parametrize("fmt,group", FORMATS)
def test_the_accelerators_expert_is_the_cpu_kernels_expert(fmt, group):
    """Every routed pair computed by `ExpertFormat.compute` on the bank's parts, and by the numba
    kernels on the bank, against the float64 reference (activations seen as the kernels see them)."""
    bank = bank_of(fmt, group)
    f, parts = ExpertFormat.of_bank(bank), bank_parts(bank)
    assert f.name == (fmt if fmt in QUANT else "float") and f.expert_bytes == bank.bytes_per_expert
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, bank.hidden, generator=g)
    ids = torch.tensor([[0, 3], [4, 1], [3, 2]])
    w = torch.rand(3, 2, generator=g)
    ours = torch.zeros_like(x)
    for t in range(3):
        for j in range(2):
            ours[t] += w[t, j] * f.compute(x[t:t + 1], one(parts, int(ids[t, j])))[0]
    ref = moe_ref_slack(bank, x, ids, w, "silu")
    tol = 1e-4 if fmt in QUANT else 1e-5
    assert close_to_ref(ours, ref, tol)
    assert close_to_ref(moe_experts(bank, x, ids, w), ref, tol)


@pytest.mark.parametrize("k", [64, 37])
def test_activations_are_seen_as_the_cpu_kernels_see_them(k):
    """`gpu_moe.seen_by_cpu_kernels` (any device; what the accelerator's quantised experts use) is `quant.roundtrip_act_q8` bit for bit on the int8-activation path
    (a partial last block zero-padded), and the activation itself on the fp32 path."""
    v = torch.randn(4, k, generator=torch.Generator().manual_seed(k)) * torch.logspace(-3, 2, k)
    v[1] = 0.0                                         # an all-zero row: scale 0
    want = roundtrip_act_q8(v) if INT_ACT == "int8" else v
    assert torch.equal(seen_by_cpu_kernels(v), want)


@pytest.mark.parametrize("fmt,group", FORMATS)
def test_a_cut_expert_adds_up_to_the_whole(fmt, group):
    """The accelerator's first columns (`column_pieces`, stacked as the streamer stacks them, in
    `column_shapes`) plus the CPU's rest give the whole expert, at every cut the format allows."""
    bank = bank_of(fmt, group)
    f, parts = ExpertFormat.of_bank(bank), bank_parts(bank)
    x = torch.randn(2, bank.hidden, generator=torch.Generator().manual_seed(2))
    expert = one(parts, 2)
    whole = f.compute(x, expert)
    cuts = range(f.cut_block, f.inter, f.cut_block)
    assert len(cuts) >= 1
    for cols in cuts:
        first = [torch.cat(pieces) for pieces in f.column_pieces(expert, cols)]
        assert [tuple(t.shape) for t in first] == [tuple(s) for s in f.column_shapes(cols)]
        total = f.compute(x, tuple(first)) + f.compute(x, f.rest(expert, cols))
        assert (total - whole).abs().max() <= 1e-5 * whole.abs().max(), cols
    if f.name != "float":       # a quantised cut inside a block would split a scale or an activation block
        with pytest.raises(ValueError, match="blocks of"):
            f.rest(expert, f.cut_block // 2)


@pytest.mark.parametrize("fmt,group,dtypes", [
    ("int4", 64, [torch.uint8, torch.int16, torch.uint8, torch.int16]),
    ("fp8", 128, [torch.uint8, torch.float32, torch.uint8, torch.float32])])
def test_slots_and_streamer_move_quantised_experts_byte_for_byte(fmt, group, dtypes):
    """Four parts per slot (int4: packed weights and fp16 scale bits of w13 and w2; fp8: e4m3 bytes and fp32 row-block scales; the bank.s
    own memory): copies into
    slots and staging are the host bank's bytes, a cut's staging holds exactly its columns, and a
    shrink moving experts between chunks keeps every part."""
    bank = bank_of(fmt, group, experts=8)
    f, host = ExpertFormat.of_bank(bank), bank_parts(bank)
    assert [p.dtype for p in host] == dtypes
    assert host[0].data_ptr() == bank.w13.ctypes.data and host[3].data_ptr() == bank.s2.ctypes.data
    slots = SlotCache(6, f.specs, chunk_slots=2)
    assert slots.slot_bytes == bank.bytes_per_expert
    st = Streamer(slots, [None, host], f)
    for e in range(6):
        st.to_slot(1, e)
    for e in range(6):
        assert all(torch.equal(a, b) for a, b in zip(slots.get((1, e)), one(host, e)))
    staged = st.to_staging(1, 7)
    assert all(torch.equal(a, b) for a, b in zip(staged, one(host, 7)))
    cols = f.cut_block
    cut = st.to_staging_columns(1, 3, cols)
    want = [torch.cat(p) for p in f.column_pieces(one(host, 3), cols)]
    assert [tuple(t.shape) for t in cut] == [tuple(s) for s in f.column_shapes(cols)]
    assert all(torch.equal(a, b) for a, b in zip(cut, want))
    for e in (0, 2, 4):
        slots.evict((1, e))
    assert slots.resize(3) == 4                       # whole chunks: the survivors move down
    for e in (1, 3, 5):
        assert all(torch.equal(a, b) for a, b in zip(slots.get((1, e)), one(host, e)))
