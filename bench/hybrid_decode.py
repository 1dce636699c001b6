"""Hybrid (Gated DeltaNet + gated full attention) decode and prefill: a Qwen3.6-35B-A3B-shaped
checkpoint on freetoken's cpu backend (the numba GDN kernels, kernels/cpu_gdn.py) at bf16 / int8 /
int4, side by side with llama.cpp (its qwen35moe conversion of the same weights) at bf16 / q8_0 /
q4_0, interleaved rounds.

    python bench/hybrid_decode.py [--layers 4] [--experts 32] [--rounds 3] [--decode-tokens 32]
                                  [--prompt-len 512] [--threads 2] [--no-llama-cpp] [--tiny]

Geometry: Qwen3.5/3.6-35B-A3B's real widths (hidden 2048; full attention 16 q / 2 kv heads x 256
with a query gate and partial RoPE 0.25; GDN 16 k / 32 v heads x 128, conv 4; experts of width 512,
top-8 of --experts, plus a sigmoid-gated shared expert of 512) built with transformers'
Qwen3_5MoeForCausalLM (save_pretrained, random bf16 weights), the demo tokenizer and a 32,000-token
vocabulary; --layers L gives the real 3:1 pattern (every 4th layer full attention; default 4 = 3 GDN
+ 1 attention), ~1.4 GB bf16 at the defaults. --tiny is a seconds-long smoke geometry.

Prints one JSON line: per precision the median tokens/s (decode, prefill), weights read per token,
GB/s, and the state a request keeps for both engines: freetoken's recurrent + conv bytes (fixed per
request) and KV bytes per token (full-attention layers only), llama.cpp's the same two figures
measured from its sequence state size (llama_state_seq_get_size) after two prompt lengths; then
freetoken / llama.cpp ratios. If llama.cpp cannot convert or load the checkpoint, the line says why
("llama_cpp_error") and carries freetoken's figures alone.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from cpu_decode import PAIRS  # noqa: E402

# save_pretrained writes no MTP layers and no `mtp_num_hidden_layers`; llama.cpp's qwen35moe
# converter then asserts unless told to leave the MTP head out
CONVERT_ARGS = ("--no-mtp",)

REAL = dict(vocab_size=32000, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4, moe_intermediate_size=512, shared_expert_intermediate_size=512,
            num_experts_per_tok=8, max_position_embeddings=32768, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
TINY = dict(REAL, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
            linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32, moe_intermediate_size=128,
            shared_expert_intermediate_size=128, num_experts_per_tok=2)


def layer_types(layers: int) -> list[str]:
    """The releases' pattern: every 4th layer full attention, the rest linear (at least one of each)."""
    types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    return types


def build(out: Path, geometry: dict, layers: int, experts: int) -> Path:
    """Random bf16 weights through transformers' Qwen3_5MoeForCausalLM (save_pretrained writes the
    per-expert layout and `model_type: qwen3_5_moe_text`), plus the demo tokenizer. The norms and
    decays are randomised around their init (the zero-centred norms' zeros and A_log / dt_bias'
    constants would make every layer alike)."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    common.log(f"building {out.name} (random weights, bf16)")
    torch.manual_seed(0)
    cfg = Qwen3_5MoeTextConfig(**geometry, num_hidden_layers=layers, layer_types=layer_types(layers),
                               num_experts=experts)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialised in bf16: no fp32 copy (~3 GB at the defaults)
    try:
        with torch.device("cpu"):
            model = Qwen3_5MoeForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias")):
                p.add_(0.1 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (common.DEMO / name).exists():
            (out / name).write_bytes((common.DEMO / name).read_bytes())
    return out


def _nbytes(x) -> int:
    return 0 if x is None else x.nbytes


def bytes_per_token(llm) -> int:
    """Weights one decode token streams (values + scales): per layer the mixer's projections (GDN:
    the fused in_proj and out_proj plus its small fp32 vectors; attention: qkv and o), the router,
    the top-k routed experts, the shared expert and its gate; then the lm_head."""
    m, k = llm.model, llm.args.top_k
    total = m.weights.lm_head.nbytes
    for lw, bank in zip(m.weights.layers, m.experts.banks):
        total += lw.o.nbytes + (lw.gdn.nbytes if getattr(lw, "gdn", None) is not None else _nbytes(lw.qkv))
        if lw.router is not None:
            total += lw.router.nbytes + k * bank.bytes_per_expert + _nbytes(lw.shared13) + _nbytes(lw.shared2)
            total += _nbytes(getattr(lw, "shared_gate", None))
        else:
            total += lw.mlp13.nbytes + lw.mlp2.nbytes
    return total


def freetoken_state(llm) -> dict:
    """Per request: the recurrent + conv state of every GDN layer (fixed) and the K/V bytes per token
    of the full-attention layers, from the model's own state specs."""
    m = llm.model
    fixed = sum(s.values_per_request * 4 for s in m.state_specs() if getattr(s, "kind", "") == "recurrent")
    return {"state_bytes_per_request": int(fixed), "kv_bytes_per_token": int(llm.kv_bytes_per_token)}


