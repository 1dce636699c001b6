"""gpt-oss decode and prefill: a gpt-oss-20b-shaped checkpoint with its experts in MXFP4 as published
(`*_blocks` / `*_scales`, `quantization_config.quant_method: mxfp4`, bf16 elsewhere) on freetoken's
cpu backend, against llama.cpp on the same weights (convert_hf_to_gguf.py's gpt-oss conversion:
the MXFP4 blocks repacked as ggml MXFP4, everything else bf16), interleaved rounds.

    python bench/gpt_oss_decode.py [--layers 4] [--vocab 32000] [--rounds 3] [--decode-tokens 32]
                                   [--prompt-len 512] [--threads 2] [--no-llama-cpp] [--prepare]
    python bench/gpt_oss_decode.py --check [--threads 1]    # tiny: ours vs llama.cpp vs transformers

Geometry: gpt-oss-20b's real widths (hidden 2880, 64 query / 8 key-value heads of 64, q/k/v/o
biases, sinks, 32 experts of width 2880 with biases, top-4, sliding window 128 on alternate
layers, YaRN factor 32 over 4096, swiglu limit 7) with fewer layers and a smaller vocabulary
(--vocab; 201,088 in the release) so it fits in RAM: ~2.3 GB at the defaults. The checkpoint is
written tensor by tensor (no bf16 expert stack is ever materialised): random bf16 for the dense
weights (norms, sinks and biases randomised too), random MXFP4 codes with e8m0 block scales over a
few octaves for the experts, and the demo tokenizer (the converter needs one).

Before timing, both engines decode greedily from the same prompt and the line records how far
they agree (`agreement`: first-step max |logit difference| and the greedy tokens they share).
--check does that at a tiny size (hidden 128, 8 experts top-4, window 8 under a 40-token prompt,
2 layers sliding + full) against transformers' dequantised-MXFP4 reference too, and prints one
JSON line: the three pairwise max |logit difference| over the prompt's last position and 16
teacher-forced decode steps, and the greedy tokens each pair shares.

The timed line: per engine the median decode and prefill tokens/s, bytes per decode token (ours:
the loaded weights, MXFP4 run as the nvfp4 execution form, 4.5 bits; llama.cpp: its GGUF tensors,
MXFP4 4.25 bits), GB/s, the DRAM rate (probe) and roofline fraction, the CPU and its SIMD path,
and the freetoken / llama.cpp ratios.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))   # this checkout's freetoken_py
import common  # noqa: E402
from cpu_decode import _bytes_per_token  # noqa: E402

YARN = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=4096)
REAL = dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
            num_local_experts=32, num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
            rms_norm_eps=1e-5, swiglu_limit=7.0, tie_word_embeddings=False, rope_parameters=YARN)
TINY = dict(REAL, hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=8, sliding_window=8)
# per geometry: std of the dense matrices, the MXFP4 block exponents drawn from (top - span, top]
RANDOM = {"real": dict(std=0.02, top=-7, span=4), "tiny": dict(std=0.08, top=-6, span=6)}


def _mxfp4(g, experts: int, rows: int, cols: int, top: int, span: int):
    import torch

    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = (127 + top - torch.randint(0, span, (experts, rows, cols // 32), generator=g)).to(torch.uint8)
    return blocks, scales


def build(out: Path, geometry: dict, layers: int, vocab: int, kind: str) -> Path:
    """A gpt_oss checkpoint in the release's layout (key names, shapes, dtypes, config), written
    one tensor at a time from random values (seeded)."""
    if (out / "config.json").exists():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import GptOssConfig

    common.log(f"building {out.name} (random weights, MXFP4 experts, bf16 elsewhere)")
    rnd = RANDOM[kind]
    g = torch.Generator().manual_seed(0)
    d, inter, e = geometry["hidden_size"], geometry["intermediate_size"], geometry["num_local_experts"]
    hd, hq, hkv = geometry["head_dim"], geometry["num_attention_heads"], geometry["num_key_value_heads"]

    def mat(*shape):
        return (torch.randn(shape, generator=g) * rnd["std"]).to(torch.bfloat16)

    def uni(lo, hi, *shape):
        return (torch.rand(shape, generator=g) * (hi - lo) + lo).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": mat(vocab, d), "model.norm.weight": uni(0.5, 1.5, d),
         "lm_head.weight": mat(vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = uni(0.5, 1.5, d)
        t[p + "post_attention_layernorm.weight"] = uni(0.5, 1.5, d)
        for name, rows in (("q_proj", hq * hd), ("k_proj", hkv * hd), ("v_proj", hkv * hd)):
            t[p + f"self_attn.{name}.weight"], t[p + f"self_attn.{name}.bias"] = mat(rows, d), uni(-0.3, 0.3, rows)
        t[p + "self_attn.o_proj.weight"], t[p + "self_attn.o_proj.bias"] = mat(d, hq * hd), uni(-0.3, 0.3, d)
        t[p + "self_attn.sinks"] = uni(-1.0, 2.0, hq)
        t[p + "mlp.router.weight"], t[p + "mlp.router.bias"] = mat(e, d), uni(-0.3, 0.3, e)
        # output-major: gate_up [E, 2I (gate / up rows interleaved), D/32, 16], down [E, D, I/32, 16]
        for name, rows, cols in (("gate_up_proj", 2 * inter, d), ("down_proj", d, inter)):
            blocks, scales = _mxfp4(g, e, rows, cols, rnd["top"], rnd["span"])
            t[p + f"mlp.experts.{name}_blocks"], t[p + f"mlp.experts.{name}_scales"] = blocks, scales
            t[p + f"mlp.experts.{name}_bias"] = uni(-0.3, 0.3, e, rows)
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    del t
    cfg = GptOssConfig(**geometry, vocab_size=vocab, num_hidden_layers=layers).to_dict()
    cfg.update(architectures=["GptOssForCausalLM"], dtype="bfloat16",
               quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
                   "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (common.DEMO / f).exists():
            shutil.copy(common.DEMO / f, out / f)
    return out


# ---- agreement: ours, llama.cpp (and transformers) on the same weights ----------------------

def check(args) -> None:
    """Tiny model: ours, llama.cpp and transformers' dequantised-MXFP4 reference, pairwise."""
    import torch
    import transformers as tf

    from freetoken_py.llm import LLM

    model_dir = build(common.WORK / f"gpt-oss-tiny-l{args.layers}-v{args.vocab}", TINY, args.layers, args.vocab,
                      "tiny")
    prompt = common.random_prompt(args.vocab, 40)   # 5 windows of 8
    steps = 16
    llm = LLM(model_dir, dtype="bfloat16", backend="cpu", max_num_seqs=1, max_model_len=512, show_progress=False,
              enable_prefix_cache=False)
    tokens, ours = common.ours_drive(llm, prompt, steps)
    ref = tf.GptOssForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                               quantization_config=tf.Mxfp4Config(dequantize=True)).eval()
    with torch.no_grad():
        hf = ref(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].float()
        hf_greedy = ref.generate(torch.tensor([prompt]), max_new_tokens=steps + 1, do_sample=False,
                                 pad_token_id=0)[0, len(prompt):].tolist()
    out = {"bench": "gpt_oss_decode --check", "model": model_dir.name, "prompt_len": len(prompt),
           "window": TINY["sliding_window"], "steps": steps + 1, "logit_std": round(hf.std().item(), 4),
           "ours_vs_transformers": {"max_abs_logit_diff": round((ours - hf).abs().max().item(), 4),
                                    "greedy_shared_prefix": common.shared_prefix(tokens, hf_greedy)}}
    if not args.no_llama_cpp:
        gguf = common.convert_to_gguf(model_dir, "bf16")
        peer = common.LlamaCppPeer(gguf, args.threads)
        lc = peer.forced(prompt, tokens[:-1])
        lc_greedy = peer.greedy(prompt, steps + 1)
        out["llama_cpp_vs_transformers"] = {"max_abs_logit_diff": round((lc - hf).abs().max().item(), 4),
                                            "greedy_shared_prefix": common.shared_prefix(lc_greedy, hf_greedy)}
        out["ours_vs_llama_cpp"] = {"max_abs_logit_diff": round((ours - lc).abs().max().item(), 4),
                                    "argmax_equal_forced": int((ours.argmax(-1) == lc.argmax(-1)).sum()),
                                    "greedy_shared_prefix": common.shared_prefix(tokens, lc_greedy)}
        out["gguf_expert_types"] = gguf_types(gguf)
    common.emit(out)


