"""gpt-oss's harmony chat format against openai-harmony (OpenAI's own renderer and parser, PyPI):

- rendering: a conversation sent to each API (OpenAI chat, Responses, Anthropic messages) goes
  through the server's request conversion (server/chat.py) and renderer (generation.render_text)
  with gpt-oss's published chat template, and must equal openai-harmony's rendering of the same
  conversation, reasoning effort included (the API's effort field mapped to low / medium / high);
- parsing: completions that openai-harmony renders (analysis, a preamble, tool calls, the final
  answer) parse to what openai-harmony's own parser reads from the same token ids
  (`parse_messages_from_completion_tokens`, and `StreamableParser` token by token), and give the
  same events at every split of the text (every character boundary, and bytes one at a time
  through an incremental UTF-8 decoder as the detokenizer does);
- grammar: with tools the grammar accepts exactly valid harmony calls (recipient
  `functions.NAME`, JSON arguments valid against the tool's schema), checked with llguidance on
  the tokenizer the e2e tests use (tags as single tokens) and on one that spells them.
"""
from __future__ import annotations

import codecs
import json

import pytest

import harmony_util
from freetoken_py.server.chat import (
    anthropic_messages,
    anthropic_template_kwargs,
    anthropic_tools,
    openai_messages,
    openai_template_kwargs,
    openai_tools,
    responses_messages,
    responses_tools,
)
from freetoken_py.server.generation import render_text
from freetoken_py.server.protocol import ServerLimits
from freetoken_py.server.toolcalls import (
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallStart,
    collect,
    detect_tool_format,
    make_parser,
    markup_tokens,
)
from freetoken_py.tokenizer import Tokenizer

LIMITS = ServerLimits()
DATE = "2026-01-02"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "description": "the city"},
    "unit": {"type": "string", "enum": ["c", "f"]},
    "days": {"type": "integer"}}, "required": ["city"]}
TIME = {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}
DESCRIPTIONS = {"get_weather": "Weather for a city", "get_time": "Time in a zone"}


@pytest.fixture(scope="module")
def enc():
    return harmony_util.encoding()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer(harmony_util.template_dir(tmp_path_factory.mktemp("harmony")))


# ---- rendering ------------------------------------------------------------------------------
def _openai_body(effort):
    body = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21 C"},
        {"role": "assistant", "content": "Sunny 🌤"},
        {"role": "user", "content": "And the time?"}],
        "tools": [{"type": "function", "function": {"name": n, "description": DESCRIPTIONS[n], "parameters": s}}
                  for n, s in (("get_weather", WEATHER), ("get_time", TIME))]}
    if effort is not None:
        body["reasoning_effort"] = effort
    return body, openai_messages(body, LIMITS), openai_tools(body, LIMITS), openai_template_kwargs(body, effort)


def _responses_body(effort):
    body = {"instructions": "Be brief.", "input": [
        {"type": "message", "role": "user", "content": "Weather in Zürich?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Zürich"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny, 21 C"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny 🌤"}]},
        {"type": "message", "role": "user", "content": "And the time?"}],
        "tools": [{"type": "function", "name": n, "description": DESCRIPTIONS[n], "parameters": s}
                  for n, s in (("get_weather", WEATHER), ("get_time", TIME))]}
    if effort is not None:
        body["reasoning"] = {"effort": effort}
    return (body, responses_messages(body, LIMITS), responses_tools(body, LIMITS),
            openai_template_kwargs(body, effort, "reasoning.effort"))


def _anthropic_body(thinking):
    body = {"system": "Be brief.", "max_tokens": 100, "messages": [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Zürich"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "Sunny, 21 C"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Sunny 🌤"}]},
        {"role": "user", "content": "And the time?"}],
        "tools": [{"name": n, "description": DESCRIPTIONS[n], "input_schema": s}
                  for n, s in (("get_weather", WEATHER), ("get_time", TIME))]}
    if thinking is not None:
        body["thinking"] = thinking
    return body, anthropic_messages(body, LIMITS), anthropic_tools(body, LIMITS), anthropic_template_kwargs(body)


