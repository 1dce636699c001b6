"""scripts/train_demo_gpu.sh end to end on the CPU, with a few steps of a tiny model on a small
corpus (the GPU run is the same command with its defaults). Checked against independent readers:
transformers loads the sharded export and its logits equal the run's checkpoint's in bf16; the
tokenizer is the shipped one byte for byte; the evaluation's JSON line is scripts/eval_demo_model.py's
own, and its targets are the documented ones."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "freetoken_py" / "data" / "demo_model"
sys.path.insert(0, str(ROOT / "scripts"))
import demo_corpus  # noqa: E402
import train_demo_model  # noqa: E402


def _small_corpus(tmp: Path) -> tuple[Path, Path]:
    """A stdlib of ~30 real stdlib modules (one of them in the validation split), and a
    site-packages with one kept package and one held-out package (copies of other stdlib modules)."""
    real = Path(sysconfig.get_paths()["stdlib"])
    stdlib, site = tmp / "lib", tmp / "site"
    modules = [p for p in sorted(real.glob("*.py")) if demo_corpus._looks_like_code(p.read_text("utf-8"))]
    chosen = modules[:30]
    chosen += [next(p for p in modules[30:] if train_demo_model.is_val(f"stdlib/{p.name}"))]
    for p in chosen:
        (stdlib / p.name).parent.mkdir(parents=True, exist_ok=True)
        (stdlib / p.name).write_text(p.read_text("utf-8"))
    held = next(f"pkg{i}" for i in range(64) if demo_corpus.is_heldout_name(f"pkg{i}"))
    kept = next(f"pkg{i}" for i in range(64) if not demo_corpus.is_heldout_name(f"pkg{i}"))
    rest = [p for p in modules if p not in chosen]
    for i, p in enumerate(rest[:12]):
        pkg = held if i % 2 else kept
        (site / pkg).mkdir(parents=True, exist_ok=True)
        (site / pkg / p.name).write_text(p.read_text("utf-8"))
    return stdlib, site


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_demo")
    stdlib, site = _small_corpus(tmp)
    env = {**os.environ, "DEVICE": "cpu", "TRAIN_STEPS": "3", "TRAIN_MINUTES": "5", "WORK": str(tmp / "work"),
           "RUN": "t", "DEST": str(tmp / "out" / "model"), "EVAL_PROMPTS": "2", "EVAL_THREADS": "1",
           "CORPUS_STDLIB": str(stdlib), "CORPUS_SITE": str(site), "SHARD_MIB": "2", "PYTHON": sys.executable,
           "MODEL_ARGS": "--hidden 64 --layers 2 --heads 2 --kv-heads 1 --experts 4 --top-k 2 --moe-intermediate 64",
           "BATCH_ARGS": "--batch-size 2 --seq-len 128 --short-seq-len 64 --long-from 0.5 --warmup 1 --steps 6",
           "EXTRA_ARGS": "--num-chats 40 --val-windows 1"}
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "train_demo_gpu.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, proc, stdlib, site


def test_checkpoint_is_sharded_under_the_limit_and_loads_in_transformers(run):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    tmp = run[0]
    out = tmp / "out" / "model"
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (out / "model.safetensors.index.json").exists()  # 2 MiB: the ~4 MB model splits
    assert all(p.stat().st_size <= 2 * 2**20 for p in out.iterdir())
    assert (out / "tokenizer.json").read_bytes() == (SHIPPED / "tokenizer.json").read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"]) == ("qwen3_moe", 64, 2)
    # the checkpoint's trained fp32 weights, read back from the run's own state file
    state = {}
    with safe_open(str(tmp / "work" / "t" / "ckpt" / "state.safetensors"), "pt") as f:
        for k in f.keys():
            if k.startswith("model."):
                state[k[len("model."):]] = f.get_tensor(k)
    assert json.loads((tmp / "work" / "t" / "ckpt" / "state.json").read_text())["step"] == 3
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_config(loaded.config).eval()
    ref.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in state.items()}, strict=True)
    x = torch.tensor([[5, 900, 17, 4000, 2, 33]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, ref(input_ids=x).logits)


def test_the_run_trained_on_its_corpus_minus_the_held_out_package(run):
    tmp, proc, stdlib, site = run
    (data,) = [d for d in (tmp / "work").iterdir() if d.name.startswith("data-")]
    meta = json.loads((data / "data.json").read_text())
    train, heldout = demo_corpus.collect(stdlib, site)
    held = {r.split("/")[1] for r, _ in heldout}
    assert len(held) == 1 and not any(r.split("/")[1] in held for r, _ in train)
    val = [r for r, _ in train if train_demo_model.is_val(r)]
    assert (meta["train_files"], meta["val_files"], meta["heldout_files"]) == (len(train) - len(val), len(val), 6)
    assert len(val) >= 1 and any(r.startswith("site/") for r, _ in train)
    assert "-tok" in data.name and "-roots" in data.name
    assert "training for" in proc.stderr and "or 3 steps" in proc.stderr


def test_the_evaluation_line_carries_the_targets(run):
    tmp, proc = run[:2]
    row = json.loads((tmp / "out" / "eval.json").read_text())
    assert row["bench"] == "demo_model_eval" and row["prompts"] == 2
    assert row["targets"] == {"parse": ">= 0.6", "repeated": "<= 0.1"}
    for name in ("old", "new"):
        m = row[name]
        assert m["meets_targets"] == {"parse": m["parse"] >= 0.6, "repeated": m["repeated"] <= 0.1,
                                      "all": m["parse"] >= 0.6 and m["repeated"] <= 0.1}
    assert row["new"]["dir"] == str(tmp / "out" / "model") and row["old"]["dir"].endswith("demo_model")
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("train_demo_gpu: candidate parse") and "target >= 0.6" in summary
