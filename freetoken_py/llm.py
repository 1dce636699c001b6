"""The offline facade: load a model, add requests, step the engine, read outputs.

`LLM.step()` is nano-vllm's loop: schedule -> forward_batch -> sample -> postprocess (stop
conditions, detokenization). `freetoken run`, the benches and the tests use this class.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from freetoken_py.config import EngineConfig
from freetoken_py.core import FinishReason, Request, RequestOutput, SamplingParams
from freetoken_py.engine.cpu_backend import prefill_expert_memory
from freetoken_py.engine.runner import ModelRunner, ScheduledChunk
from freetoken_py.engine.sampler import logprobs_of, sample
from freetoken_py.errors import ContextLengthError, FreetokenError, ModelLoadError
from freetoken_py.kvcache import PageAllocator, paged_bytes
from freetoken_py.kvcache.pool import FP8
from freetoken_py.kvcache.radix import RadixCache
from freetoken_py.kvcache.tags import IntegrityTracker, NullTracker
from freetoken_py.loading import attach_tiers, load_engine_model
from freetoken_py.models.loader import read_generation_defaults
from freetoken_py.residency.kv_split import KV_RESPLIT_STEPS, KvSlotSplit  # noqa: F401  (the constant: old import path)
from freetoken_py.scheduler.scheduler import Scheduler
from freetoken_py.tokenizer import IncrementalDetokenizer, Tokenizer, bundled_chat_template
from freetoken_py.utils.progress import progress_bar


CORPUS_DIR = Path(__file__).parent / "data" / "corpus"   # shipped real text (its README: sources, licence)
KV_CALIBRATION_TOKENS = 512   # FP8 KV scales: a prefill of this much shipped prose and code
SCORE_ROWS = 256   # prompt logprobs: rows per log_softmax (its copy stays small next to the step's logits)
RANDOM_CALIBRATION_TOKENS = 64   # without a tokenizer: the earlier fixed pseudo-random ids, as many as before


@dataclass
class _Stream:
    """Per-request text state: detokenizer plus how much text has been handed out."""
    detok: IncrementalDetokenizer | None
    emitted: int = 0
    new_token_ids: list[int] = field(default_factory=list)


GPU_HINT = ("freetoken: a CUDA GPU is visible but unused (the model runs on the host); "
            "--gpu-experts puts the dense weights, the KV cache and the expert tiers on it")


class LLM:
    def __init__(self, model: str | Path, **overrides):
        self.config = EngineConfig(model=str(model), **overrides)
        model_dir = Path(self.config.model)
        self.backend = self._resolve_backend()
        self.model = load_engine_model(self.config, self.backend)   # checkpoint -> format -> placement
        self.args = self.model.args
        self.tokenizer = Tokenizer(model_dir) if (model_dir / "tokenizer.json").exists() else None
        if self.tokenizer is not None and not self.tokenizer.chat_template:   # DeepSeek-V3.2: our own
            self.tokenizer.chat_template = bundled_chat_template(self.args.model_type)
        self.generation = read_generation_defaults(model_dir)
        try:                            # its sampling defaults in range, said at load with the file's name
            SamplingParams(**self.generation.sampling)
        except FreetokenError as e:
            raise ModelLoadError(f"{model_dir / 'generation_config.json'}: {e}") from None
        self.max_model_len = self.config.max_model_len or self.args.max_position_embeddings
        auto_kv = getattr(self.model, "kv_dtype", self.model.dtype)  # cpu backend: bf16 for bf16 checkpoints
        self.kv_dtype = {"auto": auto_kv, "fp32": torch.float32, "bf16": torch.bfloat16, "fp8": FP8}[self.config.kv_dtype]
        a = self.args
        # only the paged layers count (a hybrid's linear-attention layers keep a per-request state)
        self._page_bytes = paged_bytes(self.model.paged_specs(), self.config.page_size, self.kv_dtype)  # DSA: + index keys
        self._snapshot_slots = self._snapshot_slot_count()   # hybrids: out of the KV budget, before the pages
        num_pages = self._num_pages()
        self.runner = ModelRunner(self.model, num_pages, self.config.page_size, self.kv_dtype,
                                  state_slots=self.config.max_num_seqs + self.spare_state_slots())
        self.residency = attach_tiers(self.model, self.config)   # after the KV cache: on a GPU the slots take what is left
        self.allocator = PageAllocator(num_pages)
        self.prefix_cache = RadixCache(self.allocator, self.config.page_size) if self.config.enable_prefix_cache else None
        self.snapshots, states = self._prefix_states()
        self.tracker = (IntegrityTracker if self.config.kv_integrity_check else NullTracker)(self.allocator)
        self._model_identity = self._identity(model_dir)
        self._namespace_base: tuple | None = None
        self.scheduler = Scheduler(self.allocator, self.config.page_size, self.config.max_num_seqs,
                                   self.config.max_num_batched_tokens, self.prefix_cache, self._cache_namespace,
                                   self.tracker, more_pages=self._more_pages if self.residency is not None else None,
                                   state_pool=self.runner.states, states=states,
                                   windows=self.runner.cache.windows)   # windowed layers' pages (kvcache/window.py)
        # the residency tiers run on the torch backend: no fused CPU decoder holds views of the
        # KV tensors that _more_pages / _return_pages reallocate
        assert self.residency is None or self.runner.fused is None
        # the KV/slot memory trade, re-decided while running (residency/kv_split.py)
        self.kv_split = (KvSlotSplit(self.residency, self.allocator, self.runner, self.scheduler, self._page_bytes,
                                     self.model.device.type == "cuda") if self.residency is not None else None)
        self._idle_tried = False     # idle() ran since the last step
        self._streams: dict[int, _Stream] = {}
        self._deferred: list[tuple[Request, Request]] = []  # (request, the sibling whose prompt it waits for)
        self._grammar_compiler = None   # engine/grammar.GrammarCompiler, on the first constrained request
        self._calibrate_kv()
        self._warm_kernels()
        self.routing_recorder = self._attach_recorder()

    def _resolve_backend(self) -> str:
        if self.config.backend != "auto":
            return self.config.backend
        if self.config.residency != "off":
            return "torch"  # the residency tiers run the dense weights in torch (experts: theirs or the store's)
        # the numba kernels (the only ones that quantise), with or without a GPU: the torch backend
        # keeps everything on the host too (only the residency tiers, --gpu-experts, put weights
        # in VRAM) and is the reference path
        return "cpu"

    @property
    def unused_gpu(self) -> bool:
        """A CUDA GPU is visible but this engine runs without it (the residency tiers are off)."""
        return self.config.residency == "off" and torch.cuda.is_available()

    def _attach_recorder(self):
        if not self.config.record_routing:
            return None
        from freetoken_py.residency.stats import RoutingRecorder, route_predictors

        a = self.model.args
        # with the routers (and their choice rule), each step also records the look-ahead prediction the prefetch makes
        routers = route_predictors(self.model)
        self.model.experts = RoutingRecorder(self.model.experts, a.num_layers, a.num_experts, a.top_k,
                                             source=str(self.config.model), routers=routers)
        return self.model.experts

    def save_routing(self) -> None:
        """Write the recorded routing trace to `config.record_routing` (no-op when not recording)."""
        if self.routing_recorder is not None:
            try:
                self.routing_recorder.trace.save(self.config.record_routing)
            except OSError as exc:
                raise FreetokenError(f"--record-routing {self.config.record_routing}: {exc.strerror}") from None

    # ---- prefix cache namespace -----------------------------------------------------------
    def _identity(self, model_dir: Path) -> tuple:
        """Everything about the weights that changes K/V content."""
        files = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(model_dir.glob("*.safetensors")))
        c = self.config
        return (str(model_dir.resolve()), files, self.backend, str(self.model.dtype), c.expert_dtype, c.dense_dtype,
                c.expert_group_size, c.residency, c.prefill_expert_dtype)

    def _cache_namespace(self, req: Request):
        """Cache key namespace: model identity, KV dtype and scales, client salt. None = not cacheable
        (FP8 scales not calibrated yet; `_calibrate_kv` does that in the constructor), and a request
        asking for prompt logprobs: every prompt position's logits must be computed."""
        if req.params.prompt_logprobs is not None:
            return None
        if self._namespace_base is None:  # fixed once the scales are (they never change after)
            scales = self.runner.cache.scales_fingerprint()
            if scales is None:
                return None
            self._namespace_base = (self._model_identity, scales)
        return (self._namespace_base, req.cache_salt)

    def _calibrate_kv(self) -> None:
        """FP8 KV: fix the per-(layer, head) scales once, before any request (so no page is ever
        rescaled and the cache namespace never changes): from the `--kv-scales` file when it
        exists (made for this model and configuration), else from a prefill of the shipped
        calibration text (`calibration_ids`), then written to that file when one is named."""
        from freetoken_py import kv_scales

        cache, path = self.runner.cache, self.config.kv_scales
        self.kv_calibration: dict = {}    # where the scales came from (fp8 only)
        if not cache.quantized:
            return
        c = self.config
        key = kv_scales.scales_key(Path(c.model), self.backend, str(self.model.dtype), c.expert_dtype,
                                   c.dense_dtype, c.expert_group_size, c.prefill_expert_dtype)
        if path and Path(path).exists():
            k, v, self.kv_calibration = kv_scales.load_scales(Path(path), key)
            try:
                cache.set_scales(k, v)
            except ValueError as exc:
                raise FreetokenError(f"--kv-scales {path}: {exc}") from None
            return
        ids, source = self.calibration_ids()
        self.calibrate_kv(ids)
        self.kv_calibration = {"source": source, "tokens": len(ids)}
        if path:
            kv_scales.save_scales(Path(path), key, cache.k_scale, cache.v_scale, self.kv_calibration)

    def calibration_ids(self, num_tokens: int = KV_CALIBRATION_TOKENS) -> tuple[list[int], str]:
        """Token ids the FP8 scales are calibrated on, and what they are: half prose, half code
        from the shipped corpus (`data/corpus/calib_*.txt`, kept apart from the evaluation
        text) in the model's own tokenizer; without a tokenizer, the fixed pseudo-random ids of
        before (64 of them: the same scales as before for such a model)."""
        n = min(num_tokens, self.kv_capacity_tokens - 1, self.max_model_len - 1)
        if self.tokenizer is None:
            n = min(n, RANDOM_CALIBRATION_TOKENS)
            g = torch.Generator().manual_seed(0)
            return torch.randint(0, self.args.vocab_size, (n,), generator=g).tolist(), "random ids (no tokenizer)"
        parts = [self.tokenizer.encode((CORPUS_DIR / f"calib_{kind}.txt").read_text(), add_special_tokens=False)
                 for kind in ("prose", "code")]
        ids = parts[0][:n // 2] + parts[1][:n - n // 2]
        return ids, "corpus calib_prose.txt + calib_code.txt"

    def calibrate_kv(self, token_ids: list[int]) -> None:
        """Calibrate the FP8 scales again from a prefill of `token_ids` (each layer's first write
        fixes its per-head absmax x margin; nothing is published to the prefix cache). Only
        while no request holds pages."""
        cache, n = self.runner.cache, len(token_ids)
        cache.recalibrate()
        self._namespace_base = None
        req = Request(list(token_ids), SamplingParams())
        req.page_table = self.allocator.allocate(-(-n // self.config.page_size))
        req.state_slot = self._throwaway_state_slot()
        try:
            self.runner.forward_batch([ScheduledChunk(req, n)])
        finally:
            self.allocator.release(req.page_table)
            self._free_state_slot(req)
        cache.clipped_per_layer.zero_()     # (the calibration's own write cannot clip; counted from here)

    def _throwaway_state_slot(self) -> int | None:
        """A state slot for a request run outside the scheduler (calibration, warm-up); hybrids only."""
        return self.runner.states.allocate() if self.runner.states is not None else None

    def _free_state_slot(self, req: Request) -> None:
        if req.state_slot is not None:
            self.runner.states.free(req.state_slot)
            req.state_slot = None

    def _warm_kernels(self) -> None:
        """cpu backend: a 3-token prefill and one decode step of a throwaway request, so numba
        compiles (first run on a machine, ~30 s) or loads from its disk cache (~1 s) the kernels
        this model's formats need now, under a progress bar, instead of inside the first
        request's time to first token. Nothing is published to the prefix cache."""
        ps = self.config.page_size
        if self.backend != "cpu" or self.kv_capacity_tokens < 4 or self.allocator.num_free < -(-4 // ps):
            return
        req = Request([t % self.args.vocab_size for t in (1, 2, 3)], SamplingParams())
        req.page_table = self.allocator.allocate(-(-4 // ps))
        req.state_slot = self._throwaway_state_slot()
        try:
            with progress_bar("Preparing CPU kernels (compiled once per machine)", 2,
                              self.config.show_progress) as advance:
                self.runner.forward_batch([ScheduledChunk(req, 3)])  # prefill path: grouped experts, GEMM
                advance()
                req.output_token_ids.append(0)
                self.runner.forward_batch([ScheduledChunk(req, 1)])  # decode path: the fused step
                advance()
        finally:
            self.allocator.release(req.page_table)
            self._free_state_slot(req)
            if self.runner.governor is not None:
                self.runner.governor.reset()  # those step times include compiling / loading kernels

    # ---- sizing -------------------------------------------------------------------------
    def _num_pages(self) -> int:
        """Pages of the KV budget. An explicit budget (kv_cache_bytes) holds the prefix-state
        snapshots too (hybrids), so theirs is taken out first; the automatic one sizes the pages
        for every sequence at full length and the snapshots come on top."""
        budget = self._kv_budget()
        if self.config.kv_cache_bytes:
            held = self._snapshot_slots * self._state_bytes()
            if self.config.prefix_snapshots and budget - held < 2 * self._page_bytes:
                raise FreetokenError(
                    f"prefix_snapshots (--prefix-snapshots) {self.config.prefix_snapshots}: that many state snapshots "
                    f"take {held / 2**30:.3f} GiB ({self._state_bytes()} B each) of the {budget / 2**30:.3f} GiB KV "
                    "budget (--kv-cache-gb), leaving no room for pages; ask for fewer or a larger budget")
            budget -= held
        return max(2, budget // self._page_bytes)

    def _kv_budget(self) -> int:
        c, per_page = self.config, self._page_bytes
        budget = c.kv_cache_bytes
        if budget == 0:  # enough for every sequence at full length, capped at 1/8 of free RAM
            want = c.max_num_seqs * self.max_model_len * per_page // c.page_size
            if self.model.device.type == "cuda":   # in VRAM: a quarter of what the dense weights left
                from freetoken_py.residency.elastic import cuda_free_bytes   # (as the slots will see it)

                budget = min(want, cuda_free_bytes() // 4)
            else:
                budget = min(want, psutil.virtual_memory().available // 8)
        return budget

    def spare_state_slots(self) -> int:
        """Recurrent-state slots beyond max_num_seqs: the prefix-state snapshots' (hybrids)."""
        return self._snapshot_slots

    def _state_bytes(self) -> int:
        """Bytes of one request's recurrent state, from the model's state specs (0: not a hybrid)."""
        return sum(s.bytes_per_request for s in self.model.state_specs() if s.kind == "recurrent")

    def _snapshot_slot_count(self) -> int:
        """Hybrids with the prefix cache: prefix_snapshots, else a quarter of the KV budget in
        snapshots (at least 2, at most 4 per sequence); see _num_pages for whose bytes they are."""
        state = self._state_bytes()
        if not state or not self.config.enable_prefix_cache:
            return 0
        if self.config.prefix_snapshots:
            return self.config.prefix_snapshots
        return max(2, min(4 * self.config.max_num_seqs, self._kv_budget() // 4 // state))

    def _prefix_states(self):
        """Hybrids with the prefix cache: the snapshot store and the scheduler's reuse policy
        (scheduler/prefix_state.py); (None, None) otherwise (a hybrid then takes no prefix hits)."""
        if not self._snapshot_slots or self.prefix_cache is None:
            return None, None
        from freetoken_py.kvcache.snapshots import SnapshotStore, snapshot_every_pages
        from freetoken_py.scheduler.prefix_state import PrefixStateReuse

        ps = self.config.page_size
        store = SnapshotStore(self.runner.states, self._snapshot_slots, check=self.config.kv_integrity_check)
        self.prefix_cache.snapshots = store
        every = self.config.snapshot_every_pages or snapshot_every_pages(store.bytes_per_snapshot,
                                                                         self.kv_bytes_per_token, ps)
        self.snapshot_every = every
        in_layer = bool(getattr(getattr(self.model, "gdn_mixer", None), "captures", False))
        return store, PrefixStateReuse(self.prefix_cache, store, ps, every, in_layer=in_layer)

    @property
    def state_bytes_per_request(self) -> int:
        """Fixed-size state one request holds (a hybrid's conv + recurrent state over its linear
        layers, fp32), measured from the pool; 0 for models without recurrent layers."""
        return self.runner.states.bytes_per_slot if self.runner.states is not None else 0

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token takes across every layer, measured from the pool (MLA: latent + rope key)."""
        return self.runner.cache.bytes_per_token

    def stats(self) -> dict:
        """A snapshot of the engine's state, as plain values: KV pages (total, free, held by the
        prefix cache, tokens per page), FP8 KV values clipped, requests running / waiting, and
        with the residency tiers on their telemetry (totals and per layer) and slot count under
        "residency". Call it where steps run (between steps): the counts are then consistent."""
        cache = self.prefix_cache
        out = {"num_pages": self.allocator.num_pages, "free_pages": self.allocator.num_free,
               "cached_pages": len(cache.cached_pages()) if cache is not None else 0,
               "page_size": self.config.page_size, "running": len(self.scheduler.running),
               "waiting": len(self.scheduler.waiting),
               "kv_fp8_clipped": self.runner.cache.clipped,  # FP8 KV values saturated (0 otherwise)
               "kv_bytes_per_token": self.kv_bytes_per_token,  # paged layers only
               "state_bytes_per_request": self.state_bytes_per_request}  # hybrids' recurrent layers (else 0)
        if self.runner.states is not None:
            out["state_slots"], out["free_state_slots"] = self.runner.states.num_slots, self.runner.states.num_free
        if self.snapshots is not None:   # hybrids: recurrent-state snapshots in the prefix cache
            sn = self.snapshots
            out["state_snapshots"] = {"slots": sn.capacity, "held": self.prefix_cache.num_snapshots,
                                      "bytes_held": sn.bytes_held, "every_pages": self.snapshot_every,
                                      "taken": sn.num_taken, "restored": sn.num_restored,
                                      "evicted": self.prefix_cache.num_snapshots_evicted,
                                      "refused": sn.num_mismatches}
        prefill = getattr(self.model, "prefill_expert_store", None)
        if prefill is not None:   # --prefill-expert-dtype: the second copy of the experts, and where it lies
            out["prefill_experts"] = prefill_expert_memory(prefill)
        ex = self.residency
        if ex is not None:
            ex.flush_timing(wait=False)  # GPU-clock times of finished calls
            out["residency"] = {**ex.telemetry.as_dict(), "expert_slots": ex.slots.num_slots}
        return out

    @property
    def kv_capacity_tokens(self) -> int:
        return self.allocator.num_pages * self.config.page_size

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
        params = params or SamplingParams()
        ids = self.encode_prompt(prompt)
        if not ids:
            raise FreetokenError("the prompt is empty")
        if any(not 0 <= t < self.args.vocab_size for t in ids):
            raise FreetokenError(f"prompt token ids must be in [0, {self.args.vocab_size})")
        limit = min(self.max_model_len, self.kv_capacity_tokens)
        if len(ids) >= limit:
            raise ContextLengthError(
                f"prompt has {len(ids)} tokens but the context limit is {limit} "
                f"(model {self.max_model_len}, KV cache {self.kv_capacity_tokens}); shorten the prompt "
                "or raise --max-model-len / --kv-cache-gb")
        if params.stop and self.tokenizer is None:
            raise FreetokenError("stop strings need a tokenizer")
        req = Request(ids, params, arrival_time=time.perf_counter(), cache_salt=cache_salt)
        req.max_len = min(limit, len(ids) + params.max_tokens)
        if params.seed is not None:
            req.generator = torch.Generator().manual_seed(params.seed)
        if params.grammar is not None:
            req.constraint = self.grammar_compiler.matcher(params.grammar)
        detok = IncrementalDetokenizer(self.tokenizer, ids) if self.tokenizer else None
        self._streams[req.request_id] = _Stream(detok)
        if after is not None and not self._prompt_done(after):
            self._deferred.append((req, after))
        else:
            self.scheduler.add(req)
        return req

    @staticmethod
    def _prompt_done(req: Request) -> bool:
        return req.finished or req.num_computed >= len(req.prompt_token_ids)

    def _admit_deferred(self) -> None:
        """Requests waiting for a sibling's prompt go to the scheduler once it is computed (and
        its pages published: publish_prompts runs after the forward that completes it)."""
        if self._deferred:
            ready = [(r, a) for r, a in self._deferred if self._prompt_done(a)]
            self._deferred = [(r, a) for r, a in self._deferred if not self._prompt_done(a)]
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
        self._streams.pop(req.request_id, None)
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
        request (`_return_pages`; the prefix cache's pages move below that size). Returns the
        pages given back."""
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
        return self._output(req, self._streams[req.request_id])

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
        ex = self.residency
        oom = ex.oom_errors if ex is not None else ()
        recorder = self.routing_recorder
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

    @property
    def kv_return_after_steps(self) -> int:
        """Steps of low use before a grown KV cache goes back to its start-up size (`KvSlotSplit`)."""
        return self.kv_split.return_after_steps

    @kv_return_after_steps.setter
    def kv_return_after_steps(self, steps: int) -> None:
        self.kv_split.return_after_steps = steps

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
            outs.append(self._output(req, self._streams[rid]))
        return outs

    def _postprocess(self, req: Request, token: int) -> RequestOutput:
        now = time.perf_counter()
        req.output_token_ids.append(token)
        req.first_token_time = req.first_token_time or now
        st = self._streams[req.request_id]
        st.new_token_ids.append(token)
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.generation.eos_token_ids):
            req.finish_reason = FinishReason.STOP
            req.stop_reason = token if token in p.stop_token_ids else None
        else:
            if st.detok is not None:
                st.detok.push(token)
            self._check_stop_strings(req, st)
        if req.finish_reason is None and (len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= req.max_len):
            req.finish_reason = FinishReason.LENGTH
        if req.finished:
            req.finish_time = now
            self.scheduler.finish(req)
        return self._output(req, st)

    def _check_stop_strings(self, req: Request, st: _Stream) -> None:
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

    def _output(self, req: Request, st: _Stream) -> RequestOutput:
        text = st.detok.text if st.detok else ""
        visible = len(text)
        if not req.finished and req.params.stop:  # hold back what could be the start of a stop string
            visible = max(st.emitted, len(text) - max(map(len, req.params.stop)) + 1)
        new_text, st.emitted = text[st.emitted:visible], visible
        new_ids, st.new_token_ids = st.new_token_ids, []
        if req.finished:
            self._streams.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, token_ids=list(req.output_token_ids),
            text=text[:visible], finish_reason=req.finish_reason.value if req.finished else None,
            stop_reason=req.stop_reason, new_text=new_text, new_token_ids=new_ids,
            num_cached_tokens=req.num_cached_tokens,
            logprobs=req.logprobs if req.params.logprobs is not None else None,
            prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs is not None else None,
            ttft_s=(req.first_token_time - req.arrival_time) if req.first_token_time else None,
            total_s=(req.finish_time - req.arrival_time) if req.finish_time else None)

    # ---- conveniences -------------------------------------------------------------------
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

    def default_sampling(self, **overrides) -> SamplingParams:
        """generation_config.json's sampling defaults, overridden by explicit (non-None) values."""
        values = dict(self.generation.sampling)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return dataclasses.replace(SamplingParams(), **values)
