"""MLA decode and prefill: a DeepSeek-shaped checkpoint on freetoken's cpu backend (absorbed
decode over the latent KV cache) at bf16 / int8 / int4, side by side with llama.cpp (its
deepseek2 conversion of the same weights) at bf16 / q8_0 / q4_0, interleaved rounds.

    python bench/mla_decode.py [--layers 2] [--experts 8] [--rounds 3] [--decode-tokens 32]
                               [--prompt-len 512] [--threads 2] [--no-llama-cpp] [--tiny]

Geometry: DeepSeek-V3's real widths (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, nope 128,
rope 64, v 128, expert width 2048, top-8 of --experts plus one shared expert, YaRN factor 40) with
fewer layers and experts and a 32,000-token vocabulary so it fits in RAM (~3.3 GB bf16 at the
defaults); --tiny is a seconds-long smoke geometry. Prints one JSON line: per precision the median
tokens/s, weights read per token, GB/s, KV bytes per token (from the pool) for both engines, and
freetoken / llama.cpp ratios.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from cpu_decode import PAIRS, _gguf  # noqa: E402

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0,
            mscale_all_dim=1.0, original_max_position_embeddings=4096)
REAL = dict(vocab_size=32000, hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=2048,
            intermediate_size=18432, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=0,
            routed_scaling_factor=2.5, max_position_embeddings=163840, tie_word_embeddings=False)
TINY = dict(REAL, hidden_size=256, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=96, kv_lora_rank=64,
            qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, moe_intermediate_size=128, num_experts_per_tok=2)


def build(out: Path, geometry: dict, layers: int, experts: int) -> Path:
    """Random bf16 weights through transformers' DeepseekV3 classes (save_pretrained), plus the demo
    tokenizer and the `scoring_func` key llama.cpp needs to route with sigmoid (docs: PERF.md)."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    common.log(f"building {out.name} (random weights, bf16)")
    torch.manual_seed(0)
    groups = 8 if experts % 8 == 0 and experts >= 16 else 1
    cfg = DeepseekV3Config(**geometry, num_hidden_layers=layers, n_routed_experts=experts, n_group=groups,
                           topk_group=min(groups, 4), rope_parameters=YARN)
    with torch.device("cpu"):
        model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    c = json.loads((out / "config.json").read_text())
    c.update(scoring_func="sigmoid", topk_method="noaux_tc")
    (out / "config.json").write_text(json.dumps(c, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (common.DEMO / name).exists():
            (out / name).write_bytes((common.DEMO / name).read_bytes())
    return out


def bytes_per_token(llm) -> int:
    """Weights one decode token streams (values + scales): MLA projections, o_proj, router, top-k
    routed experts and the shared expert of each layer, the lm_head; kv_b as the fp32 W_UK / W_UV
    the kernel reads."""
    m, k = llm.model, llm.args.top_k
    total = m.weights.lm_head.nbytes
    for lw, bank in zip(m.weights.layers, m.experts.banks):
        total += lw.mla.nbytes + lw.o.nbytes
        if lw.router is not None:
            total += lw.router.nbytes + k * bank.bytes_per_expert + lw.shared13.nbytes + lw.shared2.nbytes
        else:
            total += lw.mlp13.nbytes + lw.mlp2.nbytes
    return total


def main() -> None:
    args = common.moe_setup(__doc__, 2, 8, "smoke geometry (hidden 256), seconds")
    from freetoken_py.llm import LLM

    name = f"deepseek-mla-{'tiny' if args.tiny else 'real'}-l{args.layers}-e{args.experts}"
    model_dir = build(common.WORK / name, TINY if args.tiny else REAL, args.layers, args.experts)
    prompt = common.random_prompt(REAL["vocab_size"], args.prompt_len)
    n = args.decode_tokens
    precisions = args.precisions.split(",")
    engines, bpt, kv, peer_bpt, peer_kv = {}, {}, {}, {}, {}
    for p in precisions:
        expert, dense, ggml = PAIRS[p]
        llm = LLM(model_dir, dtype="bfloat16", backend="cpu", expert_dtype=expert, dense_dtype=dense,
                  max_num_seqs=1, max_model_len=2048, show_progress=False, enable_prefix_cache=False)
        engines[f"freetoken-{p}"] = common.freetoken_timers(llm)
        bpt[p], kv[p] = bytes_per_token(llm), llm.kv_bytes_per_token
        if not args.no_llama_cpp:
            gguf = _gguf(model_dir, ggml)
            engines[f"llama.cpp-{ggml}"] = common.llama_cpp_timers(gguf, args.threads)
            peer_bpt[p] = common.gguf_decode_bytes(gguf, llm.args.top_k, llm.args.num_experts)
            peer_kv[p] = common.llama_cpp_seq_state(engines[f"llama.cpp-{ggml}"][0].__self__,
                                                    REAL["vocab_size"])["kv_bytes_per_token"]
    samples = common.time_rounds(engines, prompt, n, args.rounds, digits=2)
    dram, method = common.dram_gbps()
    out = {"bench": "mla_decode", "model": name, "layers": args.layers, "experts": args.experts,
           "threads": args.threads, "prompt_len": args.prompt_len, "decode_tokens": n, "rounds": args.rounds,
           "dram_gbps": round(dram, 2), "dram_method": method, "precisions": {}}
    for p in precisions:
        out["precisions"][p] = _row(p, samples, bpt[p], kv[p], peer_bpt.get(p), peer_kv.get(p))
    common.emit(out)


def _row(p: str, samples: dict, bpt: int, kv_bytes: int, peer_bpt: int | None, peer_kv: int | None) -> dict:
    ours = samples[f"freetoken-{p}"]
    dec, pre = common.median(ours["decode"]), common.median(ours["prefill"])
    row = {"decode_tps": round(dec, 3), "prefill_tps": round(pre, 2), "bytes_per_token": round(bpt),
           "decode_gbps": round(dec * bpt / 1e9, 2), "kv_bytes_per_token": kv_bytes,
           "decode_samples": [round(x, 3) for x in ours["decode"]]}
    peer = samples.get(f"llama.cpp-{PAIRS[p][2]}")
    if peer:
        row.update(common.peer_fields(ours, peer, PAIRS[p][2], peer_bpt, digits=3))
        row["llama_cpp"]["kv_bytes_per_token"] = peer_kv  # from its sequence state size
    return row


if __name__ == "__main__":
    main()
