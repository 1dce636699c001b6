"""Prefill and decode tokens/s of freetoken on the ~0.5B qwen3_moe, side by side with
transformers and llama.cpp (llama-cpp-python) on the same weights, interleaved rounds.

    python bench/decode.py [--rounds 3] [--decode-tokens 32] [--prompt-len 512] [--no-llama-cpp]

Prints one JSON line: per engine the median prefill/decode tokens/s, achieved GB/s (weights read
per token x tokens/s), the DRAM roofline from the probe, and ratios to the peers.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def main() -> None:
    ap = common.bench_args(__doc__)
    ap.add_argument("--backend", default="auto", help="freetoken backend: auto, cpu (numba) or torch")
    ap.add_argument("--no-transformers", action="store_true")
    args = ap.parse_args()
    model_dir, prompt = common.setup(args)
    from freetoken_py.llm import LLM

    short, n = prompt[:16], args.decode_tokens
    ours = LLM(model_dir, dtype="bfloat16", max_num_seqs=1, max_model_len=2048, show_progress=False,
               backend=args.backend, enable_prefix_cache=False)  # each round prefills the same prompt again
    engines = {"freetoken": common.freetoken_timers(ours)}
    if not args.no_transformers:
        engines["transformers"] = common.transformers_timers(model_dir)
    if not args.no_llama_cpp:
        engines["llama.cpp"] = common.llama_cpp_timers(common.convert_to_gguf(model_dir, "bf16"), args.threads)

    samples = {name: {"prefill": [], "decode": []} for name in engines}
    for r in range(args.rounds):  # interleaved: A B C A B C ...
        for name, (prefill, decode) in engines.items():
            samples[name]["prefill"].append(prefill(prompt))
            samples[name]["decode"].append(decode(short, n))
            common.log(f"round {r} {name}: prefill {samples[name]['prefill'][-1]:.1f} tok/s, "
                       f"decode {samples[name]['decode'][-1]:.2f} tok/s")

    dram, dram_method = common.dram_gbps()
    bpt = common.bytes_per_token(ours.args, 2.0)["bytes_per_token"]
    result = {"bench": "decode", "model": "qwen3_moe ~0.49B (hidden 1024, 8 layers, 64 experts, top-8, width 256)",
              "dtype": "bf16", "backend": ours.backend, "threads": args.threads, "prompt_len": args.prompt_len, "decode_tokens": n,
              "rounds": args.rounds, "bytes_per_token": bpt, "dram_gbps": round(dram, 2), "dram_method": dram_method,
              "roofline_decode_tps": round(dram * 1e9 / bpt, 1), "engines": {}}
    for name, s in samples.items():
        dec, pre = common.median(s["decode"]), common.median(s["prefill"])
        result["engines"][name] = {"decode_tps": round(dec, 2), "prefill_tps": round(pre, 1),
                                   "decode_gbps": round(dec * bpt / 1e9, 2),
                                   "decode_samples": [round(x, 2) for x in s["decode"]]}
    mine = result["engines"]["freetoken"]
    for peer in ("transformers", "llama.cpp"):
        if peer in result["engines"]:
            p = result["engines"][peer]
            result[f"ratio_vs_{peer}"] = {"decode": round(mine["decode_tps"] / p["decode_tps"], 3),
                                          "prefill": round(mine["prefill_tps"] / p["prefill_tps"], 3)}
    result["roofline_fraction"] = round(mine["decode_tps"] / result["roofline_decode_tps"], 3)
    common.emit(result)


if __name__ == "__main__":
    main()
