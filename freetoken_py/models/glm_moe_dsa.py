"""GLM-5 / GLM-5.1 / GLM-5.2 (`model_type: glm_moe_dsa`): DeepSeek-V3.2's MLA with sparse attention
(models/deepseek_v32.py), the indexer's RoPE interleaved. GLM-5.2 shares selections across
layers: `indexer_types[i]` is "full" (its own indexer, index keys cached) or "shared" (no indexer
tensors; the last full layer's top-k reused). Without `indexer_types`, transformers' own fallbacks
apply: `index_topk_pattern` ("FSS..." or a list), else `index_topk_freq` / `index_skip_topk_offset`
(default: every layer full, as GLM-5 and 5.1)."""
from __future__ import annotations

from freetoken_py.errors import ModelLoadError
from freetoken_py.models import deepseek_v3, deepseek_v32
from freetoken_py.models.args import ConfigReader, ModelArgs

SCHEME = deepseek_v3.SCHEME
architecture = deepseek_v3.architecture  # MLA (+ DSA's indexer), sigmoid router, shared expert


def indexer_types(c: ConfigReader) -> tuple[str, ...]:
    n = c.get("num_hidden_layers")
    kinds = c.cfg.get("indexer_types")
    field = "indexer_types"
    if kinds is None and c.cfg.get("index_topk_pattern") is not None:
        field, pattern = "index_topk_pattern", c.cfg["index_topk_pattern"]
        if isinstance(pattern, str):
            bad = set(pattern) - {"F", "S"}
            if bad:
                raise ModelLoadError(f"{c.path}: 'index_topk_pattern' must use F (full) and S (shared), got {pattern!r}")
            pattern = [{"F": "full", "S": "shared"}[ch] for ch in pattern]
        kinds = pattern
    elif kinds is None:  # transformers' schedule: full where max(i - offset + 1, 0) % freq == 0
        freq = max(c.get("index_topk_freq", default=1), 1)
        offset = c.get("index_skip_topk_offset", default=2)
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if not isinstance(kinds, list) or len(kinds) != n or not set(kinds) <= {"full", "shared"}:
        raise ModelLoadError(f"{c.path}: '{field}' must list 'full' or 'shared' for each of the {n} layers, "
                             f"got {kinds!r}")
    if kinds[0] != "full":
        raise ModelLoadError(f"{c.path}: '{field}': layer 0 is 'shared', but a shared indexer layer reuses the "
                             "selection of an earlier 'full' one")
    return tuple(kinds)


def parse_config(c: ConfigReader) -> ModelArgs:
    dsa = deepseek_v32.dsa_config(c, indexer_types(c), interleave=True)
    mla = deepseek_v3.mla_config(c, sparse_attention=True, interleave=True)
    return deepseek_v3.parse_config(c, sparse=deepseek_v32.mlp_kinds(c), model_type="glm_moe_dsa", mla=mla, dsa=dsa)
