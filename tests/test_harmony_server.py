"""gpt-oss's harmony format end to end: a real server on loopback with a tiny scripted gpt_oss
checkpoint (tests/harmony_model.py: the published chat template, harmony's tags as special tokens;
greedy, it writes an analysis message then the final answer, or under tool_choice required /
any the grammar makes it call the tool after the same analysis), spoken to with the official
OpenAI and Anthropic SDKs over the three APIs. The reference is the engine's own greedy text for
the prompt and grammar (an LLM in the test, the server's own constraints module building the
grammar) read by openai-harmony's parser from o200k_harmony tokens: reasoning, content and calls
must come back in each API's own fields (reasoning_content / thinking blocks / reasoning items),
streamed and not."""
from __future__ import annotations

import json

import pytest

import harmony_model
import harmony_util
import server_util
from freetoken_py.core import SamplingParams

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

ASK = "What is the weather in Paris?"
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}}, "required": ["city"],
          "additionalProperties": False}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                              "parameters": PARAMS}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return harmony_model.build(tmp_path_factory.mktemp("harmony_gpt_oss"))


@pytest.fixture(scope="module")
def srv(model_dir):
    with server_util.ServerThread(model_dir, enable_prefix_cache=False) as s:
        yield s


@pytest.fixture(scope="module")
def ref(model_dir):
    from freetoken_py.llm import LLM
    from freetoken_py.server.toolcalls import markup_tokens

    llm = LLM(model_dir, dtype="float32", show_progress=False, enable_prefix_cache=False)
    llm.tokenizer.keep_in_text(markup_tokens("harmony"))
    return llm


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)


def _expected(ref, tools, mode):
    """(reasoning, content, calls) of the engine's greedy turn, read by openai-harmony."""
    from openai_harmony import Role

    from freetoken_py.server.constraints import ToolChoice, request_grammar, shape_of
    from freetoken_py.server.generation import Prepared

    ids = ref.tokenizer.encode(ref.tokenizer.apply_chat_template([{"role": "user", "content": ASK}], tools))
    grammar = request_grammar(tools, ToolChoice(mode), None, shape_of(Prepared(ids, None, "harmony"), ref.tokenizer))
    text = ref.generate([ids], SamplingParams(max_tokens=60, temperature=0, grammar=grammar))[0].text
    enc = harmony_util.encoding()
    end = "<|call|>" if mode == "required" else "<|return|>"   # the stop token the engine does not print
    messages = enc.parse_messages_from_completion_tokens(enc.encode(text + end, allowed_special="all"),
                                                         Role.ASSISTANT)
    reasoning = "".join(c.text for m in messages if m.channel == "analysis" for c in m.content)
    content = "".join(c.text for m in messages if m.channel == "final" for c in m.content)
    calls = [(m.recipient.split(".", 1)[1], json.loads(m.content[0].text)) for m in messages
             if (m.recipient or "").startswith("functions.")]
    return reasoning, content, calls


def test_the_script_is_what_the_model_writes(ref):
    assert _expected(ref, None, "auto") == (harmony_model.REASONING, harmony_model.ANSWER, [])
    assert _expected(ref, [CHAT_TOOL], "required") == (harmony_model.REASONING, "", [("get_weather", {"city": "Paris"})])
    assert _expected(ref, [CHAT_TOOL], "auto") == (harmony_model.REASONING, harmony_model.ANSWER, [])


def test_openai_chat_reasoning_and_content(oai, ref):
    reasoning, content, _ = _expected(ref, None, "auto")
    for effort in (None, "low", "high"):
        extra = {"reasoning_effort": effort} if effort else {}
        msg = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": ASK}], max_tokens=60,
                                          temperature=0, **extra).choices[0]
        assert (msg.message.reasoning_content, msg.message.content, msg.finish_reason) == (reasoning, content, "stop")
    chunks = list(oai.chat.completions.create(model="m", messages=[{"role": "user", "content": ASK}], max_tokens=60,
                                              temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_openai_chat_forced_tool_call(oai, ref, choice):
    reasoning, _, [(name, args)] = _expected(ref, [CHAT_TOOL], "required")
    kw = dict(model="m", messages=[{"role": "user", "content": ASK}], tools=[CHAT_TOOL], tool_choice=choice,
              max_tokens=60, temperature=0)
    out = oai.chat.completions.create(**kw).choices[0]
    (call,) = out.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments), out.finish_reason) == (name, args, "tool_calls")
    assert out.message.reasoning_content == reasoning and not out.message.content
    deltas = [c.choices[0].delta for c in oai.chat.completions.create(stream=True, **kw) if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert calls[0].function.name == name
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == args
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    # tool_choice auto: the grammar lets the model answer, and it does
    auto = oai.chat.completions.create(**dict(kw, tool_choice="auto")).choices[0]
    assert auto.message.tool_calls is None and auto.message.content == _expected(ref, [CHAT_TOOL], "auto")[1]


def test_anthropic_thinking_text_and_tool_use(claude, ref):
    reasoning, content, _ = _expected(ref, None, "auto")
    kw = dict(model="m", max_tokens=60, messages=[{"role": "user", "content": ASK}], extra_body={"temperature": 0})
    msg = claude.messages.create(**kw)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in msg.content] == \
        [("thinking", reasoning), ("text", content)]
    with claude.messages.stream(**kw, thinking={"type": "enabled", "budget_tokens": 1024}) as st:
        final = st.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == content
    tool = {"name": "get_weather", "description": "Weather for a city", "input_schema": PARAMS}
    _, _, [(name, args)] = _expected(ref, [CHAT_TOOL], "required")
    msg = claude.messages.create(**kw, tools=[tool], tool_choice={"type": "any"})
    assert [b.type for b in msg.content] == ["thinking", "tool_use"] and msg.stop_reason == "tool_use"
    assert (msg.content[1].name, msg.content[1].input) == (name, args)
    with claude.messages.stream(**kw, tools=[tool], tool_choice={"type": "tool", "name": "get_weather"}) as st:
        final = st.get_final_message()
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [("thinking", None), ("tool_use", args)]


def test_responses_reasoning_items_and_function_call(oai, ref):
    reasoning, content, _ = _expected(ref, None, "auto")
    full = oai.responses.create(model="m", input=ASK, max_output_tokens=60, temperature=0,
                                reasoning={"effort": "high"})
    assert [i.type for i in full.output] == ["reasoning", "message"]
    assert full.output[0].content[0].text == reasoning and full.output_text == content
    events = list(oai.responses.create(model="m", input=ASK, max_output_tokens=60, temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == content
    tool = {"type": "function", "name": "get_weather", "description": "Weather for a city", "parameters": PARAMS}
    _, _, [(name, args)] = _expected(ref, [CHAT_TOOL], "required")
    full = oai.responses.create(model="m", input=ASK, tools=[tool], tool_choice="required", max_output_tokens=60,
                                temperature=0)
    assert [i.type for i in full.output] == ["reasoning", "function_call"]
    assert (full.output[1].name, json.loads(full.output[1].arguments)) == (name, args)
