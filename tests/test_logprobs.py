"""Log-probabilities from the offline LLM (SamplingParams.logprobs / prompt_logprobs) against the
independent reference: transformers' log_softmax of the same demo checkpoint's logits (fp32),
teacher-forced over prompt + generated tokens; top-k ids in the reference's order."""
from __future__ import annotations

import pytest
import torch

from freetoken_py.cli import DEMO_MODEL
from freetoken_py.core import SamplingParams
from freetoken_py.errors import FreetokenError

TOL = 1e-4


@pytest.fixture(scope="module")
def hf():
    from conftest import reference_model

    return reference_model(DEMO_MODEL)


@pytest.fixture(scope="module")
def llm():
    from freetoken_py.llm import LLM

    # a small batched-token budget: the 40-token prompt is prefilled in chunks (rows of several steps)
    return LLM(DEMO_MODEL, dtype="float32", show_progress=False, max_model_len=256,
               max_num_batched_tokens=16)


def reference_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row p is the log-distribution of token p + 1, teacher-forced."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check(entries, ref: torch.Tensor, tokens: list[int], k: int) -> None:
    """entries[i] scores tokens[i] with row ref[i]; its top-k equal the reference's, in order."""
    assert len(entries) == len(tokens)
    for e, row, tok in zip(entries, ref, tokens):
        assert e.token_id == tok
        assert abs(e.logprob - float(row[tok])) < TOL
        vals, ids = torch.topk(row, k)
        assert [i for i, _ in e.top] == ids.tolist()
        assert torch.allclose(torch.tensor([v for _, v in e.top]), vals, atol=TOL)


def prompt_ids(llm, n: int = 40) -> list[int]:
    text = "The quick brown fox jumps over the lazy dog. " * 8
    return llm.encode_prompt(text)[:n]


def test_generated_and_prompt_logprobs_equal_transformers(llm, hf):
    ids = prompt_ids(llm)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    (out,) = llm.generate([ids], params)
    ref = reference_logprobs(hf, ids + out.token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    check(out.prompt_logprobs[1:], ref[:len(ids) - 1], ids[1:], 3)
    check(out.logprobs, ref[len(ids) - 1:-1], out.token_ids, 5)


def test_sampled_tokens_report_the_raw_distribution_not_the_tempered_one(llm, hf):
    """At temperature 1.7 with top_k 3 the sampler draws from a different distribution; the
    logprobs stay the model's (documented choice)."""
    ids = prompt_ids(llm, 12)
    params = SamplingParams(max_tokens=5, temperature=1.7, top_k=3, seed=3, logprobs=0, ignore_eos=True)
    (out,) = llm.generate([ids], params)
    ref = reference_logprobs(hf, ids + out.token_ids)
    check(out.logprobs, ref[len(ids) - 1:-1], out.token_ids, 0)


def test_max_tokens_zero_scores_the_prompt_only_and_bypasses_the_prefix_cache(llm, hf):
    ids = prompt_ids(llm, 37)
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0))  # the prompt's pages now cached
    (out,) = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1))
    assert out.token_ids == [] and out.finish_reason == "length" and out.num_cached_tokens == 0
    check(out.prompt_logprobs[1:], reference_logprobs(hf, ids)[:-1], ids[1:], 1)


def test_batched_requests_with_and_without_logprobs(llm, hf):
    """A scoring request batched with plain ones: each gets its own rows; the plain ones none."""
    a, b = prompt_ids(llm, 20), prompt_ids(llm, 9)
    outs = llm.generate([a, b], [SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, logprobs=2),
                                 SamplingParams(max_tokens=3, temperature=0)])
    ref = reference_logprobs(hf, a + outs[0].token_ids)
    check(outs[0].prompt_logprobs[1:], ref[:len(a) - 1], a[1:], 2)
    check(outs[0].logprobs, ref[len(a) - 1:-1], outs[0].token_ids, 2)
    assert outs[1].logprobs is None and outs[1].prompt_logprobs is None


