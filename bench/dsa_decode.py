"""DSA decode cost against context length: a GLM-5.2-shaped checkpoint (glm_moe_dsa) on freetoken's
cpu backend with its sparse attention (index_topk 2048) and, on the same weights, dense MLA (the
indexer's top-k beyond the context: every key attended, as llama.cpp runs GLM-5), at contexts of
1K, 8K and 32K tokens.

    python bench/dsa_decode.py [--layers 2] [--experts 8] [--contexts 1024,8192,32768] [--steps 6]
                               [--threads 2] [--tiny]

Geometry: GLM-5's real attention widths (hidden 6144, 64 heads, q_lora 2048, kv_lora 512, nope 192,
rope 64, v 256; indexer 32 heads x 128, top-2048), expert width 2048, top-8 of --experts plus one
shared expert, fewer layers (full, shared, full, ... indexer layers) and a 32,000-token vocabulary
so it fits in RAM (~2.8 GB bf16 at the defaults). The context is not prefilled (the expanded MLA
prefill of 32K tokens would take hours on a small machine): the pages hold random latents, rope
keys and index keys, written straight into the pool, and each step decodes one token over them
(the decode path and the bytes it reads are the same). Prints one JSON line: per context the
median decode tokens/s of both (their steps alternated, so both see the same machine), the KV
bytes per token (from the pool) and the bytes each decode step streams from the cache.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

REAL = dict(vocab_size=32000, hidden_size=6144, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048,
            kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, moe_intermediate_size=2048,
            intermediate_size=12288, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=0,
            routed_scaling_factor=2.5, index_n_heads=32, index_head_dim=128, index_topk=2048,
            max_position_embeddings=202752, tie_word_embeddings=False)
TINY = dict(REAL, hidden_size=256, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=96, kv_lora_rank=64,
            qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, moe_intermediate_size=128, num_experts_per_tok=2,
            index_n_heads=8, index_head_dim=32, index_topk=256)


def build(out: Path, geometry: dict, layers: int, experts: int) -> Path:
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    common.log(f"building {out.name} (random weights, bf16)")
    torch.manual_seed(0)
    kinds = ["full" if i % 2 == 0 else "shared" for i in range(layers)]
    cfg = GlmMoeDsaConfig(**geometry, num_hidden_layers=layers, n_routed_experts=experts, indexer_types=kinds)
    GlmMoeDsaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


def dense_copy(src: Path) -> Path:
    """The same weights (links) with index_topk beyond any context: dense MLA."""
    dst = src.with_name(src.name + "-dense")
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(dict(cfg, index_topk=1 << 30)))
    return dst


def engine(model_dir: Path, contexts: list[int], steps: int):
    """A cpu-backend runner over a pool big enough for the longest context, its pages filled with
    random rows (what a prefill would have left, in scale)."""
    import torch

    from freetoken_py.engine.cpu_backend import load_cpu_model
    from freetoken_py.engine.runner import ModelRunner

    model = load_cpu_model(model_dir, "bfloat16", show_progress=False)
    page = 16
    runner = ModelRunner(model, -(-(max(contexts) + 2 * steps + 4) // page), page, torch.bfloat16)
    assert type(runner.fused).__name__ == "MlaDecoder"
    runner.governor = None  # every step on all --threads (the adaptive count explores in early steps)
    g = torch.Generator().manual_seed(0)
    for t in (runner.cache.k, runner.cache.v, runner.cache.index):
        for layer in range(t.shape[0]):
            t[layer].copy_(torch.randn(t.shape[1:], generator=g))
    return runner


def step_timer(runner, ctx: int, steps: int):
    """A request whose first `ctx` tokens are in the pages; each call decodes one token, returns seconds."""
    from freetoken_py.core import Request, SamplingParams
    from freetoken_py.engine.runner import ScheduledChunk

    prompt = common.random_prompt(runner.model.args.vocab_size, ctx + 1)
    req = Request(prompt_token_ids=prompt, params=SamplingParams(max_tokens=2 * steps + 4, temperature=0))
    req.page_table, req.num_computed = list(range(runner.cache.num_pages)), ctx

    def step() -> float:
        t0 = time.perf_counter()
        logits = runner.forward_batch([ScheduledChunk(req, 1)])
        req.output_token_ids.append(int(logits[0].argmax()))
        return time.perf_counter() - t0
    return step


def decode_tps(runners: dict, contexts: list[int], steps: int) -> dict:
    """Median tokens/s per engine and context, the engines' steps alternated (shared noise), two
    warm-up steps each (numba compiles on the first)."""
    out = {name: {} for name in runners}
    for ctx in contexts:
        timers = {name: step_timer(r, ctx, steps) for name, r in runners.items()}
        times = {name: [] for name in runners}
        for _ in range(steps + 2):
            for name, step in timers.items():
                times[name].append(step())
        for name in runners:
            out[name][ctx] = round(1 / common.median(times[name][2:]), 3)
    return out


def main() -> None:
    ap = common.bench_args(__doc__)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--tiny", action="store_true", help="smoke geometry (hidden 256), seconds")
    args = ap.parse_args()
    from freetoken_py.kernels import configure_threads

    configure_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    name = f"glm5-dsa-{'tiny' if args.tiny else 'real'}-l{args.layers}-e{args.experts}"
    src = build(common.WORK / name, TINY if args.tiny else REAL, args.layers, args.experts)
    runners = {"dsa": engine(src, contexts, args.steps), "dense": engine(dense_copy(src), contexts, args.steps)}
    tps = decode_tps(runners, contexts, args.steps)
    cache, dsa = runners["dsa"].cache, runners["dsa"].model.args.dsa
    g = TINY if args.tiny else REAL
    latent = g["kv_lora_rank"] + g["qk_rope_head_dim"]
    rows = {}
    for ctx in contexts:
        keys = min(ctx, dsa.topk)   # latents the sparse decode reads per layer; dense reads ctx
        index = cache.index.shape[0] * ctx * g["index_head_dim"] if ctx > dsa.topk else 0
        rows[ctx] = {"dsa_tps": tps["dsa"][ctx], "dense_tps": tps["dense"][ctx],
                     "dsa_over_dense": round(tps["dsa"][ctx] / tps["dense"][ctx], 3),
                     "kv_read_bytes_dsa": 2 * (args.layers * keys * latent + index),
                     "kv_read_bytes_dense": 2 * args.layers * ctx * latent}
    first = contexts[0]
    common.emit({"bench": "dsa_decode", "model": name, "threads": args.threads, "steps": args.steps,
                 "kv_bytes_per_token": cache.bytes_per_token, "contexts": rows,
                 "dsa_tps_vs_first_context": {c: round(tps["dsa"][c] / tps["dsa"][first], 3) for c in contexts}})


if __name__ == "__main__":
    main()
