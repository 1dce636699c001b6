"""Tiny random Qwen3-Next / Qwen3.5-MoE checkpoints (fp32) for tests/test_hybrid_models.py, built with
transformers' own classes; norms, A_log and dt_bias randomised (the zero-centred norms are saved as 0,
the GDN output norm as 1, dt_bias as 1: left alone they would hide a norm-flavour or decay mix-up)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, max_position_embeddings=512, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
               shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
               tie_word_embeddings=False)


def _config(name: str, **overrides):
    from transformers import Qwen3_5MoeTextConfig, Qwen3NextConfig

    common = {**_COMMON, **overrides}

    if name == "qwen3_next":
        return Qwen3NextConfig(intermediate_size=128, head_dim=16, norm_topk_prob=True, **common)
    if name == "qwen3_next_mixed":  # a dense MLP layer, no renormalisation, full attention at layers 1 and 3
        return Qwen3NextConfig(intermediate_size=48, head_dim=16, norm_topk_prob=False, mlp_only_layers=[2],
                               layer_types=["linear_attention", "full_attention", "linear_attention",
                                            "full_attention"], **common)
    if name == "qwen3_5_moe":
        return Qwen3_5MoeTextConfig(head_dim=32, **common)
    raise KeyError(name)


def build(name: str, out: Path, seed: int = 0, **overrides) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(name, **overrides))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif n.endswith("linear_attn.norm.weight"):   # plain gated norm (init 1)
                p.uniform_(0.5, 1.5)
            elif n.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(math.log(0.5), math.log(8.0)))
            elif n.endswith("dt_bias"):
                p.normal_(0, 1.0)
            elif "norm" in n:                              # zero-centred: applied as 1 + w
                p.uniform_(-0.5, 0.5)
    model.float().save_pretrained(out)
    return out


def reference(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def to_real_release_layout(src: Path, dst: Path) -> Path:
    """Rewrite a save_pretrained Qwen3.5-MoE checkpoint the way the real releases store it, by the
    documented rule (FAMILIES.md §10): the VLM wrapper's config (text model under `text_config`,
    model_type qwen3_5_moe), every text tensor under `model.language_model.`, and each MoE layer's
    experts fused: gate_up_proj [E, 2I, D] = per expert cat(gate_proj, up_proj) rows, down_proj
    [E, D, I], no `.weight`; plus a vision tensor and an mtp tensor, which the loader must skip."""
    import re

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(f))
    out, experts = {}, {}
    pat = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
    for name, t in tensors.items():
        m = pat.fullmatch(name)
        if m:
            experts.setdefault(int(m[1]), {}).setdefault(int(m[2]), {})[m[3]] = t
        else:
            out["model.language_model." + name[len("model."):] if name.startswith("model.") else name] = t
    for layer, by_e in experts.items():
        es = [by_e[e] for e in sorted(by_e)]
        p = f"model.language_model.layers.{layer}.mlp.experts."
        out[p + "gate_up_proj"] = torch.stack([torch.cat([x["gate"], x["up"]]) for x in es]).contiguous()
        out[p + "down_proj"] = torch.stack([x["down"] for x in es]).contiguous()
    out["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    out["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((src / "config.json").read_text())
    text["model_type"] = "qwen3_5_moe_text"
    wrapper = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
               "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    (dst / "config.json").write_text(json.dumps(wrapper))
    return dst
