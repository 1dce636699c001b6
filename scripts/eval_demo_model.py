#!/usr/bin/env python3
"""Held-out evaluation of the demo model: does its greedy output look like Python?

    python scripts/eval_demo_model.py [--old DIR] [--new DIR | --new-run RUN] [--prompts 100]

--new-run RUN evaluates a training run's latest checkpoint (intermediate or final) without
swapping anything: it is exported (scripts/train_demo_model.py --export-only) to a temporary
directory first.

Prompts come from held-out site-packages files (scripts/demo_corpus.py: packages neither the old
nor the new model trained on): a function signature or a class header with its docstring. Each
gets a greedy 64-token continuation through freetoken's own engine (LLM.generate, the default
backend, as `freetoken run` uses it). Reported per model, in one JSON line:

- parse: share whose prompt + continuation, cut at the continuation's last complete line, parses
  with `ast`; parse_nonblank: the same, with at least one non-blank line kept (a continuation of
  nothing but blank lines parses trivially);
- repeated: share that degenerate into a repeated line (a line with a letter or digit in it
  appears 3+ times in the cut continuation); blank: share with no non-blank line;
  distinct_first_lines: distinct first non-blank lines over prompts (added later: one line
  written for every prompt passes the checks above);
- tool_calls: share of a few fixed chat prompts (TOOL_CASES: the servers' tests' weather question
  among them) whose greedy reply calls the tool it should, or answers in text where no tools are
  offered; tool_call_names lists what each reply called (added with the tool-call reward step);
- readme: the README's first command's greedy continuation of "import os" (its text, whether
  it parses and whether it repeats a line 3+ times), the first output a new user sees;
- ppl / bits_per_byte: held-out perplexity per token and, comparable across tokenizers, bits per
  byte of the same text (the first 40 held-out files, first 6,000 characters each, windows of 512
  tokens after an <|endoftext|>), scored by transformers (an independent forward);
- meets_targets: whether parse >= 0.60 and repeated <= 0.10 (TARGETS: a new checkpoint ships only
  when both hold and every client test passes with it), each and "all".
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_corpus  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "freetoken_py" / "data" / "demo_model"
MAX_TOKENS = 64
PPL_FILES, PPL_CHARS, PPL_WINDOW = 40, 6000, 512
TARGETS = {"parse": (">=", 0.60), "repeated": ("<=", 0.10)}   # what a checkpoint must meet to ship (issue 43)
README_PROMPT = "import os"   # the README's first command: freetoken run "import os" --max-tokens 64 --temperature 0


def cut_at_last_line(continuation: str) -> str:
    """The continuation up to and including its last newline ('' if it has none)."""
    return continuation[:continuation.rfind("\n") + 1]


def parses(prompt: str, continuation: str) -> bool:
    try:
        ast.parse(prompt + cut_at_last_line(continuation))
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    return True


def is_blank(continuation: str) -> bool:
    return not cut_at_last_line(continuation).strip()


def is_repeated(continuation: str, times: int = 3) -> bool:
    """Some line with a letter or digit in it occurs `times`+ times (stripped) in the cut."""
    lines = [l.strip() for l in cut_at_last_line(continuation).splitlines()]
    counts = Counter(l for l in lines if any(c.isalnum() for c in l))
    return bool(counts) and max(counts.values()) >= times


def score(prompts: list[str], continuations: list[str]) -> dict:
    n = len(prompts)
    ok = [parses(p, c) for p, c in zip(prompts, continuations)]
    blank = [is_blank(c) for c in continuations]
    return {"parse": sum(ok) / n,
            "parse_nonblank": sum(o and not b for o, b in zip(ok, blank)) / n,
            "repeated": sum(map(is_repeated, continuations)) / n,
            "blank": sum(blank) / n,
            # (added after the first runs: a model that writes one safe line for every prompt
            # scores well above; this says how many different first lines it writes)
            "distinct_first_lines": len({first_line(c) for c in continuations}) / n}


def meets_targets(row: dict) -> dict:
    """Each target of TARGETS met or not by a model's row, and all of them."""
    met = {k: row[k] >= v if op == ">=" else row[k] <= v for k, (op, v) in TARGETS.items()}
    return {**met, "all": all(met.values())}


def first_line(continuation: str) -> str:
    """The first non-blank line of the cut continuation, stripped ('' if none)."""
    return next((l.strip() for l in cut_at_last_line(continuation).splitlines() if l.strip()), "")


def greedy_params(llm, max_tokens: int, repetition_penalty: float | None = None):
    """Greedy as `freetoken run --temperature 0` decodes: the model's generation_config.json defaults
    that apply in greedy decoding (its repetition_penalty) unless repetition_penalty overrides them."""
    return llm.default_sampling(max_tokens=max_tokens, temperature=0, repetition_penalty=repetition_penalty)


def greedy_continuations(llm, prompts: list[str], repetition_penalty: float | None = None) -> list[str]:
    outs = llm.generate(prompts, greedy_params(llm, MAX_TOKENS, repetition_penalty))
    return [o.text for o in outs]


def _tool(name: str, desc: str, **props) -> dict:
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": {k: {"type": "string"} for k in props}, "required": list(props)}}}


WEATHER = _tool("get_weather", "Get the current weather for a city", city="")
READ = _tool("read_file", "Read a text file and return its contents.", path="")
BASH = _tool("Bash", "Run a shell command", command="")
# (user message, tools offered, the tool a greedy answer should call, or None: answer in text).
# The servers' tests and the README's chat example ask the first ones.
TOOL_CASES = [("What is the weather in Paris?", [WEATHER], "get_weather"),
              ("What's the weather in London?", [WEATHER], "get_weather"),
              ("Is it cold in Oslo right now?", [READ, WEATHER], "get_weather"),
              ("What is in src/app.py?", [READ], "read_file"),
              ("Show me setup.py", [BASH, READ], "read_file"),
              ("Run the tests with pytest.", [BASH], "Bash"),
              ("What is in src/app.py?", None, None),
              ("What is a list?", None, None)]


