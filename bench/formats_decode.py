"""Decode / prefill per format at Qwen3-30B-A3B's layer widths (hidden 2048, 128 experts of width
768, top-8; fewer layers), each against llama.cpp's nearest format on the same weights, in one run:

    ours                                                   llama.cpp (same bf16 source weights)
    int8  (the bf16 checkpoint, experts + dense int8 at load)  Q8_0 (output Q8_0, as our int8 lm_head)
    fp8   (block-128 e4m3 checkpoint)                          Q8_0 (output as ours: bf16)
    int4  (compressed-tensors int4 g32 checkpoint)             Q4_0 (output bf16)
    nvfp4 (compressed-tensors nvfp4 g16 checkpoint)            Q4_0 (output bf16; --nvfp4-peer mxfp4:
                                                               MXFP4_MOE = experts MXFP4, the rest Q8_0)

plus the peak RSS of starting up from each quantised checkpoint (a fresh process) against the
checkpoint's size.

    python bench/formats_decode.py [--layers 8] [--rounds 3] [--decode-tokens 32] [--prompt-len 512] [--threads 2]
                                   [--formats int8,fp8,int4,nvfp4] [--nvfp4-peer q4_0|mxfp4] [--no-rss] [--prepare]
    python bench/formats_decode.py --layers 2 --hidden 256 --experts 8 --width 128 --vocab 4352 --threads 1  # smoke

The quantised checkpoints are written by `freetoken quantize` from a random bf16 one (built
with transformers' classes). Prints one JSON line: the CPU and SIMD path, the DRAM rate (probe),
per format tokens/s, bytes per token, GB/s, the DRAM roofline fraction, llama.cpp's figures and
the decode / prefill ratios, and the start-up RSS. A DRAM read sample follows each round
("round_dram_gbps"); "paired_decode" / "paired_prefill" are the medians of the per-round ratios
(ours / peer timed seconds apart), which a bandwidth swing between rounds does not bias.
Expert kernels against llama.cpp's (issue 45, item 3): `--heads 1 --vocab 4352 --experts 32
--layers 12` keeps Qwen3-30B-A3B's expert shape (2048 / 768, top-8) but shrinks attention and
lm_head to ~4 % of the bytes per token, so each format's decode GB/s is its expert kernel's
streaming rate inside a real decode step, next to llama.cpp's nearest format on the same weights
and the per-round DRAM samples.
Rounds interleave each format with its own peer; a pair's engines are freed before the next pair
loads (int4 and nvfp4 share their Q4_0 peer), so the box never holds more than three models.
The peer's output tensor (lm_head) is stored as ours runs it (`--peer-output same`, the default):
a compressed-tensors or fp8 checkpoint usually leaves lm_head in bf16 (its ignore list), and at
this vocabulary (151,936 x 2048) a bf16 lm_head is 622 MB of the bytes read per token, so with
llama.cpp's own default (Q6_K for Q4_0) the line would compare lm_head formats rather than the
expert formats. `--peer-output default` keeps llama.cpp's default output type.
"""
from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))   # this checkout's freetoken_py
import common  # noqa: E402
from cpu_decode import _bytes_per_token, _gguf  # noqa: E402

FORMATS = {"int8": "q8_0", "fp8": "q8_0", "int4": "q4_0", "nvfp4": "q4_0"}   # ours -> llama.cpp's peer type
LOAD_TIME = {"int8": "int8"}   # formats run from the bf16 checkpoint, quantised at load (expert + dense dtype)

# VmHWM, not ru_maxrss: a child's ru_maxrss starts from this (large) process's peak, which once
# made these starts read 6.3 / 17.3 GB (see bench/startup_rss.py, which also measures what a start adds)
_RSS = """
import sys, json
from freetoken_py.llm import LLM
llm = LLM(sys.argv[1], dtype="bfloat16", backend="cpu", max_num_seqs=1, max_model_len=2048, show_progress=False,
          expert_cache=sys.argv[2], expert_dtype=sys.argv[3], dense_dtype=sys.argv[3])
hwm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"peak_rss_bytes": hwm}))
"""