def _gguf(model_dir: Path, kind: str) -> Path:
    if kind in ("bf16", "q8_0"):
        return common.convert_to_gguf(model_dir, kind, CONVERT_ARGS)
    return common.quantize_gguf(common.convert_to_gguf(model_dir, "bf16", CONVERT_ARGS), kind.upper())


def main() -> None:
    args = common.moe_setup(__doc__, 4, 32, "smoke geometry (hidden 256), seconds")
    from freetoken_py.llm import LLM

    name = f"qwen35moe-{'tiny' if args.tiny else 'real'}-l{args.layers}-e{args.experts}"
    model_dir = build(common.WORK / name, TINY if args.tiny else REAL, args.layers, args.experts)
    prompt = common.random_prompt(REAL["vocab_size"], args.prompt_len)
    n = args.decode_tokens
    precisions = args.precisions.split(",")
    engines, bpt, state, peer_bpt, peer_state, peer_error = {}, {}, {}, {}, {}, None
    for p in precisions:
        expert, dense, ggml = PAIRS[p]
        llm = LLM(model_dir, dtype="bfloat16", backend="cpu", expert_dtype=expert, dense_dtype=dense,
                  max_num_seqs=1, max_model_len=2048, show_progress=False, enable_prefix_cache=False)
        engines[f"freetoken-{p}"] = common.freetoken_timers(llm)
        bpt[p], state[p] = bytes_per_token(llm), freetoken_state(llm)
        if args.no_llama_cpp or peer_error is not None:
            continue
        try:
            gguf = _gguf(model_dir, ggml)
            peer = common.LlamaCppPeer(gguf, args.threads)
            peer_state[p] = common.llama_cpp_seq_state(peer, REAL["vocab_size"])
            engines[f"llama.cpp-{ggml}"] = (peer.prefill_tps, peer.decode_tps)
            peer_bpt[p] = common.gguf_decode_bytes(gguf, llm.args.top_k, llm.args.num_experts)
        except Exception as exc:  # conversion or load failed: say why in the JSON line, bench ours alone
            err = getattr(exc, "stderr", None)
            tail = err.decode(errors="replace").strip().splitlines()[-1] if isinstance(err, bytes) and err.strip() else ""
            peer_error = f"{type(exc).__name__}: {exc}" + (f" ({tail})" if tail else "")
            common.log(f"llama.cpp unavailable: {peer_error}")
    samples = common.time_rounds(engines, prompt, n, args.rounds, digits=2)
    dram, method = common.dram_gbps()
    out = {"bench": "hybrid_decode", "model": name, "layers": args.layers, "layer_types": layer_types(args.layers),
           "experts": args.experts, "threads": args.threads, "prompt_len": args.prompt_len, "decode_tokens": n,
           "rounds": args.rounds, "dram_gbps": round(dram, 2), "dram_method": method, "precisions": {}}
    if peer_error is not None:
        out["llama_cpp_error"] = peer_error
    for p in precisions:
        out["precisions"][p] = _row(p, samples, bpt[p], state[p], peer_bpt.get(p), peer_state.get(p))
    common.emit(out)


def _row(p: str, samples: dict, bpt: int, state: dict, peer_bpt: int | None, peer_state: dict | None) -> dict:
    ours = samples[f"freetoken-{p}"]
    dec, pre = common.median(ours["decode"]), common.median(ours["prefill"])
    row = {"decode_tps": round(dec, 3), "prefill_tps": round(pre, 2), "bytes_per_token": round(bpt),
           "decode_gbps": round(dec * bpt / 1e9, 2), **state,
           "decode_samples": [round(x, 3) for x in ours["decode"]]}
    peer = samples.get(f"llama.cpp-{PAIRS[p][2]}")
    if peer:
        row.update(common.peer_fields(ours, peer, PAIRS[p][2], peer_bpt, digits=3))
        row["llama_cpp"].update(peer_state)
    return row


if __name__ == "__main__":
    main()
