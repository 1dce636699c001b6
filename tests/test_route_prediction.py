"""The residency look-ahead predicts a sigmoid router's experts with that router's own choice rule
(layers.moe.sigmoid_group_route: e_score_correction_bias for the choice, group-limited top-k), on a
tiny DeepSeek-V3 checkpoint built with transformers' classes (tests/mla_util.py: randomised bias,
n_group 2, three MoE layers).

- Invariant: fed the input the layer itself routed (the next layer's input, once known), the
  prediction is exactly the routed set, for decode tokens and prefill chunks; the old rule (top-k
  of the raw logits, the softmax routers' rule) is not.
- On one recorded greedy run, the look-ahead's hits (predicted experts the next layer then routes
  to, on decode steps: what the executor's prefetch% counts) rise over the old rule's."""
from __future__ import annotations

import pytest
import torch

import mla_util
from freetoken_py.core import SamplingParams
from freetoken_py.llm import LLM
from freetoken_py.residency.stats import RoutingRecorder, predict_experts, route_predictors


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = mla_util.build("deepseek_v3_deep", tmp_path_factory.mktemp("ds_deep"))
    return LLM(path, dtype="float32", show_progress=False, backend="torch")


class _Capture:
    """Delegates to the model's executor, keeping each call's (layer, x, routed ids)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __call__(self, layer, x, ids, weights):
        self.calls.append((layer, x.detach().clone(), ids.detach().clone()))
        return self.inner(layer, x, ids, weights)


def _prompt(n, seed):
    return torch.randint(0, mla_util.VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prediction_on_the_layers_own_input_is_the_routed_set(llm):
    a = llm.model.args
    assert a.router == "sigmoid" and a.n_group == 2
    inner = llm.model.experts
    cap = llm.model.experts = _Capture(inner)
    try:
        llm.generate([_prompt(13, 3)], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    finally:
        llm.model.experts = inner
    preds = route_predictors(llm.model)
    assert [p is not None for p in preds] == [False, True, True, True]
    decode = chunk = old_wrong = 0
    for layer, x, ids in cap.calls:
        p = preds[layer]
        got = predict_experts(p(x), a.top_k, p.rule)
        old = predict_experts(p(x), a.top_k)
        if x.shape[0] == 1:
            assert got == sorted(got, key=lambda e: -float(torch.sigmoid(p(x)[0, e])))   # by routing weight
            assert set(got) == set(ids[0].tolist()), layer
            decode += 1
            old_wrong += set(old) != set(ids[0].tolist())
        else:
            assert set(got) == set(ids.flatten().tolist()), layer
            chunk += 1
    assert decode == 11 * 3 and chunk == 3
    assert old_wrong > 0   # the fixture's bias and groups do change the choice


def test_look_ahead_hits_rise_over_the_old_rule_on_a_recorded_run(llm):
    """Two recorders over one run: the inner predicts with the old rule (the bare router
    linears, as before), the outer with route_predictors' rule; the routed ids are the same run's."""
    a = llm.model.args
    inner = llm.model.experts
    old = RoutingRecorder(inner, a.num_layers, a.num_experts, a.top_k,
                          routers=[lw.router for lw in llm.model.weights.layers])
    new = llm.model.experts = RoutingRecorder(old, a.num_layers, a.num_experts, a.top_k,
                                              routers=route_predictors(llm.model))
    try:
        llm.generate([_prompt(9, 4)], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    finally:
        llm.model.experts = inner

    def hits(trace):
        n = predicted = 0
        for s, step in enumerate(trace.steps):
            if not trace.is_decode(s):
                continue
            for layer, ids in step.items():
                guess = trace.prediction(s, layer)
                if guess is not None:
                    predicted += len(guess)
                    n += len(set(guess) & set(ids.flatten().tolist()))
        return n, predicted

    assert [len(t.steps) for t in (old.trace, new.trace)] == [24, 24]
    assert all((x == y).all() for so, sn in zip(old.trace.steps, new.trace.steps) for x, y in
               zip(so.values(), sn.values()))
    (h_new, p_new), (h_old, p_old) = hits(new.trace), hits(old.trace)
    assert p_new == p_old == 23 * 2 * a.top_k   # 23 decode steps x 2 predicted layers x k
    print("look-ahead hits", h_new, "vs old rule", h_old, "of", p_new)
    assert h_new > h_old, (h_new, h_old)
