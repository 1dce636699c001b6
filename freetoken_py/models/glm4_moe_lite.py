"""GLM-4.7-Flash (`model_type: glm4_moe_lite`): DeepSeek-V3's MLA, router and shared expert
(models/deepseek_v3.py), with dense vs MoE layers named per layer by `mlp_layer_types`
(default: layer 0 dense, the rest sparse)."""
from __future__ import annotations

from freetoken_py.errors import ModelLoadError
from freetoken_py.models import deepseek_v3
from freetoken_py.models.args import ConfigReader, ModelArgs

SCHEME = deepseek_v3.SCHEME
architecture = deepseek_v3.architecture  # MLA (+ DSA's indexer), sigmoid router, shared expert


def parse_config(c: ConfigReader) -> ModelArgs:
    num_layers = c.get("num_hidden_layers")
    kinds = c.cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (num_layers - 1)
    if not isinstance(kinds, list) or len(kinds) != num_layers or not set(kinds) <= {"dense", "sparse"}:
        raise ModelLoadError(f"{c.path}: 'mlp_layer_types' must list 'dense' or 'sparse' for each of the "
                             f"{num_layers} layers, got {kinds!r}")
    return deepseek_v3.parse_config(c, sparse=tuple(k == "sparse" for k in kinds), model_type="glm4_moe_lite")
