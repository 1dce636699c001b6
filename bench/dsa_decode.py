"""DSA decode cost against context length: a GLM-5.2-shaped checkpoint (glm_moe_dsa) on freetoken's
cpu backend with its sparse attention (index_topk 2048) and, on the same weights, dense MLA (the
indexer's top-k beyond the context: every key attended), and llama.cpp on the same weights (its
GLM-5 conversion, GlmMoeDsaForCausalLM -> glm-dsa, bf16), at contexts of 1K, 8K and 32K tokens.

    python bench/dsa_decode.py [--layers 2] [--experts 8] [--contexts 1024,8192,32768] [--steps 6]
                               [--threads 2] [--no-llama-cpp] [--llama-seed 512] [--tiny] [--prepare]
    python bench/dsa_decode.py --check [--threads 1]    # tiny: ours vs llama.cpp vs transformers

Geometry: GLM-5's real attention widths (hidden 6144, 64 heads, q_lora 2048, kv_lora 512, nope 192,
rope 64, v 256; indexer 32 heads x 128, top-2048), expert width 2048, top-8 of --experts plus one
shared expert, fewer layers (full, shared, full, ... indexer layers) and a 32,000-token vocabulary
so it fits in RAM (~2.8 GB bf16 at the defaults).

No engine prefills the context (the expanded MLA prefill of 32K tokens would take hours on a small
machine; llama.cpp's at these widths ~20-40 min): ours gets random latents, rope keys and index
keys written straight into its pages; llama.cpp gets its own KV state: it prefills --llama-seed
real tokens, its sequence state (the MLA latent cache and the indexer-key cache) is read, tiled to
the context's length at positions 0..ctx-1 and written back with llama_state_seq_set_data (it then
holds ctx positions: checked against llama_memory_seq_pos_max). Each step decodes one token over
the whole context; the decode path and the bytes it reads are those of a prefilled context.

llama.cpp's glm-dsa graph (this version) runs the lightning indexer and its top-k, but applies the
selection as a mask over dense attention: every cached latent is read each step. It runs with
flash attention on (llama.cpp's own default on a CPU; llama-cpp-python's is off).

Prints one JSON line: per context the median decode tokens/s of each engine (their steps
alternated, so all see the same machine), the ratios, and bytes per decode token for each: the
weights (ours: as loaded; llama.cpp: its GGUF tensors, routed experts at top-k / E) plus the KV
bytes the step reads (ours sparse: top-k latents + every index key; ours dense and llama.cpp: every
latent, llama.cpp also every index key); KV bytes stored per token (ours from the pool, llama.cpp
from its state).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))   # this checkout's freetoken_py
import common  # noqa: E402

REAL = dict(vocab_size=32000, hidden_size=6144, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048,
            kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, moe_intermediate_size=2048,
            intermediate_size=12288, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=0,
            routed_scaling_factor=2.5, index_n_heads=32, index_head_dim=128, index_topk=2048,
            max_position_embeddings=202752, tie_word_embeddings=False)
# index_head_dim 64: llama.cpp rotates the indexer keys with a Hadamard matrix of at least 64 (a
# multiple of 64 or its context fails to build); 16 indexer heads keep the top-k free of ties
TINY = dict(REAL, hidden_size=256, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=96, kv_lora_rank=64,
            qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, moe_intermediate_size=128, num_experts_per_tok=2,
            index_n_heads=16, index_head_dim=64, index_topk=256)


def build(out: Path, geometry: dict, layers: int, experts: int, dtype: str = "bfloat16",
          randomise: bool = False) -> Path:
    """transformers' GlmMoeDsaForCausalLM, random weights (`randomise`: norms, the indexer's
    LayerNorm bias and the routers' correction bias drawn too, as tests/dsa_util.py does), plus the
    demo tokenizer (llama.cpp's converter needs one)."""
    if not (out / "config.json").exists():
        import torch
        from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

        common.log(f"building {out.name} (random weights, {dtype})")
        torch.manual_seed(0)
        kinds = ["full" if i % 2 == 0 else "shared" for i in range(layers)]
        cfg = GlmMoeDsaConfig(**geometry, num_hidden_layers=layers, n_routed_experts=experts, indexer_types=kinds)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(getattr(torch, dtype))   # built in its dtype: no fp32 copy of a bf16 model
        try:
            model = GlmMoeDsaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(prev)
        if randomise:
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    if p.dim() >= 2:
                        p.normal_(0, 0.05)
                    elif pname.endswith("norm.weight") or "layernorm" in pname:
                        p.uniform_(0.5, 1.5)
                    elif pname.endswith("k_norm.bias"):
                        p.uniform_(-0.5, 0.5)
                for bname, b in model.named_buffers():
                    if bname.endswith("e_score_correction_bias"):
                        b.uniform_(-0.3, 0.3)
        model.to(getattr(torch, dtype)).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (common.DEMO / f).exists() and not (out / f).exists():
            (out / f).write_bytes((common.DEMO / f).read_bytes())
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


def _greedy_step(peer, first: int):
    """A timer that decodes one greedy token on llama.cpp per call (starting from `first`), in seconds."""
    tok = [first]

    def step() -> float:
        t0 = time.perf_counter()
        peer.llm.eval([tok[0]])
        tok[0] = int(peer.logits().argmax())
        return time.perf_counter() - t0
    return step


def llama_step_timer(peer, ctx: int, seed: list[int], fill: dict):
    """llama.cpp holding `ctx` positions (its KV state written, common.llama_cpp_fill_context; the
    seed state read once and kept in `fill`); each call decodes one token, returns seconds."""
    got = common.llama_cpp_fill_context(peer, seed, ctx, fill.get("state"))
    fill.update(got)
    return _greedy_step(peer, int(peer.logits().argmax()) if ctx <= len(seed) else seed[0])


def llama_prefilled_timer(peer, ctx: int, vocab: int, upto: int, prefill: dict):
    """llama.cpp holding `ctx` positions by really prefilling them (contexts <= `upto` only: None
    beyond); the prefill's tokens/s goes into `prefill`. The cross-check of the state-written
    context: both must decode at the same speed."""
    if ctx > upto:
        return None
    prompt = common.random_prompt(vocab, ctx)
    peer.llm.reset()
    t0 = time.perf_counter()
    peer.llm.eval(prompt)
    prefill[ctx] = round(ctx / (time.perf_counter() - t0), 2)
    common.log(f"llama.cpp prefilled {ctx} tokens at {prefill[ctx]} tok/s")
    return _greedy_step(peer, int(peer.logits().argmax()))


def decode_tps(makers: dict, contexts: list[int], steps: int) -> dict:
    """Median tokens/s per engine and context, the engines' steps alternated (shared noise), two
    warm-up steps each (numba compiles on the first). makers: name -> ctx -> step timer (or None:
    that engine skips the context)."""
    out = {name: {} for name in makers}
    for ctx in contexts:
        timers = {name: make(ctx) for name, make in makers.items()}
        timers = {name: t for name, t in timers.items() if t is not None}
        times = {name: [] for name in timers}
        for _ in range(steps + 2):
            for name, step in timers.items():
                times[name].append(step())
        for name in timers:
            out[name][ctx] = round(1 / common.median(times[name][2:]), 3)
        common.log(f"context {ctx}: " + ", ".join(f"{n} {out[n][ctx]} tok/s" for n in timers))
    return out


def weight_bytes(model) -> int:
    """Weights one of our decode tokens streams (values + scales): MLA projections and kv_b, o_proj,
    the indexer on its full layers, router, top-k routed experts and the shared expert, lm_head."""
    k, total = model.args.top_k, model.weights.lm_head.nbytes
    for lw, bank in zip(model.weights.layers, model.experts.banks):
        total += lw.mla.nbytes + lw.o.nbytes + (lw.indexer.nbytes if lw.indexer is not None else 0)
        if lw.router is not None:
            total += lw.router.nbytes + k * bank.bytes_per_expert + lw.shared13.nbytes + lw.shared2.nbytes
        else:
            total += lw.mlp13.nbytes + lw.mlp2.nbytes
    return total


def kv_bytes_per_token(cache) -> int:
    """The pool's KV bytes per token (all layers). Falls back to counting the paged tensors when the
    pool's own figure fails (seen with a windowed-pool change in progress: its empty window tensors
    made `bytes_per_token` raise IndexError on a model without windowed layers)."""
    try:
        return cache.bytes_per_token
    except IndexError:
        ts = [getattr(cache, n, None) for n in ("_k", "_v", "index")]
        return sum(t[:, 0].numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor) and t.numel())


