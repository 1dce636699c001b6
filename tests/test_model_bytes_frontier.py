"""`freetoken probe --model` planning of the sigmoid-router families (glm4_moe, minimax_m2): the
byte split read off the safetensors headers equals what the config implies, computed by hand
here — routed experts apart from the dense work (shared expert, router and its correction bias,
the dense first layer), and the MTP layer beyond num_hidden_layers counted in no layer."""
from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import save_file

from freetoken_py.hw.model_bytes import read_model_bytes

F32 = 4


def test_glm4_moe_split_shared_expert_dense_layer_and_mtp(checkpoint_factory, tmp_path):
    src = checkpoint_factory("glm4_moe")
    path = tmp_path / "glm"
    shutil.copytree(src, path, ignore=shutil.ignore_patterns("freetoken-experts-*"))
    cfg = json.loads((path / "config.json").read_text())
    D, E, k, I = cfg["hidden_size"], cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    n, shared = cfg["num_hidden_layers"], cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
    mtp = {f"model.layers.{n}.mlp.experts.0.gate_proj.weight": torch.zeros(I, D),
           f"model.layers.{n}.eh_proj.weight": torch.zeros(D, 2 * D)}
    save_file(mtp, path / "model-mtp.safetensors")
    m = read_model_bytes(path)
    assert [lay.layer for lay in m.layers] == list(range(n))
    assert m.by_category["not_run"] == (I * D + 2 * D * D) * F32
    dense0 = m.layers[0]
    assert dense0.num_experts == 0 and dense0.by_category["dense_mlp"] == 3 * cfg["intermediate_size"] * D * F32
    for lay in m.layers[1:]:
        assert lay.num_experts == E and lay.bytes_per_expert == 3 * I * D * F32
        assert lay.by_category["routed_experts"] == E * 3 * I * D * F32
        assert lay.by_category["shared_experts"] == 3 * shared * D * F32
        assert lay.by_category["router"] == (E * D + E) * F32  # gate weight + e_score_correction_bias
    assert m.per_token["routed_experts"] == (n - 1) * k * 3 * I * D * F32
    dense_per_layer = sum(lay.dense_bytes for lay in m.layers)
    assert m.per_token["dense"] == dense_per_layer + D * F32  # + the final norm
    assert m.kv_bytes_per_token == 2 * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * n  # bf16 K and V


def test_minimax_m2_router_bias_on_the_block_is_router_bytes(checkpoint_factory):
    path = checkpoint_factory("minimax_m2")
    cfg = json.loads((path / "config.json").read_text())
    D, E, I = cfg["hidden_size"], cfg["num_local_experts"], cfg["intermediate_size"]
    m = read_model_bytes(path)
    assert "other" not in m.by_category and "shared_experts" not in m.by_category
    for lay in m.layers:
        assert lay.by_category["router"] == (E * D + E) * F32
        assert lay.bytes_per_expert == 3 * I * D * F32
