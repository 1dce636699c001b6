"""One module per Hugging Face `model_type`, found through a lazy registry.

A model module exposes `SCHEME` (a WeightScheme: its checkpoint tensor names),
`parse_config(ConfigReader) -> ModelArgs` and `architecture(ModelArgs) -> Architecture` (its
layers composed from layers/' kinds: models/architecture.py). Nothing is imported until a model of that type loads.
"""
from __future__ import annotations

import importlib

from freetoken_py.errors import UnsupportedModelError

# model_type -> module under freetoken_py.models
_REGISTRY = {
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "olmoe": "olmoe",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",  # Kimi K2 text configs: deepseek_v3 under another name
    "glm4_moe_lite": "glm4_moe_lite",
    "deepseek_v32": "deepseek_v32",
    "glm_moe_dsa": "glm_moe_dsa",
    "kimi_k25": "kimi_k25",
    "glm4_moe": "glm4_moe",
    "minimax_m2": "minimax_m2",
    "gpt_oss": "gpt_oss",
    "qwen3_next": "qwen3_next",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
}


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)


def model_module(model_type: str):
    name = _REGISTRY.get(model_type)
    if name is None:
        raise UnsupportedModelError(f"config.json: model_type '{model_type}' is not supported "
                                    f"(supported: {', '.join(supported_model_types())})")
    return importlib.import_module(f"freetoken_py.models.{name}")


def architecture_of(args):
    """The model file's composition of its layers (models/architecture.Architecture) for `args`."""
    return model_module(args.model_type).architecture(args)
