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
from freetoken_py.layers.linear import TorchLinear
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


def _gdn_shapes(a: ModelArgs, s: WeightScheme) -> dict[str, tuple[int, ...]]:
    g, D = a.gdn, a.hidden_size
    p = "linear_attn."
    shapes = {p + "conv1d.weight": (g.conv_dim, 1, g.conv_kernel), p + "dt_bias": (g.num_v_heads,),
              p + "A_log": (g.num_v_heads,), p + "norm.weight": (g.v_head_dim,),
              p + "out_proj.weight": (D, g.value_dim),
              "input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,)}
    if s.gdn_proj == "grouped":
        shapes.update({p + "in_proj_qkvz.weight": (2 * g.key_dim + 2 * g.value_dim, D),
                       p + "in_proj_ba.weight": (2 * g.num_v_heads, D)})
    else:
        shapes.update({p + "in_proj_qkv.weight": (g.conv_dim, D), p + "in_proj_z.weight": (g.value_dim, D),
                       p + "in_proj_b.weight": (g.num_v_heads, D), p + "in_proj_a.weight": (g.num_v_heads, D)})
    return shapes


def _layer_attention_shapes(a: ModelArgs, s: WeightScheme, i: int) -> dict[str, tuple[int, ...]]:
    if a.is_linear(i):
        return _gdn_shapes(a, s)
    shapes = _attention_shapes(a)
    if a.dsa is not None and a.dsa.is_full(i):  # DSA: the indexer, on "full" layers only
        shapes.update({f"self_attn.indexer.{k}": v
                       for k, v in a.dsa.tensor_shapes(a.hidden_size, a.mla.q_lora_rank).items()})
    return shapes


def _attention_shapes(a: ModelArgs) -> dict[str, tuple[int, ...]]:
    if a.mla is not None:
        return {**{f"self_attn.{k}": v for k, v in a.mla.tensor_shapes(a.hidden_size).items()},
                "input_layernorm.weight": (a.hidden_size,), "post_attention_layernorm.weight": (a.hidden_size,)}
    q_out, kv_out = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    q_rows = 2 * q_out if a.attn_output_gate else q_out  # [query | gate] per head
    shapes = {"self_attn.q_proj.weight": (q_rows, a.hidden_size), "self_attn.k_proj.weight": (kv_out, a.hidden_size),
              "self_attn.v_proj.weight": (kv_out, a.hidden_size), "self_attn.o_proj.weight": (a.hidden_size, q_out),
              "input_layernorm.weight": (a.hidden_size,), "post_attention_layernorm.weight": (a.hidden_size,)}
    if a.attention_bias:
        shapes.update({"self_attn.q_proj.bias": (q_rows,), "self_attn.k_proj.bias": (kv_out,),
                       "self_attn.v_proj.bias": (kv_out,)})
    if a.has_o_bias:
        shapes["self_attn.o_proj.bias"] = (a.hidden_size,)
    if a.attn_sinks:
        shapes["self_attn.sinks"] = (a.num_heads,)
    if a.qk_norm == "head":
        shapes.update({"self_attn.q_norm.weight": (a.head_dim,), "self_attn.k_norm.weight": (a.head_dim,)})
    elif a.qk_norm == "full":
        shapes.update({"self_attn.q_norm.weight": (q_out,), "self_attn.k_norm.weight": (kv_out,)})
    return shapes


def _swiglu_shapes(prefix: str, i: int, d: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}gate_proj.weight": (i, d), f"{prefix}up_proj.weight": (i, d), f"{prefix}down_proj.weight": (d, i)}


def _mlp_shapes(a: ModelArgs, s: WeightScheme, sparse: bool) -> dict[str, tuple[int, ...]]:
    g, u, d = s.expert_proj
    if not sparse:
        return _swiglu_shapes(s.dense_mlp, a.intermediate_size, a.hidden_size)
    i = a.moe_intermediate_size
    shapes = {s.router: (a.num_experts, a.hidden_size)}
    if a.router in ("sigmoid", "topk"):
        shapes[s.router_bias] = (a.num_experts,)
    if a.shared_intermediate_size:
        shapes.update(_swiglu_shapes(s.shared_expert, a.shared_intermediate_size, a.hidden_size))
        if a.shared_expert_gate:
            shapes[s.shared_expert_gate] = (1, a.hidden_size)
    for e in range(a.num_experts):
        p = s.expert.format(e=e)
        shapes.update({f"{p}{g}.weight": (i, a.hidden_size), f"{p}{u}.weight": (i, a.hidden_size),
                       f"{p}{d}.weight": (a.hidden_size, i)})
        if a.expert_bias:
            shapes.update({f"{p}{g}.bias": (i,), f"{p}{u}.bias": (i,), f"{p}{d}.bias": (a.hidden_size,)})
    return shapes


def expected_shapes(a: ModelArgs, s: WeightScheme) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (a.vocab_size, a.hidden_size), "model.norm.weight": (a.hidden_size,)}
    if not a.tie_word_embeddings:
        shapes["lm_head.weight"] = (a.vocab_size, a.hidden_size)
    for i in range(a.num_layers):
        prefix = s.layer.format(i=i)
        for name, shape in {**_layer_attention_shapes(a, s, i), **_mlp_shapes(a, s, a.sparse_layers[i])}.items():
            shapes[prefix + name] = shape
    return shapes


