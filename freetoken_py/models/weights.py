"""Checkpoint tensor names -> the engine's weight layout, with validation against the config.

A model file describes its names with a `WeightScheme`; this module derives the expected tensor
set and shapes from (ModelArgs, WeightScheme), rejects a checkpoint that differs (naming the file
and tensor), and loads tensors into `ModelWeights` with experts stacked as `[E, ...]` banks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from freetoken_py.errors import ModelLoadError
from freetoken_py.layers.decoder import NORMS
from freetoken_py.layers.linear import TorchLinear
from freetoken_py.models import architecture_of
from freetoken_py.models.args import ModelArgs
from freetoken_py.formats import LOGICAL_TAGS
from freetoken_py.models.checkpoint import SUPPORTED_DTYPES, TensorInfo, TensorReader


@dataclass(frozen=True)
class WeightScheme:
    layer: str = "model.layers.{i}."
    router: str = "mlp.gate.weight"
    expert: str = "mlp.experts.{e}."
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    dense_mlp: str = "mlp."
    router_bias: str = "mlp.gate.e_score_correction_bias"  # sigmoid routers' choice bias [E]
    shared_expert: str = "mlp.shared_experts."  # ungated shared expert (gate/up/down_proj)
    shared_expert_gate: str = "mlp.shared_expert_gate.weight"  # [1, D] (ModelArgs.shared_expert_gate)
    gdn_proj: str = "separate"  # GDN input projections: "separate" (in_proj_qkv/z/b/a) | "grouped" (in_proj_qkvz/ba)
    ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)


@dataclass
class LayerWeights:
    """One decoder layer. Linear layers are callables (TorchLinear or KernelLinear)."""
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: object  # fused q, k, v projections: [Hq*hd + 2*Hkv*hd, D]; None for MLA (see `mla`)
    o: object  # [D, Hq*hd]
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    router: object | None = None  # [E, D]
    router_bias: torch.Tensor | None = None  # [E] fp32, sigmoid routers: shifts the choice only
    w13: torch.Tensor | None = None  # [E, 2I, D] routed experts (gate rows then up rows)
    w2: torch.Tensor | None = None  # [E, D, I]
    mlp13: object | None = None  # dense layer: [2I, D] gate rows then up rows
    mlp2: object | None = None  # [D, I]
    shared13: object | None = None  # MoE layer's shared expert: [2Is, D] gate rows then up rows
    shared2: object | None = None  # [D, Is]
    mla: object | None = None  # MLA attention's projections (layers.mla.MlaWeights); o_proj stays in `o`
    gdn: object | None = None  # linear attention (layers.gated_deltanet.GdnWeights); out_proj stays in `o`
    shared_gate: object | None = None  # [1, D] sigmoid gate of the shared expert (Qwen3-Next / 3.5)
    indexer: object | None = None  # DSA lightning indexer (layers.dsa.IndexerWeights) on its "full" layers
    sinks: torch.Tensor | None = None  # [Hq] attention sinks (ModelArgs.attn_sinks)
    b13: torch.Tensor | None = None  # [E, 2I] routed experts' gate then up biases (ModelArgs.expert_bias)
    b2: torch.Tensor | None = None  # [E, D] their down biases

    EXPERTS = ("w13", "w2", "b13", "b2")   # the routed experts; every other field is a dense weight

    def dense(self) -> dict[str, object]:
        """The layer's dense weights (norm tensors and linear layers) by field name, absent ones
        left out: what every token reads besides the routed experts."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in self.EXPERTS and getattr(self, f.name) is not None}


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, D]
    final_norm: torch.Tensor  # [D]
    lm_head: object  # [V, D] (wraps the embedding itself when tied)
    layers: list[LayerWeights] = field(default_factory=list)


