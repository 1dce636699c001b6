"""The offline facade: load a model, add requests, step the engine, read outputs.

`LLM` loads through the load pipeline (loading/: a finished `LoadedModel`), builds the `Engine`
over it (engine/engine.py: scheduler, runner, caches, memory planning, start-up passes, the loop)
and adds what text brings: prompts and chats as token ids, generate / stream, sampling defaults.
`freetoken run`, the server (through `server/engine_api.EngineAPI`), the benches and the tests use it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import torch

from freetoken_py.config import EngineConfig
from freetoken_py.core import Request, RequestOutput, SamplingParams
from freetoken_py.engine.engine import Engine
from freetoken_py.engine.warmup import CORPUS_DIR, KV_CALIBRATION_TOKENS  # noqa: F401  (old import path)
from freetoken_py.errors import FreetokenError
from freetoken_py.loading import load
from freetoken_py.residency.kv_split import KV_RESPLIT_STEPS  # noqa: F401  (the constant: old import path)

GPU_HINT = ("freetoken: a CUDA GPU is visible but unused (the model runs on the host); "
            "--gpu-experts puts the dense weights, the KV cache and the expert tiers on it")

# the engine's parts and sizes as callers (tests, benches, the CLI) read them through the facade
ENGINE_ATTRS = frozenset({
    "model", "runner", "allocator", "prefix_cache", "snapshots", "snapshot_every", "tracker", "scheduler",
    "residency", "kv_split", "routing_recorder", "memory", "kv_dtype", "kv_calibration", "kv_bytes_per_token",
    "state_bytes_per_request", "spare_state_slots", "grammar_compiler", "calibration_ids", "calibrate_kv",
    "_page_bytes", "_namespace_base", "_cache_namespace", "_streams"})


class LLM:
    def __init__(self, model: str | Path, **overrides):
        self.config = EngineConfig(model=str(model), **overrides)
        self.loaded = load(self.config)   # checkpoint -> format -> placement -> tokenizer, defaults
        self.backend, self.args, self.tokenizer = self.loaded.backend, self.loaded.args, self.loaded.tokenizer
        self.generation = self.loaded.generation
        self.engine = Engine(self.config, self.loaded)
        self.max_model_len = self.engine.max_model_len

    def __getattr__(self, name: str):
        """The engine's parts named in ENGINE_ATTRS, read through (only those)."""
        if name in ENGINE_ATTRS and "engine" in self.__dict__:
            return getattr(self.engine, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def unused_gpu(self) -> bool:
        """A CUDA GPU is visible but this engine runs without it (the residency tiers are off)."""
        return self.config.residency == "off" and torch.cuda.is_available()

    def save_routing(self) -> None:
        """Write the recorded routing trace to `config.record_routing` (no-op when not recording)."""
        recorder = self.engine.routing_recorder
        if recorder is not None:
            try:
                recorder.trace.save(self.config.record_routing)
            except OSError as exc:
                raise FreetokenError(f"--record-routing {self.config.record_routing}: {exc.strerror}") from None

    # ---- sizes and state ------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        return self.engine.kv_capacity_tokens

    @property
    def kv_return_after_steps(self) -> int:
        """Steps of low use before a grown KV cache goes back to its start-up size (`KvSlotSplit`)."""
        return self.engine.kv_split.return_after_steps

    @kv_return_after_steps.setter
    def kv_return_after_steps(self, steps: int) -> None:
        self.engine.kv_split.return_after_steps = steps

    def stats(self) -> dict:
        """A snapshot of the engine's state, as plain values: KV pages (total, free, held by the
        prefix cache, tokens per page), FP8 KV values clipped, requests running / waiting, and
        with the residency tiers on their telemetry (totals and per layer) and slot count under
        "residency". Call it where steps run (between steps): the counts are then consistent."""
        return self.engine.stats()

    # ---- requests -----------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise FreetokenError("this model directory has no tokenizer.json; pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def chat_prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        if self.tokenizer is None:
            raise FreetokenError("this model directory has no tokenizer.json; chat needs one")
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, tools=tools))

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    cache_salt: str | None = None, after: Request | None = None) -> Request:
        """`after`: a request with the same prompt (n > 1 completions): this one waits until that
        one's prompt is computed and published, then takes its pages from the prefix cache
        instead of computing the prompt again."""
        return self.engine.add_request(self.encode_prompt(prompt), params, cache_salt, after)

    def abort(self, req: Request) -> None:
        self.engine.abort(req)

    def default_sampling(self, **overrides) -> SamplingParams:
        """generation_config.json's sampling defaults, overridden by explicit (non-None) values."""
        values = dict(self.generation.sampling)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return dataclasses.replace(SamplingParams(), **values)

    # ---- the loop -----------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished

    @property
    def idle_work(self) -> bool:
        """`idle()` has something to do: the KV cache is above its start-up size."""
        return self.engine.idle_work

    def idle(self) -> int:
        """Nothing to run (a server between requests): a KV cache grown into expert-slot memory
        goes back to its start-up size now. Returns the pages given back."""
        return self.engine.idle()

    def step(self) -> list[RequestOutput]:
        """One engine iteration. Returns an output for each request that produced a token."""
        return self.engine.step()

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        final: dict[int, RequestOutput] = {}
        while any(not r.finished for r in reqs):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r.request_id] for r in reqs]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        req = self.add_request(prompt, params)
        try:
            while not req.finished:
                for out in self.step():
                    if out.request_id == req.request_id:
                        yield out
        finally:
            self.abort(req)
