"""The agent-replay trace over HTTP: TTFT and decode tokens/s per turn of `freetoken serve`, against
llama.cpp's server (llama-cpp-python's `llama_cpp.server`) on the same weights, in the same run.

    python bench/serve_agent.py [--turns 8] [--system-chars 6000] [--result-chars 1500]
                                [--decode-tokens 32] [--threads 2] [--no-llama-cpp]

The trace is what a coding agent sends: a system prompt and four tool schemas, then per turn the
whole history so far — user request, the assistant's tool call, the tool's result (real text: a
slice of a stdlib source file) — growing every turn. The history is replayed (fixed assistant
turns, not the generated ones), so both servers get the same text each turn. It is rendered once
with the model's chat template and sent as a streamed `/v1/completions` prompt to both (llama.cpp's
server would apply its own chat handling to chat requests; a text prompt keeps the comparison
exact). Both reuse the prefix of the previous turn: freetoken through its prefix cache, llama.cpp
through its single-slot prompt reuse.

The model is bench/common.py's ~0.49B qwen3_moe with its vocabulary cut to the demo tokenizer's
4,096 tokens (embeddings and lm_head shrink; every layer is the same): with 32,000 random-weight
logits most sampled ids have no text in that tokenizer, freetoken's stream skips empty deltas,
and per-token timing could not be observed.

Servers run one at a time (never competing for cores): freetoken first, then llama.cpp.
TTFT = request sent -> first streamed token; decode tok/s = (tokens - 1) / (last - first token).
Prints one JSON line.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": name, "description": desc, "parameters": {
    "type": "object", "properties": {k: {"type": "string", "description": f"The {k}."} for k in keys},
    "required": list(keys)}}} for name, desc, keys in (
    ("read_file", "Read a file from the workspace and return its contents.", ("path",)),
    ("bash", "Run a shell command in the workspace and return stdout and stderr.", ("command",)),
    ("edit_file", "Replace an exact string in a file with another string.", ("path", "old", "new")),
    ("grep", "Search files for a regular expression and return matching lines.", ("pattern", "path")))]


def _source_text(chars: int, turn: int) -> str:
    """Real text for tool results: consecutive slices of stdlib sources (deterministic)."""
    import json as json_mod

    text = "".join(Path(m.__file__).read_text() for m in (json_mod.decoder, json_mod.encoder, json_mod.scanner))
    start = (turn * chars) % max(1, len(text) - chars)
    return text[start:start + chars]


def build_trace(args) -> tuple[str, list[list[dict]]]:
    """The system prompt and, per turn, the full message list sent that turn."""
    rule = "Keep changes minimal, run the tests after each edit, and explain what you changed. "
    system = ("You are a coding agent working in a Python repository. " + rule * args.system_chars)[:args.system_chars]
    messages, per_turn = [{"role": "system", "content": system}], []
    for t in range(args.turns):
        messages.append({"role": "user", "content": f"Step {t + 1}: look at the JSON decoder and fix the bug."})
        per_turn.append(list(messages))
        call = {"type": "function", "function": {"name": "read_file",
                                                 "arguments": {"path": f"json/decoder_part{t}.py"}}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "content": _source_text(args.result_chars, t)}]
    return system, per_turn


def render(model_dir: Path, per_turn: list[list[dict]]) -> list[str]:
    from freetoken_py.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    return [tok.apply_chat_template(msgs, tools=TOOLS) for msgs in per_turn]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float = 900) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout_s}s: {log_path.read_text()[-2000:]}")


def start_server(kind: str, args, model_dir: Path, max_len: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    t = str(args.threads)
    if kind == "freetoken":
        cmd = [sys.executable, "-m", "freetoken_py", "serve", "--model", str(model_dir), "--port", str(port),
               "--max-model-len", str(max_len), "--threads", t, "--dtype", "bfloat16", "--max-num-seqs", "1"]
    else:
        gguf = common.convert_to_gguf(model_dir, "bf16")
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--port", str(port),
               "--host", "127.0.0.1", "--n_ctx", str(max_len), "--n_threads", t, "--n_threads_batch", t]
    env = dict(os.environ, PYTHONPATH=str(common.REPO))
    log_path = common.WORK / f"serve_agent-{kind}.log"  # a file, not a pipe: progress output must not block it
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    _wait(url, proc, log_path)
    return proc, url


def timed_completion(url: str, prompt: str, num_tokens: int) -> dict:
    """One streamed completion; token times from the stream (one chunk per token on both servers)."""
    import httpx

    body = {"model": "m", "prompt": prompt, "max_tokens": num_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    times, usage, t0 = [], None, time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if chunk.get("choices") and (chunk["choices"][0].get("finish_reason") is None or not times):
                times.append(time.perf_counter() - t0)  # one chunk per token (llama.cpp sends empty ones too)
    n = (usage or {}).get("completion_tokens") or len(times)
    span = times[-1] - times[0] if len(times) > 1 else float("nan")
    return {"ttft_s": round(times[0], 4) if times else None, "tokens": n,
            "decode_tps": round((n - 1) / span, 2) if span == span and span > 0 else None,
            "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "cached_tokens": ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")}


def replay(kind: str, args, model_dir: Path, prompts: list[str], max_len: int) -> list[dict]:
    proc, url = start_server(kind, args, model_dir, max_len)
    try:
        timed_completion(url, "warm-up: def main():", 2)  # kernels compiled, pages touched
        rows = []
        for turn, prompt in enumerate(prompts, 1):
            row = {"turn": turn, **timed_completion(url, prompt, args.decode_tokens)}
            common.log(f"{kind} {row}")
            rows.append(row)
        return rows
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def summary(rows: list[dict]) -> dict:
    later = rows[1:] or rows
    return {"median_ttft_s_turn2plus": round(common.median([r["ttft_s"] for r in later if r["ttft_s"]]), 4),
            "median_decode_tps": round(common.median([r["decode_tps"] for r in rows if r["decode_tps"]]), 2)}


def build_model() -> Path:
    """bench/common.py's ~0.49B checkpoint with vocab_size 4096 (see the module docstring)."""
    full = common.QWEN3_05B
    common.QWEN3_05B = dict(full, vocab_size=4096)
    try:
        return common.build_qwen3_moe(common.WORK / "qwen3moe-0.5b-v4096-bf16")
    finally:
        common.QWEN3_05B = full


