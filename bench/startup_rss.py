"""Start-up peak memory from a quantised checkpoint (issue #22's must-show): each start runs in a
fresh process, and its peak RSS (VmHWM, ru_maxrss) must stay within the checkpoint's size plus
one layer, never a bf16 copy of the whole model.

    python bench/startup_rss.py [--layers 2] [--formats fp8,int4,nvfp4]            # real widths (the lead)
    python bench/startup_rss.py --layers 2 --hidden 256 --experts 8 --width 128 --vocab 1024   # smoke

The model is Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts of width 768, top-8, vocab
151936; fewer layers), built with transformers' classes (random bf16) and quantised by `freetoken
quantize` (fp8-block, compressed-tensors int4 g32, compressed-tensors nvfp4 g16), shared with
bench/formats_decode.py's cache under bench/_work. Per format: the cpu backend's first start
(the expert cache built, `expert_cache=rebuild`) and the next one (the cache file mapped), each
in a fresh process; `baseline_rss_bytes` is the same start on the bundled 18 MB demo model less
its checkpoint's size (the interpreter, torch, numba's compiled kernels, the engine's own
buffers: what does not grow with the model). `added_bytes` = peak - baseline; `budget_bytes` = checkpoint + its largest layer shard (quantize
writes one shard per layer); `within_budget` compares the two. `dequantised_bytes` counts the
packed weights the start dequantised to floats (0: the dense part runs as stored). Prints one
JSON line.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from formats_decode import build, quantised  # noqa: E402

_START = r"""
import json, resource, sys
mode = sys.argv[1]
from freetoken_py.llm import LLM
from freetoken_py.formats import packed
LLM(sys.argv[2], dtype="bfloat16", backend="cpu", max_num_seqs=1, max_model_len=2048, show_progress=False,
    expert_cache=mode, enable_prefix_cache=False)
hwm = 0
with open("/proc/self/status") as f:
    for line in f:
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
print(json.dumps({"vmhwm_bytes": hwm, "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "dequantised_bytes": packed.DEQUANTISED_BYTES}))
"""


def _run(mode: str, path: Path) -> dict:
    cmd = [sys.executable, "-c", _START, mode, str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"start-up ({mode}) failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--layers", 2), ("--hidden", 2048), ("--experts", 128), ("--width", 768),
                          ("--vocab", 151936)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--formats", default="fp8,int4,nvfp4")
    args = ap.parse_args()
    src = build(args)
    demo = _run("auto", common.DEMO)
    base = {"vmhwm_bytes": max(demo["vmhwm_bytes"], demo["ru_maxrss_bytes"])
            - sum(p.stat().st_size for p in common.DEMO.glob("*.safetensors"))}
    out = {"bench": "startup_rss", "model": f"qwen3_moe shape: hidden {args.hidden}, {args.layers} layers, "
           f"{args.experts} experts of width {args.width}, vocab {args.vocab}",
           "baseline_rss_bytes": base["vmhwm_bytes"], "formats": {}}
    for f in args.formats.split(","):
        path = quantised(src, f)
        shards = sorted(path.glob("*.safetensors"))
        ckpt = sum(p.stat().st_size for p in shards)
        layer = max(p.stat().st_size for p in shards[1:]) if len(shards) > 1 else 0   # shard 1: outside the layers
        row = {"checkpoint_bytes": ckpt, "one_layer_bytes": layer, "budget_bytes": ckpt + layer}
        for name, mode in (("first_start", "rebuild"), ("mapped_start", "auto")):
            r = _run(mode, path)
            peak = max(r["vmhwm_bytes"], r["ru_maxrss_bytes"])
            row[name] = {"peak_rss_bytes": peak, "added_bytes": peak - base["vmhwm_bytes"],
                         "within_budget": peak - base["vmhwm_bytes"] <= ckpt + layer,
                         "dequantised_bytes": r["dequantised_bytes"]}
            common.log(f"{f} {name}: peak {peak / 2**20:.0f} MiB, added {(peak - base['vmhwm_bytes']) / 2**20:.0f} "
                       f"MiB, budget {(ckpt + layer) / 2**20:.0f} MiB")
        out["formats"][f] = row
    common.emit(out)


if __name__ == "__main__":
    main()
