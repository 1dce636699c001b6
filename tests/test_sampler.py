"""Sampling against independent computations: formulas written out in the test, empirical
frequencies against the filtered distribution, seeded reproducibility."""
from __future__ import annotations

import torch

from freetoken_py.core import Request, SamplingParams
from freetoken_py.engine.sampler import apply_penalties, filter_probs, sample


def _req(params, prompt=(1, 2, 3), output=()):
    r = Request(list(prompt), params)
    r.output_token_ids = list(output)
    if params.seed is not None:
        r.generator = torch.Generator().manual_seed(params.seed)
    return r


def test_greedy_is_argmax():
    logits = torch.randn(3, 50)
    reqs = [_req(SamplingParams(temperature=0)) for _ in range(3)]
    assert sample(logits, reqs) == logits.argmax(-1).tolist()


def test_repetition_penalty_hf_formula():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = apply_penalties(logits, _req(SamplingParams(repetition_penalty=2.0), prompt=(0,), output=(1,)))
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]


def test_presence_and_frequency_penalties_openai_formula():
    logits = torch.zeros(4)
    out = apply_penalties(logits, _req(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
                                       prompt=(3,), output=(1, 1, 2)))
    # token 1 seen twice: -(0.5 + 2*0.25); token 2 once: -(0.5 + 0.25); prompt token 3 untouched
    assert out.tolist() == [0.0, -1.0, -0.75, 0.0]


def test_top_k_top_p_min_p_filters():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    kept = lambda **kw: (filter_probs(probs, SamplingParams(**kw)) > 0).nonzero().flatten().tolist()
    assert kept(top_k=2) == [0, 1]
    assert kept(top_p=0.6) == [0, 1]  # 0.5 < 0.6, so the token crossing 0.6 is kept
    assert kept(top_p=0.5) == [0]
    assert kept(min_p=0.3) == [0, 1, 2]  # >= 0.3 * 0.5
    assert kept(top_k=3, min_p=0.35) == [0, 1]


def test_sampling_frequencies_follow_filtered_distribution():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    params = SamplingParams(temperature=1.0, top_k=3, seed=0)
    req = _req(params)
    draws = torch.tensor([sample(logits[None], [req])[0] for _ in range(4000)])
    freq = torch.bincount(draws, minlength=4).float() / 4000
    expected = torch.tensor([0.4, 0.3, 0.2, 0.0]) / 0.9
    assert (freq - expected).abs().max() < 0.03


def test_seed_reproducible_and_temperature_sharpens():
    logits = torch.randn(1, 100)
    a = [sample(logits, [r])[0] for r in [_req(SamplingParams(seed=7))] for _ in range(20)]
    b = [sample(logits, [r])[0] for r in [_req(SamplingParams(seed=7))] for _ in range(20)]
    assert a == b
    top = int(logits.argmax())
    logits[0, top] += 0.5  # a clear winner: at T=0.05 each rival has weight <= exp(-10)
    cold = _req(SamplingParams(temperature=0.05, seed=1))
    assert sum(sample(logits, [cold])[0] == top for _ in range(50)) >= 45


def test_degenerate_limits_behave_as_their_limit():
    """Found by the server fuzzer: temperature / top_p below fp32's range made the distribution
    NaN or empty and crashed the engine. Their limit is the top token."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    greedy = [int(i) for i in logits.argmax(-1)]
    for kw in ({"temperature": 1e-300}, {"top_p": 1e-300}, {"min_p": 1e-300, "top_p": 1e-300},
               {"temperature": 1e-30, "top_k": 3}):
        reqs = [_req(SamplingParams(seed=i, **kw)) for i in range(3)]
        assert sample(logits, reqs) == greedy, kw
    inf_row = torch.zeros(1, 50)
    inf_row[0, 7] = float("inf")
    assert sample(inf_row, [_req(SamplingParams(seed=0))]) == [7]
