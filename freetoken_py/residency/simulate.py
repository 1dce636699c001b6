"""Replay a routing trace through a cache policy and the cost model: hit rate, PCIe bytes, CPU
share and predicted decode tokens/s. Pure Python + numpy; no model, no accelerator.

Time model per layer-step (the planner's own, see planner.py): dense weights are read from VRAM;
hits compute on the accelerator while copies run on the copy engine; a streamed expert computes
after its copy; CPU experts run concurrently; the layer ends when both sides do; the executor's
fixed host work (`TierProfile.host_layer_s`, measured by residency.calibrate, 0 in the hand-built
profiles) and the host's launches outside it (`CostModel.host_step_s`) are added to every
layer-step, and the accelerator's fixed step cost (`CostModel.gpu_step_s`) to its side of every
layer-step it has work in (`CostModel.moe_s`; both 0 in the hand-built profiles, seeded from the
H200 run in a measured one).

Look-ahead prefetch (`simulate(..., prefetch=True)`, on a trace that carries the predictions,
`RoutingTrace.predicted`) replays the executor's (`ResidencyExecutor._prefetch`): after layer l's
split, the experts predicted for the next MoE layer are offered to the policy (`admit`), best
first, and those it admits are copied once layer l's accelerator work is done, as many as
`planner.prefetch_allowance` lets (the time the CPU side runs past the accelerator side, plus
the lead to the next layer's routing: the dense read and host work here, measured by the
executor), stopping when an admission evicts a better-ranked predicted expert (resident, or
copied by this look-ahead). The copy engine is one queue across
layers and steps: what is left of it when the next layer's experts start (the backlog) delays
that layer's copies, and its hits if one of them is a prefetched expert (a hit on a slot whose
copy has not landed waits for it); a layer with no copy and no prefetched hit does not wait.
Within the allowance and with the lead replayed as it was, the queue is empty by then; the
backlog is what an ungated look-ahead (`prefetch_limit=False`) pays. A misprediction costs its
copy and the slot it took. The prediction is scored on decode steps.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass

import numpy as np

from freetoken_py.residency.planner import (CostModel, LayerStats, _add, _gpu_finish, copies_s,
                                            prefetch_allowance)
from freetoken_py.residency.policy import look_ahead
from freetoken_py.residency.profiles import GB, ModelSpec
from freetoken_py.residency.stats import RoutingTrace, iter_layer_steps, tokens_per_expert


@dataclass
class SimResult:
    routed_pairs: int = 0
    hit_pairs: int = 0
    stream_pairs: int = 0
    cpu_pairs: int = 0
    split_pairs: int = 0             # pairs of an expert cut between the two sides (planner decision 5)
    split_cpu_share: float = 0.0     # of those, the CPU's part (sum of 1 - fraction per pair)
    streamed_experts: int = 0        # copies over PCIe (one per streamed expert per layer-step)
    tokens: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    prefill_tokens: int = 0          # the other steps' tokens (a prompt, or a chunk of one)
    prefill_seconds: float = 0.0
    seconds: float = 0.0
    pcie_bytes: int = 0
    prefetch_predicted: int = 0      # experts predicted for the next layer (look-ahead prefetch)
    prefetch_correct: int = 0        # of those, routed there
    prefetch_copies: int = 0         # copies the prefetch made (admitted and not resident)
    prefetch_stops: int = 0          # look-aheads ended because a guess evicted a better-ranked one

    @property
    def prefetch_accuracy(self) -> float:
        return self.prefetch_correct / self.prefetch_predicted if self.prefetch_predicted else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_pairs / self.routed_pairs if self.routed_pairs else 0.0

    @property
    def cpu_share(self) -> float:
        """Share of routed pairs the CPU computed (a cut expert's pairs count by the CPU's part)."""
        return (self.cpu_pairs + self.split_cpu_share) / self.routed_pairs if self.routed_pairs else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    def _end_step(self, tokens: int, seconds: float, decode: bool) -> None:
        """A step's time: a decode step (one generated token per request: a lone one or a batch) counts its
        tokens as decode tokens, any other as prefill."""
        self.seconds += seconds
        if decode:
            self.decode_tokens, self.decode_seconds = self.decode_tokens + tokens, self.decode_seconds + seconds
        elif tokens > 0:
            self.prefill_tokens, self.prefill_seconds = self.prefill_tokens + tokens, self.prefill_seconds + seconds

    def _count(self, tokens: dict, p, expert_bytes: int) -> None:
        """A layer-step's pairs by where the plan `p` runs them, and the bytes it streams."""
        self.routed_pairs += sum(tokens.values())
        self.hit_pairs += sum(tokens[e] for e in p.hits)
        self.stream_pairs += sum(tokens[e] for e in p.stream)
        self.cpu_pairs += sum(tokens[e] for e in p.cpu)
        self.split_pairs += sum(tokens[e] for e, _ in p.split)
        self.split_cpu_share += sum(tokens[e] * (1 - f) for e, f in p.split)
        self.streamed_experts += len(p.stream)
        self.pcie_bytes += len(p.stream) * expert_bytes + sum(int(f * expert_bytes) for _, f in p.split)

    def to_dict(self) -> dict:
        return dict(asdict(self), hit_rate=self.hit_rate, cpu_share=self.cpu_share,
                    decode_tok_s=self.decode_tok_s, prefill_tok_s=self.prefill_tok_s,
                    prefetch_accuracy=self.prefetch_accuracy)


