"""How a checkpoint's bytes split: dense vs experts, per layer, per expert, per decode token.

Reads only the safetensors headers (8-byte little-endian length + JSON) and config.json — no
tensor data — so it is instant even for a 600 GB checkpoint. Sizes come from `data_offsets`,
which is exact for every dtype, quantized packings included.
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from freetoken_py.config import EngineConfig
from freetoken_py.errors import ModelLoadError
from freetoken_py.models.checkpoint import TensorInfo as CheckpointTensor
from freetoken_py.models.checkpoint import list_checkpoint_tensors, read_json

CATEGORIES = ("embedding", "lm_head", "attention", "router", "dense_mlp", "shared_experts",
              "routed_experts", "norm", "other", "not_run")  # not_run: MTP layers (>= num_hidden_layers)
_LAYER = re.compile(r"\.(?:layers|h|blocks|block)\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_EMBED = re.compile(r"(^|\.)(embed_tokens|wte|tok_embeddings|word_embeddings)\.")
_ROUTER = re.compile(r"\.(gate|router)\.")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    category: str
    layer: Optional[int]
    expert: Optional[int]


@dataclass(frozen=True)
class LayerBytes:
    layer: int
    by_category: dict[str, int]
    num_experts: int              # routed experts in this layer (0: a dense layer)
    bytes_per_expert: int

    @property
    def dense_bytes(self) -> int:
        return sum(v for k, v in self.by_category.items() if k != "routed_experts")


@dataclass(frozen=True)
class ModelBytes:
    model_dir: str
    model_type: str
    files: tuple[str, ...]
    dtypes: dict[str, int]              # bytes per stored dtype
    expert_dtype: Optional[str]         # most common dtype among routed-expert tensors
    total_bytes: int
    by_category: dict[str, int]
    layers: tuple[LayerBytes, ...]
    top_k: int
    num_experts: int
    vocab_size: int
    tied_embeddings: bool
    kv_bytes_per_token: int             # bf16 KV cache, the paged layers that keep every token
    per_token: dict[str, int] = field(default_factory=dict)   # bytes read per decode token
    weight_format: str = "unquantised"  # formats/ decoder's description (fp8 block [128, 128], ...)
    format_error: Optional[str] = None  # set when freetoken cannot load this format (the one-line reason)
    state_bytes_per_request: int = 0    # hybrids: fp32 conv + recurrent state of the linear-attention layers
    window_bytes_per_request: int = 0   # sliding-window layers next to full ones (gpt-oss): bf16 K/V, window + a page

    def kv_bytes(self, tokens: int) -> int:
        """The KV cache one request of `tokens` holds: every full layer's rows, the windowed layers' window."""
        return self.kv_bytes_per_token * tokens + self.window_bytes_per_request

    @property
    def routed_expert_bytes(self) -> int:
        return self.by_category.get("routed_experts", 0)

    @property
    def per_token_bytes(self) -> int:
        return sum(self.per_token.values())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["routed_expert_bytes"] = self.routed_expert_bytes
        d["per_token_bytes"] = self.per_token_bytes
        for layer in d["layers"]:
            layer["dense_bytes"] = sum(v for k, v in layer["by_category"].items()
                                       if k != "routed_experts")
        return d


def load_config(model_dir: Path) -> dict[str, Any]:
    cfg = read_json(model_dir / "config.json")
    # multimodal wrappers keep the language model's fields in text_config
    return {**cfg, **cfg["text_config"]} if isinstance(cfg.get("text_config"), dict) else cfg


def _first(cfg: dict[str, Any], *keys: str, default: Any = 0) -> Any:
    return next((cfg[k] for k in keys if cfg.get(k) is not None), default)


def classify(name: str) -> str:
    if _EMBED.search(name):
        return "embedding"
    if name.startswith("lm_head.") or name == "output.weight":
        return "lm_head"
    if "shared_expert" in name:
        return "shared_experts"
    if ".experts." in name:                  # per-expert and fused layouts, Mixtral included
        return "routed_experts"
    if _ROUTER.search(name) or name.endswith("e_score_correction_bias"):  # MiniMax-M2's sits on the block
        return "router"
    if "attn" in name or "attention" in name:
        return "attention"
    if "norm" in name:
        return "norm"
    if any(k in name for k in (".mlp.", ".feed_forward.", ".ffn.")):
        return "dense_mlp"
    return "other"


def _tensor_info(t: CheckpointTensor) -> TensorInfo:
    layer, expert = _LAYER.search(t.name), _EXPERT.search(t.name)
    return TensorInfo(t.name, t.dtype, t.shape, t.nbytes, classify(t.name),
                      int(layer.group(1)) if layer else None, int(expert.group(1)) if expert else None)


def _not_run(t: TensorInfo, num_layers: int | None) -> TensorInfo:
    """A tensor of a layer the forward never runs (DeepSeek / GLM MTP layers: index >=
    num_hidden_layers) counts in the file's bytes, not in any layer's or any token's."""
    if num_layers is None or t.layer is None or t.layer < num_layers:
        return t
    return replace(t, category="not_run", layer=None, expert=None)