def _reference(enc, effort: str) -> str:
    """openai-harmony's rendering of the conversation all three bodies describe."""
    from openai_harmony import (
        Author,
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    tools = [ToolDescription.new(n, DESCRIPTIONS[n], parameters=s) for n, s in (("get_weather", WEATHER),
                                                                                 ("get_time", TIME))]
    system = SystemContent.new().with_reasoning_effort(ReasoningEffort(effort.capitalize())) \
        .with_conversation_start_date(DATE)
    conv = Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, system),
        Message.from_role_and_content(Role.DEVELOPER,
                                      DeveloperContent.new().with_instructions("Be brief.").with_function_tools(tools)),
        Message.from_role_and_content(Role.USER, "Weather in Zürich?"),
        Message.from_role_and_content(Role.ASSISTANT, json.dumps({"city": "Zürich"}, ensure_ascii=False))
        .with_channel("commentary").with_recipient("functions.get_weather").with_content_type("json"),
        # the published template writes a tool's output with tojson: a JSON string
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), json.dumps("Sunny, 21 C"))
        .with_recipient("assistant").with_channel("commentary"),
        Message.from_role_and_content(Role.ASSISTANT, "Sunny 🌤").with_channel("final"),
        Message.from_role_and_content(Role.USER, "And the time?"),
    ])
    return enc.decode_utf8(enc.render_conversation_for_completion(conv, Role.ASSISTANT))


CASES = [(_openai_body, e, r) for e, r in ((None, "medium"), ("low", "low"), ("medium", "medium"),
                                           ("high", "high"), ("minimal", "low"), ("xhigh", "high"))] + \
        [(_responses_body, e, r) for e, r in ((None, "medium"), ("low", "low"), ("high", "high"), ("none", "low"))] + \
        [(_anthropic_body, t, r) for t, r in (
            (None, "medium"), ({"type": "disabled"}, "low"), ({"type": "enabled", "budget_tokens": 1024}, "low"),
            ({"type": "enabled", "budget_tokens": 8000}, "medium"),
            ({"type": "enabled", "budget_tokens": 32000}, "high"),
            ({"type": "adaptive"}, "medium"))]


@pytest.mark.parametrize("make, effort, harmony_effort", CASES,
                         ids=[f"{m.__name__[1:-5]}-{json.dumps(e)}" for m, e, _ in CASES])
def test_each_api_renders_what_openai_harmony_renders(tok, enc, make, effort, harmony_effort):
    _, messages, tools, kwargs = make(effort)
    ours = render_text(tok, messages, tools, dict(kwargs, strftime_now=lambda fmt: DATE))
    assert ours == _reference(enc, harmony_effort)


def test_the_template_is_detected_as_harmony(tok):
    assert detect_tool_format(tok.chat_template) == "harmony"
    assert detect_tool_format(None, "gpt_oss") == "none"   # no template: nothing to parse
    assert set(markup_tokens("harmony")) >= {"<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"}


# ---- parsing --------------------------------------------------------------------------------
def _completion(enc, messages, last_end: str) -> list[int]:
    """Token ids of an assistant turn after the prompt's `<|start|>assistant`, as gpt-oss writes it:
    openai-harmony renders each message; the turn's last one ends with `last_end`."""
    ids = [t for m in messages for t in enc.render(m)]
    start, role = enc.encode("<|start|>", allowed_special="all") + enc.encode("assistant")
    assert ids[:2] == [start, role]
    ids = ids[2:]
    if last_end != "<|call|>":
        ids[-1:] = enc.encode(last_end, allowed_special="all")
    return ids


def _turns():
    from openai_harmony import Message, Role

    def a(text, channel, recipient=None):
        m = Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)
        return m.with_recipient(recipient).with_content_type("<|constrain|>json") if recipient else m

    return {
        "answer": ([a("The user greets. Reply.", "analysis"), a("Hello! ¿Qué tal? 👋", "final")], "<|return|>"),
        "call": ([a("Need the weather for Zürich.", "analysis"),
                  a('{"city":"Zürich","unit":"c"}', "commentary", "functions.get_weather")], "<|call|>"),
        "preamble_call": ([a("Plan: two calls.", "analysis"), a("I will look it up.", "commentary"),
                           a('{"tz": "Europe/Zurich", "note": "<|call|> in a string"}', "commentary",
                             "functions.get_time")], "<|call|>"),
        "answer_ends_with_end": ([a("Short.", "analysis"), a("Done.", "final")], "<|end|>"),
        "no_reasoning": ([a("Just text, 100 % sure: {\"a\": 1}", "final")], "<|return|>"),
    }


def _expected(messages) -> tuple[str, str, list[tuple[str, dict]]]:
    """openai-harmony's messages -> (content, reasoning, calls) as the APIs split them."""
    content, reasoning, calls = "", "", []
    for m in messages:
        text = "".join(c.text for c in m.content)
        if m.recipient and m.recipient.startswith("functions."):
            calls.append((m.recipient[len("functions."):], json.loads(text)))
        elif m.channel == "analysis":
            reasoning += text
        else:
            content += text
    return content, reasoning, calls


def _ours(events) -> tuple[str, str, list[tuple[str, dict]]]:
    parsed = collect(events)
    return parsed.content, parsed.reasoning, [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def _strip_ids(events) -> list:
    return [ToolCallStart(e.index, "", e.name) if isinstance(e, ToolCallStart) else e for e in events]


def _merged(events) -> list:
    """Adjacent text / reasoning deltas joined (a split may cut one delta in two)."""
    out: list = []
    for e in _strip_ids(events):
        if out and type(e) in (TextDelta, ReasoningDelta) and type(out[-1]) is type(e):
            out[-1] = type(e)(out[-1].text + e.text)
        else:
            out.append(e)
    return out


def _feed(pieces, tools=True) -> list:
    parser = make_parser("harmony", False, tools)
    events = [e for p in pieces for e in parser.feed(p)]
    return events + parser.finish()


def _token_deltas(enc, ids: list[int]) -> list[str]:
    """The text one token at a time, an incomplete UTF-8 character held until it completes (as
    the server's IncrementalDetokenizer does)."""
    out, shown = [], ""
    for i in range(len(ids)):
        text = enc.decode(ids[:i + 1])
        if not text.endswith("\ufffd"):
            out.append(text[len(shown):])
            shown = text
    return out


@pytest.mark.parametrize("name", list(_turns()))
def test_parse_equals_openai_harmony_on_the_same_tokens(enc, name):
    from openai_harmony import Role, StreamableParser

    messages, end = _turns()[name]
    ids = _completion(enc, messages, end)
    reference = enc.parse_messages_from_completion_tokens(ids, Role.ASSISTANT)
    stream = StreamableParser(enc, Role.ASSISTANT)
    for t in ids:
        stream.process(t)
    if end == "<|end|>":   # a turn cut after <|end|>: the streaming parser's last message is complete too
        assert [m.to_dict() for m in stream.messages] == [m.to_dict() for m in reference]
    expected = _expected(reference)
    assert expected[2] or expected[0]   # (the case means something)
    # whole text, and token by token as the server's detokenizer feeds it
    assert _ours(_feed([enc.decode_utf8(ids)])) == expected
    assert _ours(_feed(_token_deltas(enc, ids))) == expected


@pytest.mark.parametrize("name", list(_turns()))
def test_every_split_gives_the_same_events(enc, name):
    messages, end = _turns()[name]
    text = enc.decode_utf8(_completion(enc, messages, end))
    whole = _merged(_feed([text]))
    for k in range(len(text) + 1):
        assert _merged(_feed([text[:k], text[k:]])) == whole, k
    assert _merged(_feed(list(text))) == whole
    decoder = codecs.getincrementaldecoder("utf-8")()   # bytes one at a time, held while incomplete
    assert _merged(_feed([decoder.decode(bytes([b])) for b in text.encode()] + [decoder.decode(b"", final=True)])) \
        == whole


def test_reasoning_is_streamed_before_the_message_ends():
    parser = make_parser("harmony", False, True)
    assert parser.feed("<|channel|>analysis<|message|>Thinking abo") == [ReasoningDelta("Thinking abo")]
    assert parser.feed("ut it<|e") == [ReasoningDelta("ut it")]   # "<|e" may be <|end|>: held back
    assert parser.feed("nd|><|start|>assistant<|channel|>final<|message|>Hi") == [TextDelta("Hi")]


def test_calls_without_tools_and_malformed_calls_are_text():
    call = '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>'
    assert collect(_feed([call], tools=False)).content == '{"a": 1}'
    bad = '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": <|call|>'
    parsed = collect(_feed([bad]))
    assert parsed.tool_calls == [] and parsed.content == bad
    # the recipient before the channel (how the template writes history) is read too
    parsed = collect(_feed([' to=functions.get_time<|channel|>commentary json<|message|>{"tz": "UTC"}<|call|>']))
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_time", {"tz": "UTC"})]
    # a built-in tool (browser / python) is not run by this server: its message stays reasoning
    parsed = collect(_feed(["<|channel|>analysis to=python code<|message|>print(1)<|call|>"]))
    assert parsed.tool_calls == [] and parsed.reasoning == "print(1)"
    # text that is not harmony at all comes back as content
    assert collect(_feed(["plain words"])).content == "plain words"
    # text that reaches no <|message|> within 256 characters is not harmony: shown as written,
    # wherever it was cut (and a <|message|> after that is text too)
    long = "<|start|>" + "word " * 60 + "<|channel|>final<|message|>x<|return|>"
    assert _merged(_feed([long])) == _merged(_feed(list(long))) == [TextDelta(long)]
    assert _feed(["<|start|>assistant"]) == []   # a message that never came


# ---- grammar --------------------------------------------------------------------------------
GRAMMAR_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["c", "f"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 9}}}}},
    {"type": "function", "function": {"name": "goto_line", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["line", "force"],
        "properties": {"line": {"type": "integer", "minimum": 1, "maximum": 99}, "force": {"type": "boolean"}}}}}]