def _look_ahead(r: SimResult, policy, nxt: int, guess, allowed: int, step: int, expert_bytes: int):
    """The executor's _prefetch: the same admissions (policy.look_ahead), copied in order; counted
    in r. Returns (the experts in flight for layer nxt, the copies issued)."""
    flying, copies, stopped = look_ahead(policy, nxt, guess, allowed, step)
    r.prefetch_copies += copies
    r.prefetch_stops += stopped
    r.pcie_bytes += copies * expert_bytes
    return flying, copies


def simulate(trace: RoutingTrace, policy, cost: CostModel, dense_bytes: int, prefetch: bool = False,
             lead_s: float | None = None, prefill_lead_s: float | None = None,
             prefetch_limit: bool = True) -> SimResult:
    """`dense_bytes`: non-expert weights read per token (spread over the MoE layers). `prefetch`:
    replay the trace's look-ahead predictions (module docstring); no effect on a trace without.
    `lead_s`: the time from one layer's expert work to the next layer's routing, which the
    look-ahead copies may use (None: a layer-step's dense read and host work; a run's measured
    lead to replay that run); `prefill_lead_s` the same for the other steps (None:
    `lead_s`). `prefetch_limit` False drops the allowance (the stop still applies): what the
    allowance saves."""
    profile, layers = cost.profile, trace.moe_layers
    nxt_layer = dict(zip(layers, layers[1:]))
    prefetch = prefetch and trace.has_predictions
    # every layer-step: its share of the dense weights read, the executor's fixed host work (0: hand-built profiles)
    fixed_layer_s = dense_bytes / max(1, len(layers)) / (profile.vram_gbps * GB) + profile.host_layer_s \
        + cost.host_step_s
    lead_decode = fixed_layer_s if lead_s is None else lead_s
    lead_prefill = lead_decode if prefill_lead_s is None else prefill_lead_s
    r = SimResult()
    step_s, step_tokens, step_decode, cur = 0.0, 0, False, -1
    # copy-engine seconds left at a layer's start; per layer, the experts predicted for it and those copied
    backlog, guessed, in_flight = 0.0, {}, {}
    for step, layer, ids in iter_layer_steps(trace):
        if step != cur:
            r._end_step(step_tokens, step_s, step_decode)
            step_s, step_tokens, step_decode, cur = 0.0, ids.shape[0], trace.is_decode(step), step
            guessed.clear()             # as the executor's _new_step: a prediction lives within its step
            in_flight.clear()
            r.tokens += step_tokens
        tokens = {int(e): int(c) for e, c in enumerate(tokens_per_expert(ids, trace.num_experts)) if c}
        p = policy.split(layer, LayerStats(tokens, policy.resident(layer)), cost)
        policy.touch(layer, step, tokens)
        policy.admit_many(layer, p.stream, step)
        r._count(tokens, p, cost.expert_bytes)
        if not prefetch:
            step_s += fixed_layer_s + cost.moe_s(p)
            continue
        predicted, copied = guessed.pop(layer, ()), in_flight.pop(layer, set())
        if step_decode:                 # scored on decode steps, as the executor's prefetch%
            r.prefetch_predicted += len(predicted)
            r.prefetch_correct += sum(e in tokens for e in predicted)
        lead = lead_decode if step_decode else lead_prefill
        moe_s, gpu_end, own_copies_s = _with_backlog(p, tokens, cost, backlog, copied & set(p.hits))
        if cost.gpu_step_s and (p.hits or p.stream or p.split):   # the accelerator's fixed step cost
            gpu_end += cost.gpu_step_s
            moe_s = max(moe_s, gpu_end)
        # ahead copies start once the layer's accelerator work is done (and its own copies)
        queued = max(gpu_end, backlog + own_copies_s)
        nxt = nxt_layer.get(layer)
        guess = trace.prediction(step, nxt) if nxt is not None else None
        if guess:
            guessed[nxt] = guess
            allowed = prefetch_allowance(p, cost, lead) if prefetch_limit else len(guess)
            in_flight[nxt], copies = _look_ahead(r, policy, nxt, guess, allowed, step, cost.expert_bytes)
            queued += copies * cost.copy_s()
        # the queue keeps working through the rest of this layer and up to the next one's routing
        backlog = max(0.0, queued - moe_s - lead)
        step_s += fixed_layer_s + moe_s
    r._end_step(step_tokens, step_s, step_decode)
    return r