def first_call_name(text: str):
    """The name in the first complete `<tool_call>` JSON of a reply, '' for a broken one, None for none."""
    if "<tool_call>" not in text:
        return None
    body = text.split("<tool_call>", 1)[1]
    try:
        call = json.loads(body.split("</tool_call>", 1)[0]) if "</tool_call>" in body else None
    except ValueError:
        call = None
    ok = isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict)
    return call["name"] if ok else ""


def tool_calls(llm, repetition_penalty: float | None = None) -> dict:
    """Greedy replies (60 tokens, the raw text with its tool-call tags) to TOOL_CASES: the share that
    do what the case wants (a well-formed call of that tool / no call) and each reply's call."""
    ids = [llm.chat_prompt_ids([{"role": "user", "content": q}], tools=t) for q, t, _ in TOOL_CASES]
    outs = llm.generate(ids, greedy_params(llm, 60, repetition_penalty))
    names = [first_call_name(o.text) for o in outs]
    ok = [n == want for n, (_, _, want) in zip(names, TOOL_CASES)]
    return {"tool_calls": sum(ok) / len(ok), "tool_call_names": names}


def heldout_nll(model_dir: Path, texts: list[str]) -> dict:
    """Sum of next-token NLL over the texts (transformers, fp32), per token and per byte."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll, tokens = 0.0, 0
    for text in texts:
        ids = tok.encode(text).ids
        for s in range(0, len(ids), PPL_WINDOW):
            window = torch.tensor([[eot] + ids[s:s + PPL_WINDOW]])  # [1, 1 + w]
            with torch.no_grad():
                logits = model(input_ids=window[:, :-1]).logits[0]  # [w, vocab]
            nll += float(torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum"))
            tokens += window.shape[1] - 1
    nbytes = sum(len(t.encode()) for t in texts)
    return {"ppl": math.exp(nll / tokens), "bits_per_byte": nll / math.log(2) / nbytes,
            "ppl_tokens": tokens}


def evaluate(model_dir: Path, prompts: list[dict], ppl_texts: list[str], show: int,
             repetition_penalty: float | None = None) -> dict:
    from freetoken_py.llm import LLM

    texts = [p["prompt"] for p in prompts]
    t0 = time.perf_counter()
    llm = LLM(model_dir, show_progress=False)
    load_s = time.perf_counter() - t0
    rp = repetition_penalty
    conts = greedy_continuations(llm, texts, rp)
    (readme,) = greedy_continuations(llm, [README_PROMPT], rp)
    row = {"dir": str(model_dir), "repetition_penalty": greedy_params(llm, 1, rp).repetition_penalty,
           **score(texts, conts), **tool_calls(llm, rp), **heldout_nll(model_dir, ppl_texts),
           "readme": {"prompt": README_PROMPT, "parses": parses(README_PROMPT, readme),
                      "repeated": is_repeated(readme), "text": readme},
           "load_s": round(load_s, 2)}
    row["meets_targets"] = meets_targets(row)
    for p, c in list(zip(texts, conts))[:show]:
        print(f"--- {model_dir.name}\n{p}{c}", file=sys.stderr)
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, default=DEMO, help="the model to compare against")
    ap.add_argument("--new", type=Path, default=None, help="the candidate (omit: old only)")
    ap.add_argument("--new-run", default=None,
                    help="the candidate is this training run's latest checkpoint (exported to a temp dir)")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="the training work dir of --new-run (default: train_demo_model.py's)")
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--show", type=int, default=0, help="print the first N samples to stderr")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--site", type=Path, default=None,
                    help="the held-out packages of this site-packages directory (default: the running Python's)")
    ap.add_argument("--repetition-penalty", type=float, default=None,
                    help="override each model's generation_config.json repetition_penalty (1.0: none)")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    from freetoken_py.kernels import configure_threads

    torch.set_num_threads(args.threads)
    configure_threads(args.threads)
    tmp = None
    if args.new_run is not None:
        if args.new is not None:
            ap.error("give --new or --new-run, not both")
        import tempfile

        import train_demo_model
        targs = train_demo_model.parse_args(["--run", args.new_run] + (
            ["--work-dir", str(args.work_dir)] if args.work_dir else []))
        tmp = tempfile.TemporaryDirectory(prefix=f"demo-eval-{args.new_run}-")
        args.new = Path(tmp.name) / args.new_run
        with contextlib.redirect_stdout(sys.stderr):  # stdout keeps the one JSON line
            train_demo_model.export(targs.work_dir / args.new_run, args.new, targs)
    files = demo_corpus.heldout_files(args.site)
    prompts = demo_corpus.heldout_prompts(files, args.prompts)
    ordered = sorted(files, key=lambda f: demo_corpus.file_key(f[0]))
    ppl_texts = [text[:PPL_CHARS] for _, text in ordered[:PPL_FILES]]
    row = {"bench": "demo_model_eval", "prompts": len(prompts), "max_tokens": MAX_TOKENS,
           "targets": {k: f"{op} {v}" for k, (op, v) in TARGETS.items()},
           "heldout_files": len(files), "ppl_bytes": sum(len(t.encode()) for t in ppl_texts)}
    for name, d in (("old", args.old), ("new", args.new)):
        if d is not None:
            row[name] = evaluate(d, prompts, ppl_texts, args.show, args.repetition_penalty)
    if tmp is not None:
        row["new"]["run"] = args.new_run
        tmp.cleanup()
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