def main() -> None:
    ap = common.bench_args(__doc__)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-chars", type=int, default=6000)
    ap.add_argument("--result-chars", type=int, default=1500)
    args = ap.parse_args()
    model_dir = build_model()
    _, per_turn = build_trace(args)
    prompts = render(model_dir, per_turn)
    from freetoken_py.tokenizer import Tokenizer

    longest = len(Tokenizer(model_dir).encode(prompts[-1]))
    max_len = longest + args.decode_tokens + 64
    result = {"bench": "serve_agent", "model": "qwen3_moe ~0.49B (bench/common.py), vocab 4096", "threads": args.threads,
              "turns": args.turns, "decode_tokens": args.decode_tokens, "prompt_tokens_last_turn": longest,
              "api": "/v1/completions, streamed, temperature 0"}
    engines = ["freetoken"] + ([] if args.no_llama_cpp else ["llama_cpp"])
    for kind in engines:
        rows = replay(kind, args, model_dir, prompts, max_len)
        result[kind] = {"per_turn": rows, **summary(rows)}
    if "llama_cpp" in result:
        ours, peer = result["freetoken"], result["llama_cpp"]
        result["ttft_ratio_vs_llama_cpp"] = round(ours["median_ttft_s_turn2plus"] / peer["median_ttft_s_turn2plus"], 3)
        result["decode_ratio_vs_llama_cpp"] = round(ours["median_decode_tps"] / peer["median_decode_tps"], 3)
    common.emit(result)


if __name__ == "__main__":
    main()
