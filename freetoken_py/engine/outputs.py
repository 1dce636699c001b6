"""Per-request text state and the `RequestOutput`s the engine hands out: incremental
detokenization (with the request's own detokenizer options), stop strings, what text is visible."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from freetoken_py.core import FinishReason, Request, RequestOutput
from freetoken_py.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class TextStream:
    """Per-request text state: detokenizer plus how much text has been handed out."""
    detok: IncrementalDetokenizer | None
    emitted: int = 0
    new_token_ids: list[int] = field(default_factory=list)


class OutputProcessor:
    """Owns each live request's `TextStream`; turns sampled tokens into stop decisions and outputs.
    Finishing a request in the scheduler is the caller's (the engine's) part."""

    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.streams: dict[int, TextStream] = {}

    def open(self, req: Request) -> None:
        """The request's detokenizer, with its own options: `params.keep_special_tokens` are kept
        in its text on top of the tokenizer's defaults (the shared tokenizer is not changed)."""
        tok = self.tokenizer
        keep = tok.special_ids(req.params.keep_special_tokens) if tok is not None else frozenset()
        detok = IncrementalDetokenizer(tok, req.prompt_token_ids, keep=keep) if tok is not None else None
        self.streams[req.request_id] = TextStream(detok)

    def close(self, request_id: int) -> None:
        self.streams.pop(request_id, None)

    def on_token(self, req: Request, token: int) -> None:
        """Append a sampled token and decide stop (EOS, stop token or string) / length."""
        now = time.perf_counter()
        req.output_token_ids.append(token)
        req.first_token_time = req.first_token_time or now
        st = self.streams[req.request_id]
        st.new_token_ids.append(token)
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            req.finish_reason = FinishReason.STOP
            req.stop_reason = token if token in p.stop_token_ids else None
        else:
            if st.detok is not None:
                st.detok.push(token)
            _check_stop_strings(req, st)
        if req.finish_reason is None and (len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= req.max_len):
            req.finish_reason = FinishReason.LENGTH
        if req.finished:
            req.finish_time = now

    def output(self, req: Request) -> RequestOutput:
        st = self.streams[req.request_id]
        text = st.detok.text if st.detok else ""
        visible = len(text)
        if not req.finished and req.params.stop:  # hold back what could be the start of a stop string
            visible = max(st.emitted, len(text) - max(map(len, req.params.stop)) + 1)
        new_text, st.emitted = text[st.emitted:visible], visible
        new_ids, st.new_token_ids = st.new_token_ids, []
        if req.finished:
            self.streams.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, token_ids=list(req.output_token_ids),
            text=text[:visible], finish_reason=req.finish_reason.value if req.finished else None,
            stop_reason=req.stop_reason, new_text=new_text, new_token_ids=new_ids,
            num_cached_tokens=req.num_cached_tokens,
            logprobs=req.logprobs if req.params.logprobs is not None else None,
            prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs is not None else None,
            ttft_s=(req.first_token_time - req.arrival_time) if req.first_token_time else None,
            total_s=(req.finish_time - req.arrival_time) if req.finish_time else None)


def _check_stop_strings(req: Request, st: TextStream) -> None:
    if not req.params.stop or st.detok is None:
        return
    text = st.detok.text
    longest = max(map(len, req.params.stop))
    window_start = max(0, st.emitted - longest)
    hits = [(text.find(s, window_start), s) for s in req.params.stop]
    hits = [(i, s) for i, s in hits if i >= 0]
    if hits:
        i, s = min(hits)
        st.detok.text = text[:i]
        req.finish_reason, req.stop_reason = FinishReason.STOP, s
