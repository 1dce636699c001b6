"""Anthropic `thinking.budget_tokens` is enforced: once the thought has that many tokens the grammar
allows only `</think>` (llguidance's max_tokens on the thought), then decoding goes on unconstrained.
On the demo model with a Qwen3-style thinking template (its generation prompt opens <think>; the demo
model never closes a thought by itself), greedy: the first `budget` tokens are the unconstrained
greedy ones, then the </think> token, then exactly what greedy writes after that prefix (an
independent generate on prompt + thought + </think>); the parser returns a thought of the budget's
tokens and an answer after it. Without a budget (enabled without one, adaptive) nothing changes."""
from __future__ import annotations

import asyncio

import pytest

from freetoken_py.core import SamplingParams
from freetoken_py.server.chat import anthropic_template_kwargs
from freetoken_py.server.constraints import anthropic_constrained
from freetoken_py.server.generation import Prepared, render_chat
from freetoken_py.server.toolcalls import detect_tool_format, parse_output
from server_util import REPO
import server_util

TEMPLATE = REPO / "tests" / "data" / "templates" / "qwen3-thinking-switch.jinja"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
N = 20


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from freetoken_py.llm import LLM

    out = server_util.demo_with_template(tmp_path_factory.mktemp("thinking_demo"), TEMPLATE)
    return LLM(out, dtype="float32", show_progress=False, enable_prefix_cache=False)


def _prepared(llm, thinking: dict) -> tuple[Prepared, dict]:
    body = {"thinking": thinking, "max_tokens": N}
    ids, reasoning = render_chat(llm, MESSAGES, None, anthropic_template_kwargs(body))
    fmt = detect_tool_format(llm.tokenizer.chat_template)
    prep = Prepared(ids, llm.default_sampling(max_tokens=N, temperature=0), fmt, reasoning, None)
    return asyncio.run(anthropic_constrained(prep, body, None, llm.tokenizer)), body


@pytest.mark.parametrize("budget", [1, 6])
def test_budget_closes_the_thought_then_decoding_goes_on(llm, budget):
    prep, _ = _prepared(llm, {"type": "enabled", "budget_tokens": budget})
    assert prep.reasoning == "open" and prep.params.grammar is not None
    free = llm.generate([prep.prompt_ids], SamplingParams(max_tokens=N, temperature=0))[0]
    assert "</think>" not in free.text   # unbudgeted, the whole output is thought: the cut is the grammar's
    out = llm.generate([prep.prompt_ids], prep.params)[0]
    close = llm.tokenizer.token_to_id("</think>")
    assert out.token_ids[:budget] == free.token_ids[:budget] and out.token_ids[budget] == close
    rest = llm.generate([prep.prompt_ids + out.token_ids[:budget + 1]],
                        SamplingParams(max_tokens=N - budget - 1, temperature=0))[0]
    assert out.token_ids[budget + 1:] == rest.token_ids and out.finish_reason == rest.finish_reason
    parsed = parse_output(out.text, prep.tool_format, reasoning="open")
    assert parsed.reasoning == llm.tokenizer.decode(free.token_ids[:budget]).strip()
    assert parsed.content == rest.text.lstrip() and parsed.content


@pytest.mark.parametrize("thinking", [{"type": "enabled"}, {"type": "adaptive"}, {"type": "disabled"}])
def test_without_a_budget_nothing_changes(llm, thinking):
    prep, _ = _prepared(llm, thinking)
    assert prep.params.grammar is None
    if thinking["type"] == "enabled":
        free = llm.generate([prep.prompt_ids], SamplingParams(max_tokens=N, temperature=0))[0]
        assert llm.generate([prep.prompt_ids], prep.params)[0].token_ids == free.token_ids