def validate(a: ModelArgs, s: WeightScheme, tensors: dict[str, TensorInfo], model_dir: Path) -> None:
    expected = expected_shapes(a, s)
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
               skip_experts: bool = False) -> tuple[int, int]:
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
    for i in range(a.num_layers):
        p = s.layer.format(i=i)
        for name in _layer_attention_shapes(a, s, i):
            fused = a.mla is None and name.startswith(("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.",
                                                       "linear_attn.in_proj"))
            total += held(p + name, fused)
        if not a.sparse_layers[i]:
            m = p + s.dense_mlp
            total += held(m + "gate_proj.weight", True) + held(m + "up_proj.weight", True)
            total += held(m + "down_proj.weight", False)
            continue
        if a.router == "sigmoid":  # router weight and bias kept in fp32 (see _load_router)
            total += held(p + s.router, False, torch.float32) + held(p + s.router_bias, False, torch.float32)
        else:
            total += held(p + s.router, False) + (held(p + s.router_bias, False) if a.router == "topk" else 0)
        if a.shared_intermediate_size:
            m = p + s.shared_expert
            total += held(m + "gate_proj.weight", True) + held(m + "up_proj.weight", True)
            total += held(m + "down_proj.weight", False)
            if a.shared_expert_gate:
                total += held(p + s.shared_expert_gate, False)
        if not skip_experts:
            g, u, d = s.expert_proj
            names = [p + s.expert.format(e=e) for e in range(a.num_experts)]
            w13 = sum(held(f"{x}{g}.weight", True) + held(f"{x}{u}.weight", True) for x in names)
            total += w13 + sum(held(f"{x}{d}.weight", True) for x in names)
            # stacking: each expert's gate and up rows concatenated (w13's size) are held besides
            # the stack; the down pieces are views unless cast (half of that at most)
            peak = max(peak, w13)
    return total, peak


def load_weights(a: ModelArgs, s: WeightScheme, reader: TensorReader, dtype: torch.dtype,
                 progress=None, skip_experts: bool = False) -> ModelWeights:
    """skip_experts: leave `w13`/`w2` None on MoE layers (the cpu backend's expert store builds
    its banks straight from the checkpoint, so stacking them here would be a second full copy)."""
    def get(name: str, at: torch.dtype | None = None) -> torch.Tensor:
        return reader.get(name).to(at or dtype).contiguous()

    embed = get("model.embed_tokens.weight")
    weights = ModelWeights(embed=embed, final_norm=get("model.norm.weight"),
                           lm_head=TorchLinear(embed if a.tie_word_embeddings else get("lm_head.weight")))
    for i in range(a.num_layers):
        weights.layers.append(_load_layer(a, s, i, get, skip_experts))
        if progress is not None:
            progress()
    if a.zero_centred_norms:  # stored w, applied as (1 + w) in fp32 (the GDN output norm is plain)
        weights.final_norm = 1.0 + weights.final_norm.float()
        for lw in weights.layers:
            for name in ("input_norm", "post_norm", "q_norm", "k_norm"):
                if getattr(lw, name) is not None:
                    setattr(lw, name, 1.0 + getattr(lw, name).float())
    return weights


def _load_layer(a: ModelArgs, s: WeightScheme, i: int, get, skip_experts: bool = False) -> LayerWeights:
    lw = (_load_gdn(a, s, i, get) if a.is_linear(i) else _load_mla(a, s, i, get) if a.mla is not None
          else _load_gqa(a, s, i, get))
    p = s.layer.format(i=i)
    if a.sparse_layers[i]:
        g, u, d = s.expert_proj
        lw.router, lw.router_bias = _load_router(a, s, p, get)
        if a.shared_intermediate_size:
            lw.shared13, lw.shared2 = _swiglu(p + s.shared_expert, get)
            if a.shared_expert_gate:
                lw.shared_gate = TorchLinear(get(p + s.shared_expert_gate))
        if skip_experts:
            if a.expert_bias:  # small: the cpu backend attaches them to its expert banks
                lw.b13, lw.b2 = expert_biases(a, s, i, get)
            return lw
        experts = [p + s.expert.format(e=e) for e in range(a.num_experts)]
        lw.w13 = torch.stack([torch.cat([get(f"{x}{g}.weight"), get(f"{x}{u}.weight")]) for x in experts])
        lw.w2 = torch.stack([get(f"{x}{d}.weight") for x in experts])
        if a.expert_bias:
            lw.b13, lw.b2 = expert_biases(a, s, i, get)
    else:
        lw.mlp13, lw.mlp2 = _swiglu(p + s.dense_mlp, get)
    return lw


def expert_biases(a: ModelArgs, s: WeightScheme, i: int, get) -> tuple[torch.Tensor, torch.Tensor]:
    """(b13 [E, 2I] gate then up, b2 [E, D]) of layer i's routed experts."""
    g, u, d = s.expert_proj
    experts = [s.layer.format(i=i) + s.expert.format(e=e) for e in range(a.num_experts)]
    return (torch.stack([torch.cat([get(f"{x}{g}.bias"), get(f"{x}{u}.bias")]) for x in experts]),
            torch.stack([get(f"{x}{d}.bias") for x in experts]))


def _load_gqa(a: ModelArgs, s: WeightScheme, i: int, get) -> LayerWeights:
    p = s.layer.format(i=i) + "self_attn."
    qkv_w = torch.cat([get(f"{p}{x}_proj.weight") for x in "qkv"])
    qkv_b = torch.cat([get(f"{p}{x}_proj.bias") for x in "qkv"]) if a.attention_bias else None
    lw = LayerWeights(
        input_norm=get(s.layer.format(i=i) + "input_layernorm.weight"),
        post_norm=get(s.layer.format(i=i) + "post_attention_layernorm.weight"),
        qkv=TorchLinear(qkv_w, qkv_b),
        o=TorchLinear(get(p + "o_proj.weight"), get(p + "o_proj.bias") if a.has_o_bias else None))
    if a.qk_norm != "none":
        lw.q_norm, lw.k_norm = get(p + "q_norm.weight"), get(p + "k_norm.weight")
    if a.attn_sinks:
        lw.sinks = get(p + "sinks")
    return lw


def _load_gdn(a: ModelArgs, s: WeightScheme, i: int, get) -> LayerWeights:
    """A Gated DeltaNet layer; its input projections fused into one [q | k | v | z | b | a] linear
    (qwen3_next's rows, grouped per key head [q k v z] and [b a], reordered to that)."""
    from freetoken_py.layers.gated_deltanet import GdnWeights

    g, L = a.gdn, s.layer.format(i=i)
    p = L + "linear_attn."
    if s.gdn_proj == "grouped":
        Hk, dk, dv, r = g.num_k_heads, g.k_head_dim, g.v_head_dim, g.num_v_heads // g.num_k_heads
        qkvz = get(p + "in_proj_qkvz.weight").view(Hk, 2 * dk + 2 * r * dv, -1)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=1)
        ba = get(p + "in_proj_ba.weight").view(Hk, 2 * r, -1)
        b, a_ = ba.split([r, r], dim=1)
        rows = [t.reshape(-1, t.shape[-1]) for t in (q, k, v, z, b, a_)]
    else:
        rows = [get(p + f"in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")]
    gdn = GdnWeights(in_proj=TorchLinear(torch.cat(rows).contiguous()), conv=get(p + "conv1d.weight")[:, 0].contiguous(),
                     A_log=get(p + "A_log", torch.float32), dt_bias=get(p + "dt_bias", torch.float32),
                     norm=get(p + "norm.weight"))
    return LayerWeights(input_norm=get(L + "input_layernorm.weight"), post_norm=get(L + "post_attention_layernorm.weight"),
                        qkv=None, o=TorchLinear(get(p + "out_proj.weight")), gdn=gdn)


def _load_mla(a: ModelArgs, s: WeightScheme, i: int, get) -> LayerWeights:
    """MLA projections (layers/mla.py); kv_b stays one [H*(dn+dv), R] tensor, split into W_UK / W_UV by view."""
    from freetoken_py.layers.mla import MlaWeights

    p, m = s.layer.format(i=i) + "self_attn.", a.mla
    bias = (lambda n: get(p + n + ".bias")) if m.bias else (lambda n: None)  # noqa: E731
    lora = m.q_lora_rank is not None
    mla = MlaWeights(
        q_a=TorchLinear(get(p + "q_a_proj.weight"), bias("q_a_proj")) if lora else None,
        q_a_norm=get(p + "q_a_layernorm.weight") if lora else None,
        q_b=TorchLinear(get(p + ("q_b_proj.weight" if lora else "q_proj.weight"))),
        kv_a=TorchLinear(get(p + "kv_a_proj_with_mqa.weight"), bias("kv_a_proj_with_mqa")),
        kv_a_norm=get(p + "kv_a_layernorm.weight"), kv_b=get(p + "kv_b_proj.weight"))
    return LayerWeights(input_norm=get(s.layer.format(i=i) + "input_layernorm.weight"),
                        post_norm=get(s.layer.format(i=i) + "post_attention_layernorm.weight"),
                        qkv=None, o=TorchLinear(get(p + "o_proj.weight"), bias("o_proj")), mla=mla,
                        indexer=_load_indexer(p + "indexer.", get) if a.dsa is not None and a.dsa.is_full(i) else None)


def _load_indexer(p: str, get):
    """DSA's indexer; weights_proj at fp32 whatever the load dtype (transformers' _keep_in_fp32_modules)."""
    from freetoken_py.layers.dsa import IndexerWeights

    return IndexerWeights(wq_b=TorchLinear(get(p + "wq_b.weight")), wk=TorchLinear(get(p + "wk.weight")),
                          k_norm=get(p + "k_norm.weight"), k_norm_bias=get(p + "k_norm.bias"),
                          weights_proj=TorchLinear(get(p + "weights_proj.weight", torch.float32)))


def _swiglu(prefix: str, get) -> tuple[TorchLinear, TorchLinear]:
    """A dense SwiGLU MLP's (gate|up [2I, D], down [D, I]) from its {gate,up,down}_proj."""
    w13 = torch.cat([get(prefix + "gate_proj.weight"), get(prefix + "up_proj.weight")])
    return TorchLinear(w13), TorchLinear(get(prefix + "down_proj.weight"))


def _load_router(a: ModelArgs, s: WeightScheme, p: str, get):
    """(router linear, choice bias or None). A sigmoid router runs in fp32 as transformers keeps it
    (`_keep_in_fp32_modules_strict`): weight and bias are read at fp32 whatever the load dtype."""
    if a.router == "topk":  # gpt-oss: the bias is the linear's, in the model dtype
        return TorchLinear(get(p + s.router), get(p + s.router_bias)), None
    if a.router != "sigmoid":
        return TorchLinear(get(p + s.router)), None
    return TorchLinear(get(p + s.router, torch.float32)), get(p + s.router_bias, torch.float32)
