"""The engine under the `LLM` facade: one loaded model, its caches and the request loop.

`Engine.step()` is nano-vllm's loop: schedule -> forward_batch -> sample -> postprocess (stop
conditions, detokenization: engine/outputs.py). The engine owns the scheduler, the runner, the
caches (page allocator, radix prefix cache, recurrent-state snapshots, page tags), memory planning
(engine/memory.py: KV pages, snapshot slots; residency/kv_split.py: the KV/slot trade while
running), the out-of-memory policy of a forward, and the start-up passes (engine/warmup.py: FP8 KV
calibration, kernel warm-up). It takes token ids; text in (prompts, chat) is the facade's.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from freetoken_py.config import EngineConfig
from freetoken_py.core import FinishReason, Request, RequestOutput, SamplingParams
from freetoken_py.engine import warmup
from freetoken_py.engine.memory import kv_dtype_of, plan_memory
from freetoken_py.engine.outputs import OutputProcessor
from freetoken_py.engine.runner import ModelRunner, ScheduledChunk
from freetoken_py.engine.sampler import logprobs_of, sample
from freetoken_py.engine.stats import engine_stats
from freetoken_py.errors import ContextLengthError, FreetokenError
from freetoken_py.kvcache import PageAllocator
from freetoken_py.kvcache.radix import RadixCache
from freetoken_py.kvcache.tags import IntegrityTracker, NullTracker
from freetoken_py.loading import LoadedModel, attach_tiers
from freetoken_py.residency.kv_split import KvSlotSplit
from freetoken_py.scheduler.scheduler import Scheduler

SCORE_ROWS = 256   # prompt logprobs: rows per log_softmax (its copy stays small next to the step's logits)


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel):
        self.config, self.loaded, self.backend = config, loaded, loaded.backend
        self.model, self.args, self.tokenizer = loaded.model, loaded.args, loaded.tokenizer
        self.generation = loaded.generation
        self.max_model_len = config.max_model_len or self.args.max_position_embeddings
        self.kv_dtype = kv_dtype_of(config, loaded.kv_dtype)
        plan = plan_memory(config, loaded.paged_specs(), loaded.state_specs(), self.kv_dtype, self.max_model_len,
                           self.model.device.type == "cuda")
        self.memory, self._page_bytes = plan, plan.page_bytes
        self.runner = ModelRunner(self.model, plan.num_pages, config.page_size, self.kv_dtype,
                                  state_slots=config.max_num_seqs + plan.snapshot_slots, window_pages=plan.window_pages)
        self.residency = attach_tiers(loaded, config)   # after the KV cache: on a GPU the slots take what is left
        self._build_caches(plan)
        self.outputs = OutputProcessor(self.tokenizer, self.generation.eos_token_ids)
        self._idle_tried = False     # idle() ran since the last step
        self._deferred: list[tuple[Request, Request]] = []  # (request, the sibling whose prompt it waits for)
        self._grammar_compiler = None   # engine/grammar.GrammarCompiler, on the first constrained request
        self.kv_calibration = warmup.calibrate_kv_at_start(self)   # where the FP8 scales came from (fp8 only)
        warmup.warm_kernels(self)
        self.routing_recorder = self._attach_recorder()

    def _build_caches(self, plan) -> None:
        c = self.config
        self.allocator = PageAllocator(plan.num_pages)
        self.prefix_cache = RadixCache(self.allocator, c.page_size) if c.enable_prefix_cache else None
        self.snapshots, states = self._prefix_states(plan.snapshot_slots)
        self.tracker = (IntegrityTracker if c.kv_integrity_check else NullTracker)(self.allocator)
        self._model_identity = self._identity(Path(c.model))
        self._namespace_base: tuple | None = None
        self.scheduler = Scheduler(self.allocator, c.page_size, c.max_num_seqs, c.max_num_batched_tokens,
                                   self.prefix_cache, self._cache_namespace, self.tracker,
                                   more_pages=self._more_pages if self.residency is not None else None,
                                   state_pool=self.runner.states, states=states,
                                   windows=self.runner.cache.windows)   # windowed layers' pages (kvcache/window.py)
        # the residency tiers run on the torch backend: no fused CPU decoder holds views of the
        # KV tensors that _more_pages / _return_pages reallocate
        assert self.residency is None or self.runner.fused is None
        # the KV/slot memory trade, re-decided while running (residency/kv_split.py)
        self.kv_split = (KvSlotSplit(self.residency, self.allocator, self.runner, self.scheduler, self._page_bytes,
                                     self.model.device.type == "cuda") if self.residency is not None else None)

    def _prefix_states(self, snapshot_slots: int):
        """Hybrids with the prefix cache: the snapshot store and the scheduler's reuse policy
        (scheduler/prefix_state.py); (None, None) otherwise (a hybrid then takes no prefix hits)."""
        if not snapshot_slots or self.prefix_cache is None:
            return None, None
        from freetoken_py.kvcache.snapshots import SnapshotStore, snapshot_every_pages
        from freetoken_py.scheduler.prefix_state import PrefixStateReuse

        ps = self.config.page_size
        store = SnapshotStore(self.runner.states, snapshot_slots, check=self.config.kv_integrity_check)
        self.prefix_cache.snapshots = store
        every = self.config.snapshot_every_pages or snapshot_every_pages(store.bytes_per_snapshot,
                                                                         self.kv_bytes_per_token, ps)
        self.snapshot_every = every
        return store, PrefixStateReuse(self.prefix_cache, store, ps, every, in_layer=self.loaded.snapshots_in_layer)

    def _attach_recorder(self):
        if not self.config.record_routing:
            return None
        from freetoken_py.residency.stats import RoutingRecorder, route_predictors

        a = self.args
        # with the routers (and their choice rule), each step also records the look-ahead prediction the prefetch makes
        routers = route_predictors(self.model)
        self.model.experts = RoutingRecorder(self.model.experts, a.num_layers, a.num_experts, a.top_k,
                                             source=str(self.config.model), routers=routers)
        return self.model.experts

    # ---- prefix cache namespace -----------------------------------------------------------
    def _identity(self, model_dir: Path) -> tuple:
        """Everything about the weights that changes K/V content."""
        files = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(model_dir.glob("*.safetensors")))
        c = self.config
        return (str(model_dir.resolve()), files, self.backend, str(self.model.dtype), c.expert_dtype, c.dense_dtype,
                c.expert_group_size, c.residency, c.prefill_expert_dtype)

    def _cache_namespace(self, req: Request):
        """Cache key namespace: model identity, KV dtype and scales, client salt. None = not cacheable
        (FP8 scales not calibrated yet; the constructor does that), and a request asking for prompt
        logprobs: every prompt position's logits must be computed."""
        if req.params.prompt_logprobs is not None:
            return None
        if self._namespace_base is None:  # fixed once the scales are (they never change after)
            scales = self.runner.cache.scales_fingerprint()
            if scales is None:
                return None
            self._namespace_base = (self._model_identity, scales)
        return (self._namespace_base, req.cache_salt)

    def forget_namespace(self) -> None:
        """The FP8 scales are being calibrated again: the namespace is fixed anew from them."""
        self._namespace_base = None

    def calibration_ids(self, num_tokens: int = warmup.KV_CALIBRATION_TOKENS) -> tuple[list[int], str]:
        return warmup.calibration_ids(self, num_tokens)

    def calibrate_kv(self, token_ids: list[int]) -> None:
        warmup.calibrate_kv(self, token_ids)

    # ---- sizes ------------------------------------------------------------------------------
    def spare_state_slots(self) -> int:
        """Recurrent-state slots beyond max_num_seqs: the prefix-state snapshots' (hybrids)."""
        return self.memory.snapshot_slots

    @property
    def state_bytes_per_request(self) -> int:
        """Fixed-size state one request holds (a hybrid's conv + recurrent state over its linear
        layers, fp32), measured from the pool; 0 for models without recurrent layers."""
        return self.runner.states.bytes_per_slot if self.runner.states is not None else 0

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token takes across every layer, measured from the pool (MLA: latent + rope key)."""
        return self.runner.cache.bytes_per_token

    @property
    def kv_capacity_tokens(self) -> int:
        return self.allocator.num_pages * self.config.page_size

    @property
    def context_limit(self) -> int:
        return min(self.max_model_len, self.kv_capacity_tokens)

    def stats(self) -> dict:
        """A snapshot of the engine's state, as plain values (engine/stats.py)."""
        return engine_stats(self)

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, ids: list[int], params: SamplingParams | None = None, cache_salt: str | None = None,
                    after: Request | None = None) -> Request:
        """`after`: a request with the same prompt (n > 1 completions): this one waits until that
        one's prompt is computed and published, then takes its pages from the prefix cache
        instead of computing the prompt again."""
        params = params or SamplingParams()
        self._check_prompt(ids, params)
        req = Request(ids, params, arrival_time=time.perf_counter(), cache_salt=cache_salt)
        req.max_len = min(self.context_limit, len(ids) + params.max_tokens)
        if params.seed is not None:
            req.generator = torch.Generator().manual_seed(params.seed)
        if params.grammar is not None:
            req.constraint = self.grammar_compiler.matcher(params.grammar)
        self.outputs.open(req)
        if after is not None and not _prompt_done(after):
            self._deferred.append((req, after))
        else:
            self.scheduler.add(req)
        return req

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise FreetokenError("the prompt is empty")
        if any(not 0 <= t < self.args.vocab_size for t in ids):
            raise FreetokenError(f"prompt token ids must be in [0, {self.args.vocab_size})")
        limit = self.context_limit
        if len(ids) >= limit:
            raise ContextLengthError(
                f"prompt has {len(ids)} tokens but the context limit is {limit} "
                f"(model {self.max_model_len}, KV cache {self.kv_capacity_tokens}); shorten the prompt "
                "or raise --max-model-len / --kv-cache-gb")
        if params.stop and self.tokenizer is None:
            raise FreetokenError("stop strings need a tokenizer")

    def _admit_deferred(self) -> None:
        """Requests waiting for a sibling's prompt go to the scheduler once it is computed (and
        its pages published: publish_prompts runs after the forward that completes it)."""
        if self._deferred:
            ready = [(r, a) for r, a in self._deferred if _prompt_done(a)]
            self._deferred = [(r, a) for r, a in self._deferred if not _prompt_done(a)]
            for req, _ in ready:
                self.scheduler.add(req)

    @property
    def grammar_compiler(self):
        """The tokenizer as the grammar library sees it, built on the first constrained request."""
        if self._grammar_compiler is None:
            from freetoken_py.engine.grammar import GrammarCompiler

            self._grammar_compiler = GrammarCompiler.from_model_dir(
                Path(self.config.model), self.args.vocab_size, list(self.generation.eos_token_ids))
        return self._grammar_compiler

    def abort(self, req: Request) -> None:
        self.outputs.close(req.request_id)
        waiting = [(r, a) for r, a in self._deferred if r is not req]
        if not req.finished:
            req.finish_reason = FinishReason.ABORT
            req.finish_time = time.perf_counter()
            if len(waiting) == len(self._deferred):   # a deferred one holds nothing yet
                self.scheduler.finish(req)
        self._deferred = waiting

    # ---- the loop -----------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._deferred)

    @property
    def idle_work(self) -> bool:
        """`idle()` has something to do: the KV cache is above its start-up size (and no try
        failed since the last step)."""
        return self.kv_split is not None and self.kv_split.grown and not self._idle_tried

    def idle(self) -> int:
        """Nothing to run (a server between requests): a KV cache grown into expert-slot memory
        goes back to its start-up size now, not after `kv_return_after_steps` steps of the next
        request (the prefix cache's pages move below that size). Returns the pages given back."""
        if not self.idle_work or self.has_unfinished:
            return 0
        self._idle_tried = True                      # once per idle spell, whatever happens
        sp = self.kv_split
        sp.idle_steps = max(sp.idle_steps, sp.return_after_steps - 1)
        return sp.return_pages()

    def step(self) -> list[RequestOutput]:
        """One engine iteration. Returns an output for each request that produced a token."""
        self._idle_tried = False
        if self.kv_split is not None and self.kv_split.grown:
            self.kv_split.return_pages()
        self._admit_deferred()
        chunks = self.scheduler.schedule()
        aborted = self._check_integrity()  # after scheduling: covers the pages this step just allocated
        chunks = [c for c in chunks if not c.req.finished]
        if not chunks:
            if self.scheduler.has_work and not aborted:
                raise FreetokenError("KV cache too small to make progress; raise --kv-cache-gb")
            return aborted
        scoring = any(c.req.params.prompt_logprobs is not None and c.req.num_computed < len(c.req.prompt_token_ids)
                      for c in chunks)
        logits = self._forward_scoring(chunks) if scoring else self._forward(chunks)
        self.scheduler.publish_prompts(chunks)
        sampled = [c.req for c in chunks if c.req.num_computed == c.req.num_tokens]
        if any(r.params.max_tokens == 0 for r in sampled):   # prompt only (scored): nothing to sample
            keep = [i for i, r in enumerate(sampled) if r.params.max_tokens]
            done = [self._finish_scored(r) for r in sampled if not r.params.max_tokens]
            logits, sampled = logits[keep], [sampled[i] for i in keep]
            aborted = aborted + done
        tokens = sample(logits, sampled)
        return aborted + [self._postprocess(req, tok) for req, tok in zip(sampled, tokens)]

    def _forward_scoring(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """A step where some prompt's logprobs were asked for: the logits of every row (the
        prompt's teacher-forced distributions; only such steps pay for them), recorded as
        those prompts' logprobs; returns the sampling rows, as `_forward` does."""
        starts = [c.req.num_computed for c in chunks]
        rows = self._forward(chunks, all_rows=True)  # [sum num_new, V]
        picks, off = [], 0
        for ch, start in zip(chunks, starts):
            req, n, k = ch.req, len(ch.req.prompt_token_ids), ch.req.params.prompt_logprobs
            if k is not None:
                scored = req.prompt_logprobs or [None]   # token 0 has no logprob
                lo, hi = max(start, len(scored) - 1), min(start + ch.num_new, n - 1)  # row p scores token p + 1
                for a in range(lo, hi, SCORE_ROWS):   # (a recompute after preemption scores nothing twice)
                    b = min(hi, a + SCORE_ROWS)        # log_softmax copies: a slice of rows at a time
                    scored.extend(logprobs_of(rows[off + a - start:off + b - start],
                                              req.prompt_token_ids[a + 1:b + 1], k))
                req.prompt_logprobs = scored
            off += ch.num_new
            if start + ch.num_new == req.num_tokens:
                picks.append(off - 1)
        return rows[picks]

    def _finish_scored(self, req: Request) -> RequestOutput:
        """max_tokens 0 (with prompt logprobs): the prompt is scored, the request ends."""
        req.finish_reason, req.finish_time = FinishReason.LENGTH, time.perf_counter()
        req.first_token_time = req.first_token_time or req.finish_time
        self.scheduler.finish(req)
        return self.outputs.output(req)

    def _forward(self, chunks: list[ScheduledChunk], all_rows: bool = False):
        """forward_batch; with the residency tiers on, an out-of-memory error inside it (a long
        prefill's activations on a GPU whose memory another process took) gives back about half
        the expert slots (at least one chunk; the elastic sizing then stays under what is left)
        and runs the same chunks again, until it fits or no slot is left (then the error
        stands). Nothing is lost: requests advance only after a forward and its logits
        complete, the retry rewrites the same KV slots with the same values, and the prefix
        cache is not touched. The failed pass's residency telemetry is rewound (the step counts
        once); the policy keeps the failed pass's routing counts and admissions (the admitted
        experts are in their slots)."""
        ex, recorder = self.residency, self.routing_recorder
        oom = ex.oom_errors if ex is not None else ()
        # a decode step (lone or batched): every request brings one token it generated and samples
        # the next (not a prompt's last token computed alone, after a prefix-cache hit or a chunked
        # prefill, nor one token of a preempted request's recompute)
        decode = all(ch.num_new == 1 and ch.samples and ch.req.num_computed >= len(ch.req.prompt_token_ids)
                     for ch in chunks)
        for tiers in (ex, recorder):
            if tiers is not None:
                tiers.decode_step = decode
        while True:
            recorded = len(recorder.trace.steps) if recorder is not None else 0
            mark = ex.checkpoint() if ex is not None else None
            try:
                return self.runner.forward_batch(chunks, all_rows)
            except oom:
                if recorder is not None:     # the failed pass's routing is not a step of the trace
                    recorder.rewind(recorded)
                ex.rewind_pass(mark)         # nor of the telemetry
                if not ex.shrink_after_oom():    # (resize gives the dropped chunks back to the driver)
                    raise                    # no slot left to give back: the step cannot fit

    def _more_pages(self, need: int) -> int:
        """The scheduler's hook before it preempts: `KvSlotSplit.more_pages`."""
        return self.kv_split.more_pages(need)

    def _check_integrity(self) -> list[RequestOutput]:
        """Abort every request whose recorded (page, tag) pairs no longer match; others go on."""
        bad = self.tracker.check()
        if not bad:
            return []
        live = {r.request_id: r for r in [*self.scheduler.running, *self.scheduler.waiting]}
        outs = []
        for rid, pages in bad.items():
            req = live.get(rid)
            if req is None:
                self.tracker.forget(rid)
                continue
            req.finish_reason = FinishReason.ABORT
            req.stop_reason = (f"KV integrity check failed: page(s) {pages} were freed or reassigned under this "
                               "request; aborted instead of reading another request's cache")
            req.finish_time = time.perf_counter()
            self.scheduler.finish(req, publish=False)
            outs.append(self.outputs.output(req))
        return outs

    def _postprocess(self, req: Request, token: int) -> RequestOutput:
        self.outputs.on_token(req, token)
        if req.finished:
            self.scheduler.finish(req)
        return self.outputs.output(req)

    @property
    def _streams(self) -> dict:
        """Each live request's text state (engine/outputs.py)."""
        return self.outputs.streams


def _prompt_done(req: Request) -> bool:
    return req.finished or req.num_computed >= len(req.prompt_token_ids)
