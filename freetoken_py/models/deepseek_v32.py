"""DeepSeek-V3.2-Exp / V3.2 (`model_type: deepseek_v32`): DeepSeek-V3's MLA, router and shared
expert (models/deepseek_v3.py) with DeepSeek Sparse Attention: a lightning indexer on every layer
(layers/dsa.py; rotate-half RoPE on its first qk_rope_head_dim dims) picks each query's top
`index_topk` keys. The main MLA's RoPE is always interleaved (transformers ignores rope_interleave).
Dense vs MoE layers from `mlp_layer_types`, else `first_k_dense_replace`; MTP layers are not read."""
from __future__ import annotations

from freetoken_py.errors import ModelLoadError
from freetoken_py.layers.dsa import DsaConfig
from freetoken_py.models import deepseek_v3
from freetoken_py.models.args import ConfigReader, ModelArgs

SCHEME = deepseek_v3.SCHEME
architecture = deepseek_v3.architecture  # MLA (+ DSA's indexer), sigmoid router, shared expert


def mlp_kinds(c: ConfigReader) -> tuple[bool, ...]:
    """Per layer: MoE (True) or dense, from `mlp_layer_types` or the first `first_k_dense_replace` dense."""
    n = c.get("num_hidden_layers")
    kinds = c.cfg.get("mlp_layer_types")
    if kinds is None:
        dense = min(c.get("first_k_dense_replace", default=0), n)
        kinds = ["dense"] * dense + ["sparse"] * (n - dense)
    if not isinstance(kinds, list) or len(kinds) != n or not set(kinds) <= {"dense", "sparse"}:
        raise ModelLoadError(f"{c.path}: 'mlp_layer_types' must list 'dense' or 'sparse' for each of the "
                             f"{n} layers, got {kinds!r}")
    return tuple(k == "sparse" for k in kinds)


def dsa_config(c: ConfigReader, layer_types: tuple[str, ...], interleave: bool) -> DsaConfig:
    """The indexer's geometry (required keys: a one-line error naming the missing one)."""
    heads, dim, topk = c.get("index_n_heads"), c.get("index_head_dim"), c.get("index_topk")
    rope_dim = c.get("qk_rope_head_dim")
    if heads <= 0 or topk <= 0:
        raise ModelLoadError(f"{c.path}: 'index_n_heads' ({heads}) and 'index_topk' ({topk}) must be positive")
    if not rope_dim < dim:
        raise ModelLoadError(f"{c.path}: 'index_head_dim' ({dim}) must exceed qk_rope_head_dim ({rope_dim}): "
                             "RoPE covers the index key's first qk_rope_head_dim dims")
    if c.cfg.get("q_lora_rank") is None:
        raise ModelLoadError(f"{c.path}: missing required key 'q_lora_rank' (the DSA indexer reads the q-LoRA residual)")
    return DsaConfig(n_heads=heads, head_dim=dim, topk=topk, rope_dim=rope_dim, interleave=interleave,
                     layer_types=layer_types)


def parse_config(c: ConfigReader) -> ModelArgs:
    n = c.get("num_hidden_layers")
    dsa = dsa_config(c, ("full",) * n, interleave=False)
    mla = deepseek_v3.mla_config(c, sparse_attention=True, interleave=True)
    return deepseek_v3.parse_config(c, sparse=mlp_kinds(c), model_type="deepseek_v32", mla=mla, dsa=dsa)
