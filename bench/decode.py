"""Prefill and decode tokens/s of freetoken on the ~0.5B qwen3_moe, side by side with
transformers and llama.cpp (llama-cpp-python) on the same weights, interleaved rounds.

    python bench/decode.py [--rounds 3] [--decode-tokens 32] [--prompt-len 512] [--no-llama-cpp]

Prints one JSON line: per engine the median prefill/decode tokens/s, achieved GB/s (weights read
per token x tokens/s), the DRAM roofline from the probe, and ratios to the peers.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--no-transformers", action="store_true")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from freetoken_py.core import SamplingParams
    from freetoken_py.llm import LLM

    model_dir = common.build_qwen3_moe(common.WORK / "qwen3moe-0.5b-bf16")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 32000, (args.prompt_len,), generator=g).tolist()
    short = prompt[:16]
    n = args.decode_tokens

    ours = LLM(model_dir, dtype="bfloat16", max_num_seqs=1, max_model_len=2048, show_progress=False)
    engines = {"freetoken": _freetoken(ours, SamplingParams)}
    if not args.no_transformers:
        engines["transformers"] = _transformers(model_dir)
    if not args.no_llama_cpp:
        engines["llama.cpp"] = _llama_cpp(model_dir, args.threads)

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
              "dtype": "bf16", "threads": args.threads, "prompt_len": args.prompt_len, "decode_tokens": n,
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


def _freetoken(llm, SamplingParams):
    def prefill(prompt):
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))[0]
        return len(prompt) / out.ttft_s

    def decode(prompt, n):
        out = llm.generate([prompt], SamplingParams(max_tokens=n + 1, temperature=0, ignore_eos=True))[0]
        return n / (out.total_s - out.ttft_s)

    return prefill, decode


def _transformers(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()

    def gen(prompt, new):
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0)
        return time.perf_counter() - t

    def prefill(prompt):
        return len(prompt) / gen(prompt, 1)

    def decode(prompt, n):
        return n / (gen(prompt, n + 1) - gen(prompt, 1))

    return prefill, decode


def _llama_cpp(model_dir, threads):
    peer = common.LlamaCppPeer(common.convert_to_gguf(model_dir, "bf16"), threads)
    return peer.prefill_tps, peer.decode_tps


if __name__ == "__main__":
    main()
