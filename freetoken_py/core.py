"""Requests, sampling parameters and outputs: the vocabulary shared by llm.py, the scheduler,
the engine and (later) the server."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from freetoken_py.errors import FreetokenError


@dataclass(frozen=True)
class Grammar:
    """A constraint on the generated text, as plain data (the server builds it, the engine
    compiles it: engine/grammar.py). `lark` is llguidance's Lark dialect, where `%json {...}`
    embeds a JSON schema and `<tok>` names a special token; `name` says what it came from
    ("tools:auto", "json_schema", ...) for errors and stats."""
    lark: str
    name: str = "grammar"


MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability and the `top` most likely tokens at its position, best first."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style, over prompt + output
    presence_penalty: float = 0.0  # OpenAI style, over output
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    grammar: Grammar | None = None  # constrained decoding: only tokens the grammar allows are sampled
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), OpenAI's logit_bias
    # log-probabilities, from the model's raw distribution (log-softmax of the logits, before the
    # grammar mask, penalties, temperature and top-k/p filters): None = not computed (no cost);
    # k >= 0 = each token's own and its k most likely alternatives
    logprobs: int | None = None  # of every generated token
    prompt_logprobs: int | None = None  # of every prompt token after the first (bypasses the prefix cache)
    # detokenizer option (as vLLM's skip_special_tokens): special tokens this request keeps in its text,
    # e.g. its chat format's tool-call and reasoning tags, which the server's output parser reads
    keep_special_tokens: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 1 or (self.max_tokens == 0 and self.prompt_logprobs is not None),
             "max_tokens must be >= 1 (0 only with prompt_logprobs: score the prompt, generate nothing)"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be in [0, {MAX_LOGPROBS}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0 (0 disables it)"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (self.grammar is None or isinstance(self.grammar, Grammar), "grammar must be a core.Grammar"),
            (all(-100 <= b <= 100 for _, b in self.logit_bias), "logit_bias values must be in [-100, 100]"),
        ]
        for ok, msg in checks:
            if not ok:
                raise FreetokenError(msg)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"


_ids = itertools.count()


@dataclass
class Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: int = field(default_factory=lambda: next(_ids))
    output_token_ids: list[int] = field(default_factory=list)
    page_table: list[int] = field(default_factory=list)
    state_slot: int | None = None  # hybrids: its recurrent-state slot (kvcache/state.py) while admitted
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    cache_salt: str | None = None  # client-chosen namespace for prefix-cache sharing
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    max_len: int = 0  # prompt + output may not exceed this (context window); set by the scheduler
    generator: object | None = None  # torch.Generator when seeded
    constraint: object | None = None  # engine/grammar.TokenConstraint when params.grammar is set
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token (params.logprobs)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # [None, tok 1, ...] (params.prompt_logprobs)
    # timings (perf_counter seconds)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, pos: int) -> int:
        """all_token_ids[pos] without building the joined list (the decode step's hot path)."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one request (or, when streaming, the state after the latest step)."""
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None = None
    new_text: str = ""  # text added by the latest step (streaming)
    new_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    logprobs: list[TokenLogprob] | None = None  # params.logprobs: one per token of token_ids
    prompt_logprobs: list[TokenLogprob | None] | None = None  # params.prompt_logprobs: [None, ...] per prompt token
    ttft_s: float | None = None
    total_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
