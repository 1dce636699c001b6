"""`--kv-scales FILE`: the FP8 KV cache's calibrated per-(layer, head) scales, cached as JSON.

The file is keyed by what changes K/V values (the checkpoint's config.json and safetensors sizes,
backend, compute dtype, expert / dense formats) and by how the scales were calibrated; a file
made for another model or configuration is refused in one line, never applied.

    {"format": "freetoken-kv-scales", "version": 1, "key": {...}, "calibration": {...},
     "k_scale": [[...Hkv] x L], "v_scale": [[...Hkv] x L]}
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from freetoken_py.errors import FreetokenError

FORMAT, VERSION = "freetoken-kv-scales", 1


def scales_key(model_dir: Path, backend: str, dtype: str, expert_dtype: str, dense_dtype: str,
               group_size: int, prefill_expert_dtype: str = "auto") -> dict:
    """What the scales depend on, as a JSON-able dict (no paths or mtimes: a copied checkpoint
    keeps its scales)."""
    config = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()
    weights = sorted([f.name, f.stat().st_size] for f in model_dir.glob("*.safetensors"))
    key = {"config_sha256": config, "weights": weights, "backend": backend, "dtype": dtype,
           "expert_dtype": expert_dtype, "dense_dtype": dense_dtype, "expert_group_size": group_size}
    if prefill_expert_dtype != "auto":   # the calibration prefill runs at that precision (older files keep their key)
        key["prefill_expert_dtype"] = prefill_expert_dtype
    return key


def load_scales(path: Path, key: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(k_scale [L, Hkv], v_scale [L, Hkv], calibration info) from `path`; FreetokenError naming
    the field when the file is not a scales file or was made for another key."""
    where = f"--kv-scales {path}"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FreetokenError(f"{where}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise FreetokenError(f"{where}: not a {FORMAT} v{VERSION} file (field 'format' / 'version')")
    stored = data.get("key")
    if stored != key:
        fields = sorted(k for k in set(key) | set(stored or {}) if (stored or {}).get(k) != key.get(k))
        raise FreetokenError(f"{where}: made for another model or configuration (key differs in "
                             f"{', '.join(fields)}); delete the file to calibrate again")
    try:
        k, v = (torch.tensor(data[name], dtype=torch.float32) for name in ("k_scale", "v_scale"))
    except (KeyError, TypeError, ValueError) as exc:
        raise FreetokenError(f"{where}: fields 'k_scale' / 'v_scale' must be [layers][heads] numbers ({exc})") from None
    return k, v, data.get("calibration", {})


def save_scales(path: Path, key: dict, k_scale: torch.Tensor, v_scale: torch.Tensor, calibration: dict) -> None:
    data = {"format": FORMAT, "version": VERSION, "key": key, "calibration": calibration,
            "k_scale": k_scale.cpu().tolist(), "v_scale": v_scale.cpu().tolist()}
    try:
        Path(path).write_text(json.dumps(data) + "\n")
    except OSError as exc:
        raise FreetokenError(f"--kv-scales {path}: cannot write ({exc.strerror})") from None
