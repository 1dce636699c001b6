"""Engine logprobs (core.TokenLogprob) in OpenAI's two wire shapes, and the request fields that ask
for them. The values are the model's raw distribution (engine/sampler.py): log-softmax of the
logits before the grammar mask, penalties, temperature and top-k/top-p (vLLM's default).

Token strings are each token decoded alone (special tokens kept); a token holding part of a UTF-8
character decodes to U+FFFD, and its `bytes` are those of that string."""
from __future__ import annotations

from freetoken_py.core import MAX_LOGPROBS, TokenLogprob
from freetoken_py.server.protocol import bad, get


class TokenText:
    """id -> its text, memoised per response (the same ids recur in every top-k list)."""

    def __init__(self, tokenizer):
        self.tok, self.memo = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        if token_id not in self.memo:
            self.memo[token_id] = self.tok.decode([token_id], skip_special_tokens=False) if self.tok else str(token_id)
        return self.memo[token_id]


def chat_fields(body: dict) -> int | None:
    """`logprobs` (bool) and `top_logprobs` (0..20) -> SamplingParams.logprobs (None: not asked)."""
    on = get(body, "logprobs", bool, False)
    top = get(body, "top_logprobs", int, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not on:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if on else None


def chat_content(entries: list[TokenLogprob], text: TokenText) -> list[dict]:
    """choices[].logprobs.content: one item per generated token, with its `top` alternatives."""
    def item(tid: int, lp: float) -> dict:
        s = text(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]} for e in entries]


def chat_logprobs(entries: list[TokenLogprob] | None, text: TokenText) -> dict | None:
    return None if entries is None else {"content": chat_content(entries, text), "refusal": None}


def completion_logprobs(token_ids: list[int], entries: list[TokenLogprob | None], text: TokenText,
                        offset: int = 0) -> dict:
    """choices[].logprobs of /v1/completions, parallel lists over `token_ids`; a None entry (an
    echoed prompt's first token) has null logprobs. `top_logprobs` holds the k best and the token
    itself (so up to k + 1, as OpenAI documents); `text_offset` counts characters from `offset`."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, e in zip(token_ids, entries):
        s = text(tid)
        out["tokens"].append(s)
        out["text_offset"].append(offset)
        offset += len(s)
        out["token_logprobs"].append(None if e is None else e.logprob)
        if e is None:
            out["top_logprobs"].append(None)
        else:
            top = {text(t): v for t, v in e.top}
            top.setdefault(s, e.logprob)
            out["top_logprobs"].append(top)
    return out