def _with_backlog(p, tokens: dict[int, int], cost: CostModel, backlog: float,
                  prefetched_hits: set) -> tuple[float, float, float]:
    """(the layer-step's expert seconds, its accelerator side's finish, its own copies' seconds on
    the copy engine) when the copy engine is busy for `backlog` seconds at its start: its copies
    queue behind, and its hits wait for the queue when one of them is a prefetched expert still
    in it. Backlog 0: the plan's times. A cut expert's part is a copy too; with a cut the
    accelerator's whole side waits (the plan's figures do not say how much of it is the cut's)."""
    copies = copies_s(p, cost)
    if backlog <= 0.0:
        return p.seconds, p.gpu_s, copies
    hit_start = backlog if prefetched_hits else 0.0
    if p.split:
        gpu = backlog + p.gpu_s
    elif not p.stream:
        gpu = hit_start + _add(cost.gpu_compute_s(tokens[e]) for e in p.hits) if p.hits else 0.0
    else:
        computes = [cost.gpu_compute_s(tokens[e]) for e in p.stream]
        gpu = _gpu_finish(hit_start + _add(cost.gpu_compute_s(tokens[e]) for e in p.hits),
                          backlog + copies, _add(computes), computes[-1])
    return max(gpu, p.cpu_s), gpu, copies


# ---- synthetic traces ---------------------------------------------------------------------------
def _distinct(rng, num_experts: int, k: int, p: np.ndarray | None = None) -> np.ndarray:
    return rng.choice(num_experts, size=k, replace=False, p=p)


def synthetic_trace(regime: str, spec: ModelSpec, steps: int, seed: int = 0, model_seed: int = 0) -> RoutingTrace:
    """Decode traces (one token per step) for three published routing regimes:

    locality   strong temporal locality: each token reuses, per slot, an expert the layer routed
               in the last few steps with probability 0.8 (a recent-use cache of half the
               experts then hits ~65-70%, as the llama.cpp measurement reports)
    flat_skew  no temporal correlation, stationary Zipf(1.0) popularity per layer (a frequency
               oracle beats LRU, as FreeToken issue #174 measured on DeepSeek-V4-Flash)
    flat       no correlation and no skew: every expert equally likely

    `model_seed` fixes the per-layer popularity (a property of the model, shared by a calibration
    trace and an evaluation trace); `seed` the tokens.
    """
    pop_rng, rng = np.random.default_rng(model_seed), np.random.default_rng(seed + 1)
    L, E, k = spec.num_layers, spec.num_experts, spec.top_k
    trace = RoutingTrace(L, E, k, source=f"synthetic:{regime}:{spec.name}")
    zipf = 1.0 / np.arange(1, E + 1)
    pops = [pop_rng.permutation(zipf / zipf.sum()) for _ in range(L)]
    recent = [list(_distinct(rng, E, k)) for _ in range(L)]
    for _ in range(steps):
        step = {}
        for l in range(L):
            if regime == "flat":
                ids = _distinct(rng, E, k)
            elif regime == "flat_skew":
                ids = _distinct(rng, E, k, pops[l])
            elif regime == "locality":
                ids = _locality_step(rng, recent[l], E, k)
                recent[l] = (list(ids) + recent[l])[:6 * k]
            else:
                raise ValueError(f"unknown regime {regime!r}")
            step[l] = np.asarray(ids, np.int64).reshape(1, k)
        trace.add_step(step)
    return trace


def _locality_step(rng, recent: list[int], num_experts: int, k: int) -> list[int]:
    chosen: list[int] = []
    pool = list(dict.fromkeys(recent))
    while len(chosen) < k:
        if pool and rng.random() < 0.8:
            e = pool[min(int(rng.exponential(k)), len(pool) - 1)]
        else:
            e = int(rng.integers(num_experts))
        if e not in chosen:
            chosen.append(e)
    return chosen


