"""Per-request detokenizer options (SamplingParams.keep_special_tokens): a request keeps the special
tokens it names in its own text; the shared tokenizer and every other request are unchanged
(the server used to call Tokenizer.keep_in_text per request, while the engine thread detokenized).
Reference: the tokenizer's own decode with and without skipping special tokens."""
from __future__ import annotations

import pytest

from freetoken_py.core import SamplingParams

TAG = "<|im_start|>"   # a special token of the demo vocabulary that is not an EOS token


@pytest.fixture(scope="module")
def llm():
    from freetoken_py.cli import DEMO_MODEL
    from freetoken_py.llm import LLM

    return LLM(DEMO_MODEL, dtype="float32", show_progress=False)


def test_keep_is_per_request(llm):
    tok = llm.tokenizer
    tag = tok.token_to_id(TAG)
    assert tag in tok.special_ids([TAG]) and tag not in llm.generation.eos_token_ids
    forced = dict(max_tokens=3, temperature=0, ignore_eos=True, logit_bias=((tag, 100.0),))   # every token is TAG
    keep, plain = llm.generate(["Hello there", "Hello there"],   # one batch: both detokenize in the same steps
                               [SamplingParams(**forced, keep_special_tokens=(TAG,)), SamplingParams(**forced)])
    assert keep.token_ids == plain.token_ids == [tag] * 3
    assert keep.text == tok.decode([tag] * 3, skip_special_tokens=False) == TAG * 3
    assert plain.text == tok.decode([tag] * 3) == ""
    assert tok.decode([tag]) == ""   # the shared tokenizer's default is untouched


def test_server_chat_params_carry_the_formats_tags(llm):
    """prepare_chat's params name the chat format's tags; the shared tokenizer keeps none."""
    import asyncio

    from freetoken_py.server.async_engine import AsyncEngine
    from freetoken_py.server.generation import prepare_chat
    from freetoken_py.server.toolcalls import markup_tokens

    prep = asyncio.run(prepare_chat(llm, AsyncEngine(llm), [{"role": "user", "content": "hi"}], None, {}, 4, ()))
    assert prep.params.keep_special_tokens == markup_tokens(prep.tool_format)
    assert llm.tokenizer._keep == frozenset()  # noqa: SLF001  (what keep_in_text used to change)
