"""GLM-4.5-Air-shaped CPU decode and prefill: freetoken's numba path at bf16 / int8 / int4 against
llama.cpp (its GLM4_MOE conversion) at bf16 / q8_0 / q4_0 on the same random weights.

    python bench/glm4_moe_decode.py [--layers 4] [--experts 16] [--rounds 3] [--threads 2] [--tiny]

The checkpoint has GLM-4.5-Air's real widths (hidden 4096, 96 q / 8 kv heads x 128, RoPE on half
of each head, q/k/v biases, expert width 1408 top-8 with the sigmoid router and one shared expert,
a dense first layer of width 10944) but fewer layers and routed experts so it fits in RAM (a
decode token reads top-8 experts per layer whatever their count), and the demo tokenizer's
32,000-token vocabulary instead of 151,552 (the lm_head would otherwise dominate every token).
Precisions run one after another (engine built, timed, dropped) so only one model is resident.
`--tiny` is the smoke run (hidden 256, 2 layers). Prints one JSON line.
"""
from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PAIRS = {"bf16": ("bf16", "bf16", "bf16"), "int8": ("int8", "int8", "q8_0"), "int4": ("int4", "int4", "q4_0")}

AIR = dict(hidden_size=4096, num_attention_heads=96, num_key_value_heads=8, head_dim=128, intermediate_size=10944,
           moe_intermediate_size=1408, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1,
           n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True, partial_rotary_factor=0.5,
           attention_bias=True, use_qk_norm=False, rope_theta=1e6, max_position_embeddings=4096,
           tie_word_embeddings=False, num_nextn_predict_layers=0, vocab_size=32000)
TINY = dict(AIR, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
            moe_intermediate_size=128)


def build(out: Path, geometry: dict, layers: int, experts: int) -> Path:
    """Random bf16 weights through transformers' Glm4MoeForCausalLM (built in bf16: half the RAM),
    correction bias randomised (it is initialised to 0), the demo tokenizer."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    common.log(f"building {out.name} (random weights, bf16)")
    torch.manual_seed(0)
    cfg = Glm4MoeConfig(**geometry, num_hidden_layers=layers, n_routed_experts=experts)
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = Glm4MoeForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.02)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (common.DEMO / name).exists():
            (out / name).write_bytes((common.DEMO / name).read_bytes())
    return out


_CONVERT = """
import sys
sys.path.insert(0, {src!r})
import conversion.base as base
import conversion.glm as glm
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"  # synthetic tokenizer: same split regex
glm.Glm4MoeModel.set_vocab = lambda self: self._set_vocab_gpt2()       # no GLM special tokens in it
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outtype", {outtype!r}, "--outfile", {out!r}]
convert_hf_to_gguf.main()
"""


def gguf_for(model_dir: Path, kind: str) -> Path:
    bf16 = model_dir.parent / f"{model_dir.name}-bf16.gguf"
    if not bf16.exists():
        code = _CONVERT.format(src=str(common.llama_cpp_source()), model=str(model_dir), outtype="bf16", out=str(bf16))
        common.log(f"converting {model_dir.name} to GGUF bf16")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"convert_hf_to_gguf failed: {proc.stderr[-2000:]}")
    return bf16 if kind == "bf16" else common.quantize_gguf(bf16, kind.upper())


def bytes_per_token(llm) -> int:
    """What one decode token streams from the loaded weights (values + scales): attention, router,
    shared expert, top-k routed experts, dense MLP, lm_head."""
    m, k = llm.model, llm.args.top_k
    total = m.weights.lm_head.nbytes
    for lw, bank in zip(m.weights.layers, m.experts.banks):
        total += lw.qkv.nbytes + lw.o.nbytes
        if lw.router is None:
            total += lw.mlp13.nbytes + lw.mlp2.nbytes
            continue
        total += lw.router.nbytes + k * bank.bytes_per_expert
        if lw.shared13 is not None:
            total += lw.shared13.nbytes + lw.shared2.nbytes
    return total


def time_engine(prefill, decode, prompt, n, rounds) -> dict:
    prefill(prompt[:32])
    decode(prompt[:16], 2)  # warm-up: numba compile / page-in, untimed
    dec, pre = [], []
    for _ in range(rounds):
        dec.append(decode(prompt[:16], n))
        pre.append(prefill(prompt))
    return {"decode_tps": round(common.median(dec), 2), "prefill_tps": round(common.median(pre), 1),
            "decode_samples": [round(x, 2) for x in dec]}


def main() -> None:
    args = common.moe_setup(__doc__, 4, 16, "smoke run: hidden 256, 2 layers, 8 experts")
    from freetoken_py.llm import LLM

    geometry, layers, experts = (TINY, 2, 8) if args.tiny else (AIR, args.layers, args.experts)
    name = f"glm4moe-{'tiny' if args.tiny else 'air'}-{layers}l-{experts}e-bf16"
    model_dir = build(common.WORK / name, geometry, layers, experts)
    prompt = common.random_prompt(geometry["vocab_size"], args.prompt_len)
    out = {"bench": "glm4_moe_decode", "model": f"glm4_moe GLM-4.5-Air widths, {layers} layers, {experts} experts"
           f"{' (tiny smoke geometry)' if args.tiny else ''}", "threads": args.threads, "prompt_len": args.prompt_len,
           "decode_tokens": args.decode_tokens, "rounds": args.rounds, "precisions": {}}
    dram, method = common.dram_gbps()
    out.update(dram_gbps=round(dram, 2), dram_method=method)
    for p in args.precisions.split(","):
        expert, dense, ggml = PAIRS[p]
        llm = LLM(model_dir, dtype="bfloat16", backend="cpu", expert_dtype=expert, dense_dtype=dense, max_num_seqs=1,
                  max_model_len=2048, show_progress=False, enable_prefix_cache=False)
        bpt = bytes_per_token(llm)
        row = time_engine(*common.freetoken_timers(llm), prompt, args.decode_tokens, args.rounds)
        row.update(bytes_per_token=bpt, decode_gbps=round(row["decode_tps"] * bpt / 1e9, 2))
        top_k, num_experts = llm.args.top_k, llm.args.num_experts
        del llm
        gc.collect()
        if not args.no_llama_cpp:
            gguf = gguf_for(model_dir, ggml)
            peer = common.LlamaCppPeer(gguf, args.threads)
            prow = time_engine(peer.prefill_tps, peer.decode_tps, prompt, args.decode_tokens, args.rounds)
            pbpt = common.gguf_decode_bytes(gguf, top_k, num_experts)
            prow.update(type=ggml, bytes_per_token=pbpt, decode_gbps=round(prow["decode_tps"] * pbpt / 1e9, 2))
            row["llama_cpp"] = prow
            row["ratio_decode"] = round(row["decode_tps"] / prow["decode_tps"], 3)
            row["ratio_prefill"] = round(row["prefill_tps"] / prow["prefill_tps"], 3)
            del peer
            gc.collect()
        common.log(f"{p}: {row}")
        out["precisions"][p] = row
    common.emit(out)


if __name__ == "__main__":
    main()