# ---- the ceiling no placement can beat ------------------------------------------------------
def belady_misses(trace: RoutingTrace, capacity: int) -> np.ndarray:
    """Fewest possible misses per step [steps] for a cache of `capacity` (layer, expert) slots.

    Belady's MIN over the trace's access stream (one access per distinct expert per layer-step, in
    execution order): on a miss with the cache full, drop whichever of the residents and the new
    expert is next used furthest in the future (dropping the new one = evaluating it elsewhere).
    The cache starts preloaded for free with the first `capacity` experts the trace uses (the best
    possible warm start), so only misses a cache of this size cannot avoid are counted. No online
    policy, with or without prefetch, fetches fewer experts than MIN.
    """
    keys, steps = [], []
    for s, layer, ids in iter_layer_steps(trace):
        for e in np.unique(ids):
            keys.append(layer * trace.num_experts + int(e))
            steps.append(s)
    n = len(keys)
    nxt, seen = [n] * n, {}
    for i in range(n - 1, -1, -1):          # next use of the same key (n = never)
        nxt[i] = seen.get(keys[i], n)
        seen[keys[i]] = i
    misses = np.zeros(len(trace.steps), np.int64)
    resident: dict[int, int] = {}           # key -> its next use
    heap: list[tuple[int, int]] = []        # (-next use, key), stale entries skipped
    for i, key in enumerate(keys):
        if key in resident:
            resident[key] = nxt[i]
            heapq.heappush(heap, (-nxt[i], key))
            continue
        if len(resident) < capacity:        # still filling: the free preload (nothing evicted yet)
            resident[key] = nxt[i]
            heapq.heappush(heap, (-nxt[i], key))
            continue
        misses[steps[i]] += 1
        if capacity == 0:
            continue
        while True:                         # the resident used furthest ahead
            far, victim = heap[0]
            if resident.get(victim) == -far:
                break
            heapq.heappop(heap)
        if -far > nxt[i]:                   # it is used later than the new one: swap them
            heapq.heappop(heap)
            del resident[victim]
            resident[key] = nxt[i]
            heapq.heappush(heap, (-nxt[i], key))
    return misses


def upper_bound_tok_s(trace: RoutingTrace, cost: CostModel, dense_bytes: int, capacity: int) -> float:
    """Decode tokens/s that no placement policy can exceed under this cost model.

    Over the decode steps, the time is at least the dense weights read from VRAM, and at least
    MIN's misses moved at the PCIe and CPU bandwidths added together (a perfect split, copies
    overlapped across layers and steps, no per-call latency, the accelerator's expert compute
    free), plus the profile's fixed host work per layer-step. Hits cost nothing here, so a higher figure than this cannot come from a better cache.
    Only decode steps count; MIN runs on each stretch of consecutive decode steps with its own
    free preload, since a policy may take any number of misses in a prefill to prepare for it.
    """
    profile, layers = cost.profile, trace.moe_layers
    dense_layer_s = dense_bytes / max(1, len(layers)) / (profile.vram_gbps * GB)
    decode = [s for s, step in enumerate(trace.steps) if step and trace.is_decode(s)]
    if not decode:
        return 0.0
    # MIN over each run of consecutive decode steps on its own, each with a free preload: a
    # policy may spend misses in a prefill (not counted) to arrive with exactly the right set
    missed, run = 0, [decode[0]]
    for s in decode[1:] + [None]:
        if s is not None and s == run[-1] + 1:
            run.append(s)
            continue
        sub = RoutingTrace(trace.num_layers, trace.num_experts, trace.top_k, trace.source)
        sub.steps = [trace.steps[i] for i in run]
        missed += int(belady_misses(sub, capacity).sum())
        run = [s]
    layer_steps = sum(len(trace.steps[s]) for s in decode)
    dense_s = layer_steps * dense_layer_s
    miss_s = missed * cost.expert_bytes / ((cost.pcie_gbps + cost.cpu_expert_gbps) * GB)
    # the fixed host work of each layer-step runs on its own (0 in the hand-built profiles)
    return sum(trace.tokens(s) for s in decode) / (max(dense_s, miss_s) + layer_steps * (profile.host_layer_s + cost.host_step_s))


