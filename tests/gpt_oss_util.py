"""Tiny gpt-oss checkpoints built with transformers' own GptOssForCausalLM, for tests/test_gpt_oss.py:
a sliding window (4) far shorter than the prompts, layers alternating sliding / full (and one
config with two sliding layers in a row), YaRN RoPE as the release (factor 32, truncate false,
here over an original context of 64), and every parameter randomised: norms, sinks, attention and
expert biases, router bias (transformers starts several at 0 or 1, where a missing term goes unseen)."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 128
WINDOW = 4
_YARN = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
             original_max_position_embeddings=64)
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
             max_position_embeddings=2048, rope_parameters=_YARN, tie_word_embeddings=False)


def configs() -> dict:
    return {
        "gpt_oss": dict(_BASE),   # transformers' default layer_types: sliding, full, sliding, full
        "gpt_oss_mixed": dict(_BASE, num_hidden_layers=3,
                              layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
    }


def build(name: str, out: Path, seed: int = 0, dtype=torch.float32, **changes) -> Path:
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.GptOssForCausalLM(tf.GptOssConfig(**dict(configs()[name], **changes)))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif "norm" in pname:
                p.uniform_(0.5, 1.5)
            elif pname.endswith("sinks"):
                p.uniform_(-1.0, 2.0)
            else:  # biases: attention, router, experts
                p.uniform_(-0.3, 0.3)
    model.to(dtype).save_pretrained(out)
    return out


def reference(path: Path):
    import transformers as tf

    return tf.GptOssForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def write_mxfp4(src: Path, dst: Path, seed: int = 0, span: int = 12) -> Path:
    """`src`'s checkpoint with every expert stack replaced by random MXFP4 in the published layout
    (FAMILIES §F3): `*_blocks` uint8 [E, out, in/32, 16] (element 2b in byte b's low nibble, 2b + 1
    in its high one), `*_scales` uint8 e8m0 [E, out, in/32], output-major, gate / up rows
    interleaved; block exponents drawn over `span` octaves per row, a few all-zero blocks; the
    biases stay plain; config.json gets quantization_config {quant_method: mxfp4}."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.bin"))
    g = torch.Generator().manual_seed(seed)
    for f in dst.glob("*.safetensors"):
        out = {}
        for name, t in load_file(f).items():
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                out[name] = t
                continue
            E, k, n = t.shape   # stored [E, in, out]: MXFP4 is [E, out, in/32, 16]
            blocks = torch.randint(0, 256, (E, n, k // 32, 16), generator=g, dtype=torch.uint8)
            blocks[:, :, 0][torch.rand(E, n, generator=g) < 0.1] = 0   # some all-zero blocks
            scales = (127 - 6 - torch.randint(0, span, (E, n, k // 32), generator=g)).to(torch.uint8)
            out[name + "_blocks"], out[name + "_scales"] = blocks, scales
        save_file(out, f, metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst
