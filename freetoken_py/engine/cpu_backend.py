"""Switch a loaded model to the numba CPU path: every linear layer becomes a `KernelLinear`, every
MoE layer's experts an `ExpertBank`, activations fp32.

`load_cpu_model` is the start-up path: the loader skips the torch expert stacks and the expert
store (`expert_store.py`) builds the banks straight from the checkpoint, or maps them from its
disk cache, so peak memory is the dense weights plus the banks plus one layer in flight.
`use_cpu_kernels` alone also converts a fully loaded model (experts stacked as torch tensors),
one layer at a time, dropping the torch copies as it goes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken_py.errors import FreetokenError
from freetoken_py.layers.linear import KernelLinear, TorchLinear
from freetoken_py.models.loader import load_model, open_checkpoint
from freetoken_py.models.moe_transformer import MoeTransformer

EXPERT_FORMATS = ("bf16", "fp32", "int8", "int4", "fp8", "nvfp4")


class FormatConversion(UserWarning):
    """A checkpoint's quantised weights converted to another format because it was asked for."""


def note_conversion(msg: str) -> None:
    import warnings

    # one line on the CLI ("freetoken:0: FormatConversion: ..."), as the expert store's warnings
    warnings.warn_explicit(msg, FormatConversion, "freetoken", 0, module=__name__)


class KernelExpertExecutor:
    """Routed experts through `freetoken_py.kernels.moe_experts` (fp32 in, fp32 out).

    Asymmetric precision (`--prefill-expert-dtype`): `prefill_banks` is a second, higher-precision
    copy of the experts (mapped from its expert-store cache file). The rows named by
    `prefill_rows` (a bool mask the runner sets for one forward pass: the tokens of chunks of
    more than one token) run on it; every other row, and every row of the fused decode step
    (which reads `banks` itself), on `banks`. So a token's result depends only on its own
    chunk, not on what else shares the batch."""

    def __init__(self, banks: list, activation: str = "silu", prefill_banks: list | None = None):
        from freetoken_py.kernels import moe_experts

        self.banks = banks  # per layer: ExpertBank or None (dense layer)
        self.prefill_banks = prefill_banks  # per layer, or None (one copy)
        self.prefill_rows: torch.Tensor | None = None  # bool [T] of the pass in flight; None = none
        self.activation = activation
        self._run = moe_experts

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        rows = self.prefill_rows if self.prefill_banks is not None else None
        if rows is None or not bool(rows.any()):
            return self._run(self.banks[layer], x, ids, weights, activation=self.activation)  # casts to fp32 itself
        if bool(rows.all()):
            return self._run(self.prefill_banks[layer], x, ids, weights, activation=self.activation)
        out = torch.empty(x.shape, dtype=torch.float32)
        dec = ~rows
        out[rows] = self._run(self.prefill_banks[layer], x[rows], ids[rows], weights[rows], activation=self.activation)
        out[dec] = self._run(self.banks[layer], x[dec], ids[dec], weights[dec], activation=self.activation)
        return out


def prefill_expert_memory(store) -> dict:
    """What the prefill copy of the experts takes: its format, bytes, the cache file it maps and
    how much of that file is resident in this process now (Linux: /proc/self/smaps, summed
    over every mapping of the file, so another engine mapping the same file counts too; None
    elsewhere). Pages in as prefills touch experts; the kernel may drop them again (clean)."""
    banks = [b for b in store.banks if b is not None]
    nbytes = sum(a.nbytes for b in banks for a in (b.w13, b.s13, b.w2, b.s2))
    out = {"format": banks[0].fmt if banks else None, "bytes": nbytes,
           "mapped_file": str(store.path) if store.path is not None else None, "resident_bytes": None}
    if store.path is None:
        out["resident_bytes"] = nbytes   # built in memory (--expert-cache off)
        return out
    try:
        resident, inside = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                    inside = len(head) >= 6 and head[-1] == str(store.path)
                elif inside and head and head[0] == "Rss:":
                    resident += int(head[1]) * 1024
        out["resident_bytes"] = resident
    except OSError:
        pass
    return out


def weight_format(dtype: torch.dtype) -> str:
    """Dense weights keep their stored precision: bf16 stays bf16; fp32 and fp16 run as fp32."""
    return "bf16" if dtype == torch.bfloat16 else "fp32"


def _kernel(lin: TorchLinear, fmt: str, group_size: int = 32, packed=None) -> KernelLinear:
    """packed: the checkpoint's own fp8 / int4 form of this weight (formats.Packed), run as it is."""
    if packed is not None:
        return KernelLinear.from_packed(packed, lin.bias)
    return KernelLinear(lin.weight, lin.bias, fmt, group_size)


def packed_groups(ckpt, a) -> list[dict]:
    """Per layer (and -1: the lm_head), the dense linears the checkpoint stores packed, as the
    logical names of each LayerWeights field: {"qkv": [q, k, v names], "o": [...], "mlp13": [gate,
    up], "mlp2": [down], "shared13": ..., "shared2": ...}. A fused field counts only when all its
    parts are packed (q, k and v; gate and up); MLA projections stay at the load dtype (not yet
    packed). `load_cpu_model` defers these names in the loader (never dequantised) and
    `packed_dense` reads them in their own format."""
    s, dec = ckpt.scheme, ckpt.decoder

    def full(names: list[str]) -> list[str] | None:
        return names if all(dec.is_packed(n) for n in names) else None

    out = []
    for i in range(a.num_layers):
        p = s.layer.format(i=i)
        got = {}
        if a.mla is None:
            got["qkv"] = full([f"{p}self_attn.{x}_proj.weight" for x in "qkv"])
        got["o"] = full([p + "self_attn.o_proj.weight"])
        mlp = s.dense_mlp if not a.sparse_layers[i] else (s.shared_expert if a.shared_intermediate_size else None)
        if mlp is not None:
            key = "mlp" if not a.sparse_layers[i] else "shared"
            got[key + "13"] = full([p + mlp + "gate_proj.weight", p + mlp + "up_proj.weight"])
            got[key + "2"] = full([p + mlp + "down_proj.weight"])
        out.append({k: v for k, v in got.items() if v is not None})
    head = None if a.tie_word_embeddings else full(["lm_head.weight"])
    out.append({"lm_head": head} if head is not None else {})
    return out


def packed_dense(ckpt, model: MoeTransformer, groups: list[dict] | None = None) -> list[dict]:
    """`packed_groups` as formats.Packed weights (fused fields concatenated along rows), by
    LayerWeights field, for the fields the loaded model has."""
    from freetoken_py.formats import cat_rows

    groups = packed_groups(ckpt, model.args) if groups is None else groups
    reader = ckpt.reader()
    out = []
    for lw, g in zip([*model.weights.layers, None], groups):
        out.append({k: cat_rows([reader.packed(n) for n in names]) for k, names in g.items()
                    if k == "lm_head" or getattr(lw, k, None) is not None})
    reader.close()
    return out


def _mla_kernels(w, fmt: str, group_size: int) -> None:
    """An MLA layer's projections as KernelLinears, in place (layers/mla.py's MlaWeights)."""
    if w.q_a is not None:
        w.q_a, w.q_a_norm = _kernel(w.q_a, fmt, group_size), w.q_a_norm.float()
    w.q_b, w.kv_a = _kernel(w.q_b, fmt, group_size), _kernel(w.kv_a, fmt, group_size)
    # kv_b (W_UK / W_UV) stays at its stored precision: the decode kernel reads fp32 or bf16 in place
    w.kv_a_norm = w.kv_a_norm.float()
    if w.kv_b.dtype not in (torch.float32, torch.bfloat16):
        w.kv_b = w.kv_b.float()


def _head_format(dense_fmt: str) -> str:
    """Router and lm_head format: int4 dense keeps these two at int8 (llama.cpp's Q4_0 likewise
    keeps the output matrix at 6 bits and the router unquantised: both are small or sensitive)."""
    return "int8" if dense_fmt == "int4" else dense_fmt


def _check_int4_dense(a, group_size: int) -> None:
    ks = {"hidden size": a.hidden_size, "attention width (heads x head dim)": a.num_heads * a.head_dim}
    if a.intermediate_size and not all(a.sparse_layers):
        ks["dense MLP width"] = a.intermediate_size
    if a.shared_intermediate_size:
        ks["shared expert width"] = a.shared_intermediate_size
    bad = [f"{name} {k}" for name, k in ks.items() if k % group_size]
    if bad:
        raise FreetokenError(f"--dense-dtype int4 needs every input width divisible by the group size "
                             f"{group_size}; not: {', '.join(bad)} (use --dense-dtype int8)")


@dataclass(frozen=True)
class CpuModel:
    """`load_cpu_parts`' result: the model on the kernels, the store(s) its banks come from, and
    the KV storage of `--kv-dtype auto` (the checkpoint's precision where the kernels read it
    in place: bf16 halves the bytes decode attention streams; fp32 otherwise)."""
    model: MoeTransformer
    expert_store: object
    prefill_expert_store: object | None
    kv_dtype: torch.dtype


def load_cpu_model(model_dir, dtype: str = "auto", expert_format: str | None = None, group_size: int = 32,
                   dense_format: str | None = None, expert_cache: str = "auto",
                   show_progress: bool = True, prefill_format: str | None = None) -> MoeTransformer:
    """`load_cpu_parts`' model alone (benches and tests that need only the forward)."""
    return load_cpu_parts(model_dir, dtype, expert_format, group_size, dense_format, expert_cache, show_progress,
                          prefill_format).model


def load_cpu_parts(model_dir, dtype: str = "auto", expert_format: str | None = None, group_size: int = 32,
                   dense_format: str | None = None, expert_cache: str = "auto",
                   show_progress: bool = True, prefill_format: str | None = None) -> CpuModel:
    """Load for the cpu backend: dense weights through the loader, experts through the store.
    prefill_format: a second copy of the experts in this format for prefill chunks
    (`--prefill-expert-dtype`), from the store as well (its cache file, mapped), unless it is
    the decode format already."""
    from freetoken_py.engine.expert_store import open_expert_store
    from freetoken_py.kernels.threads import tune_allocator

    tune_allocator()  # process-wide, idempotent: every cpu-backend LLM gets it, not only the CLI
    ckpt = open_checkpoint(model_dir)
    native = ckpt.decoder.exec_format            # fp8 / int4 / nvfp4 checkpoints run in their own format
    # the dense linears stored packed are run as stored: the loader never reads (dequantises) them
    groups = packed_groups(ckpt, ckpt.args) if native is not None and dense_format is None else None
    defer = frozenset(n for g in groups or () for names in g.values() for n in names)
    model = load_model(ckpt, dtype, show_progress, experts="skip", defer=defer)
    if dense_format == "int4":  # before the expert store spends minutes building a cache file
        _check_int4_dense(model.args, group_size)
    fmt = expert_format or native or dense_format or weight_format(model.dtype)
    expert_group = ckpt.decoder.group_size if fmt == native else group_size
    if native is not None and fmt != native:
        note_conversion(f"converting the checkpoint's {ckpt.decoder.describe()} experts to {fmt} (--expert-dtype)")
    load_dtype = model.dtype
    store = open_expert_store(model_dir, model.args, load_dtype, fmt, expert_group, expert_cache, show_progress,
                              layout="auto")
    packed = packed_dense(ckpt, model, groups) if groups is not None else None
    use_cpu_kernels(model, fmt, expert_group if dense_format is None else group_size, dense_format=dense_format,
                    banks=store.banks, packed=packed)
    pstore = None
    if prefill_format is not None and prefill_format != fmt:
        pgroup = ckpt.decoder.group_size if prefill_format == native else group_size
        pstore = open_expert_store(model_dir, model.args, load_dtype, prefill_format, pgroup, expert_cache,
                                   show_progress, layout="auto")
        model.experts.prefill_banks = pstore.banks
    kv_dtype = torch.bfloat16 if load_dtype == torch.bfloat16 else torch.float32
    return CpuModel(model, store, pstore, kv_dtype)


def use_cpu_kernels(model: MoeTransformer, expert_format: str | None = None, group_size: int = 32,
                    progress=None, dense_format: str | None = None, banks: list | None = None,
                    packed: list[dict] | None = None) -> None:
    """banks: prebuilt per-layer ExpertBanks (from the expert store); else converted from the
    model's torch expert stacks. packed: `packed_dense`'s per-layer checkpoint weights, run in
    their own format instead of converting the loaded ones."""
    dense_fmt = dense_format or weight_format(model.dtype)
    expert_format = expert_format or dense_fmt
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"expert format must be one of {EXPERT_FORMATS}")
    a = model.args
    if expert_format == "int4" and (a.hidden_size % group_size or a.moe_intermediate_size % group_size):
        raise FreetokenError(f"int4 experts need hidden size ({a.hidden_size}) and expert width "
                             f"({a.moe_intermediate_size}) divisible by the group size {group_size}")
    if dense_fmt == "int4":
        _check_int4_dense(a, group_size)
    head_fmt = _head_format(dense_fmt)
    w = model.weights
    out_banks = []
    for i, lw in enumerate(w.layers):
        pk = packed[i] if packed is not None else {}
        _attention_kernels(lw, dense_fmt, group_size, pk)
        if lw.router is not None:
            out_banks.append(_moe_kernels(lw, dense_fmt, head_fmt, expert_format, group_size, pk,
                                          banks[i] if banks is not None else None))
        else:
            lw.mlp13 = _kernel(lw.mlp13, dense_fmt, group_size, pk.get("mlp13"))
            lw.mlp2 = _kernel(lw.mlp2, dense_fmt, group_size, pk.get("mlp2"))
            out_banks.append(None)
        if progress is not None:
            progress()
    w.lm_head = _kernel(w.lm_head, head_fmt, packed=packed[-1].get("lm_head") if packed is not None else None)
    w.final_norm = w.final_norm.float()
    model.experts = KernelExpertExecutor(out_banks, activation=a.hidden_act)
    if model.hybrid:  # Gated DeltaNet layers: conv, delta rule and gated norm in numba (kernels/cpu_gdn.py)
        from freetoken_py.layers.gdn_cpu import gated_deltanet_cpu

        model.gdn_mixer = gated_deltanet_cpu
    model.dtype = torch.float32  # activations; the embedding rows are widened on lookup


def _attention_kernels(lw, dense_fmt: str, group_size: int, pk: dict) -> None:
    """One layer's attention (GQA, MLA, the DSA indexer, Gated DeltaNet) and norms, in place."""
    lw.qkv = _kernel(lw.qkv, dense_fmt, group_size, pk.get("qkv")) if lw.qkv is not None else None
    lw.o = _kernel(lw.o, dense_fmt, group_size, pk.get("o"))
    if lw.mla is not None:  # MLA: its projections on the kernels, kv_b (W_UK / W_UV) kept as stored
        _mla_kernels(lw.mla, dense_fmt, group_size)
    if lw.indexer is not None:  # DSA indexer: wq_b / wk in the dense format, weights_proj fp32 (its head weights)
        ix = lw.indexer
        ix.wq_b, ix.wk = _kernel(ix.wq_b, dense_fmt, group_size), _kernel(ix.wk, dense_fmt, group_size)
        ix.weights_proj = _kernel(ix.weights_proj, "fp32")
        ix.k_norm, ix.k_norm_bias = ix.k_norm.float(), ix.k_norm_bias.float()
    if lw.gdn is not None:  # Gated DeltaNet: the fused input projection on the kernels, the rest fp32
        g = lw.gdn
        g.in_proj, g.conv, g.norm = _kernel(g.in_proj, dense_fmt, group_size), g.conv.float(), g.norm.float()
    lw.input_norm, lw.post_norm = lw.input_norm.float(), lw.post_norm.float()
    if lw.q_norm is not None:
        lw.q_norm, lw.k_norm = lw.q_norm.float(), lw.k_norm.float()


def _moe_kernels(lw, dense_fmt: str, head_fmt: str, expert_format: str, group_size: int, pk: dict, prebuilt):
    """One MoE layer's router and shared expert on the kernels, in place; returns its ExpertBank
    (`prebuilt`, the store's, or converted from the torch stacks, which are dropped)."""
    from freetoken_py.kernels import ExpertBank
    from freetoken_py.kernels.cpu_moe import preferred_layout

    # a sigmoid router stays fp32 (as transformers and llama.cpp keep it): its scores pick experts
    lw.router = _kernel(lw.router, "fp32" if lw.router_bias is not None else head_fmt)
    if lw.shared13 is not None:  # the shared expert is dense work, in the dense format
        lw.shared13 = _kernel(lw.shared13, dense_fmt, group_size, pk.get("shared13"))
        lw.shared2 = _kernel(lw.shared2, dense_fmt, group_size, pk.get("shared2"))
    if lw.shared_gate is not None:  # [1, D]: its sigmoid scales the shared expert, kept fp32
        lw.shared_gate = _kernel(lw.shared_gate, "fp32")
    if prebuilt is not None:
        bank = prebuilt if lw.b13 is None else prebuilt.with_biases(lw.b13, lw.b2)
    elif lw.w13 is None:
        raise FreetokenError("model was loaded without its experts; pass the expert store's banks")
    else:
        inter = lw.w13.shape[1] // 2
        bank = ExpertBank.from_weights(lw.w13[:, :inter], lw.w13[:, inter:], lw.w2,
                                       fmt=expert_format, group_size=group_size,
                                       layout=preferred_layout(expert_format, inter, lw.w2.shape[1], group_size))
        bank = bank if lw.b13 is None else bank.with_biases(lw.b13, lw.b2)
    lw.w13 = lw.w2 = lw.b13 = lw.b2 = None
    return bank