@pytest.mark.parametrize("kwargs", [dict(logprobs=21), dict(prompt_logprobs=-1), dict(max_tokens=0)])
def test_out_of_range_logprob_params_are_refused(kwargs):
    with pytest.raises(FreetokenError):
        SamplingParams(**kwargs)


def test_siblings_wait_for_the_prompt_and_take_it_from_the_prefix_cache(llm):
    """n > 1: three requests `after` a first one with the same 33-token prompt (page size 16):
    the first computes it, the others find 32 tokens cached and compute only the last one; their
    seeds differ, so do their samples."""
    ids = prompt_ids(llm, 33)
    page = llm.config.page_size
    assert len(ids) % page == 1
    salt = "siblings"   # a namespace of its own: nothing earlier in this module is reused
    first = llm.add_request(ids, SamplingParams(max_tokens=8, temperature=1.0, seed=1, ignore_eos=True), salt)
    rest = [llm.add_request(ids, SamplingParams(max_tokens=8, temperature=1.0, seed=1 + i, ignore_eos=True), salt,
                            after=first) for i in range(1, 4)]
    while llm.has_unfinished:
        llm.step()
    assert first.num_cached_tokens == 0
    assert [r.num_cached_tokens for r in rest] == [len(ids) - 1] * 3
    assert len({tuple(r.output_token_ids) for r in [first, *rest]}) == 4


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_prompt_and_generated_logprobs_of_a_hybrid_model(tmp_path_factory, backend):
    """A Qwen3-Next hybrid (recurrent-state layers, prefix-state snapshots on): prompt rows over
    chunked prefill and decode rows equal transformers' log_softmax, on both backends."""
    from hybrid_util import build
    from hybrid_util import reference as hybrid_reference

    from freetoken_py.llm import LLM

    path = build("qwen3_next", tmp_path_factory.mktemp("hybrid_lp"))
    llm = LLM(path, dtype="float32", show_progress=False, backend=backend, max_num_batched_tokens=16)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (37,), generator=g).tolist()
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0))   # its prefix (and state) cached
    (out,) = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, logprobs=3, prompt_logprobs=3,
                                                ignore_eos=True))
    ref = reference_logprobs(hybrid_reference(path), ids + out.token_ids)
    assert out.num_cached_tokens == 0
    check(out.prompt_logprobs[1:], ref[:len(ids) - 1], ids[1:], 3)
    check(out.logprobs, ref[len(ids) - 1:-1], out.token_ids, 3)


def test_logprobs_of_an_mla_model_through_the_fused_decoder(tmp_path_factory):
    """DeepSeek-V3 attention (MLA): prompt rows through the torch prefill, decode rows through the
    fused MLA decoder, against transformers."""
    from mla_util import build
    from mla_util import reference as mla_reference

    from freetoken_py.llm import LLM

    path = build("deepseek_v3", tmp_path_factory.mktemp("mla_lp"))
    llm = LLM(path, dtype="float32", show_progress=False, max_num_batched_tokens=16)
    ids = torch.randint(0, 160, (29,), generator=torch.Generator().manual_seed(9)).tolist()
    (out,) = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=2,
                                                ignore_eos=True))
    ref = reference_logprobs(mla_reference("deepseek_v3", path), ids + out.token_ids)
    check(out.prompt_logprobs[1:], ref[:len(ids) - 1], ids[1:], 2)
    check(out.logprobs, ref[len(ids) - 1:-1], out.token_ids, 2)


def test_prompt_rows_scored_in_slices(llm, hf, monkeypatch):
    """SCORE_ROWS smaller than a chunk: the slices join without a gap or a repeat."""
    import freetoken_py.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "SCORE_ROWS", 5)
    ids = prompt_ids(llm, 31)
    (out,) = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=2))
    check(out.prompt_logprobs[1:], reference_logprobs(hf, ids)[:-1], ids[1:], 2)
