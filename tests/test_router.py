"""The DeepSeek "noaux_tc" router (sigmoid, correction bias for the choice only, group-limited
top-k, renormalisation, scaling) and MiniMax-M2's variant of it, against (1) a float64 per-token
reimplementation written from FAMILIES.md §1 / §12 and (2) transformers' own router modules."""
from __future__ import annotations

import pytest
import torch

from freetoken_py.layers.moe import sigmoid_group_route


def reference_route(logits, bias, top_k, n_group, topk_group, renorm, scaling):
    """float64, one token at a time, in plain Python: returns [(set of ids, {id: weight})]."""
    out = []
    for row in logits.double().tolist():
        s = [1.0 / (1.0 + torch.exp(torch.tensor(-v, dtype=torch.float64)).item()) for v in row]
        c = [v + b for v, b in zip(s, bias.double().tolist())]
        per = len(c) // n_group
        group_score = [sum(sorted(c[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        allowed = [e for e in range(len(c)) if e // per in groups]
        chosen = sorted(allowed, key=lambda e: -c[e])[:top_k]
        total = sum(s[e] for e in chosen) if renorm else 1.0
        out.append({e: s[e] / total * scaling for e in chosen})
    return out


def as_dicts(ids, weights):
    return [dict(zip(i, w)) for i, w in zip(ids.tolist(), weights.tolist())]


def assert_same_routes(ours, ref, tol=1e-6):
    for a, b in zip(ours, ref, strict=True):
        assert set(a) == set(b)
        assert max(abs(a[e] - b[e]) for e in a) <= tol


CASES = [  # (E, k, n_group, topk_group, renorm, scaling)
    (16, 4, 4, 2, True, 2.5),  # DeepSeek-V3 shape in miniature: group masking changes the choice
    (12, 3, 3, 1, True, 1.0),  # one group kept: every pick from it
    (8, 2, 1, 1, True, 2.5),  # GLM-4.5: no groups
    (8, 2, 1, 1, False, 1.8),  # no renormalisation: raw sigmoid weights, scaled
]


@pytest.mark.parametrize("E,k,n_group,topk_group,renorm,scaling", CASES)
def test_matches_float64_reimplementation(E, k, n_group, topk_group, renorm, scaling):
    g = torch.Generator().manual_seed(E * 100 + k)
    logits = torch.randn(64, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.5  # large enough that it changes choices
    ids, weights = sigmoid_group_route(logits, bias, k, n_group, topk_group, renorm, scaling)
    assert ids.shape == weights.shape == (64, k) and weights.dtype == torch.float32
    assert_same_routes(as_dicts(ids, weights), reference_route(logits, bias, k, n_group, topk_group, renorm, scaling))


def test_bias_moves_the_choice_not_the_weights():
    """A bias that makes expert 0 win everywhere: it is always chosen, its weight is its sigmoid."""
    logits = torch.randn(10, 6, generator=torch.Generator().manual_seed(3))
    bias = torch.tensor([10.0, 0, 0, 0, 0, 0])
    ids, weights = sigmoid_group_route(logits, bias, 2, renormalize=False)
    assert (ids == 0).any(dim=1).all()
    w0 = weights[ids == 0]
    assert torch.allclose(w0, torch.sigmoid(logits[:, 0]))


def test_group_masking_excludes_experts_outside_kept_groups():
    """Expert 0 has the top score but its group's top-2 sum loses: it must not be picked."""
    logits = torch.full((1, 8), -4.0)
    logits[0, 0] = 4.0  # group 0 = experts 0..3: sum of top-2 = s(4) + s(-4)
    logits[0, 4:6] = 2.0  # group 1: sum of top-2 = 2 s(2) > group 0's
    ids, _ = sigmoid_group_route(logits, torch.zeros(8), 2, n_group=2, topk_group=1)
    assert sorted(ids[0].tolist()) == [4, 5]


def _deepseek_router(cls_name, module, E, k, n_group, topk_group, renorm, scaling):
    import importlib

    cfg_mod = importlib.import_module(f"transformers.models.{module}.configuration_{module}")
    model_mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    config_cls = next(getattr(cfg_mod, n) for n in dir(cfg_mod) if n.endswith("Config") and n != "PreTrainedConfig"
                      and isinstance(getattr(cfg_mod, n), type))
    config = config_cls(hidden_size=32, n_routed_experts=E, num_experts_per_tok=k, n_group=n_group,
                        topk_group=topk_group, norm_topk_prob=renorm, routed_scaling_factor=scaling)
    return getattr(model_mod, cls_name)(config)


@pytest.mark.parametrize("module,cls_name", [("deepseek_v3", "DeepseekV3TopkRouter"),
                                             ("glm4_moe", "Glm4MoeTopkRouter")])
@pytest.mark.parametrize("E,k,n_group,topk_group,renorm,scaling", CASES)
def test_matches_transformers_router(module, cls_name, E, k, n_group, topk_group, renorm, scaling):
    router = _deepseek_router(cls_name, module, E, k, n_group, topk_group, renorm, scaling)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        router.weight.normal_(0, 0.5, generator=g)
        router.e_score_correction_bias.normal_(0, 0.3, generator=g)
        x = torch.randn(50, 32, generator=g)
        _, their_w, their_ids = router(x)
    logits = x @ router.weight.T
    ids, weights = sigmoid_group_route(logits, router.e_score_correction_bias, k, n_group, topk_group,
                                       renorm, scaling)
    assert_same_routes(as_dicts(ids, weights), as_dicts(their_ids, their_w))


def test_matches_transformers_minimax_m2_router():
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

    config = MiniMaxM2Config(hidden_size=32, num_local_experts=8, num_experts_per_tok=3)
    router = MiniMaxM2TopKRouter(config)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        router.weight.normal_(0, 0.5, generator=g)
        bias = torch.randn(8, generator=g) * 0.3
        x = torch.randn(40, 32, generator=g)
        _, their_w, their_ids = router(x, bias)
    ids, weights = sigmoid_group_route(x @ router.weight.T, bias, 3)
    assert_same_routes(as_dicts(ids, weights), as_dicts(their_ids, their_w))
