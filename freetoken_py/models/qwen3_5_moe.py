"""Qwen3.5 / Qwen3.6 MoE (`model_type: qwen3_5_moe`, the text model alone `qwen3_5_moe_text`):
the Qwen3-Next hybrid (models/qwen3_next.py) with separate GDN input projections
(`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`), a router that always renormalises and
mRoPE, which for text-only input (the three position streams equal) is 1-D partial RoPE.

Two checkpoint layouts load: the real releases' (a VLM: `text_config`, tensors under
`model.language_model.`, experts fused as `mlp.experts.gate_up_proj [E, 2I, D]` (gate rows then
up rows) and `mlp.experts.down_proj [E, D, I]`, no `.weight`), and what transformers'
save_pretrained writes (`model.layers.*`, per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`).
The vision tower (`model.visual.*`) and `mtp.*` are not loaded (one note on stderr)."""
from __future__ import annotations

import re
import sys

from freetoken_py.errors import ModelLoadError, UnsupportedModelError
from freetoken_py.models.args import ConfigReader, ModelArgs
from freetoken_py.models.qwen3_next import hybrid_architecture, parse_hybrid
from freetoken_py.models.weights import WeightScheme

SCHEME = WeightScheme(shared_expert="mlp.shared_expert.", gdn_proj="separate")
_TEXT = "model.language_model."
_SKIPPED = ("model.visual.", "mtp.", "visual.")
_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_scale_inv)?$")


def parse_config(c: ConfigReader) -> ModelArgs:
    text = c.cfg.get("text_config")
    if text is None:
        return parse_hybrid(c, c.cfg.get("model_type", "qwen3_5_moe"), norm_topk_prob=True)
    if not isinstance(text, dict):
        raise ModelLoadError(f"{c.path}: 'text_config' must be an object (the text model's config)")
    kind = text.get("model_type", "qwen3_5_moe_text")
    if kind != "qwen3_5_moe_text":
        raise UnsupportedModelError(f"{c.path}: text_config.model_type '{kind}' is not supported for "
                                    "qwen3_5_moe (supported: qwen3_5_moe_text)")
    merged = dict(text)
    if "tie_word_embeddings" not in merged and "tie_word_embeddings" in c.cfg:
        merged["tie_word_embeddings"] = c.cfg["tie_word_embeddings"]
    return parse_hybrid(ConfigReader(merged, f"{c.path} text_config"), "qwen3_5_moe", norm_topk_prob=True)


def rename(name: str) -> str | None:
    """Stored name -> the text model's name (None: the vision tower or the MTP head, not loaded)."""
    if name.startswith(_SKIPPED):
        return None
    if name.startswith(_TEXT):
        return "model." + name[len(_TEXT):]
    return name


def note_skipped(count: int) -> None:
    if count:
        print(f"freetoken: qwen3_5_moe: {count} vision tower / multi-token-prediction tensors not loaded "
              "(text only)", file=sys.stderr)


def expand(tensors: dict) -> dict:
    """The fused expert stacks read as per-expert tensors (views of the stored ones):
    gate_up_proj [E, 2I, D] -> experts.{e}.gate_proj.weight (rows :I) and up_proj.weight (rows I:),
    down_proj [E, D, I] -> experts.{e}.down_proj.weight. An FP8-block checkpoint's scale grids
    (`gate_up_proj_scale_inv` [E, R, C], `down_proj_scale_inv`, as transformers' FP8 experts name
    them) split the same way into each expert's `weight_scale_inv`: gate the first R/2 block rows,
    up the rest (a block row shared by gate and up rows, R odd, is refused by name)."""
    out = {}
    for name, info in tensors.items():
        m = _FUSED.match(name)
        if m is None:
            out[name] = info
            continue
        if len(info.shape) != 3:
            raise ModelLoadError(f"{info.file}: tensor '{info.name}' has shape {list(info.shape)}, expected "
                                 "[experts, rows, cols] (a fused expert stack)")
        prefix, kind, scale = m.groups()
        suffix = "weight" + (scale or "")
        E, rows = info.shape[0], info.shape[1]
        for e in range(E):
            if kind == "gate_up_proj":
                if rows % 2:
                    what = ("block rows (a scale block would span gate and up rows)" if scale else
                            "row count (gate rows then up rows)")
                    raise ModelLoadError(f"{info.file}: tensor '{info.name}' has an odd {what}: {rows}")
                out[f"{prefix}{e}.gate_proj.{suffix}"] = info.sub(e, 0, rows // 2)
                out[f"{prefix}{e}.up_proj.{suffix}"] = info.sub(e, rows // 2, rows)
            else:
                out[f"{prefix}{e}.down_proj.{suffix}"] = info.sub(e)
    return out


def architecture(a: ModelArgs):
    """Qwen3-Next's hybrid (models/qwen3_next.py) with separate GDN input projections."""
    return hybrid_architecture(a, SCHEME)
