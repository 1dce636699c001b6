"""`freetoken eval tools`: how often a model's tool calls are usable, with and without grammar-
constrained decoding.

A fixed suite of coding-agent requests (Claude Code-like and OpenCode-like tool sets,
evals/tool_schemas.py, with the tasks agents give) is rendered through the server's own chat
conversion and template (server/chat.py, server/generation.render_chat), sampled with the
model's generation defaults, and parsed by the server's own output parser (server/toolcalls).
Each output that starts a call (the format's opener appears) is scored: a parseable call
(every opener became a call), naming only declared tools, with arguments that validate against
the tool's JSON schema (the `jsonschema` package, the independent judge). The same requests run
twice, unconstrained and under the grammar the server would use for tool_choice auto
(server/constraints.py); a third run forces a call (tool_choice required).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from freetoken_py.errors import FreetokenError
from freetoken_py.evals.tool_schemas import CLAUDE_CODE_TOOLS, OPENCODE_TOOLS, schemas_by_name

CLAUDE_SYSTEM = "You are an interactive CLI tool that helps users with software engineering tasks."
OPENCODE_SYSTEM = "You are opencode, an agent that helps with coding tasks in the user's repository."
TASKS = [
    "Run the test suite and tell me what fails.",
    "Read README.md and summarise it.",
    "In src/app.py, rename the function load_cfg to load_config.",
    "Create a file hello.py that prints hello world.",
    "Find every TODO comment in the repository.",
    "List the Python files under tests/.",
    "What does the function parse_args in cli.py do?",
    "Fix the typo 'recieve' in server/handler.py.",
]
SUITE = [(CLAUDE_SYSTEM, CLAUDE_CODE_TOOLS), (OPENCODE_SYSTEM, OPENCODE_TOOLS)]


@dataclass(frozen=True)
class ToolsEvalOptions:
    model_dir: Path
    samples: int = 2            # seeds per (task, tool set)
    num_requests: int = 0       # the first N requests of the suite (0: all 16)
    max_tokens: int = 160
    temperature: float | None = None   # None: the model's generation_config.json
    as_json: bool = False
    engine: dict = field(default_factory=dict)


@dataclass
class Score:
    outputs: int = 0
    attempts: int = 0     # outputs in which a call starts
    parseable: int = 0    # ... and every started call parsed
    declared: int = 0     # ... and names only declared tools
    valid: int = 0        # ... and every call's arguments validate

    def add(self, attempted: bool, parsed: bool, declared: bool, valid: bool) -> None:
        self.outputs += 1
        self.attempts += attempted
        self.parseable += attempted and parsed
        self.declared += attempted and parsed and declared
        self.valid += attempted and parsed and declared and valid

    def as_dict(self) -> dict:
        share = (lambda n: round(n / self.attempts, 4) if self.attempts else None)  # noqa: E731
        return {"outputs": self.outputs, "attempts": self.attempts, "parseable": share(self.parseable),
                "declared": share(self.declared), "valid": share(self.valid)}


def requests() -> list[tuple[list[dict], list[dict]]]:
    """(messages, tools) of the suite, converted as the server converts an OpenAI request."""
    from freetoken_py.server.chat import openai_messages, openai_tools
    from freetoken_py.server.protocol import ServerLimits

    out = []
    for task in TASKS:            # alternating tool sets: the first N requests cover both
        for system, tools in SUITE:
            body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": task}],
                    "tools": tools}
            out.append((openai_messages(body, ServerLimits()), openai_tools(body, ServerLimits())))
    return out


def score_output(text: str, tools: list[dict], tool_format: str, reasoning) -> tuple[bool, bool, bool, bool]:
    """(attempted, parseable, declared, valid) of one generation."""
    import jsonschema

    from freetoken_py.server.toolcalls import FORMATS, parse_output

    opener = FORMATS[tool_format].open if tool_format in FORMATS else "<tool_call>"
    parsed = parse_output(text, tool_format, reasoning, True, tools)
    attempted = opener in text
    schemas = schemas_by_name(tools)
    ok_parse = bool(parsed.tool_calls) and opener not in parsed.content
    declared = all(c.name in schemas for c in parsed.tool_calls)
    valid = declared
    for c in parsed.tool_calls if declared else []:
        try:
            jsonschema.validate(json.loads(c.arguments), schemas[c.name])
        except (ValueError, jsonschema.ValidationError):
            valid = False
    return attempted, ok_parse, declared, valid


def _run(llm, reqs, grammar_of, opts: ToolsEvalOptions, tool_format: str) -> Score:
    """Every request x seed under grammar_of(tools, reasoning) (None: unconstrained), one batch."""
    from freetoken_py.server.generation import render_chat

    prompts, params, meta = [], [], []
    for messages, tools in reqs:
        ids, reasoning = render_chat(llm, messages, tools)
        for seed in range(opts.samples):
            prompts.append(ids)
            params.append(llm.default_sampling(max_tokens=opts.max_tokens, seed=seed, temperature=opts.temperature,
                                               grammar=grammar_of(tools, reasoning)))
            meta.append((tools, reasoning))
    score = Score()
    for out, (tools, reasoning) in zip(llm.generate(prompts, params), meta):
        score.add(*score_output(out.text, tools, tool_format, reasoning))
    return score


def run_tools_eval(opts: ToolsEvalOptions) -> dict:
    from freetoken_py.llm import LLM
    from freetoken_py.server.constraints import Shape, ToolChoice, free_tokens, marker_tokens, request_grammar
    from freetoken_py.server.toolcalls import detect_tool_format, markup_tokens

    t0 = time.perf_counter()
    llm = LLM(opts.model_dir, show_progress=not opts.as_json, **opts.engine)
    tok = llm.tokenizer
    if tok is None or not tok.chat_template:
        raise FreetokenError(f"{opts.model_dir}: eval tools needs a tokenizer.json with a chat template")
    tool_format = detect_tool_format(tok.chat_template, llm.args.model_type)
    if tool_format not in ("qwen3_json", "qwen3_coder_xml"):
        raise FreetokenError(f"{opts.model_dir}: this model's tool-call format ({tool_format}) has no tool-call "
                             "support in the server yet")
    tok.keep_in_text(markup_tokens(tool_format))
    single = marker_tokens(tok)

    def grammar(mode: str):
        if tool_format != "qwen3_json":
            return None
        return lambda tools, reasoning: request_grammar(tools, ToolChoice(mode), None,
                                                        Shape(tool_format, reasoning, single, free_tokens(tok, single)))

    reqs = requests()[:opts.num_requests or None]
    out = {"eval": "tools", "model": str(opts.model_dir), "tool_format": tool_format, "requests": len(reqs),
           "samples": opts.samples, "max_tokens": opts.max_tokens,
           "unconstrained": _run(llm, reqs, lambda tools, reasoning: None, opts, tool_format).as_dict()}
    if grammar("auto") is not None:
        out["constrained"] = _run(llm, reqs, grammar("auto"), opts, tool_format).as_dict()
        out["required"] = _run(llm, reqs, grammar("required"), opts, tool_format).as_dict()
    else:
        out["constrained"] = out["required"] = None   # no grammar for this format yet (docs/server.md)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def tools_main(opts: ToolsEvalOptions) -> dict:
    out = run_tools_eval(opts)
    print(json.dumps(out) if opts.as_json else _report(out), flush=True)
    return out


def _report(o: dict) -> str:
    def line(name: str, s: dict | None) -> str:
        if s is None:
            return f"{name:<14} (no grammar for {o['tool_format']})"
        pct = lambda v: "   -  " if v is None else f"{100 * v:5.1f}%"  # noqa: E731
        return (f"{name:<14} {s['attempts']:>4}/{s['outputs']:<4} {pct(s['parseable'])}   {pct(s['declared'])}   "
                f"{pct(s['valid'])}")
    return "\n".join([f"model: {o['model']} ({o['tool_format']}), {o['requests']} requests x {o['samples']} samples, "
                      f"max_tokens {o['max_tokens']}",
                      f"{'':<14} calls/outs  parseable  declared  valid   (shares of the outputs that start a call)",
                      line("unconstrained", o["unconstrained"]), line("constrained", o["constrained"]),
                      line("required", o["required"]), f"{o['seconds']} s"])