GRAMMAR_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in GRAMMAR_TOOLS}


def _grammar_vocab(tmp_path, special: bool):
    import llguidance

    d = harmony_util.template_dir(tmp_path / ("special" if special else "spelled"), special_tokens=special)
    tok = Tokenizer(d)
    n = tok.vocab_size
    return tok, llguidance.LLTokenizer((d / "tokenizer.json").read_text(), n_vocab=n, eos_token=[2]), n


def _shape(tok, budget=None):
    from freetoken_py.server.constraints import Shape, free_tokens, marker_tokens

    single = marker_tokens(tok, "harmony")
    return Shape("harmony", False, single, free_tokens(tok, single, "harmony"), think_budget=budget)


def _harmony_walk(lark, lltok, n_vocab, endings, rng, max_steps=400):
    """Random allowed tokens; past a random length, closers (tags, quotes, brackets) so messages end."""
    import llguidance
    import numpy as np

    m = llguidance.LLMatcher(lltok, lark, log_level=0)
    assert not m.is_error(), m.get_error()
    ids, wander = [], rng.randrange(0, 30)
    for _ in range(max_steps):
        if m.is_stopped():
            return ids, True
        allowed = np.flatnonzero(np.frombuffer(m.compute_logit_bias(), np.uint8)[:n_vocab])
        assert len(allowed) and not m.is_error()
        if len(ids) >= wander:
            fits = [e for e in endings if m.validate_tokens(e) == len(e)]
            if 2 in allowed and (not fits or rng.random() < 0.3):
                return ids, True
            if fits:
                choice = rng.choice(fits)
                assert m.consume_tokens(choice)
                ids += choice
                continue
        pick = int(rng.choice(list(allowed[allowed != 2]) or [2]))
        if pick == 2:
            return ids, True
        assert m.consume_token(pick)
        ids.append(pick)
    return ids, False


def _reference_calls(enc, text: str) -> list[tuple[str, dict]]:
    """openai-harmony's reading of a turn's text (re-encoded with o200k_harmony)."""
    from openai_harmony import Role

    messages = enc.parse_messages_from_completion_tokens(enc.encode(text, allowed_special="all"), Role.ASSISTANT)
    return _expected(messages)[2]


@pytest.mark.parametrize("special", [True, False], ids=["special", "spelled"])
def test_grammar_forces_valid_harmony_calls(tmp_path, enc, special):
    import random

    import jsonschema

    from freetoken_py.server.constraints import ToolChoice, request_grammar

    tok, lltok, n_vocab = _grammar_vocab(tmp_path, special)
    tok.keep_in_text(markup_tokens("harmony"))
    shape = _shape(tok)
    assert (shape.token_of("<|call|>") is not None) == special
    closers = ["<|end|>", "<|return|>", "<|call|>", "<|start|>assistant", "<|channel|>final<|message|>",
               "<|channel|>commentary to=functions.", "get_weather", "goto_line", " <|constrain|>json<|message|>",
               '"', "}", "1", "true", '"c"', '{"city":"Oslo"}', '{"line":3,"force":false}']
    endings = [tok.encode(e) for e in closers]
    rng = random.Random(f"harmony{special}")
    counts = {"required": 0, "named": 0, "auto": 0}
    for mode, name, runs in (("required", None, 12), ("named", "goto_line", 6), ("auto", None, 10)):
        grammar = request_grammar(GRAMMAR_TOOLS, ToolChoice(mode, name), None, shape)
        for _ in range(runs):
            ids, ended = _harmony_walk(grammar.lark, lltok, n_vocab, endings, rng)
            text = tok.decode(ids)
            parsed = collect(_feed([text]))
            for call in parsed.tool_calls:
                jsonschema.validate(json.loads(call.arguments), GRAMMAR_SCHEMAS[call.name])
            counts[mode] += len(parsed.tool_calls)
            if mode != "auto" and ended:   # forced: one call, and openai-harmony reads the same call
                (call,) = parsed.tool_calls
                assert mode != "named" or call.name == "goto_line"
                assert _reference_calls(enc, text) == [(call.name, json.loads(call.arguments))]
                assert not parsed.content.strip() or text.count("<|channel|>commentary<|message|>")
    assert counts["required"] >= 10 and counts["named"] >= 5, counts


