"""CPU decode and prefill of freetoken's numba path at bf16 / int8 / int4, side by side with
llama.cpp at bf16 / q8_0 / q4_0 on the same weights, same thread count, interleaved rounds.

    python bench/cpu_decode.py [--rounds 3] [--decode-tokens 32] [--prompt-len 512] [--threads 2]

Pairs: freetoken bf16 (all weights bf16)                <-> llama.cpp BF16 GGUF
       freetoken int8 (experts + dense int8)            <-> llama.cpp Q8_0
       freetoken int4 (experts + attention int4 g32,    <-> llama.cpp Q4_0 (experts + attention q4_0,
                       router + lm_head int8)                output q6_K, router f32)
Prints one JSON line: per pair the median tokens/s, weights read per token, achieved GB/s, the
fraction of the DRAM roofline (probe figure), and freetoken / llama.cpp ratios.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# precision -> (expert dtype, dense dtype, llama.cpp type)
PAIRS = {
    "bf16": ("bf16", "bf16", "bf16"),
    "int8": ("int8", "int8", "q8_0"),
    "int4": ("int4", "int4", "q4_0"),
}


def _bytes_per_token(llm) -> int:
    """Bytes one decode token streams, from the loaded weights themselves (values + scales):
    every layer's attention and router, top-k experts of each MoE layer, dense MLPs, lm_head."""
    m, k = llm.model, llm.args.top_k
    total = m.weights.lm_head.nbytes
    for lw, bank in zip(m.weights.layers, m.experts.banks):
        total += lw.qkv.nbytes + lw.o.nbytes
        if lw.router is not None:
            total += lw.router.nbytes + k * bank.bytes_per_expert
        else:
            total += lw.mlp13.nbytes + lw.mlp2.nbytes
    return total


def _gguf(model_dir: Path, kind: str) -> Path:
    if kind in ("bf16", "q8_0"):
        return common.convert_to_gguf(model_dir, kind)
    return common.quantize_gguf(common.convert_to_gguf(model_dir, "bf16"), kind.upper())


def main() -> None:
    ap = common.bench_args(__doc__)
    ap.add_argument("--precisions", default="bf16,int8,int4")
    args = ap.parse_args()
    model_dir, prompt = common.setup(args)
    from freetoken_py.llm import LLM

    n = args.decode_tokens
    precisions = args.precisions.split(",")

    engines, bpt, peer_bpt = {}, {}, {}
    for p in precisions:
        expert, dense, ggml = PAIRS[p]
        llm = LLM(model_dir, dtype="bfloat16", backend="cpu", expert_dtype=expert, dense_dtype=dense,
                  max_num_seqs=1, max_model_len=2048, show_progress=False,
                  enable_prefix_cache=False)  # a repeated prompt must be prefilled, not matched
        engines[f"freetoken-{p}"] = common.freetoken_timers(llm)
        bpt[p] = _bytes_per_token(llm)
        if not args.no_llama_cpp:
            gguf = _gguf(model_dir, ggml)
            engines[f"llama.cpp-{ggml}"] = common.llama_cpp_timers(gguf, args.threads)
            peer_bpt[p] = common.gguf_decode_bytes(gguf, llm.args.top_k, llm.args.num_experts)
    samples = common.time_rounds(engines, prompt, n, args.rounds)

    dram, method = common.dram_gbps()
    out = {"bench": "cpu_decode", "model": "qwen3_moe ~0.49B (hidden 1024, 8 layers, 64 experts, top-8, width 256)",
           "threads": args.threads, "prompt_len": args.prompt_len, "decode_tokens": n, "rounds": args.rounds,
           "dram_gbps": round(dram, 2), "dram_method": method, "precisions": {}}
    for p in precisions:
        ours = samples[f"freetoken-{p}"]
        dec = common.median(ours["decode"])
        row = {"decode_tps": round(dec, 2), "prefill_tps": round(common.median(ours["prefill"]), 1),
               "bytes_per_token": round(bpt[p]), "decode_gbps": round(dec * bpt[p] / 1e9, 2),
               "roofline_tps": round(dram * 1e9 / bpt[p], 1), "roofline_fraction": round(dec * bpt[p] / 1e9 / dram, 3),
               "decode_samples": [round(x, 2) for x in ours["decode"]]}
        peer = samples.get(f"llama.cpp-{PAIRS[p][2]}")
        if peer:
            row.update(common.peer_fields(ours, peer, PAIRS[p][2], peer_bpt[p]))
        out["precisions"][p] = row
    common.emit(out)


if __name__ == "__main__":
    main()
