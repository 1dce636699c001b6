"""Decode tokens/s of the residency tiers under the EMULATED accelerator, with the CPU tier on the
numba expert kernels against the same tier on torch, on the ~0.5B qwen3_moe (bf16), alternating.

    python bench/residency_cpu_tier.py [--profile rtx4060-laptop-8g] [--slots-mb 0] [--rounds 3] [--decode-tokens 32]

The accelerator tier runs on CPU tensors here (no GPU): the tokens/s are this machine's CPU doing
every tier's work, NOT a GPU speed. What the comparison shows is the CPU tier's own speed-up,
since the hit / stream / split work is identical in both runs. With `--slots-mb 0` (the default)
there are no slots and every expert runs on the CPU tier. Prints one JSON line: tokens/s per
variant, their ratio, each CPU tier's achieved GB/s over the decode steps (expert bytes it read
over the time spent in it, timed inside the executor) against the probe's DRAM roofline, the
share of decode time spent in the CPU tier, and the residency telemetry.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def main() -> None:
    ap = common.bench_args(__doc__)
    ap.add_argument("--profile", default="rtx4060-laptop-8g", help="hand-built tier profile to emulate")
    ap.add_argument("--slots-mb", type=int, default=0,
                    help="VRAM budget for expert slots (0: none, every expert on the CPU tier)")
    args = ap.parse_args()
    model_dir, prompt = common.setup(args)
    prompt = prompt[:64]
    from freetoken_py.llm import LLM
    from freetoken_py.residency.attach import attach_residency

    llm = LLM(model_dir, dtype="bfloat16", max_num_seqs=1, max_model_len=1024, show_progress=False,
              residency="emulate", residency_profile=args.profile, enable_prefix_cache=False,
              vram_budget_bytes=args.slots_mb * 2**20 or 1)
    variants = {"numba": llm.residency,
                "torch": attach_residency(llm.model, "emulate", args.profile, args.slots_mb * 2**20 or 1,
                                          cpu_kernels=False)}
    results: dict[str, list[float]] = {name: [] for name in variants}
    tier = {name: [0.0, 0, 0.0] for name in variants}     # decode only: CPU tier seconds, bytes; decode seconds
    for _ in range(args.rounds):
        for name, ex in variants.items():
            llm.model.experts = ex
            common.residency_decode(llm, ex, prompt, 4)        # warm: jit, slots
            run = common.residency_decode(llm, ex, prompt, args.decode_tokens)
            results[name].append(run["tokens"] / run["seconds"])
            tier[name][0] += run["cpu_tier_s"]
            tier[name][1] += run["cpu_tier_bytes"]
            tier[name][2] += run["seconds"]
    tel = {name: ex.telemetry.summary() for name, ex in variants.items()}
    tok_s = {k: statistics.median(v) for k, v in results.items()}
    dram, method = common.dram_gbps()
    print(json.dumps({
        "bench": "residency_cpu_tier", "accelerator": f"EMULATED ({args.profile} profile; CPU tensors, not GPU speed)",
        "decode_tok_s": {k: round(v, 2) for k, v in tok_s.items()}, "samples": results,
        "numba_over_torch": round(tok_s["numba"] / tok_s["torch"], 3),
        "cpu_tier_gbps": {k: round(b / sec / 1e9, 2) if sec else None for k, (sec, b, _) in tier.items()},
        "cpu_tier_share_of_decode_time": {k: round(sec / total, 3) for k, (sec, _, total) in tier.items()},
        "roofline_dram_gbps": round(dram, 2), "roofline_method": method,
        **{f: round(tel["numba"][f], 3) for f in ("hit_rate", "cpu_share", "split_share", "stream_share")}}))


if __name__ == "__main__":
    main()
