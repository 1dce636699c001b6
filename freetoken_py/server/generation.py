"""What both APIs do between "validated request" and "engine stream": render the chat template,
build SamplingParams, choose the output parser, and fold a whole generation for non-streamed
responses."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from freetoken_py.core import SamplingParams
from freetoken_py.errors import FreetokenError
from freetoken_py.server.async_engine import AsyncEngine
from freetoken_py.server.engine_api import EngineAPI
from freetoken_py.server.protocol import ApiError, bad, clamp_max_tokens, fix_sampling
from freetoken_py.server.sse import Final, engine_events, until_disconnect
from freetoken_py.server.toolcalls import (
    OutputParser,
    ParsedOutput,
    detect_reasoning,
    detect_tool_format,
    make_parser,
    markup_tokens,
)
from freetoken_py.server.toolcalls import collect as collect_events


@dataclass
class Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    tool_format: str = "none"
    reasoning: bool | str = False
    tools: list[dict] | None = None

    def parser(self) -> OutputParser:
        # raises UnsupportedToolFormat (a FreetokenError -> 400) for tools on an unsupported family
        return make_parser(self.tool_format, self.reasoning, self.tools is not None, self.tools)


def render_chat(llm: EngineAPI, messages: list[dict], tools: list[dict] | None,
                template_kwargs: dict | None = None) -> tuple[list[int], bool | str]:
    """Prompt ids and the reasoning mode: "open" when the template itself opened a <think> block,
    False when it closed one (thinking switched off), else whether the template knows <think>.
    `template_kwargs` (e.g. enable_thinking) are variables the template reads. Late system
    messages (chat.py marks them) are placed as `late_system_mode` says for this template."""
    tok = llm.tokenizer
    if tok is None or not tok.chat_template:
        raise FreetokenError("this model has no chat template; use /v1/completions with a plain prompt")
    text = render_text(tok, messages, tools, template_kwargs)
    reasoning = detect_reasoning(tok.chat_template)
    if reasoning and text.rstrip().endswith("<think>"):
        reasoning = "open"
    elif reasoning and text.rstrip().endswith("</think>"):
        reasoning = False  # the template closed the thought (thinking off: DeepSeek-V3.2, GLM-5): the answer follows
    return tok.encode(text), reasoning


def render_text(tok, messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None = None,
                add_generation_prompt: bool = True) -> str:
    """The template's text, late system messages placed so that earlier text stays the same."""
    kwargs = dict(template_kwargs or {}, add_generation_prompt=add_generation_prompt)
    mode = late_system_mode(tok) if any(m.get("late") for m in messages) else "none"
    if mode != "merge":
        try:
            return tok.apply_chat_template(place_late_system(messages, mode), tools=tools, **kwargs)
        except FreetokenError:
            if mode == "none":
                raise
    return tok.apply_chat_template(place_late_system(messages, "merge"), tools=tools, **kwargs)


def place_late_system(messages: list[dict], mode: str) -> list[dict]:
    """Late system messages as `system` messages in place, as `user` messages in place, or
    ("merge", the last resort) appended to the leading system message."""
    out, merged = [], []
    for m in messages:
        if not m.get("late"):
            out.append(m)
        elif mode == "merge":
            merged.append(m["content"])
        else:
            out.append({"role": "system" if mode in ("system", "none") else "user", "content": m["content"]})
    if merged:
        if out and out[0]["role"] == "system":
            out[0] = dict(out[0], content="\n\n".join([out[0]["content"], *merged]))
        else:
            out.insert(0, {"role": "system", "content": "\n\n".join(merged)})
    return out


_LATE_MODE: dict[str, str] = {}


def late_system_mode(tok) -> str:
    """"system" when the template writes a system message after the conversation started in
    place (the text before it unchanged), else "user" when a user message there renders, else
    "merge". Probed once per template with marker texts."""
    template = tok.chat_template
    if template not in _LATE_MODE:
        head = [{"role": "system", "content": "SYS-0"}, {"role": "user", "content": "USER-1"},
                {"role": "assistant", "content": "ASSIST-2"}]
        _LATE_MODE[template] = "merge"
        for mode in ("system", "user"):
            try:
                plain = tok.apply_chat_template(head + [{"role": "user", "content": "USER-4"}])
                late = tok.apply_chat_template(head + [{"role": mode, "content": "LATE-3"},
                                                       {"role": "user", "content": "USER-4"}])
            except FreetokenError:
                continue
            k = plain.find("ASSIST-2") + len("ASSIST-2")
            if k >= len("ASSIST-2") and plain[:k] == late[:k] and "LATE-3" in late[k:]:
                _LATE_MODE[template] = mode
                break
    return _LATE_MODE[template]