def expected_shapes(a: ModelArgs, s: WeightScheme, arch=None) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold and its shape: the embedding, final norm and head,
    and per layer what its kinds name (models/<model_type>.py's architecture, layers/decoder.py)."""
    shapes = {"model.embed_tokens.weight": (a.vocab_size, a.hidden_size), "model.norm.weight": (a.hidden_size,)}
    if not a.tie_word_embeddings:
        shapes["lm_head.weight"] = (a.vocab_size, a.hidden_size)
    for i, layer in enumerate((arch or architecture_of(a)).layers):
        prefix = s.layer.format(i=i)
        shapes.update({prefix + name: shape for name, shape in layer.shapes(a.hidden_size).items()})
    return shapes


def validate(a: ModelArgs, s: WeightScheme, tensors: dict[str, TensorInfo], model_dir: Path, arch=None) -> None:
    """arch: the model file's Architecture for `a`, when the caller has built it already."""
    expected = expected_shapes(a, s, arch)
    for name, shape in expected.items():
        info = tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{model_dir}: missing tensor '{name}' (expected shape {list(shape)})")
        if info.shape != shape:
            raise ModelLoadError(f"{info.file}: tensor '{name}' has shape {list(info.shape)}, "
                                 f"config.json implies {list(shape)}")
        if info.dtype not in SUPPORTED_DTYPES and info.dtype not in LOGICAL_TAGS:  # (tags: decoded by formats/)
            raise ModelLoadError(f"{info.file}: tensor '{name}' has dtype {info.dtype}; supported: "
                                 f"{', '.join(SUPPORTED_DTYPES)} unquantised (a quantised checkpoint says its format "
                                 "in config.json's quantization_config; see docs/formats.md)")
    tied_head = a.tie_word_embeddings and "lm_head.weight" in tensors
    for name, info in tensors.items():
        if _beyond_layers(name, a, s):  # MTP layers (layer >= num_hidden_layers): not run, not read
            continue
        if name not in expected and not name.endswith(s.ignored_suffixes) and not tied_head:
            raise ModelLoadError(f"{info.file}: unexpected tensor '{name}' (does config.json match the weights?)")


def _beyond_layers(name: str, a: ModelArgs, s: WeightScheme) -> bool:
    """A tensor of layer >= num_layers (DeepSeek / GLM multi-token-prediction layers)."""
    head, _, tail = s.layer.partition("{i}")
    if not name.startswith(head):
        return False
    index = name[len(head):].split(tail, 1)[0] if tail else ""
    return index.isdigit() and int(index) >= a.num_layers


_STORED_AS = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def held_bytes(a: ModelArgs, s: WeightScheme, tensors: dict[str, TensorInfo], dtype: torch.dtype,
               skip_experts: bool = False, arch=None) -> tuple[int, int]:
    """What `load_weights` holds in anonymous memory at `dtype`, and the most it holds on top of
    that for a moment (bytes). A tensor stored at `dtype` and used as it is stays a view of the
    checkpoint's mapping (file pages the kernel may drop and read again); a cast one, and one
    concatenated or stacked (q/k/v into qkv, a dense MLP's gate and up, every expert), is a copy.
    The moment: one MoE layer's gate and up rows, concatenated per expert before the stack."""
    def held(name: str, copied: bool, at: torch.dtype = dtype) -> int:
        info = tensors[name]
        copied = copied or info.dtype != _STORED_AS[at]
        return math.prod(info.shape) * at.itemsize if copied else 0

    total = held("model.embed_tokens.weight", False) + held("model.norm.weight", False)
    if not a.tie_word_embeddings:
        total += held("lm_head.weight", False)
    peak = 0
    for i, layer in enumerate((arch or architecture_of(a)).layers):
        p = s.layer.format(i=i)
        total += sum(held(p + name, False) for name in NORMS.values()) + layer.mixer.held(held, p)
        ffn, moment = layer.ffn.held(held, p, skip_experts)
        total, peak = total + ffn, max(peak, moment)
    return total, peak


def load_weights(a: ModelArgs, s: WeightScheme, reader: TensorReader, dtype: torch.dtype,
                 progress=None, skip_experts: bool = False, arch=None) -> ModelWeights:
    """Each layer's tensors through its kinds (layer.mixer.load, layer.ffn.load) into LayerWeights.
    skip_experts: leave `w13`/`w2` None on MoE layers (the cpu backend's expert store builds
    its banks straight from the checkpoint, so stacking them here would be a second full copy)."""
    def get(name: str, at: torch.dtype | None = None) -> torch.Tensor:
        return reader.get(name).to(at or dtype).contiguous()

    arch = arch or architecture_of(a)
    embed = get("model.embed_tokens.weight")
    weights = ModelWeights(embed=embed, final_norm=arch.norm.prepare(get("model.norm.weight")),
                           lm_head=TorchLinear(embed if a.tie_word_embeddings else get("lm_head.weight")))
    for i, layer in enumerate(arch.layers):
        p = s.layer.format(i=i)
        norms = {field: arch.norm.prepare(get(p + name)) for field, name in NORMS.items()}
        lw = LayerWeights(**norms, qkv=None, o=None)
        for field, value in {**layer.mixer.load(get, p), **layer.ffn.load(get, p, skip_experts)}.items():
            setattr(lw, field, value)
        weights.layers.append(lw)
        if progress is not None:
            progress()
    return weights
