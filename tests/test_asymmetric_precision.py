"""Asymmetric precision (`--prefill-expert-dtype bf16` with `--expert-dtype int4`): prefill chunks
run the experts from a second, bf16 copy (mapped from its expert-store cache file), decode steps
from int4. Checked against the one-precision engines: the prefill logits equal the bf16-expert
engine's, the decode logits equal the int4 engine's given the same KV cache (copied over), and in
a mixed batch each row gets its own chunk's precision."""
from __future__ import annotations

import pytest
import torch

from freetoken_py.core import Request, SamplingParams
from freetoken_py.engine.runner import ScheduledChunk
from freetoken_py.errors import FreetokenError
from freetoken_py.llm import LLM

N, TOL = 12, 1e-4
KW = dict(backend="cpu", max_num_seqs=2, enable_prefix_cache=False, show_progress=False,
          kv_cache_bytes=1 << 20, max_model_len=256)


@pytest.fixture(scope="module")
def ckpt(checkpoint_factory):
    return checkpoint_factory("qwen3_moe_step2", dtype=torch.bfloat16)   # expert width 64: int4 groups fit


@pytest.fixture(scope="module")
def engines(ckpt):
    return {"asym": LLM(ckpt, expert_dtype="int4", prefill_expert_dtype="bf16", **KW),
            "bf16": LLM(ckpt, expert_dtype="bf16", **KW), "int4": LLM(ckpt, expert_dtype="int4", **KW)}


def _request(llm, tokens):
    req = Request(list(tokens), SamplingParams())
    req.page_table = llm.allocator.allocate(-(-len(tokens) // llm.config.page_size))
    return req


def _prompt(seed, n, vocab):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _prefill_then_decode(llm, tokens, kv_from=None):
    """Logits of the first len-1 tokens as one prefill chunk, then of the last as a decode step
    (with `kv_from`: that engine's KV cache copied in before the decode step)."""
    req = _request(llm, tokens)
    try:
        pre = llm.runner.forward_batch([ScheduledChunk(req, len(tokens) - 1)], all_rows=True)
        if kv_from is not None:
            llm.runner.cache.k.copy_(kv_from.runner.cache.k)
            llm.runner.cache.v.copy_(kv_from.runner.cache.v)
        dec = llm.runner.forward_batch([ScheduledChunk(req, 1)], all_rows=True)
        return pre, dec
    finally:
        llm.allocator.release(req.page_table)


def test_prefill_equals_bf16_experts_and_decode_equals_int4_given_the_same_kv(engines):
    asym, bf16, int4 = engines["asym"], engines["bf16"], engines["int4"]
    tokens = _prompt(0, N + 1, asym.args.vocab_size)
    pre_a, dec_a = _prefill_then_decode(asym, tokens)
    pre_b, dec_b = _prefill_then_decode(bf16, tokens)
    pre_4, dec_4 = _prefill_then_decode(int4, tokens, kv_from=asym)   # int4 decode over asym's (bf16-prefilled) KV
    assert (pre_a - pre_b).abs().max().item() < TOL
    assert (dec_a - dec_4).abs().max().item() < TOL
    # and the two precisions do differ here (the comparisons above could fail)
    assert (pre_a - int4_prefill(int4, tokens)).abs().max().item() > 100 * TOL
    assert (dec_a - dec_b).abs().max().item() > 100 * TOL


def int4_prefill(llm, tokens):
    req = _request(llm, tokens)
    try:
        return llm.runner.forward_batch([ScheduledChunk(req, len(tokens) - 1)], all_rows=True)
    finally:
        llm.allocator.release(req.page_table)


def test_mixed_batch_gives_each_row_its_own_chunks_precision(engines):
    """One pass over a prefill chunk of request 1 and a decode row of request 2: request 1's rows
    are the bf16 engine's prefill, request 2's row the same engine's decode step run alone."""
    asym, bf16 = engines["asym"], engines["bf16"]
    vocab = asym.args.vocab_size
    t1, t2 = _prompt(1, N, vocab), _prompt(2, N + 1, vocab)
    pre_b, _ = _prefill_then_decode(bf16, t1 + [0])
    _, alone = _prefill_then_decode(asym, t2)
    r1, r2 = _request(asym, t1), _request(asym, t2)
    try:
        asym.runner.forward_batch([ScheduledChunk(r2, N)])               # request 2's prompt
        mixed = asym.runner.forward_batch([ScheduledChunk(r1, N), ScheduledChunk(r2, 1)], all_rows=True)
    finally:
        asym.allocator.release(r1.page_table)
        asym.allocator.release(r2.page_table)
    assert (mixed[:N] - pre_b).abs().max().item() < TOL
    assert (mixed[N:] - alone).abs().max().item() < TOL


def test_the_bf16_copy_is_a_mapped_cache_file_and_shows_in_the_stats(engines):
    asym, int4 = engines["asym"], engines["int4"]
    a = asym.args
    mem = asym.stats()["prefill_experts"]
    moe_layers = sum(a.sparse_layers)
    assert mem["format"] == "bf16" and mem["bytes"] == moe_layers * a.num_experts * 3 * a.moe_intermediate_size * a.hidden_size * 2
    assert mem["mapped_file"].endswith("freetoken-experts-bf16-g32-from-bfloat16.bin")
    # (resident: every mapping of that file in this process; the bf16 engine here maps it too)
    assert isinstance(mem["resident_bytes"], int) and mem["resident_bytes"] >= 0
    assert "prefill_experts" not in int4.stats()


def test_asymmetric_precision_refuses_the_torch_backend_and_the_residency_tiers(ckpt):
    with pytest.raises(FreetokenError, match="--prefill-expert-dtype needs the cpu backend"):
        LLM(ckpt, backend="torch", prefill_expert_dtype="bf16")
    with pytest.raises(FreetokenError, match="--prefill-expert-dtype needs the cpu backend"):
        LLM(ckpt, residency="emulate", expert_dtype="int4", prefill_expert_dtype="bf16")
    with pytest.raises(FreetokenError, match="prefill expert dtype must be"):
        LLM(ckpt, prefill_expert_dtype="int4")
