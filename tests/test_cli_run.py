"""`freetoken run` end to end on the bundled demo model (real subprocesses), and text-level engine
behaviour (stop strings, detokenization, context checks) against independent references."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from freetoken_py.cli import DEMO_MODEL
from freetoken_py.core import SamplingParams
from freetoken_py.errors import ContextLengthError
from freetoken_py.llm import LLM


def freetoken(*args, stdin: str | None = None):
    return subprocess.run([sys.executable, "-m", "freetoken_py", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def demo():
    return LLM(DEMO_MODEL, dtype="float32", show_progress=False)


def test_json_output_matches_transformers_greedy(demo):
    proc = freetoken("run", "import os\n", "--json", "--max-tokens", "12", "--temperature", "0", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert set(res) >= {"text", "token_ids", "prompt_token_ids", "finish_reason", "timings"}
    assert res["prompt_token_ids"] == demo.tokenizer.encode("import os\n")
    assert res["text"] == demo.tokenizer.decode(res["token_ids"])
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref.generate(torch.tensor([res["prompt_token_ids"]]), max_new_tokens=12, do_sample=False,
                                eos_token_id=list(demo.generation.eos_token_ids), pad_token_id=0)
    assert res["token_ids"] == expected[0, len(res["prompt_token_ids"]):].tolist()
    assert res["timings"]["prompt_tokens"] == len(res["prompt_token_ids"])


def test_default_model_is_announced_and_streamed_text_equals_json_text():
    args = ["run", "def main(", "--max-tokens", "16", "--temperature", "0"]
    streamed, as_json = freetoken(*args), freetoken(*args, "--json")
    assert streamed.returncode == 0 and as_json.returncode == 0
    assert "bundled demo model" in streamed.stderr
    assert streamed.stdout.rstrip("\n") == json.loads(as_json.stdout)["text"].rstrip("\n")
    stats = [line for line in streamed.stderr.splitlines() if "TTFT" in line]
    assert stats and "prompt" in stats[0] and "tok/s" in stats[0]


def test_repl_conversation_continues_across_turns():
    proc = freetoken("run", "--max-tokens", "8", "--temperature", "0", stdin="hello\nwhat is a list?\n")
    assert proc.returncode == 0, proc.stderr
    stats = [line for line in proc.stderr.splitlines() if "TTFT" in line]
    assert len(stats) == 2
    prompt_lens = [int(s.split("prompt ")[1].split(" ")[0]) for s in stats]
    assert prompt_lens[1] > prompt_lens[0] + 8  # turn 2 carries turn 1 (question + answer)


def test_chat_flag_applies_template(demo):
    proc = freetoken("run", "--chat", "hi", "--json", "--max-tokens", "4", "--temperature", "0")
    res = json.loads(proc.stdout)
    expected = demo.tokenizer.encode(demo.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert res["prompt_token_ids"] == expected


def test_prompt_over_context_is_a_one_line_error():
    proc = freetoken("run", "x " * 200, "--max-model-len", "32")
    assert proc.returncode == 2
    assert "context limit is 32" in proc.stderr and "Traceback" not in proc.stderr


def test_stop_string_truncates_and_finishes(demo):
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    full = demo.generate(["import os\n"], greedy)[0].text
    assert len(full) > 10
    stop = full[6:9]
    cut = full.index(stop)
    out = demo.generate(["import os\n"], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                        stop=(stop,)))[0]
    assert out.text == full[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    streamed = "".join(o.new_text for o in demo.stream("import os\n", SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, stop=(stop,))))
    assert streamed == full[:cut]  # the held-back text never leaks the stop string


def test_stop_token_ids_and_max_tokens(demo):
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ids = demo.generate(["class A:"], greedy)[0].token_ids
    out = demo.generate(["class A:"], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                     stop_token_ids=(ids[5],)))[0]
    first = ids.index(ids[5])
    assert out.token_ids == ids[:first + 1] and out.finish_reason == "stop"
    out = demo.generate(["class A:"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == ids[:3] and out.finish_reason == "length"


def test_streamed_deltas_concatenate_to_full_text(demo):
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True)
    chunks = list(demo.stream("def f(x):", params))
    assert "".join(c.new_text for c in chunks) == chunks[-1].text
    assert chunks[-1].text == demo.tokenizer.decode(chunks[-1].token_ids)


def test_context_length_error_before_allocation(demo):
    small = LLM(DEMO_MODEL, dtype="float32", show_progress=False, max_model_len=16)
    free = small.allocator.num_free
    with pytest.raises(ContextLengthError, match="20 tokens"):
        small.add_request(list(range(20)))
    assert small.allocator.num_free == free


def test_quantized_experts_from_the_cli_stay_close_to_bf16(demo):
    """--expert-dtype int8: greedy tokens of the quantised run agree with the fp32 reference engine
    on most positions (small models flip near-ties); a bad value is a one-line error."""
    args = ["run", "import os\n", "--json", "--max-tokens", "16", "--temperature", "0"]
    quant = freetoken(*args, "--expert-dtype", "int8", "--dense-dtype", "int8")
    assert quant.returncode == 0, quant.stderr
    ref = demo.generate(["import os\n"], SamplingParams(max_tokens=16, temperature=0))[0].token_ids
    got = json.loads(quant.stdout)["token_ids"]
    assert got[:4] == ref[:4]
    bad = freetoken("run", "x", "--expert-dtype", "int3")
    assert bad.returncode == 2 and "expert dtype must be" in bad.stderr and "Traceback" not in bad.stderr


def test_a_visible_gpu_without_the_tiers_runs_the_cpu_kernels_and_says_so(monkeypatch, capsys):
    """`--backend auto` on a machine whose CUDA GPU is visible (stood in: torch.cuda.is_available)
    picks the numba CPU kernels (the torch backend would keep everything on the host as well, on
    the reference path), and `freetoken run` says in one line how to use the GPU; the tokens are
    the torch reference's. With the tiers on (emulated here) there is no such line."""
    from freetoken_py.cli_run import RunOptions, run_main
    from freetoken_py.llm import GPU_HINT

    params = dict(max_tokens=6, temperature=0.0)
    ref = LLM(DEMO_MODEL, show_progress=False, backend="torch").generate(
        ["import os\n"], SamplingParams(max_tokens=6, temperature=0))[0].token_ids
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    llm = LLM(DEMO_MODEL, show_progress=False)
    assert llm.backend == "cpu" and llm.unused_gpu
    assert llm.generate(["import os\n"], SamplingParams(max_tokens=6, temperature=0))[0].token_ids == ref
    opts = dict(model_dir=DEMO_MODEL, prompt="import os\n", chat=False, system=None, as_json=True, dtype="auto",
                max_model_len=0, kv_cache_bytes=0, sampling=params)
    run_main(RunOptions(**opts))
    out = capsys.readouterr()
    assert out.err.strip().splitlines()[0] == GPU_HINT and json.loads(out.out)["token_ids"] == ref
    run_main(RunOptions(**opts, residency=dict(residency="emulate", residency_profile="rtx4090")))
    assert GPU_HINT not in capsys.readouterr().err


