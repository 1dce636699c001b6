"""The cpu backend's hybrid decode step (engine/fused_hybrid.py: kernels/cpu_gdn.gdn_decode for the
Gated DeltaNet layers, kernels/cpu_decode.decode_gated_qkv + decode_attn for the gated full
attention, decode_tail, add_swiglu for the gated shared expert) against the engine's own torch
forward (MoeTransformer.forward with layers/attention.py, layers/gdn_cpu.py, the torch MoE block) on
the same weights: teacher-forced logits per step, a ragged batch of three requests decoded
together, fp32 / bf16 / fp8 KV caches, both hybrid families and a layout with a dense MLP layer and
two attention layers. (tests/test_hybrid_models.py checks the same path against transformers.)"""
from __future__ import annotations

import pytest
import torch

import hybrid_util
from freetoken_py.core import Request, SamplingParams
from freetoken_py.engine.fused_hybrid import HybridDecoder
from freetoken_py.engine.runner import ScheduledChunk
from freetoken_py.llm import LLM

_BUILT: dict = {}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    def make(name: str):
        if name not in _BUILT:
            _BUILT[name] = hybrid_util.build(name, tmp_path_factory.mktemp(name))
        return _BUILT[name]
    return make


def _engine(path, kv: str, fused: bool) -> LLM:
    llm = LLM(path, dtype="float32", backend="cpu", kv_dtype=kv, show_progress=False, kv_cache_bytes=1 << 22,
              max_num_seqs=4, enable_prefix_cache=False)
    assert isinstance(llm.runner.fused, HybridDecoder)  # the cpu backend builds it for these models
    if not fused:
        llm.runner.fused = None  # the reference: MoeTransformer.forward for every step
    return llm


def _teacher_forced(llm: LLM, seqs: list[list[int]], prefill: list[int]) -> torch.Tensor:
    """Prefill each sequence alone (its own state slot), then decode all of them together one forced
    token per step. Returns logits [steps, len(seqs), V]."""
    reqs = []
    for seq, n in zip(seqs, prefill):
        req = Request(seq[:n], SamplingParams())
        req.page_table = llm.allocator.allocate(-(-len(seq) // llm.config.page_size))
        req.state_slot = llm.runner.states.allocate()
        llm.runner.forward_batch([ScheduledChunk(req, n)])
        reqs.append(req)
    steps = []
    for i in range(min(len(s) - n for s, n in zip(seqs, prefill))):
        for req, seq, n in zip(reqs, seqs, prefill):
            req.output_token_ids.append(seq[n + i])
        steps.append(llm.runner.forward_batch([ScheduledChunk(r, 1) for r in reqs]))
    for req in reqs:
        llm.allocator.release(req.page_table)
        llm.runner.states.free(req.state_slot)
    return torch.stack(steps)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, hybrid_util.VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch,kv", [("qwen3_5_moe", "auto"), ("qwen3_5_moe", "bf16"), ("qwen3_5_moe", "fp8"),
                                     ("qwen3_next", "auto"), ("qwen3_next_mixed", "auto")])
def test_fused_hybrid_decode_matches_torch_forward(arch, kv, ckpt):
    path = ckpt(arch)
    seqs = [_prompt(60, seed=s) for s in range(3)]
    prefill = [7, 19, 30]  # ragged contexts and states; one 1-token-longer than the attention chunk split
    ours = _teacher_forced(_engine(path, kv, fused=True), seqs, prefill)
    ref = _teacher_forced(_engine(path, kv, fused=False), seqs, prefill)
    assert ours.shape == ref.shape and ours.shape[0] == 30
    scale = max(1.0, ref.abs().max().item())
    err = (ours - ref).abs()
    print(f"{arch} kv={kv}: max {err.max().item() / scale:.2e}, mean {err.mean().item() / scale:.2e} (relative)")
    # as tests/test_fused_decode.py: fp32 KV is fp32 reassociation; a bf16 / fp8 K/V element can
    # round to its neighbour, so single logits move more, the mean stays at fp32 noise
    assert err.max().item() <= {"auto": 1e-4, "bf16": 1e-3, "fp8": 1e-2}[kv] * scale
    assert err.mean().item() <= {"auto": 1e-5, "bf16": 2e-5, "fp8": 2e-4}[kv] * scale


def test_fused_hybrid_long_context(ckpt):
    """Contexts past 256 keys: the attention layer's keys split over several tasks and merged."""
    path = ckpt("qwen3_5_moe")
    seqs = [_prompt(300, seed=7 + s) for s in range(2)]
    ours = _teacher_forced(_engine(path, "auto", fused=True), seqs, [260, 270])
    ref = _teacher_forced(_engine(path, "auto", fused=False), seqs, [260, 270])
    assert ours.shape[0] == 30
    scale = max(1.0, ref.abs().max().item())
    assert (ours - ref).abs().max().item() <= 1e-4 * scale