def llama_peer(src: Path, threads: int, n_ctx: int, outtype: str = "bf16"):
    gguf = common.convert_to_gguf(src, outtype, prelude=common.GLM_VOCAB)
    n_ctx = -(-n_ctx // 256) * 256
    return gguf, common.LlamaCppPeer(gguf, threads, n_ctx=n_ctx, n_ubatch=128, flash_attn=True)


def check(args) -> None:
    """Tiny fp32 checkpoint (top-16 of a 48-token prompt, full + shared indexer layers): ours,
    llama.cpp (f32 GGUF) and transformers pairwise; then llama.cpp's state written back as is
    (must decode exactly as the prefilled cache does) and tiled to 4x the prompt (must hold them)."""
    import torch
    import transformers as tf

    from freetoken_py.llm import LLM

    geo = dict(TINY, index_topk=16, vocab_size=4352)
    src = build(common.WORK / "glm5-dsa-check-l2-e8-fp32", geo, 2, 8, "float32", randomise=True)
    prompt, steps = common.random_prompt(geo["vocab_size"], 48), 16
    llm = LLM(src, dtype="float32", backend="cpu", max_num_seqs=1, max_model_len=512, show_progress=False,
              enable_prefix_cache=False)
    tokens, ours = common.ours_drive(llm, prompt, steps)
    ref = tf.GlmMoeDsaForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = ref(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].float()
        hf_greedy = ref.generate(torch.tensor([prompt]), max_new_tokens=steps + 1, do_sample=False,
                                 pad_token_id=0)[0, len(prompt):].tolist()
    out = {"bench": "dsa_decode --check", "model": src.name, "prompt_len": len(prompt), "index_topk": 16,
           "steps": steps + 1, "logit_std": round(hf.std().item(), 4),
           "ours_vs_transformers": {"max_abs_logit_diff": round((ours - hf).abs().max().item(), 6),
                                    "greedy_shared_prefix": common.shared_prefix(tokens, hf_greedy)}}
    if not args.no_llama_cpp:
        _, peer = llama_peer(src, args.threads, 1024, "f32")
        lc = peer.forced(prompt, tokens[:-1])
        lc_greedy = peer.greedy(prompt, steps + 1)
        out["llama_cpp_vs_transformers"] = {"max_abs_logit_diff": round((lc - hf).abs().max().item(), 6),
                                            "greedy_shared_prefix": common.shared_prefix(lc_greedy, hf_greedy)}
        out["ours_vs_llama_cpp"] = {"max_abs_logit_diff": round((ours - lc).abs().max().item(), 6),
                                    "argmax_equal_forced": int((ours.argmax(-1) == lc.argmax(-1)).sum()),
                                    "greedy_shared_prefix": common.shared_prefix(tokens, lc_greedy)}
        # the state path the timed run uses: written back unchanged it must decode as the prefill did
        fill = common.llama_cpp_fill_context(peer, prompt, len(prompt))
        peer.llm.eval([tokens[0]])
        same = (torch.tensor(peer.logits()).float() - lc[1]).abs().max().item()
        tiled = common.llama_cpp_fill_context(peer, prompt, 4 * len(prompt), fill["state"])
        peer.llm.eval([tokens[0]])
        finite = bool(torch.isfinite(torch.tensor(peer.logits())).all())
        out["llama_cpp_state"] = {"caches": fill["caches"], "kv_bytes_per_token": fill["kv_bytes_per_token"],
                                  "rewritten_max_abs_logit_diff": round(same, 6),
                                  "tiled_positions_held": tiled["positions_held"], "tiled_logits_finite": finite}
    common.emit(out)


def main() -> None:
    ap = common.bench_args(__doc__)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--llama-seed", type=int, default=512, help="tokens llama.cpp really prefills before its "
                    "state is tiled to each context")
    ap.add_argument("--llama-prefill-upto", type=int, default=1024,
                    help="contexts up to this length are also really prefilled by llama.cpp (a second llama.cpp "
                         "engine, 'llama.cpp-prefilled', alternated with the others): the check that the "
                         "state-written context decodes at the speed of a prefilled one (0: none)")
    ap.add_argument("--tiny", action="store_true", help="smoke geometry (hidden 256), seconds")
    ap.add_argument("--check", action="store_true", help="tiny-size agreement check only (no timing)")
    ap.add_argument("--prepare", action="store_true", help="only build the checkpoint and its GGUF (untimed), then exit")
    args = ap.parse_args()
    from freetoken_py.kernels import configure_threads

    configure_threads(args.threads)
    if args.check:
        return check(args)
    contexts = [int(c) for c in args.contexts.split(",")]
    name = f"glm5-dsa-{'tiny' if args.tiny else 'real'}-l{args.layers}-e{args.experts}"
    g = TINY if args.tiny else REAL
    src = build(common.WORK / name, g, args.layers, args.experts)
    if args.prepare:
        common.log(f"prepared: {src}, {dense_copy(src)}, {common.convert_to_gguf(src, 'bf16', prelude=common.GLM_VOCAB)}")
        return
    runners = {"dsa": engine(src, contexts, args.steps), "dense": engine(dense_copy(src), contexts, args.steps)}
    makers = {name: (lambda ctx, r=r: step_timer(r, ctx, args.steps)) for name, r in runners.items()}
    fill, peer_weights, prefilled = {}, None, {}
    if not args.no_llama_cpp:
        gguf, peer = llama_peer(src, args.threads, max(contexts) + args.steps + 64)
        peer_weights = common.gguf_decode_bytes(gguf, runners["dsa"].model.args.top_k,
                                                runners["dsa"].model.args.num_experts)
        seed = common.random_prompt(g["vocab_size"], args.llama_seed)
        t0 = time.perf_counter()
        fill.update(common.llama_cpp_fill_context(peer, seed, args.llama_seed))
        fill["seed_prefill_tps"] = round(args.llama_seed / (time.perf_counter() - t0), 2)
        makers["llama.cpp"] = lambda ctx: llama_step_timer(peer, ctx, seed, fill)
        if args.llama_prefill_upto and min(contexts) <= args.llama_prefill_upto:
            _, peer2 = llama_peer(src, args.threads, min(max(contexts), args.llama_prefill_upto) + args.steps + 64)
            makers["llama.cpp-prefilled"] = lambda ctx: llama_prefilled_timer(peer2, ctx, g["vocab_size"],
                                                                              args.llama_prefill_upto, prefilled)
    tps = decode_tps(makers, contexts, args.steps)
    cache, dsa = runners["dsa"].cache, runners["dsa"].model.args.dsa
    ours_weights = weight_bytes(runners["dsa"].model)
    latent = g["kv_lora_rank"] + g["qk_rope_head_dim"]
    rows = {}
    for ctx in contexts:
        keys = min(ctx, dsa.topk)   # latents the sparse decode reads per layer; dense reads ctx
        index = cache.index.shape[0] * ctx * g["index_head_dim"] if ctx > dsa.topk else 0
        row = {"dsa_tps": tps["dsa"][ctx], "dense_tps": tps["dense"][ctx],
               "dsa_over_dense": round(tps["dsa"][ctx] / tps["dense"][ctx], 3),
               "kv_read_bytes_dsa": 2 * (args.layers * keys * latent + index),
               "kv_read_bytes_dense": 2 * args.layers * ctx * latent}
        row["bytes_per_token_dsa"] = ours_weights + row["kv_read_bytes_dsa"]
        row["bytes_per_token_dense"] = ours_weights + row["kv_read_bytes_dense"]
        if "llama.cpp" in tps:
            lc = tps["llama.cpp"][ctx]
            row.update(llama_cpp_tps=lc, dsa_over_llama_cpp=round(tps["dsa"][ctx] / lc, 3),
                       dense_over_llama_cpp=round(tps["dense"][ctx] / lc, 3),
                       kv_read_bytes_llama_cpp=ctx * fill["kv_bytes_per_token"],
                       bytes_per_token_llama_cpp=peer_weights + ctx * fill["kv_bytes_per_token"])
        if ctx in tps.get("llama.cpp-prefilled", {}):
            row.update(llama_cpp_prefilled_tps=tps["llama.cpp-prefilled"][ctx],
                       llama_cpp_state_over_prefilled=round(tps["llama.cpp"][ctx] / tps["llama.cpp-prefilled"][ctx], 3),
                       llama_cpp_prefill_tps=prefilled[ctx])
        rows[ctx] = row
    first = contexts[0]
    out = {"bench": "dsa_decode", **common.cpu_fields(), "model": name, "threads": args.threads,
           "steps": args.steps, "weights_bytes_per_token": ours_weights, "kv_bytes_per_token": kv_bytes_per_token(cache),
           "contexts": rows,
           "dsa_tps_vs_first_context": {c: round(tps["dsa"][c] / tps["dsa"][first], 3) for c in contexts}}
    if peer_weights is not None:
        out["llama_cpp"] = {"gguf": "bf16 (convert_hf_to_gguf GlmMoeDsaForCausalLM)", "flash_attn": True,
                            "weights_bytes_per_token": peer_weights, "kv_bytes_per_token": fill["kv_bytes_per_token"],
                            "context_filled_by": f"KV state: {args.llama_seed} tokens prefilled, tiled to each "
                                                 "context with llama_state_seq_set_data; contexts <= "
                                                 f"{args.llama_prefill_upto} also really prefilled (llama_cpp_prefilled_tps)",
                            "seed_prefill_tps": fill["seed_prefill_tps"],
                            "attention": "indexer top-k applied as a mask over dense attention (all latents read)",
                            "amx": common._AMX_STATE.get("note")}
    common.emit(out)


if __name__ == "__main__":
    main()
