"""Kimi K2.5 / K2.6 (`model_type: kimi_k25`): the DeepSeek-V3 text model (models/deepseek_v3.py)
inside a vision-language wrapper. The text model's config is `text_config` (its `kimi_k2` spelling
accepted); its tensors sit under `language_model.` with the layers spelled `model.layers.{i}`
(the real releases) or `model.blocks.{i}` (what transformers 5.24's save_pretrained writes).
The MoonViT vision tower and the projector are not loaded (one note on stderr); this engine
takes text only."""
from __future__ import annotations

import sys

from freetoken_py.errors import ModelLoadError, UnsupportedModelError
from freetoken_py.models import deepseek_v3
from freetoken_py.models.args import ConfigReader, ModelArgs

SCHEME = deepseek_v3.SCHEME
architecture = deepseek_v3.architecture  # MLA (+ DSA's indexer), sigmoid router, shared expert
_TEXT = "language_model."
_SKIPPED = ("vision_tower.", "mm_projector.", "model.mm_projector.")


def parse_config(c: ConfigReader) -> ModelArgs:
    text = c.cfg.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"{c.path}: model_type kimi_k25 needs a 'text_config' object (the text model's config)")
    kind = text.get("model_type", "deepseek_v3")
    if kind not in ("deepseek_v3", "kimi_k2"):
        raise UnsupportedModelError(f"{c.path}: text_config.model_type '{kind}' is not supported for kimi_k25 "
                                    "(supported: deepseek_v3, kimi_k2)")
    return deepseek_v3.parse_config(ConfigReader(text, f"{c.path} text_config"), model_type="kimi_k25")


def rename(name: str) -> str | None:
    """Stored name -> the text model's name (None: not part of the text model, not loaded)."""
    if not name.startswith(_TEXT):
        if not name.startswith(_SKIPPED):
            raise ModelLoadError(f"unexpected tensor '{name}' in a kimi_k25 checkpoint (neither "
                                 f"'{_TEXT}*' nor the vision tower / projector)")
        return None
    name = name[len(_TEXT):]
    return "model.layers." + name[len("model.blocks."):] if name.startswith("model.blocks.") else name


def note_skipped(count: int) -> None:
    if count:
        print(f"freetoken: kimi_k25: {count} vision tower / projector tensors not loaded (text only)",
              file=sys.stderr)
