"""Start-up peak memory from a quantised checkpoint (issue #22's must-show): the peak RSS a start
adds must stay within the checkpoint's size plus one layer, never a float copy of the model.

    python bench/startup_rss.py [--layers 2] [--formats fp8,int4,nvfp4]            # real widths (the lead)
    python bench/startup_rss.py --layers 2 --hidden 256 --experts 8 --width 128 --vocab 1024   # smoke

The model is Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts of width 768, top-8, vocab
151936; fewer layers), built with transformers' classes (random bf16) and quantised by `freetoken
quantize` (fp8-block, compressed-tensors int4 g32, compressed-tensors nvfp4 g16), shared with
bench/formats_decode.py's cache under bench/_work. Per format, one fresh process: a start of a
small checkpoint of the same format first (the smoke geometry: imports, numba's kernels of that
format, thread pools: what does not grow with the model), then its peak reset (/proc/self/clear_refs), the cpu backend's first start
(`expert_cache=rebuild`: the expert cache built) and, peak reset again, the next start (the cache
file mapped). `added_bytes` = VmHWM - RSS before that start; `peak_rss_bytes` = the VmHWM of the
same start in a process of its own (nothing before it); `budget_bytes` = checkpoint + its largest
layer shard (quantize writes one shard per layer); `within_budget` compares `added_bytes` with it.
`dequantised_bytes` counts the packed weights the start widened to floats (0: all run as stored).
tests/test_startup_memory.py checks the same at a small geometry. Peaks are VmHWM, never
ru_maxrss: a child's ru_maxrss starts from its parent's peak (it survives fork and exec), which is
how bench/formats_decode.py once printed 6.3 / 17.3 GB for int4 / nvfp4 starts that peak at
~2.0-2.9 GB. Prints one JSON line.
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
import gc, json, sys
from freetoken_py.llm import LLM
from freetoken_py.formats import packed
from freetoken_py.hw.procmem import release_free_heap, reset_peak, status_bytes as status


def start(path, mode):
    return LLM(path, dtype="bfloat16", backend="cpu", max_num_seqs=1, max_model_len=2048, show_progress=False,
               expert_cache=mode, enable_prefix_cache=False)


warm, path, modes = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
llm = start(warm, "auto") if warm != "-" else None
out = {}
for mode in modes:
    del llm
    gc.collect()
    release_free_heap()
    before = status("VmRSS")
    if not reset_peak():                            # the peak back to the current RSS
        before = status("VmHWM")
    deq = packed.DEQUANTISED_BYTES
    llm = start(path, mode)
    out[mode] = {"vmhwm_bytes": status("VmHWM"), "added_bytes": status("VmHWM") - before,
                 "dequantised_bytes": packed.DEQUANTISED_BYTES - deq, "source": llm.loaded.expert_store.source}
print(json.dumps(out))
"""


def _run(warm: str, path: Path, modes: str) -> dict:
    cmd = [sys.executable, "-c", _START, warm, str(path), modes]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"start-up ({modes}) failed: {proc.stderr.strip().splitlines()[-1:]}")
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
    small = build(argparse.Namespace(layers=2, hidden=256, experts=8, width=128, vocab=1024))
    out = {"bench": "startup_rss", "model": f"qwen3_moe shape: hidden {args.hidden}, {args.layers} layers, "
           f"{args.experts} experts of width {args.width}, vocab {args.vocab}", "formats": {}}
    for f in args.formats.split(","):
        path = quantised(src, f)
        shards = sorted(path.glob("*.safetensors"))
        ckpt = sum(p.stat().st_size for p in shards)
        layer = max(p.stat().st_size for p in shards[1:]) if len(shards) > 1 else 0   # shard 1: outside the layers
        row = {"checkpoint_bytes": ckpt, "one_layer_bytes": layer, "budget_bytes": ckpt + layer}
        added = _run(str(quantised(small, f)), path, "rebuild,auto")
        for name, mode in (("first_start", "rebuild"), ("mapped_start", "auto")):
            r, alone = added[mode], _run("-", path, mode)[mode]
            row[name] = {"peak_rss_bytes": alone["vmhwm_bytes"], "added_bytes": r["added_bytes"],
                         "within_budget": r["added_bytes"] <= ckpt + layer, "dequantised_bytes": r["dequantised_bytes"],
                         "expert_source": r["source"]}
            common.log(f"{f} {name}: peak {alone['vmhwm_bytes'] / 2**20:.0f} MiB alone, adds {r['added_bytes'] / 2**20:.0f} "
                       f"MiB, budget {(ckpt + layer) / 2**20:.0f} MiB")
        out["formats"][f] = row
    common.emit(out)


if __name__ == "__main__":
    main()
