"""Model files compose layer kinds (models/architecture.py, layers/decoder.py).

The reference is transformers' own module tree for the same config: per layer, the mixer kind
(GQA / MLA / Gated DeltaNet), its options (q/k norm and its width, sinks, output gate, DSA
indexer), the feed-forward kind (MoE with or without a shared expert, or dense) and the state kind
each layer keeps — mixed within one model (windowed and full K/V, indexed and plain latents,
recurrent and paged). And the shared forward holds no family's name or switch.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import dsa_util
import gpt_oss_util
import hybrid_util
import mla_util
from conftest import _configs
from freetoken_py.kvcache import PagedIndexedLatent, PagedKV, PagedLatent, PagedWindowKV, Recurrent
from freetoken_py.layers.gated_deltanet import GdnMixer
from freetoken_py.layers.gqa import GqaAttention
from freetoken_py.layers.mla import MlaAttention
from freetoken_py.layers.mlp import DenseMlp
from freetoken_py.layers.moe import MoeBlock, SigmoidRouter, SoftmaxRouter, TopKRouter
from freetoken_py.models import _REGISTRY, architecture_of, model_module
from freetoken_py.models.args import ConfigReader
from freetoken_py.models.moe_transformer import MoeTransformer
from freetoken_py.models.weights import ModelWeights


def _cases() -> dict:
    import transformers as tf

    out = {name: cls(**kw) for name, (cls, kw) in _configs().items()}
    out.update({name: tf.GptOssConfig(**kw) for name, kw in gpt_oss_util.configs().items()})
    out.update({name: hybrid_util._config(name) for name in ("qwen3_next", "qwen3_next_mixed", "qwen3_5_moe")})
    out["deepseek_v32"] = tf.DeepseekV32Config(**dsa_util.configs()["deepseek_v32"][1])
    out["glm_moe_dsa"] = tf.GlmMoeDsaConfig(**dsa_util.configs()["glm_moe_dsa"][1])
    out.update({name: mla_util._model(name).config for name in mla_util.configs()})
    return out


CASES = _cases()


def _ours_and_theirs(name: str):
    from transformers import AutoModelForCausalLM

    config = CASES[name]
    cfg = config.to_dict()
    args = model_module(cfg["model_type"]).parse_config(ConfigReader(cfg))
    torch.manual_seed(0)
    text = getattr(config, "text_config", None) if cfg["model_type"] == "kimi_k25" else None   # a VLM wrapper
    return architecture_of(args), AutoModelForCausalLM.from_config(text or config).model.layers


def _mixer_matches(ours, theirs, config, i: int) -> None:
    if hasattr(theirs, "linear_attn"):
        assert isinstance(ours, GdnMixer) and isinstance(ours.state_spec(), Recurrent)
        return
    attn = theirs.self_attn
    if hasattr(attn, "kv_a_proj_with_mqa"):
        indexer = getattr(attn, "indexer", None) is not None and hasattr(attn.indexer, "wk")
        assert isinstance(ours, MlaAttention) and ours.indexer == indexer
        assert type(ours.state_spec()) is (PagedIndexedLatent if indexer else PagedLatent)
        return
    assert isinstance(ours, GqaAttention)
    hd = ours.head_dim
    assert ours.sinks == hasattr(attn, "sinks")
    assert ours.output_gate == (attn.q_proj.out_features == 2 * ours.num_heads * hd)
    q_norm = getattr(attn, "q_norm", None)
    width = None if q_norm is None else q_norm.weight.shape[0]
    assert ours.qk_norm == {None: "none", hd: "head"}.get(width, "full")
    assert ours.bias == (attn.q_proj.bias is not None) and ours.o_bias == (attn.o_proj.bias is not None)
    kinds = getattr(config, "layer_types", None)
    sliding = config.model_type == "gpt_oss" and kinds[i] == "sliding_attention"
    assert ours.window == (config.sliding_window if sliding and len(set(kinds)) > 1 else None)
    assert type(ours.state_spec()) is (PagedWindowKV if ours.window is not None else PagedKV)


def _ffn_matches(ours, theirs) -> None:
    mlp = theirs.mlp if hasattr(theirs, "mlp") else theirs.block_sparse_moe
    if not hasattr(mlp, "experts"):
        assert isinstance(ours, DenseMlp)
        return
    assert isinstance(ours, MoeBlock)
    shared = getattr(mlp, "shared_expert", None) or getattr(mlp, "shared_experts", None)
    assert bool(ours.shared_width) == (shared is not None)
    assert ours.shared_gate == hasattr(mlp, "shared_expert_gate")
    gate = getattr(mlp, "gate", None) or getattr(mlp, "router", None)
    if hasattr(gate, "e_score_correction_bias") or hasattr(mlp, "e_score_correction_bias"):
        assert isinstance(ours.router, SigmoidRouter)
    elif getattr(gate, "bias", None) is not None and isinstance(gate.bias, torch.nn.Parameter):
        assert isinstance(ours.router, TopKRouter)      # gpt-oss: the router linear's own bias
    else:
        assert isinstance(ours.router, SoftmaxRouter)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_layer_is_the_kind_transformers_builds(name):
    arch, theirs = _ours_and_theirs(name)
    assert len(arch.layers) == len(theirs)
    for i, (layer, ref) in enumerate(zip(arch.layers, theirs)):
        _mixer_matches(layer.mixer, ref, CASES[name], i)
        _ffn_matches(layer.ffn, ref)


@pytest.mark.parametrize("name, kinds", [
    ("gpt_oss", {PagedWindowKV, PagedKV}), ("glm_moe_dsa", {PagedIndexedLatent, PagedLatent}),
    ("qwen3_next_mixed", {Recurrent, PagedKV})])
def test_state_kinds_mix_within_one_model(name, kinds):
    """One model, several state kinds: the pool's layers are the paged mixers, in order."""
    arch, _ = _ours_and_theirs(name)
    no_weights = ModelWeights(torch.zeros(1), torch.zeros(1), None, [None] * len(arch.layers))
    model = MoeTransformer(_args(name), no_weights, torch.float32, experts=lambda *a: None, arch=arch)
    assert {type(s) for s in model.state_specs()} == kinds
    assert model.paged_specs() == [layer.mixer.state_spec() for layer in arch.layers if layer.mixer.paged]
    assert list(model.kv_layer) == [i for i, layer in enumerate(arch.layers) if layer.mixer.paged]


def _args(name: str):
    cfg = CASES[name].to_dict()
    return model_module(cfg["model_type"]).parse_config(ConfigReader(cfg))


def test_every_model_type_composes_its_layers():
    for model_type, module in sorted(_REGISTRY.items()):
        assert callable(getattr(model_module(model_type), "architecture", None)), module


def test_the_shared_forward_names_no_family_and_reads_no_switch():
    """moe_transformer.py runs the model file's layer list: no model_type named in it and, of the
    parsed config, only the norm epsilon, the experts' activation and the head width read."""
    src = Path(__file__).parents[1].joinpath("freetoken_py/models/moe_transformer.py").read_text()
    code = "\n".join(line.split("#")[0] for line in src.split('"""')[2].splitlines())
    for model_type in _REGISTRY:
        assert model_type not in code, model_type
    assert set(re.findall(r"args\.(\w+)", code)) <= {"rms_norm_eps", "hidden_act", "head_dim"}
