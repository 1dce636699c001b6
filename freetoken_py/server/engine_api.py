"""What the HTTP layer uses of the engine, declared: the server holds an `EngineAPI` and reaches
nothing else of it (tests/test_layering.py checks every `llm.<name>` in server/ against this list,
and that `LLM` provides each). `LLM` (llm.py) is the implementation; serve.py's loader is the one
place that imports it. Calls other than the read-only attributes run on the engine thread
(server/async_engine.py), except `encode_prompt` and `default_sampling`, which touch no engine
state. Per-request detokenizer options travel in `SamplingParams.keep_special_tokens`: nothing
here changes shared tokenizer state.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from freetoken_py.config import EngineConfig
    from freetoken_py.core import Request, RequestOutput, SamplingParams
    from freetoken_py.tokenizer import Tokenizer


@runtime_checkable
class EngineAPI(Protocol):
    # read-only after load
    tokenizer: Tokenizer | None   # chat templates, prompt text, token texts (never mutated by the server)
    args: object                  # the model's ModelArgs: model_type, vocab_size
    config: EngineConfig          # max_num_seqs
    max_model_len: int

    @property
    def kv_capacity_tokens(self) -> int: ...

    @property
    def unused_gpu(self) -> bool: ...

    # the request loop (engine thread)
    @property
    def has_unfinished(self) -> bool: ...

    @property
    def idle_work(self) -> bool: ...

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    cache_salt: str | None = None, after: Request | None = None) -> Request: ...

    def abort(self, req: Request) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def idle(self) -> int: ...

    def stats(self) -> dict: ...

    # no engine state
    def encode_prompt(self, prompt: str | list[int]) -> list[int]: ...

    def default_sampling(self, **overrides) -> SamplingParams: ...