def gguf_types(gguf: Path) -> dict:
    """ggml type per tensor kind in the GGUF (experts, attention, output), to show what was compared."""
    common._gguf_py()
    from gguf import GGUFReader

    kinds = {}
    for t in GGUFReader(str(gguf)).tensors:
        key = t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name
        kinds.setdefault(key, t.tensor_type.name)
    return kinds


def main() -> None:
    ap = common.bench_args(__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--agree-steps", type=int, default=8, help="greedy steps of the agreement check")
    ap.add_argument("--check", action="store_true", help="tiny-size agreement check only (no timing)")
    ap.add_argument("--tiny", action="store_true", help="the timed line at the tiny geometry (a smoke run, seconds)")
    ap.add_argument("--prepare", action="store_true", help="only build the checkpoint and its GGUF (untimed), then exit")
    args = ap.parse_args()
    from freetoken_py.kernels import configure_threads

    configure_threads(args.threads)
    if args.check:
        if "--layers" not in sys.argv:
            args.layers = 2
        if "--vocab" not in sys.argv:
            args.vocab = 4352     # >= the demo tokenizer's 4,099 entries (the converter pads up to vocab_size)
        return check(args)

    from freetoken_py.llm import LLM

    kind = "tiny" if args.tiny else "real"
    geo = TINY if args.tiny else REAL
    name = f"gpt-oss-{'tiny' if args.tiny else '20b-shape'}-l{args.layers}-v{args.vocab}"
    model_dir = build(common.WORK / name, geo, args.layers, args.vocab, kind)
    if args.prepare:
        common.log(f"prepared: {model_dir}, {common.convert_to_gguf(model_dir, 'bf16')}")
        return
    prompt = common.random_prompt(args.vocab, args.prompt_len)
    llm = LLM(model_dir, dtype="bfloat16", backend="cpu", max_num_seqs=1, max_model_len=2048, show_progress=False,
              enable_prefix_cache=False)   # a repeated prompt must be prefilled, not matched
    engines = {"freetoken-mxfp4": common.freetoken_timers(llm)}
    bpt = _bytes_per_token(llm)
    fmts = sorted({b.fmt for b in llm.model.experts.banks})
    agree, peer_bpt = None, None
    if not args.no_llama_cpp:
        gguf = common.convert_to_gguf(model_dir, "bf16")
        peer = common.LlamaCppPeer(gguf, args.threads)
        engines["llama.cpp-mxfp4"] = (peer.prefill_tps, peer.decode_tps)
        peer_bpt = common.gguf_decode_bytes(gguf, llm.args.top_k, llm.args.num_experts)
        agree = common.agreement(llm, peer, prompt[:64], args.agree_steps)
        common.log(f"agreement: {agree}")
    samples = common.time_rounds(engines, prompt, args.decode_tokens, args.rounds)
    dram, method = common.dram_gbps()
    ours = samples["freetoken-mxfp4"]
    dec, pre = common.median(ours["decode"]), common.median(ours["prefill"])
    out = {"bench": "gpt_oss_decode", **common.cpu_fields(),
           "model": f"gpt_oss {'TINY smoke' if args.tiny else '20b'} shape: hidden {geo['hidden_size']}, {args.layers} "
                    f"layers (sliding {geo['sliding_window']} / full alternating), {geo['num_attention_heads']} / "
                    f"{geo['num_key_value_heads']} heads of 64, {geo['num_local_experts']} experts of width "
                    f"{geo['intermediate_size']}, top-4, MXFP4 experts, bf16 dense, vocab {args.vocab}",
           "threads": args.threads, "prompt_len": args.prompt_len, "decode_tokens": args.decode_tokens,
           "rounds": args.rounds, "dram_gbps": round(dram, 2), "dram_method": method,
           "freetoken": {"expert_exec_format": ",".join(fmts), "decode_tps": round(dec, 2), "prefill_tps": round(pre, 1),
                         "bytes_per_token": round(bpt), "decode_gbps": round(dec * bpt / 1e9, 2),
                         "roofline_fraction": round(dec * bpt / 1e9 / dram, 3),
                         "decode_samples": [round(x, 2) for x in ours["decode"]],
                         "prefill_samples": [round(x, 1) for x in ours["prefill"]]}}
    if agree is not None:
        peer = samples["llama.cpp-mxfp4"]
        out.update(common.peer_fields(ours, peer, "mxfp4 (experts) + bf16", peer_bpt))
        out["llama_cpp"]["prefill_samples"] = [round(x, 1) for x in peer["prefill"]]
        out["llama_cpp"]["amx"] = common._AMX_STATE.get("note")
        out["agreement"] = agree
    common.emit(out)


if __name__ == "__main__":
    main()
