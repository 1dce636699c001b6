"""Start-up from a quantised checkpoint (issue #22): the peak RSS a start adds stays within the
checkpoint's size plus one layer, for fp8, int4 and nvfp4, on the first start (the expert cache
built) and on the next one (the cache file mapped) — never a float copy of the experts.

Each format runs in a fresh process: a start of a tiny checkpoint of the same format first (so
imports, numba's kernels and thread pools are in place), then the peak is reset (Linux
/proc/self/clear_refs) and the measured starts run; `added` = VmHWM - RSS before the start.
VmHWM, not ru_maxrss: ru_maxrss survives exec, so a child would report pytest's own peak.
The geometry makes the experts ~95 % of the checkpoint: a bf16 copy of them alone is several
times the budget."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from freetoken_py.loading.quantize import quantize_checkpoint

FORMATS = ("fp8", "int4", "nvfp4")
BIG = dict(hidden=512, layers=4, experts=32, width=256, vocab=512)
TINY = dict(hidden=128, layers=2, experts=4, width=64, vocab=512)

_CHILD = r"""
import gc, json, sys
from freetoken_py.llm import LLM
from freetoken_py.engine import expert_store
from freetoken_py.formats import packed
from freetoken_py.hw.procmem import release_free_heap as trim, reset_peak, status_bytes as status


def start(path, mode):
    return LLM(path, dtype="bfloat16", backend="cpu", max_num_seqs=1, max_model_len=64, show_progress=False,
               expert_cache=mode, enable_prefix_cache=False)


warm, big, modes = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
llm = start(warm, "auto")
out = []
for mode in modes:
    del llm
    gc.collect()
    trim()
    before = status("VmRSS")
    if not reset_peak():    # no reset: measure from the peak so far (a lower figure), one start per process
        before = status("VmHWM")
        if out:
            break
    deq = packed.DEQUANTISED_BYTES
    llm = start(big, mode)
    out.append({"mode": mode, "added": status("VmHWM") - before, "source": llm.loaded.expert_store.source,
                "dequantised": packed.DEQUANTISED_BYTES - deq})
print(json.dumps(out))
"""


def _config(g: dict) -> dict:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=g["vocab"], hidden_size=g["hidden"], num_hidden_layers=g["layers"],
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=2 * g["hidden"],
                          moe_intermediate_size=g["width"], num_experts=g["experts"], num_experts_per_tok=2,
                          norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False,
                          torch_dtype="bfloat16").to_dict()


def _linear(name: str, shape) -> bool:
    return len(shape) == 2 and name.endswith("_proj.weight")   # attention and experts (not router, embed, head)


def _packed(name: str, n: int, k: int, fmt: str, gen: torch.Generator) -> dict:
    """Random codes and scales in the layout `freetoken quantize` writes (values do not matter
    here, only the bytes and the code paths): fp8 e4m3 bytes (no NaN) + fp32 block scales,
    int4 words + bf16 power-of-two scales (exact in fp16), nvfp4 nibbles + e4m3 scales + a
    global scale."""
    def rand(shape, lo, hi, dtype=torch.uint8):
        return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(dtype)

    if fmt == "fp8":
        codes = rand((n, k), 0, 0x7E) | (rand((n, k), 0, 2) << 7)
        return {name: codes.view(torch.float8_e4m3fn),
                name + "_scale_inv": torch.full((-(-n // 128), -(-k // 128)), 2.0 ** -9)}
    base = name.removesuffix("weight")
    if fmt == "int4":
        words = rand((n, k // 8), -2**31, 2**31 - 1, torch.int32)
        return {base + "weight_packed": words, base + "weight_scale": torch.pow(2.0, -rand((n, k // 32), 6, 10,
                                                                                        torch.float32)).bfloat16(),
                base + "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    return {base + "weight_packed": rand((n, k // 2), 0, 256), base + "weight_scale": rand((n, k // 16), 0x28, 0x38)
            .view(torch.float8_e4m3fn), base + "weight_global_scale": torch.tensor([448.0 * 6 / 0.1])}


def _write(out: Path, g: dict, fmt: str | None, qcfg: dict | None = None) -> Path:
    """A qwen3_moe checkpoint of geometry `g`: bf16 (fmt None) or its linears packed in `fmt`."""
    from freetoken_py.models import model_module
    from freetoken_py.models.loader import read_model_args
    from freetoken_py.models.weights import expected_shapes

    out.mkdir(parents=True)
    cfg = _config(g)
    (out / "config.json").write_text(json.dumps(cfg))
    args = read_model_args(out)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in expected_shapes(args, model_module("qwen3_moe").SCHEME).items():
        if fmt is not None and _linear(name, shape):
            tensors.update(_packed(name, *shape, fmt, gen))
        elif len(shape) == 1:
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=gen) * 0.05).bfloat16()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if qcfg is not None:
        cfg["quantization_config"] = qcfg
        (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("startup") / "tiny-bf16", TINY, None)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc (Linux)")
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantised_start_adds_at_most_checkpoint_plus_one_layer(fmt, tiny_source, tmp_path):
    from freetoken_py.models.checkpoint import list_checkpoint_tensors

    warm = quantize_checkpoint(tiny_source, tmp_path / f"tiny-{fmt}", fmt, show_progress=False)  # the real writer
    qcfg = json.loads((warm / "config.json").read_text())["quantization_config"]
    big = _write(tmp_path / f"big-{fmt}", BIG, fmt, qcfg)
    ckpt = (big / "model.safetensors").stat().st_size
    layer = sum(t.nbytes for n, t in list_checkpoint_tensors(big).items() if n.startswith("model.layers.0."))
    experts = BIG["layers"] * BIG["experts"] * 3 * BIG["width"] * BIG["hidden"]
    budget = ckpt + layer
    assert 2 * experts > 1.5 * budget     # a bf16 copy of the experts alone is well over the budget

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    rows, modes = [], ["rebuild", "auto"]
    while modes:   # one process normally; one per start where the peak cannot be reset
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(warm), str(big), ",".join(modes)],
                              capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        rows += got
        modes = modes[len(got):]
    print(f"{fmt}: checkpoint {ckpt / 2**20:.1f} MiB, one layer {layer / 2**20:.1f} MiB, " +
          ", ".join(f"{r['mode']} adds {r['added'] / 2**20:.1f} MiB" for r in rows))
    assert [r["source"] for r in rows] == ["built", "cache"]
    for r in rows:
        assert r["dequantised"] == 0, r                       # nothing packed was widened to floats
        assert r["added"] <= budget, (r, budget)
