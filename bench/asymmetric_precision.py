"""Asymmetric precision on one box (Cloudflare's recipe): int4 experts for decode, bf16 experts
for prefill (`--prefill-expert-dtype bf16`), against int4 throughout and bf16 throughout, at
Qwen3-30B-A3B's layer widths (hidden 2048, 32 heads / 4 KV heads of 128, 128 experts of width
768, top-8; fewer layers; random weights, the demo tokenizer's vocabulary).

    python bench/asymmetric_precision.py [--layers 4] [--prompt-len 512] [--decode-tokens 32] [--rounds 3]
                                         [--window 256] [--windows 8] [--threads 2]
    python bench/asymmetric_precision.py --tiny     # smoke: hidden 256, 8 experts of 128, 2 layers

At 4 layers: a 4.9 GB bf16 checkpoint under bench/_work (FREETOKEN_BENCH_DIR), its bf16 and int4
expert cache files beside it (4.8 GB + 1.4 GB, mapped), ~7 GB of RAM at the peak.

Per configuration: prefill tokens/s (one --prompt-len chunk), decode tokens/s (best of
--rounds), KLD against the bf16 engine (freetoken eval kld's computation over the shipped
corpus: each window's first half one prefill chunk, the rest decode steps; mean over all
positions and over the decode positions, plus the per-layer expert error), the expert bytes
(decode copy + prefill copy; resident: of every mapping of the prefill file in this process, which
the bf16 engine shares) and the process RSS after each (cumulative). Prints one JSON line.
"""
from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

CONFIGS = {"int4": dict(expert_dtype="int4"),
           "int4_bf16_prefill": dict(expert_dtype="int4", prefill_expert_dtype="bf16"),
           "bf16": dict(expert_dtype="bf16")}


def real_geometry(layers: int = 4, tiny: bool = False) -> dict:
    """Qwen3-30B-A3B's per-layer widths (or the --tiny smoke widths), the demo tokenizer's vocabulary."""
    import json

    vocab = json.loads((common.DEMO / "config.json").read_text())["vocab_size"]
    if tiny:
        return dict(vocab_size=vocab, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=128,
                    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=4096,
                    rope_theta=1e6, tie_word_embeddings=False)
    return dict(vocab_size=vocab, hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32,
                num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
                rope_theta=1e6, tie_word_embeddings=False, rms_norm_eps=1e-6)


def build_real_geometry(layers: int = 4, tiny: bool = False) -> Path:
    """The bf16 checkpoint (transformers' classes, built in bf16 so no fp32 copy is held), with
    the demo tokenizer; cached under bench/_work."""
    import shutil

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = real_geometry(layers, tiny)
    out = common.WORK / ("qwen3-30b-a3b-widths-tiny" if tiny else f"qwen3-30b-a3b-widths-l{layers}")
    if (out / "config.json").exists():
        return out
    common.log(f"building {out.name} (random weights, bf16)")
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg))
        with torch.no_grad():   # transformers' 0.02 init gives near-uniform outputs; a wider one gives peaked ones
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.05 if tiny else 0.03)
    finally:
        torch.set_default_dtype(old)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(common.DEMO / name, out / name)
    return out


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def prefill_tps(llm, prompt: list[int]) -> float:
    """One chunk of len(prompt) tokens (a throwaway request, no prefix cache)."""
    from freetoken_py.evals.kld import window_logits

    t0 = time.perf_counter()
    window_logits(llm, prompt, chunk=len(prompt))
    return len(prompt) / (time.perf_counter() - t0)


def main() -> None:
    ap = common.bench_args(__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    if args.tiny:
        args.prompt_len, args.decode_tokens, args.rounds, args.window, args.windows = 64, 4, 1, 32, 2
    from gates import decode_tps

    from freetoken_py.evals.kld import DEFAULT_TEXTS, compare, read_windows
    from freetoken_py.kernels import configure_threads
    from freetoken_py.llm import LLM

    configure_threads(args.threads)
    model = build_real_geometry(args.layers, args.tiny)
    kw = dict(backend="cpu", max_num_seqs=1, enable_prefix_cache=False, show_progress=False,
              max_model_len=max(args.prompt_len + args.decode_tokens + 8, args.window) + 16)
    ref = LLM(model, **kw, **CONFIGS["bf16"])
    windows = read_windows(ref.tokenizer, DEFAULT_TEXTS, args.window, args.windows)
    prompt = common.random_prompt(ref.args.vocab_size, args.prompt_len)
    out = {"bench": "asymmetric_precision", "model": model.name, "layers": ref.args.num_layers,
           "hidden": ref.args.hidden_size, "experts": ref.args.num_experts,
           "expert_width": ref.args.moe_intermediate_size, "threads": args.threads, "prompt_len": args.prompt_len,
           "decode_tokens": args.decode_tokens, "kld_windows": len(windows), "kld_window": args.window,
           "kld_prefill": args.window // 2}
    for name, cfg in CONFIGS.items():
        llm = ref if name == "bf16" else LLM(model, **kw, **cfg)
        prefill_tps(llm, prompt[:16])                                            # warm: page the experts in
        pre = max(prefill_tps(llm, prompt) for _ in range(args.rounds))
        dec = max(decode_tps(llm, prompt[:16], args.decode_tokens) for _ in range(args.rounds))
        row = {"prefill_tps": round(pre, 2), "decode_tps": round(dec, 2)}
        if name != "bf16":
            res = compare(llm, ref, windows, chunk=1, prefill=args.window // 2, layer_error=True)
            row.update(mean_kld=round(res.mean_kld, 7), mean_kld_decode=round(res.mean_kld_after_prefill, 7),
                       p99_kld=round(res.p99_kld, 6), same_top1=round(res.same_top1, 4),
                       expert_rel_l2=[e for e in res.expert_rel_l2 if e is not None])
        stats = llm.stats()
        store = llm.loaded.expert_store
        row["expert_bytes"] = sum(a.nbytes for b in store.banks if b is not None for a in (b.w13, b.s13, b.w2, b.s2))
        if "prefill_experts" in stats:
            row["prefill_expert_bytes"] = stats["prefill_experts"]["bytes"]
            row["prefill_expert_resident_bytes"] = stats["prefill_experts"]["resident_bytes"]
        row["process_rss_after"] = rss_bytes()   # the whole process so far (the bf16 reference stays loaded)
        out[name] = row
        common.log(f"{name}: {row}")
        if llm is not ref:
            del llm
            gc.collect()
    out["prefill_speedup_vs_int4"] = round(out["int4_bf16_prefill"]["prefill_tps"] / out["int4"]["prefill_tps"], 3)
    common.emit(out)


if __name__ == "__main__":
    main()
