"""Configs of the sigmoid-router families (glm4_moe, minimax_m2) that the engine cannot run as
written are refused in one line naming the field, before any weight is read."""
from __future__ import annotations

import json
import shutil

import pytest

from freetoken_py.errors import FreetokenError
from freetoken_py.models.loader import load_model


def _with_config(checkpoint_factory, tmp_path, arch: str, **changes):
    dst = tmp_path / arch
    shutil.copytree(checkpoint_factory(arch), dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("arch,changes,field", [
    ("glm4_moe", {"scoring_func": "softmax"}, "scoring_func"),
    ("glm4_moe", {"topk_method": "greedy"}, "topk_method"),
    ("glm4_moe", {"n_group": 3}, "n_group"),  # 8 experts do not split into 3 groups
    ("glm4_moe", {"n_group": 8}, "n_group"),  # groups of 1: a group scores its top-2
    ("glm4_moe", {"topk_group": 3}, "topk_group"),  # more groups kept than there are
    ("glm4_moe", {"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "topk_group"),  # 1 group of 2 < k
    ("glm4_moe", {"rope_parameters": {"rope_theta": 1e4, "rope_type": "default", "partial_rotary_factor": "half"}},
     "partial_rotary_factor"),
    ("glm4_moe", {"rope_parameters": {"rope_theta": 1e4, "rope_type": "default", "partial_rotary_factor": 0.2}},
     "rotary"),  # 16 x 0.2 -> 3 dims: odd, no rotate-half pairs

    ("glm4_moe", {"routed_scaling_factor": "x"}, "routed_scaling_factor"),
    ("minimax_m2", {"scoring_func": "softmax"}, "scoring_func"),
    ("minimax_m2", {"use_routing_bias": False}, "use_routing_bias"),
    ("minimax_m2", {"qk_norm_type": "per_head"}, "qk_norm_type"),
    ("minimax_m2", {"shared_intermediate_size": 64}, "shared_intermediate_size"),
    ("minimax_m2", {"rotary_dim": 7}, "rotary"),
    ("minimax_m2", {"rotary_dim": 32}, "rotary"),  # more than head_dim 16
])
def test_bad_router_or_rope_config_is_one_line_naming_the_field(checkpoint_factory, tmp_path, arch, changes, field):
    path = _with_config(checkpoint_factory, tmp_path, arch, **changes)
    with pytest.raises(FreetokenError) as info:
        load_model(path, "float32", show_progress=False)
    msg = str(info.value)
    assert "\n" not in msg and field in msg and "config.json" in msg


def test_the_release_keys_with_their_own_values_load(checkpoint_factory, tmp_path):
    """MiniMax-M2's released config.json carries keys transformers ignores; their real values load."""
    path = _with_config(checkpoint_factory, tmp_path, "minimax_m2", scoring_func="sigmoid", use_routing_bias=True,
                        qk_norm_type="per_layer", use_qk_norm=True, shared_intermediate_size=0)
    model = load_model(path, "float32", show_progress=False)
    assert model.args.router == "sigmoid" and model.args.rope_dim == 8 and model.args.qk_norm == "full"