def test_grammar_refuses_what_is_not_a_valid_call(tmp_path):
    import llguidance

    from freetoken_py.server.constraints import ToolChoice, request_grammar

    tok, lltok, _ = _grammar_vocab(tmp_path, True)
    shape = _shape(tok)

    def accepts(mode, text, name=None):
        m = llguidance.LLMatcher(lltok, request_grammar(GRAMMAR_TOOLS, ToolChoice(mode, name), None, shape).lark,
                                 log_level=0)
        ids = tok.encode(text)
        return m.validate_tokens(ids) == len(ids)

    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>'
    thought = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant"
    assert accepts("required", call) and accepts("required", thought + call) and accepts("auto", call)
    assert accepts("auto", "<|channel|>final<|message|>Hi!<|return|>")
    assert not accepts("required", "<|channel|>final<|message|>Hi!<|return|>")             # an answer
    assert not accepts("required", call.replace("get_weather", "get_time"))                 # undeclared tool
    assert not accepts("required", call.replace('"Oslo"', "3"))                             # schema-invalid
    assert not accepts("required", call.replace('{"city":"Oslo"}', '{"town":"Oslo"}'))      # missing required
    assert not accepts("named", call, "goto_line")                                          # another tool
    assert not accepts("auto", "<|channel|>analysis<|message|>spelled <|end|> inside")      # a spelled tag
    assert request_grammar(GRAMMAR_TOOLS, ToolChoice("none"), None, shape) is None
    assert request_grammar(None, ToolChoice(), None, shape) is None


def test_grammar_response_format_and_thinking_budget(tmp_path):
    import llguidance
    import numpy as np

    from freetoken_py.server.constraints import ToolChoice, request_grammar

    tok, lltok, n_vocab = _grammar_vocab(tmp_path, True)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    lark = request_grammar(None, ToolChoice(), schema, _shape(tok)).lark
    m = llguidance.LLMatcher(lltok, lark, log_level=0)
    good = tok.encode('<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>'
                      '{"ok":true}<|return|>')
    assert m.validate_tokens(good) == len(good)
    bad = tok.encode('<|channel|>final<|message|>{"ok":1}')
    assert m.validate_tokens(bad) < len(bad)
    # a budget of 3 tokens: after 3 tokens of thought only <|end|> may follow
    lark = request_grammar(None, ToolChoice(), None, _shape(tok, budget=3)).lark
    m = llguidance.LLMatcher(lltok, lark, log_level=0)
    assert m.consume_tokens(tok.encode("<|channel|>analysis<|message|>") + tok.encode(" a b c"))
    allowed = np.flatnonzero(np.frombuffer(m.compute_logit_bias(), np.uint8)[:n_vocab])
    assert list(allowed) == [tok.token_to_id("<|end|>")]


_PIECES = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>", "<|",
           "<|ch", "<|end", "|>", "assistant", "analysis", "final", "commentary", " to=functions.f", " to=python",
           "json", " ", "\n", "hello", "ü€", '{"a": 1}', '{"s": "<|call|>"}', "{bad", "}"]


def test_any_split_of_any_text_gives_the_same_events():
    """Random texts of harmony's pieces, whole and cut anywhere, tools on and off (hypothesis)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=400, deadline=None)
    @given(pieces=st.lists(st.sampled_from(_PIECES), max_size=16), cuts=st.lists(st.integers(0, 300), max_size=10),
           tools=st.booleans())
    def check(pieces, cuts, tools):
        text = "".join(pieces)
        bounds = [0] + sorted({c % (len(text) + 1) for c in cuts}) + [len(text)]
        whole = _merged(_feed([text], tools))
        assert _merged(_feed([text[a:b] for a, b in zip(bounds, bounds[1:])], tools)) == whole
        assert _merged(_feed(list(text), tools)) == whole

    check()