def layer_floor_s(hits: int, misses: int, cost: CostModel) -> float:
    """The least time a decode layer-step with `hits` resident and `misses` missed experts can
    take under the cost model, whatever the split: the accelerator computes the hits and what
    is copied, the copy engine moves a experts' worth (one copy call at least), the CPU takes
    the rest (one activation round trip). Per-call latencies count once per side used; the
    accelerator's wait for the last copy and every further call are left out, so `plan` never
    beats it. Minimised exactly over the continuous a in [0, misses]:
        max(hits*g + a*g,  [a > 0] (copy_call + a*b_pcie),  [a < m] (cpu_call + (m - a)*b_cpu))
    at the two ends or where the CPU line meets the first rising line."""
    p = cost.profile
    g = cost.gpu_compute_s(1)
    if misses <= 0:
        return hits * g
    b_pcie = cost.expert_bytes / (cost.pcie_gbps * GB)        # seconds per expert copied
    b_cpu = cost.expert_bytes / (cost.cpu_expert_gbps * GB)   # seconds per expert on the CPU
    m, base = misses, hits * g
    all_cpu = max(base, p.cpu_call_s + m * b_cpu)
    all_stream = max(base + m * g, p.copy_call_s + m * b_pcie)
    best = min(all_cpu, all_stream)
    cross = min((p.cpu_call_s + m * b_cpu - base) / (g + b_cpu),
                (p.cpu_call_s - p.copy_call_s + m * b_cpu) / (b_pcie + b_cpu))
    if 0.0 < cross < m:
        best = min(best, max(base + cross * g, p.copy_call_s + cross * b_pcie,
                             p.cpu_call_s + (m - cross) * b_cpu))
    return best


def online_ceiling_flat_tok_s(trace: RoutingTrace, cost: CostModel, dense_bytes: int, capacity: int) -> float:
    """Expected decode tokens/s no *online* policy can exceed on a `flat` trace (every step routes
    k distinct experts per layer uniformly at random, independently of everything before), in
    this simulator's execution model: experts are fetched on demand, inside their layer; hits
    and copied experts compute on the accelerator; every copy and CPU round trip pays the
    profile's call latency.

    The past carries no information, so with c experts of a layer resident (any c of them) the
    layer's hits are hypergeometric(E, c, k) whatever the policy did before. In the model a
    layer's misses are served inside the layer (its routing is known once its attention has run,
    and the next layer needs its output), and a layer-step takes at least
    `layer_floor_s(hits, misses)`. So a layer holding c experts costs at least
    g(c) = E[layer_floor_s(hits, k - hits)]. A policy spreads at most `capacity` slots over the
    layers and may spread them differently each step: the least expected cost per layer is the
    lower convex hull of g at capacity / layers (a mix of two sizes can beat either alone).
    Per step: the dense read plus layers times that and the profile's fixed host work per
    layer-step. Clairvoyant caching (`upper_bound_tok_s`)
    can do better. Speculative copies that overlap other layers' work (look-ahead prefetch,
    which `simulate` replays only from a trace's recorded predictions; a flat trace has none)
    are outside the model.
    """
    profile = cost.profile
    n_layers, k, experts = len(trace.moe_layers), trace.top_k, trace.num_experts
    dense_s = dense_bytes / (profile.vram_gbps * GB)
    floor = [layer_floor_s(h, k - h, cost) for h in range(k + 1)]
    total = math.comb(experts, k)
    g = [_add(math.comb(c, h) * math.comb(experts - c, k - h) / total * floor[h]
              for h in range(max(0, k - (experts - c)), min(c, k) + 1)) for c in range(experts + 1)]
    for c in range(1, len(g)):       # a policy may leave slots empty: c slots are worth at least c - 1
        g[c] = min(g[c], g[c - 1])
    per_layer = _lower_hull_at(g, min(capacity, n_layers * experts) / n_layers)
    return 1.0 / (dense_s + n_layers * (per_layer + profile.host_layer_s + cost.host_step_s))


def _lower_hull_at(g: list[float], x: float) -> float:
    """The lower convex hull of the points (i, g[i]) evaluated at x (0 <= x <= len(g) - 1): the
    least average of g over any mix of integer points whose mean is x."""
    hull: list[int] = []
    for i in range(len(g)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (g[b] - g[a]) * (i - a) >= (g[i] - g[a]) * (b - a):   # b lies on or above a->i
                hull.pop()
            else:
                break
        hull.append(i)
    for a, b in zip(hull, hull[1:]):
        if a <= x <= b:
            return g[a] + (g[b] - g[a]) * (x - a) / (b - a)
    return g[hull[-1]]
