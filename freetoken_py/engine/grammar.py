"""Grammar-constrained decoding with llguidance.

A request's `core.Grammar` (plain data the server builds, see server/constraints.py) is compiled
against the model's tokenizer into a `TokenConstraint`, which the sampler asks for the allowed
tokens before each sample (`apply`) and advances with each sampled token (`advance`). The
constraint follows the request's output tokens, not the engine's passes: a recompute after
preemption keeps the output tokens and the matcher's state with them; should the output ever
differ from what the matcher consumed, `apply` resets it and replays the output first.

llguidance is chosen over xgrammar by bench/grammar_cost.py (docs/server.md): its matcher is
built lazily per request (no per-schema compile step for the tools each request brings) and its
mask per token is cheaper on this machine's CPU.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from freetoken_py.core import Grammar
from freetoken_py.errors import FreetokenError


class GrammarCompiler:
    """One per engine: the tokenizer as llguidance sees it (built once, ~0.1-1 s)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
        import llguidance

        self._llg = llguidance
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=self.eos_token_ids or None)

    @classmethod
    def from_model_dir(cls, model_dir: Path, vocab_size: int, eos_token_ids: list[int]) -> "GrammarCompiler":
        path = Path(model_dir) / "tokenizer.json"
        if not path.exists():
            raise FreetokenError(f"{model_dir}: constrained decoding needs tokenizer.json")
        return cls(path.read_text(encoding="utf-8"), vocab_size, eos_token_ids)

    def matcher(self, grammar: Grammar) -> "TokenConstraint":
        """A fresh constraint for one request; a grammar llguidance refuses is a FreetokenError."""
        m = self._llg.LLMatcher(self.tokenizer, grammar.lark, log_level=0)
        if m.is_error():
            raise FreetokenError(f"grammar ({grammar.name}) is invalid: {m.get_error()}")
        return TokenConstraint(m, self.vocab_size, self.eos_token_ids[0] if self.eos_token_ids else 0)


class TokenConstraint:
    """The per-request matcher and how many output tokens it has consumed."""

    def __init__(self, matcher, vocab_size: int, eos_token_id: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.num_consumed = 0
        self.num_resets = 0   # replays after the output changed under it (tests read it)

    def sync(self, output_token_ids: list[int]) -> None:
        """Make the matcher's state the one after `output_token_ids` (reset + replay if not)."""
        if self.num_consumed == len(output_token_ids):
            return
        self.matcher.reset()
        self.num_resets += 1
        if output_token_ids:
            self.matcher.consume_tokens(list(output_token_ids))
        self.num_consumed = len(output_token_ids)

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next; EOS alone when nothing is (the grammar
        is done or the matcher failed), so the request ends instead of sampling at random."""
        if self.matcher.is_stopped() or self.matcher.is_error():
            return self._only_eos()
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[:self.vocab_size].astype(bool))   # [V]
        return allowed if bool(allowed.any()) else self._only_eos()

    def _only_eos(self) -> torch.Tensor:
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        allowed[self.eos_token_id] = True
        return allowed

    def apply(self, logits: torch.Tensor, output_token_ids: list[int]) -> torch.Tensor:
        """logits: [V] fp32 -> a copy with every token the grammar forbids at -inf."""
        self.sync(output_token_ids)
        allowed = self.allowed()
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def advance(self, token: int) -> None:
        self.matcher.consume_token(int(token))   # a refused token puts the matcher in its error state
        self.num_consumed += 1
