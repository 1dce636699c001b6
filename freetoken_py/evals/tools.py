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
(server/constraints.py); a third run forces a call (tool_choice required). Two more runs ask the
same tasks for a JSON answer of a fixed schema (response_format json_schema), unconstrained and
constrained; there the share of outputs that validate is scored.
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
JSON_SYSTEM = 'Answer with one JSON object: {"answer": <text>, "confidence": <0..1>, "steps": [<text>, ...]}.'
ANSWER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "confidence"],
                 "properties": {"answer": {"type": "string", "maxLength": 120},
                                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                                "steps": {"type": "array", "items": {"type": "string", "maxLength": 60},
                                          "maxItems": 2}}}


@dataclass(frozen=True)
class ToolsEvalOptions:
    model_dir: Path
    samples: int = 2            # seeds per (task, tool set)
    num_requests: int = 0       # the first N requests of the suite (0: all 16)
    max_tokens: int = 160
    temperature: float | None = None   # None: the model's generation_config.json
    as_json: bool = False
    engine: dict = field(default_factory=dict)
    json_runs: bool = True      # also the json_schema answer runs (bench/gates.py's tools gate skips them)


@dataclass
class Score:
    outputs: int = 0
    attempts: int = 0     # outputs in which a call starts
    parseable: int = 0    # ... and every started call parsed
    declared: int = 0     # ... and names only declared tools
    valid: int = 0        # ... and every call's arguments validate
    with_call: int = 0    # outputs holding at least one parsed call

    def add(self, attempted: bool, parsed: bool, declared: bool, valid: bool, calls: int = 0) -> None:
        self.outputs += 1
        self.with_call += calls > 0
        self.attempts += attempted
        self.parseable += attempted and parsed
        self.declared += attempted and parsed and declared
        self.valid += attempted and parsed and declared and valid

    def as_dict(self) -> dict:
        share = (lambda n: round(n / self.attempts, 4) if self.attempts else None)  # noqa: E731
        return {"outputs": self.outputs, "attempts": self.attempts, "parseable": share(self.parseable),
                "declared": share(self.declared), "valid": share(self.valid),
                "call_share": round(self.with_call / self.outputs, 4) if self.outputs else None}


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


def score_output(text: str, tools: list[dict], tool_format: str, reasoning) -> tuple[bool, bool, bool, bool, int]:
    """(attempted, parseable, declared, valid, number of calls) of one generation."""
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
    return attempted, ok_parse, declared, valid, len(parsed.tool_calls)


def json_valid(text: str, reasoning) -> bool:
    """The answer (after any reasoning) is one JSON value valid against ANSWER_SCHEMA."""
    import jsonschema

    from freetoken_py.server.toolcalls import parse_output

    try:
        jsonschema.validate(json.loads(parse_output(text, "none", reasoning).content), ANSWER_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _run_json(llm, opts: ToolsEvalOptions, grammar_of) -> dict:
    """The tasks asked for a JSON answer, unconstrained (grammar_of None) or under json_schema."""
    from freetoken_py.server.generation import render_chat

    tasks = TASKS[:opts.num_requests or None]   # one request per task (the first N)
    prompts, params, modes = [], [], []
    for task in tasks:
        ids, reasoning = render_chat(llm, [{"role": "system", "content": JSON_SYSTEM},
                                           {"role": "user", "content": task}], None)
        for seed in range(opts.samples):
            prompts.append(ids)
            params.append(llm.default_sampling(max_tokens=opts.max_tokens, seed=seed, temperature=opts.temperature,
                                               grammar=grammar_of(reasoning) if grammar_of else None))
            modes.append(reasoning)
    outs = llm.generate(prompts, params)
    valid = sum(json_valid(o.text, r) for o, r in zip(outs, modes))
    return {"outputs": len(outs), "valid": round(valid / len(outs), 4) if outs else None}


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
    from freetoken_py.server.constraints import (
        SYNTAX,
        Shape,
        ToolChoice,
        free_tokens,
        json_grammar,
        marker_tokens,
        request_grammar,
    )
    from freetoken_py.server.toolcalls import detect_tool_format, markup_tokens

    t0 = time.perf_counter()
    llm = LLM(opts.model_dir, show_progress=not opts.as_json, **opts.engine)
    tok = llm.tokenizer
    if tok is None or not tok.chat_template:
        raise FreetokenError(f"{opts.model_dir}: eval tools needs a tokenizer.json with a chat template")
    tool_format = detect_tool_format(tok.chat_template, llm.args.model_type)
    if tool_format not in SYNTAX:
        raise FreetokenError(f"{opts.model_dir}: this model's tool-call format ({tool_format}) has no tool-call "
                             "support in the server yet")
    tok.keep_in_text(markup_tokens(tool_format))
    single = marker_tokens(tok, tool_format)

    def shape(reasoning) -> Shape:
        return Shape(tool_format, reasoning, single, free_tokens(tok, single, tool_format))

    def grammar(mode: str):
        return lambda tools, reasoning: request_grammar(tools, ToolChoice(mode), None, shape(reasoning))

    reqs = requests()[:opts.num_requests or None]
    out = {"eval": "tools", "model": str(opts.model_dir), "tool_format": tool_format, "requests": len(reqs),
           "samples": opts.samples, "max_tokens": opts.max_tokens,
           "unconstrained": _run(llm, reqs, lambda tools, reasoning: None, opts, tool_format).as_dict()}
    out["constrained"] = _run(llm, reqs, grammar("auto"), opts, tool_format).as_dict()
    out["required"] = _run(llm, reqs, grammar("required"), opts, tool_format).as_dict()
    if opts.json_runs:
        out["json_schema_unconstrained"] = _run_json(llm, opts, None)
        out["json_schema"] = _run_json(llm, opts, lambda reasoning: json_grammar(ANSWER_SCHEMA, shape(reasoning)))
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
                      line("required", o["required"]),
                      f"required outputs holding a call: {o['required']['call_share']}",
                      f"json_schema answers valid: unconstrained {o['json_schema_unconstrained']['valid']}, "
                      f"constrained {o['json_schema']['valid']} (of {o['json_schema']['outputs']})",
                      f"{o['seconds']} s"])