def _layers(tensors: list[TensorInfo], num_experts_cfg: int) -> tuple[LayerBytes, ...]:
    by_layer: dict[int, Counter] = defaultdict(Counter)
    expert_ids: dict[int, set] = defaultdict(set)
    for t in tensors:
        if t.layer is not None:
            by_layer[t.layer][t.category] += t.nbytes
            if t.category == "routed_experts" and t.expert is not None:
                expert_ids[t.layer].add(t.expert)
    layers = []
    for i in sorted(by_layer):
        routed = by_layer[i].get("routed_experts", 0)
        n = len(expert_ids[i]) or (num_experts_cfg if routed else 0)   # fused layout: use config
        layers.append(LayerBytes(i, {c: by_layer[i][c] for c in CATEGORIES if by_layer[i][c]},
                                 n, routed // n if n else 0))
    return tuple(layers)


def _linear_layers(cfg: dict[str, Any], num_layers: int) -> int:
    """How many layers are linear attention (Gated DeltaNet: a fixed-size state, no KV pages)."""
    kinds = cfg.get("layer_types")
    if isinstance(kinds, list):
        return sum(k == "linear_attention" for k in kinds[:num_layers])
    if cfg.get("linear_num_value_heads"):  # qwen3_next's default: every full_attention_interval-th is full
        interval = int(cfg.get("full_attention_interval") or 4)
        return sum((i + 1) % interval != 0 for i in range(num_layers))
    return 0


def state_bytes_per_request(cfg: dict[str, Any], num_layers: int) -> int:
    """fp32 state one request holds in the linear-attention layers: the conv's last K-1 inputs
    (conv_dim = 2 Hk dk + Hv dv) and the delta-rule state [Hv, dk, dv] per layer."""
    n = _linear_layers(cfg, num_layers)
    if not n:
        return 0
    hk, hv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
    kernel = int(cfg.get("linear_conv_kernel_dim") or 4)
    return n * 4 * ((2 * hk * dk + hv * dv) * (kernel - 1) + hv * dk * dv)


PAGE_SIZE = EngineConfig.page_size   # the engine's default page size (the windowed pool's pages)


def _windowed_layers(cfg: dict[str, Any], num_layers: int) -> int:
    """Layers keeping only a sliding window in their own pages (kvcache/window.py): the
    "sliding_attention" ones of a model mixing them with full layers (gpt-oss; transformers'
    default for gpt_oss without `layer_types`: sliding on even layers)."""
    kinds = cfg.get("layer_types")
    if kinds is None and cfg.get("model_type") == "gpt_oss":
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if not isinstance(kinds, list) or not cfg.get("sliding_window") or len(set(kinds[:num_layers])) < 2:
        return 0
    return sum(k == "sliding_attention" for k in kinds[:num_layers])


def window_bytes_per_request(cfg: dict[str, Any], num_layers: int) -> int:
    """bf16 K/V one request holds in the windowed layers between steps, whatever its length: the
    keys (p - W, p] of its next token span at most ceil((W - 1) / S) + 1 pages of S rows
    (kvcache/spec.window_pages_per_seq: the window and at most one page)."""
    n = _windowed_layers(cfg, num_layers)
    if not n:
        return 0
    rows = (-(-(int(cfg["sliding_window"]) - 1) // PAGE_SIZE) + 1) * PAGE_SIZE
    return 2 * n * _kv_row(cfg) * rows


def _kv_row(cfg: dict[str, Any]) -> int:
    """Values one GQA layer caches per token: K and V of every kv head."""
    heads = int(_first(cfg, "num_attention_heads", default=0))
    kv_heads = int(_first(cfg, "num_key_value_heads", default=heads))
    head_dim = int(_first(cfg, "head_dim", default=0)) or (int(_first(cfg, "hidden_size", default=0)) // max(heads, 1))
    return 2 * kv_heads * head_dim


def kv_bytes_per_token(cfg: dict[str, Any], num_layers: int) -> int:
    """bf16 KV cache bytes one token adds (MLA models cache the compressed latent, DSA ones an
    index key besides on their indexer layers; hybrids only in their full-attention layers, models
    mixing windowed and full layers only in the full ones)."""
    num_layers -= _linear_layers(cfg, num_layers) + _windowed_layers(cfg, num_layers)
    if cfg.get("kv_lora_rank"):
        per_layer = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
    else:
        per_layer = _kv_row(cfg)
    index = int(cfg.get("index_head_dim") or 0) * _index_key_layers(cfg, num_layers) if cfg.get("index_topk") else 0
    return 2 * (per_layer * num_layers + index)


def _index_key_layers(cfg: dict[str, Any], num_layers: int) -> int:
    """DSA layers that cache an index key per token (kvcache/spec.PagedIndexedLatent): every layer,
    or GLM-5.2's "full" ones (models/glm_moe_dsa.indexer_types: indexer_types, else
    index_topk_pattern, else full where max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0)."""
    kinds = cfg.get("indexer_types")
    if isinstance(kinds, list):
        return sum(k == "full" for k in kinds)
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        return sum(k in ("F", "full") for k in pattern)
    freq, offset = max(int(cfg.get("index_topk_freq") or 1), 1), int(cfg.get("index_skip_topk_offset", 2))
    return sum(max(i - offset + 1, 0) % freq == 0 for i in range(num_layers))


def per_token_bytes(by_category: dict[str, int], layers: tuple[LayerBytes, ...], top_k: int,
                    embed_rows: int, tied: bool) -> dict[str, int]:
    """Bytes one decode token reads: all dense weights, top_k experts per MoE layer, one
    embedding row, and the whole lm_head (the embedding matrix again when tied)."""
    dense = sum(v for k, v in by_category.items()
                if k not in ("embedding", "lm_head", "routed_experts", "not_run"))
    emb = by_category.get("embedding", 0)
    lm_head = by_category.get("lm_head", 0) or (emb if tied else 0)
    experts = sum(min(top_k, layer.num_experts) * layer.bytes_per_expert for layer in layers)
    return {"dense": dense, "routed_experts": experts,
            "embedding_row": emb // embed_rows if embed_rows else 0, "lm_head": lm_head}


def read_model_bytes(model_dir: Path, infos: Optional[dict] = None, label: Optional[str] = None) -> ModelBytes:
    """`infos`: the headers' tensors when they were read elsewhere (a hub repo's, by range reads:
    hub.remote_checkpoint); `model_dir` then holds the config files only. `label` names the model."""
    model_dir = Path(model_dir).expanduser()
    if not model_dir.is_dir():
        raise ModelLoadError(f"--model {model_dir}: not a directory")
    try:
        if infos is None:
            infos = list_checkpoint_tensors(model_dir)  # headers only; byte ranges checked against file sizes
        cfg = load_config(model_dir)
    except ModelLoadError as exc:
        raise ModelLoadError(f"--model {exc}") from None
    files = sorted({t.file for t in infos.values()})
    num_layers = int(_first(cfg, "num_hidden_layers", "n_layer", default=0)) or None
    tensors = [_not_run(_tensor_info(t), num_layers) for t in infos.values()]
    if not tensors:
        raise ModelLoadError(f"--model {model_dir}: the safetensors files hold no tensors")
    top_k = int(_first(cfg, "num_experts_per_tok", "num_experts_per_token", "moe_topk",
                       "experts_per_token", "top_k"))
    num_experts = int(_first(cfg, "num_experts", "num_local_experts", "n_routed_experts",
                             "moe_num_experts"))
    by_category = Counter()
    dtypes = Counter()
    expert_dtypes = Counter()
    for t in tensors:
        by_category[t.category] += t.nbytes
        dtypes[t.dtype] += t.nbytes
        if t.category == "routed_experts":
            expert_dtypes[t.dtype] += t.nbytes
    layers = _layers(tensors, num_experts)
    embed = [t for t in tensors if t.category == "embedding" and t.shape]
    vocab = int(_first(cfg, "vocab_size", default=embed[0].shape[0] if embed else 0))
    tied = bool(cfg.get("tie_word_embeddings", False)) and not by_category.get("lm_head")
    num_layers = num_layers or len(layers)
    return ModelBytes(
        model_dir=label or str(model_dir), model_type=str(cfg.get("model_type", "unknown")),
        files=tuple(f.name for f in files), dtypes=dict(dtypes),
        expert_dtype=expert_dtypes.most_common(1)[0][0] if expert_dtypes else None,
        total_bytes=sum(by_category.values()), by_category=dict(by_category), layers=layers,
        top_k=top_k, num_experts=num_experts, vocab_size=vocab, tied_embeddings=tied,
        kv_bytes_per_token=kv_bytes_per_token(cfg, num_layers),
        state_bytes_per_request=state_bytes_per_request(cfg, num_layers),
        window_bytes_per_request=window_bytes_per_request(cfg, num_layers),
        per_token=per_token_bytes(by_category, layers, top_k,
                                  embed[0].shape[0] if embed else vocab, tied),
        **_weight_format(model_dir, infos))


def _weight_format(model_dir: Path, infos: dict) -> dict[str, Any]:
    """The checkpoint's format as the loader's decoder reads it, or why it does not load."""
    from freetoken_py.formats import decoder_for, find_quant_config

    extra = model_dir / "hf_quant_config.json"
    try:
        qcfg, where = find_quant_config(read_json(model_dir / "config.json"), read_json(extra) if extra.exists() else None)
        return {"weight_format": decoder_for(qcfg, infos, where).describe()}
    except ModelLoadError as exc:
        return {"weight_format": "not loadable", "format_error": str(exc)}
