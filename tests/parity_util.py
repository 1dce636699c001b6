"""Shared by the family parity tests (test_mla_models.py, test_hybrid_models.py): a module-scoped
checkpoint cache, seeded random prompts, and a driver that records the engine's logits at every
sampled position (prefill in max_num_batched_tokens chunks, then cached decode steps)."""
from __future__ import annotations

import pytest
import torch


def checkpoint_cache(build):
    """A module-scoped fixture `make(name) -> path`, building each arch once with `build(name, dir)`."""
    built: dict = {}

    @pytest.fixture(scope="module")
    def ckpt(tmp_path_factory):
        def make(name: str):
            if name not in built:
                built[name] = build(name, tmp_path_factory.mktemp(name))
            return built[name]
        return make
    return ckpt


def random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def drive(llm, prompt: list[int], num_decode: int):
    """Greedy tokens and the logits of each sampled position: the prefill's last (a chunked prefill
    samples nothing until its last chunk) then `num_decode` cached decode steps."""
    from freetoken_py.core import SamplingParams

    req = llm.add_request(prompt, SamplingParams(max_tokens=num_decode + 1, temperature=0, ignore_eos=True))
    steps = []
    while len(req.output_token_ids) <= num_decode:
        logits = llm.runner.forward_batch(llm.scheduler.schedule())
        if len(logits):
            steps.append(logits[0])
            req.output_token_ids.append(int(logits[0].argmax()))
    return req.output_token_ids, torch.stack(steps)