def test_generation_config_repetition_penalty_is_a_default_in_greedy_too(tmp_path):
    """A checkpoint's generation_config.json `repetition_penalty` is a default, as in transformers'
    generate (where it applies under do_sample=False as well) and vLLM: greedy tokens equal
    transformers' on the same files, and differ from plain greedy (so ignoring it would fail)."""
    import shutil

    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "demo"
    shutil.copytree(DEMO_MODEL, model_dir)
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen_path.write_text(json.dumps({**gen, "repetition_penalty": 1.3, "min_p": 0.05}))
    llm = LLM(model_dir, dtype="float32", show_progress=False)
    params = llm.default_sampling(temperature=0, max_tokens=24, ignore_eos=True)
    assert params.repetition_penalty == 1.3 and params.min_p == 0.05
    assert llm.default_sampling(repetition_penalty=1.0).repetition_penalty == 1.0  # explicit wins
    prompt = llm.tokenizer.encode("import os\n")
    ours = llm.generate([prompt], params)[0].token_ids
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        penalised = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)[0, len(prompt):].tolist()
        plain = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                             eos_token_id=None, repetition_penalty=1.0)[0, len(prompt):].tolist()
    assert penalised != plain
    assert ours == penalised


@pytest.mark.parametrize("field,value,says", [("repetition_penalty", "abc", "'repetition_penalty' must be a number, got 'abc'"),
                                              ("top_k", 2.5, "'top_k' must be an integer, got 2.5"),
                                              ("repetition_penalty", -2, "repetition_penalty must be > 0"),
                                              ("min_p", 7, "min_p must be in [0, 1]")])
def test_a_malformed_generation_config_default_is_a_one_line_error_naming_the_file(tmp_path, field, value, says):
    """A wrong type or an out-of-range sampling default in generation_config.json is refused at
    load (the field and the file named, exit code 2, no traceback), not at the first request."""
    import shutil

    model_dir = tmp_path / "demo"
    shutil.copytree(DEMO_MODEL, model_dir)
    gen_path = model_dir / "generation_config.json"
    gen_path.write_text(json.dumps({**json.loads(gen_path.read_text()), field: value}))
    proc = freetoken("run", "import os", "--model", str(model_dir), "--max-tokens", "2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"freetoken: error: {gen_path}: {says}"