def build(args) -> Path:
    """The bf16 source checkpoint at the chosen widths (cached under bench/_work)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    qwen_heads = max(1, args.hidden // 64)     # Qwen3-30B-A3B's 32 at hidden 2048
    heads = args.heads or qwen_heads
    name = (f"qwen3-30b-a3b-shape-l{args.layers}-h{args.hidden}-e{args.experts}-w{args.width}-v{args.vocab}"
            + ("" if heads == qwen_heads else f"-a{heads}"))
    out = common.WORK / name
    if not (out / "config.json").exists():
        # built in bf16 (torch's default dtype set for the construction): at 8 layers the fp32
        # model transformers would otherwise build first is ~22 GB, the box's whole memory
        cfg = Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                             num_attention_heads=heads, num_key_value_heads=max(1, heads // 8), head_dim=128,
                             intermediate_size=4 * args.hidden, moe_intermediate_size=args.width,
                             num_experts=args.experts, num_experts_per_tok=min(8, args.experts), norm_topk_prob=True,
                             max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False)
        common.log(f"building {name} (random weights, bf16)")
        torch.manual_seed(0)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = Qwen3MoeForCausalLM(cfg)
        finally:
            torch.set_default_dtype(prev)
        model.to(torch.bfloat16).save_pretrained(out)
        del model
    # llama.cpp's converter needs a real tokenizer (without one its GGUF has no merges and will not
    # load): the demo tokenizer, its vocabulary padded to vocab_size, as mla_decode.py does
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (common.DEMO / f).exists() and not (out / f).exists():
            (out / f).write_bytes((common.DEMO / f).read_bytes())
    return out


def quantised(src: Path, fmt: str) -> Path:
    from freetoken_py.loading.quantize import quantize_checkpoint

    if fmt in LOAD_TIME:
        return src
    out = src.with_name(f"{src.name}-{fmt}")
    return out if (out / "config.json").exists() else quantize_checkpoint(src, out, fmt, show_progress=False)


def lm_head_type(path: Path) -> str | None:
    """The safetensors dtype `lm_head.weight` is stored in (e.g. 'BF16'), or None when the
    checkpoint stores it quantised (packed / with scales) or ties it to the embedding."""
    import struct

    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        if "lm_head.weight" in header and not any(k.startswith("lm_head.weight_") for k in header):
            return header["lm_head.weight"]["dtype"]
    return None


def peer_gguf(src: Path, fmt: str, path: Path, output: str, kind: str) -> tuple[Path, str]:
    """llama.cpp's peer GGUF of `src` for our format `fmt` (checkpoint at `path`; llama.cpp type
    `kind`) and its output type. A load-time format (int8) runs lm_head as it runs the rest (int8):
    llama.cpp's Q8_0 output is the same."""
    out_type = lm_head_type(path) if output == "same" and fmt not in LOAD_TIME else None
    if out_type is None:
        return _gguf(src, kind), "default"
    return common.quantize_gguf(common.convert_to_gguf(src, "bf16"), kind.upper(), out_type), out_type


def startup_rss(path: Path, cache: str, fmt: str) -> int:
    proc = subprocess.run([sys.executable, "-c", _RSS, str(path), cache, LOAD_TIME.get(fmt, "auto")],
                          capture_output=True, text=True, check=True, cwd=str(common.REPO))
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss_bytes"]


