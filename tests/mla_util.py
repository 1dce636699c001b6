"""Tiny MLA checkpoints (deepseek_v3, kimi_k25, glm4_moe_lite) built with transformers' own classes,
for tests/test_mla*.py. Kept apart from conftest's table: these need extra randomisation (the
router's e_score_correction_bias and every norm weight start as constants in transformers)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

VOCAB = 160

_YARN = dict(rope_type="yarn", rope_theta=1e4, factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0,
             mscale_all_dim=1.0, original_max_position_embeddings=64)
_DS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
           num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32,
           q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, routed_scaling_factor=2.5,
           max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)


def configs() -> dict:
    return {
        # YaRN (m^2 scale), q_lora, v_head_dim != qk_nope, groups, interleaved rope
        "deepseek_v3": ("deepseek_v3", dict(_DS, rope_parameters=_YARN)),
        # no q_lora (one q_proj), half-split rope, default rope, attention biases, 3 layers (2 MoE)
        "deepseek_v3_plain": ("deepseek_v3", dict(_DS, q_lora_rank=None, rope_interleave=False, attention_bias=True,
                                                  num_hidden_layers=3, n_group=1, topk_group=1,
                                                  rope_parameters=dict(rope_type="default", rope_theta=1e4))),
        "glm4_moe_lite": ("glm4_moe_lite", dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                                moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                                                num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48,
                                                qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
                                                routed_scaling_factor=1.8, max_position_embeddings=256,
                                                tie_word_embeddings=False)),
        # 4 layers, 3 of them MoE (n_group 2): a next MoE layer to predict (tests/test_route_prediction.py)
        "deepseek_v3_deep": ("deepseek_v3", dict(_DS, num_hidden_layers=4, rope_parameters=_YARN)),
        "kimi_k25": ("kimi_k25", dict(_DS, n_group=1, topk_group=1, routed_scaling_factor=2.827,
                                      rope_parameters=dict(_YARN, rope_theta=5e4, factor=32.0))),
    }


def _model(name: str):
    import transformers as tf

    kind, kw = configs()[name]
    if kind == "deepseek_v3":
        return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**kw))
    if kind == "glm4_moe_lite":
        return tf.Glm4MoeLiteForCausalLM(tf.Glm4MoeLiteConfig(**kw))
    vision = dict(num_attention_heads=2, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                  pos_emb_height=4, pos_emb_width=4)
    text = dict(kw, model_type="deepseek_v3")
    cfg = tf.Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=32,
                            tie_word_embeddings=False)
    return tf.Kimi_K25ForConditionalGeneration(cfg)


def build(name: str, out: Path, seed: int = 0, dtype=torch.float32) -> Path:
    torch.manual_seed(seed)
    model = _model(name)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif pname.endswith("norm.weight") or "layernorm" in pname:
                p.uniform_(0.5, 1.5)  # transformers starts norms at 1: a wrong norm would go unseen
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.uniform_(-0.3, 0.3)  # starts at 0: the bias path would be untested
    model.to(dtype).save_pretrained(out)
    return out


def reference(name: str, path: Path):
    import transformers as tf

    kind = configs()[name][0]
    cls = {"deepseek_v3": tf.DeepseekV3ForCausalLM, "glm4_moe_lite": tf.Glm4MoeLiteForCausalLM,
           "kimi_k25": tf.Kimi_K25ForConditionalGeneration}[kind]
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def rename_tensors(src: Path, dst: Path, rename) -> Path:
    """A copy of a checkpoint directory with every tensor name passed through rename(name)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            save_file({rename(k): v.contiguous() for k, v in load_file(f).items()}, dst / f.name,
                      metadata={"format": "pt"})
        elif f.name.endswith(".index.json"):
            idx = json.loads(f.read_text())
            idx["weight_map"] = {rename(k): v for k, v in idx["weight_map"].items()}
            (dst / f.name).write_text(json.dumps(idx))
        elif f.is_file() and f.suffix != ".bin":  # not an expert cache file of the source
            (dst / f.name).write_bytes(f.read_bytes())
    return dst
