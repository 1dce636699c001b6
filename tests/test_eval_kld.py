"""`freetoken eval kld` against an independent computation: transformers' logits of the same
windows (one full-context forward each), softmax and KL in float64, by hand here; and the
one-line errors of bad input."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from freetoken_py.errors import FreetokenError
from freetoken_py.evals.kld import DEFAULT_TEXTS, KldOptions, compare, load_engines, read_windows

DEMO = Path(__file__).resolve().parent.parent / "freetoken_py" / "data" / "demo_model"


def _tiny(out: Path, seed: int, vocab: int = 4096) -> Path:
    """A tiny random qwen3_moe over the demo model's tokenizer (transformers' own classes)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=48,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=512, norm_topk_prob=True)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    model.save_pretrained(out)
    shutil.copy(DEMO / "tokenizer.json", out / "tokenizer.json")
    return out


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    return _tiny(tmp_path_factory.mktemp("kld_a"), 0), _tiny(tmp_path_factory.mktemp("kld_b"), 1)


def _reference(a: Path, b: Path, windows: list[list[int]]) -> dict:
    """The same figures from transformers: logits of each window in one forward, float64 math."""
    from transformers import AutoModelForCausalLM

    fast, ref = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (a, b))
    kls, same, nf, nr = [], [], [], []
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w])
            pf, pr = (torch.softmax(m(ids).logits[0, :-1].double(), -1) for m in (fast, ref))
            kls.append((pr * (pr.log() - pf.log())).sum(-1))
            same.append(pf.argmax(-1) == pr.argmax(-1))
            nxt = torch.tensor(w[1:])
            nf.append(-pf[torch.arange(len(nxt)), nxt].log())
            nr.append(-pr[torch.arange(len(nxt)), nxt].log())
    kl = torch.cat(kls)
    return {"mean_kld": kl.mean().item(), "p99_kld": torch.quantile(kl, 0.99).item(), "max_kld": kl.max().item(),
            "same_top1": torch.cat(same).double().mean().item(), "ppl_fast": torch.cat(nf).mean().exp().item(),
            "ppl_ref": torch.cat(nr).mean().exp().item(), "positions": len(kl)}


@pytest.mark.parametrize("chunk", [1, 5])
def test_kld_agrees_with_transformers_in_float64(tiny_pair, chunk):
    a, b = tiny_pair
    opts = KldOptions(a, against=b, window=24, fast=dict(backend="torch"), reference=dict(backend="torch"),
                      show_progress=False)
    fast, ref = load_engines(opts)
    windows = read_windows(fast.tokenizer, DEFAULT_TEXTS, 24, 3)
    assert len(windows) == 3 and all(len(w) == 24 for w in windows)
    got = compare(fast, ref, windows, chunk).as_dict()
    want = _reference(a, b, windows)
    assert got["positions"] == want["positions"] == 3 * 23
    assert want["mean_kld"] > 0.05      # two different models: a figure that can be wrong
    for k in ("mean_kld", "p99_kld", "max_kld"):
        assert abs(got[k] - want[k]) <= 1e-6, (k, got[k], want[k])
    for k in ("ppl_fast", "ppl_ref"):
        assert abs(got[k] - want[k]) <= 1e-6 * want[k], (k, got[k], want[k])
    assert got["same_top1"] == want["same_top1"]


def test_a_configuration_against_itself_is_zero_and_fp8_kv_is_not(tiny_pair):
    a, _ = tiny_pair
    same, fp8 = (load_engines(KldOptions(a, fast=dict(backend="torch", **kv), reference=dict(backend="torch"),
                                         show_progress=False)) for kv in ({}, {"kv_dtype": "fp8"}))
    windows = read_windows(same[0].tokenizer, DEFAULT_TEXTS, 32, 2)
    assert compare(*same, windows, 1).max_kld == 0.0
    res = compare(*fp8, windows, 1)
    assert 0 < res.mean_kld < 0.01   # (a random model's flat distributions: top-1 flips easily)


def test_windows_are_spread_over_every_file(tmp_path):
    from freetoken_py.tokenizer import Tokenizer

    tok = Tokenizer(DEMO)
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    one.write_text("def f(x):\n    return x + 1\n" * 40)
    two.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    windows = read_windows(tok, (one, two), 16, 4)
    ids_two = tok.encode(two.read_text(), add_special_tokens=False)
    assert len(windows) == 4 and windows[-1] in [ids_two[i:i + 16] for i in range(0, len(ids_two) - 15, 16)]
    with pytest.raises(FreetokenError, match="shorter than one window of 4096"):
        read_windows(tok, (one,), 4096, 4)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "freetoken_py", "eval", "kld", *args], capture_output=True,
                          text=True, timeout=300)


def test_bad_input_is_one_line(tiny_pair, tmp_path):
    a, _ = tiny_pair
    short = tmp_path / "short.txt"
    short.write_text("x = 1\n")
    other = _tiny(tmp_path / "other", 2, vocab=4000)
    cases = {(str(tmp_path),): "config.json",
             ("--model", str(a), "--backend", "torch", str(short)): "shorter than one window",
             ("--model", str(a), str(tmp_path / "absent.txt")): "absent.txt: no such text file",
             ("--model", str(a), "--backend", "torch", "--against", str(other)): "vocabulary of 4000 tokens",
             ("--model", str(a), "--against", str(tmp_path / "absent")): "absent: no such directory",
             ("--model", str(a), "--backend", "torch", "--window", "16", "--prefill", "16"):
                 "--prefill 16 must be shorter than the window",
             ("--model", str(a), "--prefill-expert-dtype", "int4"): "prefill expert dtype must be"}
    for args, needle in cases.items():
        args = args if args[0] == "--model" else ("--model", *args)
        proc = _cli(*args)
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(err) == 1 and needle in err[0], (args, proc.stderr)


def test_cli_json_line(tiny_pair):
    a, b = tiny_pair
    proc = _cli("--model", str(a), "--against", str(b), "--backend", "torch", "--window", "16", "--windows", "2",
                "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["eval"] == "kld" and out["positions"] == 2 * 15 and out["mean_kld"] > 0