def main() -> None:
    ap = common.bench_args(__doc__)
    for flag, default in (("--layers", 8), ("--hidden", 2048), ("--experts", 128), ("--width", 768),
                          ("--vocab", 151936)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--heads", type=int, default=None,
                    help="attention heads (default hidden / 64, as Qwen3-30B-A3B); with --heads 1 and a small "
                         "--vocab the routed experts are ~95 %% of the bytes read per token: the expert kernels' "
                         "line against llama.cpp's on the same weights (see the module doc)")
    ap.add_argument("--formats", default="int8,fp8,int4,nvfp4")
    ap.add_argument("--peer-output", choices=("same", "default"), default="same",
                    help="llama.cpp's output tensor type: as our lm_head is stored (same), or its own default")
    ap.add_argument("--nvfp4-peer", choices=("q4_0", "mxfp4"), default="q4_0",
                    help="llama.cpp's format against our nvfp4: Q4_0 (4.5 bits everywhere, as ours) or MXFP4_MOE "
                         "(experts MXFP4 at 4.25 bits, every other tensor Q8_0)")
    ap.add_argument("--no-rss", action="store_true", help="skip the fresh-process start-up RSS of each format")
    ap.add_argument("--prepare", action="store_true", help="only build every checkpoint and GGUF this run needs "
                    "(CPU-heavy, untimed: run it before the quiet window), then exit")
    args = ap.parse_args()
    from freetoken_py.kernels import configure_threads
    from freetoken_py.llm import LLM

    configure_threads(args.threads)
    src = build(args)
    prompt = common.random_prompt(args.vocab, args.prompt_len)
    n, fmts = args.decode_tokens, args.formats.split(",")
    unknown = [f for f in fmts if f not in FORMATS]
    if unknown:
        raise SystemExit(f"--formats: unknown {unknown} (known: {', '.join(FORMATS)})")
    kinds = {f: ("mxfp4_moe" if f == "nvfp4" and args.nvfp4_peer == "mxfp4" else FORMATS[f]) for f in fmts}
    paths = {f: quantised(src, f) for f in fmts}
    if args.prepare:
        for f in fmts:
            if not args.no_llama_cpp:
                common.log(f"{f}: peer {peer_gguf(src, f, paths[f], args.peer_output, kinds[f])[0].name}")
        common.log("prepared: " + ", ".join(str(paths[f]) for f in fmts))
        return
    samples, bpt, peer_bpt, sizes, rss, peer_out, peer_name, round_dram = {}, {}, {}, {}, {}, {}, {}, {}
    # one peer at a time with the formats it serves (int8 with Q8_0, fp8 with Q8_0 + bf16 output,
    # int4 + nvfp4 with Q4_0 + bf16 output), its engines dropped before the next loads: all resident
    # at once come to about the box's 24 GiB, and the page cache then thrashes (our samples swung
    # 24 -> 15 tok/s within a run)
    groups: dict[tuple, list[str]] = {}
    for f in fmts:
        out_type = lm_head_type(paths[f]) if args.peer_output == "same" and f not in LOAD_TIME else None
        groups.setdefault((kinds[f], out_type or "default"), []).append(f)
    for (kind, _), members in groups.items():
        engines = {}
        for f in members:
            path, dt = paths[f], LOAD_TIME.get(f, "auto")
            sizes[f] = sum(p.stat().st_size for p in path.glob("*.safetensors"))
            if not args.no_rss:
                rss[f] = {"first_start": startup_rss(path, "rebuild", f), "mapped_start": startup_rss(path, "auto", f)}
            llm = LLM(path, dtype="bfloat16", backend="cpu", max_num_seqs=1, max_model_len=2048,
                      show_progress=False, enable_prefix_cache=False, expert_dtype=dt, dense_dtype=dt)
            engines[f"freetoken-{f}"] = common.freetoken_timers(llm)
            bpt[f] = _bytes_per_token(llm)
            if not args.no_llama_cpp:
                gguf, peer_out[f] = peer_gguf(src, f, path, args.peer_output, kind)
                peer_name[f] = f"llama.cpp-{kind}-{peer_out[f]}"
                if peer_name[f] not in engines:
                    engines[peer_name[f]] = common.llama_cpp_timers(gguf, args.threads)
                peer_bpt[f] = common.gguf_decode_bytes(gguf, llm.args.top_k, llm.args.num_experts)
            del llm
        group_dram: list[float] = []
        samples.update(common.time_rounds(engines, prompt, n, args.rounds, dram=group_dram))
        round_dram.update({f: group_dram for f in members})
        del engines
        gc.collect()
    dram, method = common.dram_gbps()
    out = {"bench": "formats_decode", **common.cpu_fields(),
           "model": f"qwen3_moe shape: hidden {args.hidden}, {args.layers} layers, "
           f"{args.experts} experts of width {args.width}, top-{min(8, args.experts)}, vocab {args.vocab}"
           + (f", {args.heads} attention heads" if args.heads else ""),
           "threads": args.threads, "prompt_len": args.prompt_len, "decode_tokens": n, "rounds": args.rounds,
           "dram_gbps": round(dram, 2), "dram_method": method, "formats": {}}
    for f in fmts:
        ours = samples[f"freetoken-{f}"]
        dec, pre = common.median(ours["decode"]), common.median(ours["prefill"])
        row = {"decode_tps": round(dec, 2), "prefill_tps": round(pre, 1), "bytes_per_token": round(bpt[f]),
               "decode_gbps": round(dec * bpt[f] / 1e9, 2), "roofline_fraction": round(dec * bpt[f] / 1e9 / dram, 3),
               "decode_samples": [round(x, 2) for x in ours["decode"]],
               "prefill_samples": [round(x, 1) for x in ours["prefill"]],
               "checkpoint_bytes": sizes[f] if f not in LOAD_TIME else None,
               "run_from": f"bf16 checkpoint, {LOAD_TIME[f]} at load" if f in LOAD_TIME else "its own checkpoint",
               "startup_peak_rss_bytes": rss.get(f), "round_dram_gbps": [round(x, 1) for x in round_dram.get(f, [])]}
        peer = samples.get(peer_name.get(f))
        if peer:
            row.update(common.peer_fields(ours, peer, kinds[f], peer_bpt[f], samples=True))
            row["llama_cpp"]["prefill_samples"] = [round(x, 1) for x in peer["prefill"]]
            row["llama_cpp_output_type"] = peer_out[f]
        out["formats"][f] = row
    out["llama_cpp_amx"] = common._AMX_STATE.get("note")
    out["ratios"] = {f: {"decode": r.get("ratio_decode"), "prefill": r.get("ratio_prefill"),
                         "paired_decode": r.get("paired_ratio_decode"), "paired_prefill": r.get("paired_ratio_prefill")}
                     for f, r in out["formats"].items()}
    common.emit(out)


if __name__ == "__main__":
    main()