async def prepare_chat(llm: EngineAPI, engine: AsyncEngine, messages: list[dict], tools: list[dict] | None,
                       sampling: dict, max_tokens: int | None, stop: tuple[str, ...],
                       template_kwargs: dict | None = None, template_tools: list[dict] | None | bool = True
                       ) -> Prepared:
    """`tools` are the ones the model may call; `template_tools` the ones the template lists (the
    same unless given: Anthropic's loaded deferred tools are written where they were loaded)."""
    # template rendering + tokenizing a long conversation takes milliseconds: off the event loop
    rendered = tools if template_tools is True else template_tools
    ids, reasoning = await asyncio.to_thread(render_chat, llm, messages, rendered, template_kwargs)
    engine.check_prompt(len(ids))
    tool_format = detect_tool_format(llm.tokenizer.chat_template, llm.args.model_type)
    # the parser's tags survive detokenizing: this request's own option, not the shared tokenizer's
    params = make_params(llm, engine, sampling, max_tokens, stop, len(ids),
                         keep_special_tokens=markup_tokens(tool_format))
    prep = Prepared(ids, params, tool_format, reasoning, tools)
    prep.parser()  # fail now (400) rather than after the headers went out
    return prep


def make_params(llm: EngineAPI, engine: AsyncEngine, sampling: dict, max_tokens: int | None, stop: tuple[str, ...],
                num_prompt_tokens: int, **extra) -> SamplingParams:
    limit = engine.context_limit
    if max_tokens is not None and max_tokens >= limit:
        raise bad(f"max_tokens is {max_tokens}, but the context limit is {limit} tokens (prompt and output "
                  f"together); ask for at most {limit - 1}", "max_tokens")
    budget = clamp_max_tokens(max_tokens, num_prompt_tokens, limit)
    values = {k: v for k, v in fix_sampling(sampling).items() if v is not None}
    try:
        return llm.default_sampling(max_tokens=budget, stop=stop, **values, **extra)
    except FreetokenError as exc:
        raise bad(str(exc)) from None


@dataclass
class Collected:
    """A whole generation, folded: what non-streamed responses are built from."""
    parsed: ParsedOutput = field(default_factory=ParsedOutput)
    final: Final | None = None


async def collect(engine: AsyncEngine, stream, parser: OutputParser, ping_s: float) -> Collected:
    events, final = [], None
    async for ev in engine_events(engine, stream, parser, ping_s):
        if isinstance(ev, Final):
            final = ev
        elif ev is not None:
            events.append(ev)
    return Collected(collect_events(events), final)


async def collect_or_disconnect(receive, st, stream, parser: OutputParser) -> Collected | None:
    """A non-streamed response: the whole generation, or None when the client hung up first (the
    request is then aborted and its pages freed). A generation that ended in error raises it."""
    work = asyncio.ensure_future(collect(st.engine, stream, parser, st.limits.ping_interval_s))
    got = await until_disconnect(receive, work, lambda: st.engine.abort(stream))
    if got is not None and got.final.error:
        raise stream_error(got.final)
    return got


async def collect_all_or_disconnect(receive, st, streams: list, parsers: list) -> list[Collected] | None:
    """`collect_or_disconnect` for the n choices of one request (n > 1): all of them, or None
    when the client hung up first (every one is then aborted)."""
    ping = st.limits.ping_interval_s
    work = asyncio.ensure_future(asyncio.gather(*(collect(st.engine, s, p, ping) for s, p in zip(streams, parsers))))
    got = await until_disconnect(receive, work, lambda: [st.engine.abort(s) for s in streams])
    for g in got or []:
        if g.final.error:
            raise stream_error(g.final)
    return got


def stream_error(final: Final) -> ApiError:
    """The error that ended a generation, as an HTTP error (shutdown -> 503, else 500)."""
    status = 503 if final.error.kind == "overloaded" else 500
    return ApiError(status, final.error.message, "overloaded" if status == 503 else "api")
