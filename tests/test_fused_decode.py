"""The cpu backend's fused decode step (engine/fused_decode.py, kernels/cpu_decode.py) against the
engine's own torch forward (MoeTransformer.forward + layers/attention.py) on the same weights:
teacher-forced logits per step, single and batched, every supported architecture, fp32 / bf16 /
fp8 KV caches. (tests/test_models_vs_transformers.py checks the same path against transformers.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import njit

from conftest import ARCHS, random_prompt
from freetoken_py.core import Request, SamplingParams
from freetoken_py.engine.runner import ScheduledChunk
from freetoken_py.kernels.cpu_decode import fp8_table, kv_narrow
from freetoken_py.llm import LLM


def _engine(path, kv: str, fused: bool, **kw) -> LLM:
    llm = LLM(path, dtype="float32", backend="cpu", kv_dtype=kv, show_progress=False, kv_cache_bytes=1 << 22, **kw)
    assert llm.runner.fused is not None  # the cpu backend builds it
    if not fused:
        llm.runner.fused = None  # the reference: MoeTransformer.forward for every step
    return llm


def _teacher_forced(llm: LLM, seqs: list[list[int]], prefill: int) -> torch.Tensor:
    """Prefill each sequence alone, then decode all of them together one forced token per step.
    Returns logits [steps, len(seqs), V]."""
    reqs = []
    for seq in seqs:
        req = Request(seq[:prefill], SamplingParams())
        req.page_table = llm.allocator.allocate(-(-len(seq) // llm.config.page_size))
        llm.runner.forward_batch([ScheduledChunk(req, prefill)])
        reqs.append(req)
    steps = []
    for i in range(prefill, min(len(s) for s in seqs)):
        for req, seq in zip(reqs, seqs):
            req.output_token_ids.append(seq[i])
        steps.append(llm.runner.forward_batch([ScheduledChunk(r, 1) for r in reqs]))
    for req in reqs:
        llm.allocator.release(req.page_table)
    return torch.stack(steps)


@pytest.mark.parametrize("kv", ["auto", "bf16", "fp8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_decode_matches_torch_forward(arch, kv, checkpoint_factory):
    path = checkpoint_factory(arch)
    # three sequences decoded as one batch, each prefilled to a different length -> ragged contexts
    seqs = [random_prompt(40, seed=s)[s * 5:] for s in range(3)]
    ours = _teacher_forced(_engine(path, kv, fused=True), seqs, prefill=9)
    ref = _teacher_forced(_engine(path, kv, fused=False), seqs, prefill=9)
    assert ours.shape == ref.shape and ours.shape[0] >= 20
    scale = max(1.0, ref.abs().max().item())
    err = (ours - ref).abs()
    print(f"{arch} kv={kv}: max {err.max().item() / scale:.2e}, mean {err.mean().item() / scale:.2e} (relative)")
    # fp32 KV: the same math up to fp32 reassociation. bf16 / fp8 KV: a K/V element whose fp32 value
    # differs in the last bits can round to the neighbouring bf16 / e4m3 value (2^-8 / 2^-4 apart),
    # so single logits move more; the mean must stay at fp32 noise.
    assert err.max().item() <= {"auto": 1e-4, "bf16": 1e-3, "fp8": 1e-2}[kv] * scale
    assert err.mean().item() <= {"auto": 1e-5, "bf16": 2e-5, "fp8": 2e-4}[kv] * scale


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_fused_decode_long_context_splits_keys_into_chunks(kv, checkpoint_factory):
    """Contexts are split over several tasks and merged (rescaled partial softmax): up to 8
    chunks of 32-256 keys, the chunk size changing with the length (_chunk_size); FP8's exact own
    K/V lands in the last chunk."""
    from freetoken_py.kernels.cpu_decode import ATTN_CHUNK, _chunk_size

    path = checkpoint_factory("qwen3_moe")
    seqs = [random_prompt(ATTN_CHUNK + 40, seed=9 + s) for s in range(2)]
    prefill = ATTN_CHUNK - 16  # decode steps see 241 to 295 keys: 8 chunks of 31 to 37 keys
    assert _chunk_size(241) == 31 and _chunk_size(295) == 37
    ours = _teacher_forced(_engine(path, kv, fused=True), seqs, prefill)
    ref = _teacher_forced(_engine(path, kv, fused=False), seqs, prefill)
    assert ours.shape[0] == 56
    scale = max(1.0, ref.abs().max().item())
    assert (ours - ref).abs().max().item() <= 1e-4 * scale


def test_attention_chunks_cover_the_context():
    """Every context length splits into chunks that cover it exactly once (last one partial), of
    at most ATTN_CHUNK keys, short contexts into ATTN_SPLIT tasks once they have the keys."""
    from freetoken_py.kernels.cpu_decode import ATTN_CHUNK, ATTN_MIN_CHUNK, ATTN_SPLIT, _chunk_size

    for n in range(1, 5000, 7):
        cs = _chunk_size(n)
        chunks = -(-n // cs)
        assert 1 <= cs <= ATTN_CHUNK and (chunks - 1) * cs < n <= chunks * cs
        if n >= ATTN_SPLIT * ATTN_MIN_CHUNK:
            assert chunks >= ATTN_SPLIT, (n, cs)


@pytest.mark.parametrize("arch", ["qwen3_moe_step2", "mixtral"])  # expert widths divisible by 32
def test_fused_decode_int4_attention_matches_torch_forward(arch, checkpoint_factory):
    """--dense-dtype int4: attention int4 (int8 activations on AVX2), router and lm_head int8 —
    a second weight-format specialisation of the fused kernels (router type != attention type)."""
    path = checkpoint_factory(arch)
    seqs = [random_prompt(30, seed=s)[s * 3:] for s in range(2)]
    kw = dict(expert_dtype="int4", dense_dtype="int4")
    fused = _engine(path, "auto", fused=True, **kw)
    lw = fused.model.weights.layers[0]
    assert lw.qkv.dense.fmt == "int4" and fused.model.weights.lm_head.dense.fmt == "int8"
    ours = _teacher_forced(fused, seqs, prefill=7)
    ref = _teacher_forced(_engine(path, "auto", fused=False, **kw), seqs, prefill=7)
    full = _teacher_forced(_engine(path, "auto", fused=False), seqs, prefill=7)  # fp32 weights
    scale = max(1.0, ref.abs().max().item())
    err = (ours - ref).abs()
    own, theirs = (ours - full).abs().mean().item(), (ref - full).abs().mean().item()
    print(f"{arch} int4 attention: max {err.max().item() / scale:.2e}, mean {err.mean().item() / scale:.2e}; "
          f"mean error against fp32 weights {own:.3e} (fused) / {theirs:.3e} (torch forward)")
    # the int8 activation quantiser sees inputs that differ in the last fp32 bits between the two
    # paths, so an element can land on the neighbouring int8 step (1/127 of its block's max). Which
    # elements flip depends on the vector width LLVM compiles the reductions for: on AVX2 one flip
    # moved mixtral's mean to 1.03e-4 (max 4.9e-3); on an AVX-512 machine a flip in one sequence's
    # first step gave qwen3 max 1.3e-2 / mean 4.8e-4 while its error against fp32 weights stayed
    # equal to the torch forward's (0.130 both). So the bound is on near-tie flips, and the accuracy
    # check is against the fp32-weight model: a semantic mismatch (wrong scale, group or row) adds
    # error of the int4 quantisation's own size (~0.1 here), far beyond 2 %.
    assert err.max().item() <= 2e-2 * scale and err.mean().item() <= 1e-3 * scale
    assert own <= 1.02 * theirs


def test_int4_dense_needs_divisible_widths(checkpoint_factory):
    from freetoken_py.errors import FreetokenError

    path = checkpoint_factory("qwen3_moe")  # its dense-MLP layer is 96 wide: not a multiple of 64
    with pytest.raises(FreetokenError, match="dense MLP width 96"):
        LLM(path, dtype="float32", backend="cpu", dense_dtype="int4", expert_dtype="int8", expert_group_size=64,
            show_progress=False, kv_cache_bytes=1 << 20)


def test_fused_decode_with_routing_recorder_matches(checkpoint_factory, tmp_path):
    """A wrapped expert executor (--record-routing) takes the generic experts call inside the
    fused step; the recorded routing is the torch path's."""
    path = checkpoint_factory("qwen3_moe")
    prompt = random_prompt(12, seed=3)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    traces = {}
    for fused in (True, False):
        llm = _engine(path, "auto", fused, record_routing=str(tmp_path / f"r{fused}.jsonl"))
        out = llm.generate([prompt], greedy)[0].token_ids
        traces[fused] = (out, [{l: v.tolist() for l, v in s.items()} for s in llm.routing_recorder.trace.steps])
    assert traces[True] == traces[False]
    assert len(traces[True][1]) > 0


def test_bf16_store_rounds_like_torch():
    @njit
    def narrow_all(x, out):
        like = np.uint16(0)
        for i in range(x.shape[0]):
            out[i] = kv_narrow(x[i], like)

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(100_000, generator=g) * 10 ** torch.randint(-30, 30, (100_000,), generator=g),
                   torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3.3895e38, 1e-45, 1.0 + 2 ** -8,
                                 1.0 + 3 * 2 ** -8])])  # ties round to even
    out = np.empty(x.shape[0], np.uint16)
    narrow_all(x.numpy(), out)
    assert np.array_equal(out, x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))


def test_fp8_table_is_torch_decoding():
    lut = fp8_table()
    ref = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(np.isnan(lut), np.isnan(ref)) and np.array_equal(lut[~np.isnan(lut)], ref[~np.isnan(ref)])
    assert lut[0x7E] == 448.0 and np.isnan(lut[0x7F])
