"""Tiny DSA checkpoints (deepseek_v32, glm_moe_dsa) built with transformers' own classes, for
tests/test_dsa_models.py: mla_util's geometry and randomisation plus the lightning indexer, with
index_topk far below the prompts and 16 indexer heads (with few heads relu zeroes tie many index
scores, and the top-k then depends on the sequence length)."""
from __future__ import annotations

from pathlib import Path

import torch

import mla_util

TOPK = 6
_INDEX = dict(index_n_heads=16, index_head_dim=32, index_topk=TOPK)
_DSV32 = dict(mla_util._DS, **_INDEX, num_hidden_layers=3, first_k_dense_replace=1,
              rope_parameters=mla_util._YARN)
_GLM = dict(mla_util._DS, **_INDEX, num_hidden_layers=4, first_k_dense_replace=1, n_group=1, topk_group=1,
            routed_scaling_factor=2.5, rope_parameters=dict(rope_type="default", rope_theta=1e4))


def configs() -> dict:
    return {
        "deepseek_v32": ("deepseek_v32", _DSV32),  # YaRN, groups, every layer its own indexer
        # GLM-5.2: full and shared indexer layers mixed (a shared one after a shared one too)
        "glm_moe_dsa": ("glm_moe_dsa", dict(_GLM, indexer_types=["full", "shared", "full", "shared"])),
        "glm_moe_dsa_shared2": ("glm_moe_dsa", dict(_GLM, indexer_types=["full", "shared", "shared", "full"])),
        # GLM-5 / 5.1: no indexer_types (every layer full)
        "glm_moe_dsa_all_full": ("glm_moe_dsa", dict(_GLM, num_hidden_layers=3)),
    }


def _model(name: str, **changes):
    import transformers as tf

    kind, kw = configs()[name]
    kw = dict(kw, **changes)
    if kind == "deepseek_v32":
        return tf.DeepseekV32ForCausalLM(tf.DeepseekV32Config(**kw))
    return tf.GlmMoeDsaForCausalLM(tf.GlmMoeDsaConfig(**kw))


def build(name: str, out: Path, seed: int = 0, dtype=torch.float32, **changes) -> Path:
    torch.manual_seed(seed)
    model = _model(name, **changes)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif pname.endswith("norm.weight") or "layernorm" in pname:
                p.uniform_(0.5, 1.5)  # transformers starts norms at 1: a wrong norm would go unseen
            elif pname.endswith("k_norm.bias"):
                p.uniform_(-0.5, 0.5)  # starts at 0: the LayerNorm's bias would go unseen
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.uniform_(-0.3, 0.3)
    model.to(dtype).save_pretrained(out)
    return out


def reference(name: str, path: Path):
    import transformers as tf

    cls = tf.DeepseekV32ForCausalLM if configs()[name][0] == "deepseek_v32" else tf.GlmMoeDsaForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).eval()
