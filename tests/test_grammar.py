"""Grammar-constrained decoding in the engine (engine/grammar.py, the sampler, LLM.add_request).

The references: the grammar library's own matcher walked by hand over the same tokens, the
unconstrained model's own choice (which a working mask must change), and an unpreempted run."""
from __future__ import annotations

import json

import pytest
import torch

from freetoken_py.cli import DEMO_MODEL
from freetoken_py.core import Grammar, Request, SamplingParams
from freetoken_py.engine.grammar import GrammarCompiler
from freetoken_py.engine.sampler import sample
from freetoken_py.errors import FreetokenError
from freetoken_py.llm import LLM

TARGET = '{"city": "Paris", "days": 12}'   # many tokens: a mask that is not advanced cannot spell it


@pytest.fixture(scope="module")
def llm():
    return LLM(DEMO_MODEL, show_progress=False)


def _literal(text: str) -> Grammar:
    return Grammar(f"start: {json.dumps(text)}", "literal")


def test_greedy_under_a_literal_grammar_spells_it_and_stops(llm):
    prompt = llm.encode_prompt("def main():\n")
    free, = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0))
    assert not free.text.startswith(TARGET)   # so the mask is what makes the difference
    out, = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, grammar=_literal(TARGET)))
    assert out.text == TARGET and out.finish_reason == "stop"   # then EOS, the only token left


def test_sampled_tokens_advance_the_matcher(llm):
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, grammar=_literal(TARGET))
    req = llm.add_request(llm.encode_prompt("x = "), params)
    while not req.finished:
        llm.step()
    assert llm.tokenizer.decode(req.output_token_ids) == TARGET
    assert req.constraint.num_consumed == len(req.output_token_ids) and req.constraint.num_resets == 0


def test_mask_matches_the_library_matcher_and_replays_after_a_change(llm):
    import llguidance

    compiler = llm.grammar_compiler
    grammar = Grammar('start: "a" /[0-9]+/ "z"', "regex")
    ids = llm.tokenizer.encode("a123")
    c = compiler.matcher(grammar)
    ref = llguidance.LLMatcher(compiler.tokenizer, grammar.lark)
    ref.consume_tokens(ids)
    bits = torch.tensor(list(ref.compute_bitmask()), dtype=torch.uint8)   # the library's own mask, LSB first
    ref_allowed = ((bits[:, None] >> torch.arange(8)) & 1).flatten()[:compiler.vocab_size].bool()
    logits = torch.zeros(compiler.vocab_size)
    masked = c.apply(logits, ids)    # sync: the constraint had consumed nothing, so it replays ids
    assert c.num_consumed == len(ids) and c.num_resets == 1
    assert torch.equal(torch.isfinite(masked), ref_allowed)
    c.apply(logits, ids[:2])          # the output shrank (a rewind): reset and replay the two left
    assert c.num_resets == 2 and c.num_consumed == 2


def test_sampler_masks_only_constrained_rows(llm):
    c = llm.grammar_compiler.matcher(_literal("zz"))
    want = llm.tokenizer.encode("z")[0]
    logits = torch.zeros(2, llm.args.vocab_size)
    logits[:, 5] = 10.0          # the unconstrained favourite
    free = Request([1], SamplingParams(temperature=0))
    tied = Request([1], SamplingParams(temperature=0))
    tied.constraint = c
    assert sample(logits, [free, tied]) == [5, want]
    assert c.num_consumed == 1


def test_recompute_after_preemption_keeps_the_constraint(llm):
    """A KV cache of a few pages preempts requests mid-generation; the constrained outputs are
    the ones an unpreempted engine gives with the same seeds."""
    grammar = Grammar('start: "[" NUM (", " NUM)* "]"\nNUM: /[0-9]{1,3}/', "list")
    prompt = llm.encode_prompt("data = ")
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=s, grammar=grammar) for s in range(6)]
    want = [o.token_ids for o in llm.generate([prompt] * 6, params)]
    small = LLM(DEMO_MODEL, show_progress=False, kv_cache_bytes=small_kv_bytes(llm, pages=9), page_size=16,
                enable_prefix_cache=False)
    got = small.generate([prompt] * 6, params)
    assert small.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == want
    for o in got:
        assert o.text.startswith("[") and all(p.strip().isdigit() for p in o.text.strip("[]").split(",") if p)


def small_kv_bytes(llm: LLM, pages: int) -> int:
    from freetoken_py.kvcache import KVCache

    a = llm.args
    return pages * KVCache.bytes_per_page(a.num_layers, 16, a.num_kv_heads, a.head_dim, llm.kv_dtype)


def test_invalid_grammar_is_a_one_line_error(llm):
    with pytest.raises(FreetokenError, match="grammar \\(bad\\) is invalid"):
        llm.add_request(llm.encode_prompt("x"), SamplingParams(grammar=Grammar("start: nothing_defined", "bad")))


def test_compiler_needs_a_tokenizer(tmp_path):
    with pytest.raises(FreetokenError, match="tokenizer.json"):
        GrammarCompiler.from_model_dir(tmp_path, 16, [0])
