"""Grammar-constrained decoding: llguidance against xgrammar on CPU cost, and its share of decode.

One JSON line. For each library: the time to build one request's matcher for a coding agent's
tool set (Claude Code-like Bash / Read / Edit / Write / Glob / Grep JSON schemas: a request brings
its tools, so this is paid per request unless cached) and the mask cost per token (compute the
allowed-token mask, then advance with the token) over real outputs tokenized by the model's own
tokenizer: free text followed by a call under tool_choice auto (the grammar the server builds:
server/constraints.py; xgrammar's structural tag with the same trigger), and a call alone under
tool_choice required. Then, on the model (`--model`, default the demo model), batch-1 greedy
decode ms per token with and without the tools grammar (the server's path: LLM with
SamplingParams.grammar, tool_choice required) and the engine's mask path as a share of a decode
token (mask_share_of_decode_pct; the issue's bound is 5%); decode_ratio_on_off is constrained over
unconstrained decode time per token at batch 1 (1.05 = the 5% bound).

    python bench/grammar_cost.py                       # demo model
    python bench/grammar_cost.py --model DIR --decode-tokens 64 --rounds 5

xgrammar is not a dependency (`pip install xgrammar` to compare); without it its fields are null.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DEMO, log  # noqa: E402
from freetoken_py.evals.tool_schemas import CLAUDE_CODE_TOOLS  # noqa: E402
from freetoken_py.server.constraints import Shape, ToolChoice, marker_tokens, request_grammar  # noqa: E402
from freetoken_py.tokenizer import Tokenizer  # noqa: E402

CALLS = [("Bash", {"command": "pytest -x -q tests/test_grammar.py", "timeout": 120000,
                   "description": "Run the grammar tests"}),
         ("Edit", {"file_path": "/work/main/freetoken_py/engine/sampler.py", "old_string": "return out",
                   "new_string": "return tokens", "replace_all": False})]
PREAMBLE = "I'll run the failing test first to see the error, then fix the sampler.\n"


def _call_text(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def outputs() -> dict[str, str]:
    """mode -> an output a model would write under it."""
    return {"auto": PREAMBLE + _call_text(*CALLS[0]),
            "required": _call_text(*CALLS[1])}


def _schemas() -> dict[str, dict]:
    return {t["function"]["name"]: t["function"]["parameters"] for t in CLAUDE_CODE_TOOLS}


# ---- llguidance ------------------------------------------------------------------------------
def _allowed(mask: bytes, tok: int) -> bool:
    return bool(mask[tok // 8] >> (tok % 8) & 1)


def llguidance_cost(model_dir: Path, vocab: int, eos: list[int], texts: dict[str, str], enc) -> dict:
    """The library alone (mask + advance, as xgrammar's below) on a tool set's first request
    (cold: llguidance builds its lexer lazily) and on a later one (warm), and the engine's whole
    path per token on a warm matcher (TokenConstraint.apply on a logits row + advance: what the
    sampler adds)."""
    import torch

    from freetoken_py.engine.grammar import GrammarCompiler

    compiler = GrammarCompiler.from_model_dir(model_dir, vocab, eos)
    shape = Shape("qwen3_json", False, marker_tokens(Tokenizer(model_dir)))
    out = {}
    for mode, text in texts.items():
        grammar = request_grammar(CLAUDE_CODE_TOOLS, ToolChoice(mode), None, shape)
        ids, build, cached, per_token, warm, engine = enc(text), [], [], [], [], []
        for _ in range(5):
            compiler.clear()
            t0 = time.perf_counter()
            c = compiler.matcher(grammar)            # cold: this tool set's first request
            build.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            c = compiler.matcher(grammar)            # the next turn, same tools: a copy
            cached.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for tok in ids:
                assert _allowed(c.matcher.compute_bitmask(), tok), (mode, tok)
                c.matcher.consume_token(tok)
            per_token.append((time.perf_counter() - t0) / len(ids))   # cold: the lexer is built lazily
            c = compiler.matcher(grammar)            # a later request, same tools: the lexer is built
            t0 = time.perf_counter()
            for tok in ids:
                c.matcher.compute_bitmask()
                c.matcher.consume_token(tok)
            warm.append((time.perf_counter() - t0) / len(ids))
            c, logits, seen = compiler.matcher(grammar), torch.zeros(vocab), []
            t0 = time.perf_counter()
            for tok in ids:
                c.apply(logits, seen)
                c.advance(tok)
                seen.append(tok)
            engine.append((time.perf_counter() - t0) / len(ids))
        out[mode] = {"build_ms": round(statistics.median(build) * 1e3, 3),
                     "cached_build_us": round(statistics.median(cached) * 1e6, 1),
                     "mask_us_per_token": round(statistics.median(per_token) * 1e6, 1),
                     "mask_warm_us_per_token": round(statistics.median(warm) * 1e6, 1),
                     "engine_us_per_token": round(statistics.median(engine) * 1e6, 1), "tokens": len(ids)}
    return out


# ---- xgrammar -------------------------------------------------------------------------------
def xgrammar_cost(model_dir: Path, vocab: int, eos: list[int], texts: dict[str, str], enc) -> dict | None:
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    hf = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
    tags = [xgr.StructuralTagItem(begin='<tool_call>\n{"name": ' + json.dumps(n) + ', "arguments": ',
                                  schema=json.dumps(s), end="}\n</tool_call>") for n, s in _schemas().items()]
    required = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": s},
                           "required": ["name", "arguments"], "additionalProperties": False}
                          for n, s in _schemas().items()]}
    out = {}
    for mode, text in texts.items():
        build, per_token = [], []
        for _ in range(5):
            compiler = xgr.GrammarCompiler(info, cache_enabled=False)   # cold: this tool set's first request
            t0 = time.perf_counter()
            compiled = (compiler.compile_structural_tag(tags, ["<tool_call>"]) if mode == "auto" else
                        compiler.compile_json_schema(json.dumps(required), any_whitespace=False))
            matcher = xgr.GrammarMatcher(compiled)
            build.append(time.perf_counter() - t0)
            ids = enc(text if mode == "auto" else text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
            bitmask = xgr.allocate_token_bitmask(1, vocab)
            t0 = time.perf_counter()
            words = bitmask[0].numpy()   # the same memory: read it as python ints, no torch op per token
            for tok in ids:
                matcher.fill_next_token_bitmask(bitmask)
                assert int(words[tok // 32]) >> (tok % 32) & 1, (mode, tok)
                assert matcher.accept_token(tok)
            per_token.append((time.perf_counter() - t0) / len(ids))
        out[mode] = {"build_ms": round(statistics.median(build) * 1e3, 3),
                     "mask_us_per_token": round(statistics.median(per_token) * 1e6, 1), "tokens": len(ids)}
    return out


# ---- decode share ---------------------------------------------------------------------------
def decode_cost(model_dir: Path, num_tokens: int, rounds: int) -> dict:
    from freetoken_py.core import SamplingParams
    from freetoken_py.llm import LLM

    llm = LLM(model_dir, show_progress=False, enable_prefix_cache=False)
    tok = llm.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Explain what the sampler does."}],
                                                tools=CLAUDE_CODE_TOOLS))
    # required: every decoded token is inside a call, where the mask costs the most
    grammar = request_grammar(CLAUDE_CODE_TOOLS, ToolChoice("required"), None, Shape("qwen3_json", False, marker_tokens(tok)))
    times: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(rounds + 1):
        for key, g in (("off", None), ("on", grammar)):   # interleaved: the machine's drift hits both
            params = SamplingParams(max_tokens=num_tokens, temperature=0, grammar=g)
            req = llm.add_request(prompt, params)
            llm.step()                                   # prefill + first token: not decode
            t0, n0 = time.perf_counter(), len(req.output_token_ids)
            while not req.finished:
                llm.step()
            if r:
                times[key].append((time.perf_counter() - t0) / max(1, len(req.output_token_ids) - n0))
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return {"decode_ms_per_token_off": round(off * 1e3, 3), "decode_ms_per_token_on": round(on * 1e3, 3),
            "decode_overhead_pct": round((on - off) / off * 100, 2), "decode_ratio_on_off": round(on / off, 4),
            "vocab_size": llm.args.vocab_size}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEMO)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-decode", action="store_true", help="library comparison only")
    args = ap.parse_args(argv)
    from freetoken_py.models.loader import read_generation_defaults

    tok = Tokenizer(args.model)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    eos = list(read_generation_defaults(args.model).eos_token_ids)
    texts = outputs()
    log("llguidance")
    row = {"bench": "grammar_cost", "model": str(args.model), "tools": len(CLAUDE_CODE_TOOLS),
           "llguidance": llguidance_cost(args.model, vocab, eos, texts, tok.encode)}
    log("xgrammar")
    row["xgrammar"] = xgrammar_cost(args.model, vocab, eos, texts, tok.encode)
    if not args.no_decode:
        log("decode, batch 1")
        row.update(decode_cost(args.model, args.decode_tokens, args.rounds))
        mask_ms = row["llguidance"]["required"]["engine_us_per_token"] / 1e3
        row["mask_share_of_decode_pct"] = round(mask_ms / row["decode_ms_per_token_off"] * 100, 2)
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
