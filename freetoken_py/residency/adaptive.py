"""Our cache policy: learns online how much recency vs frequency the running workload rewards.

LeCaR-style (Vietri et al., HotStorage '18): two experts, LRU (evict the least recently routed)
and LFU (evict the lowest decayed routing count), each eviction drawn from one of them with
probability w_lru / w_lfu. Every evicted or refused key is remembered in a ghost list with the
expert that decided; when a ghost is routed again soon, that decision was a regret and its
expert's weight shrinks by exp(-learning_rate * discount**age).

Changes from plain LeCaR, each for a reason measured on MoE routing:
- Recency is in *steps*, not a global access counter, so layer 0 is not "older" than layer 40
  within one forward pass (with a global counter one end of the network crowds the other out),
  and it is counted on each layer's own clock: steps since the expert was routed, up to the
  layer's latest step. Within a step, an expert of a layer the forward pass has not reached yet
  was routed in that layer's latest step and is as fresh as one routed just now; an expert the
  current layer routed last step and not now is a step stale. (Comparing raw step numbers, a
  layer's admissions evicted the next layers' experts before those layers could use them:
  RTX 4060 laptop, `locality@qwen3-235b-a22b`, 5.58 -> 5.70 tok/s.)
- Per-layer fairness: a layer holding no more than `floor_share` of its fair share
  (capacity / layers) never loses a slot.
- Shadow duel (set-dueling, Qureshi et al., ISCA '07, applied to the two experts): two
  metadata-only caches, one pure LRU and one pure LFU, replay the accesses (of sampled layers,
  below).
  When one of them has scored clearly more hits lately (decayed over SHADOW_HALF_LIFE steps), its
  rule decides each eviction outright; only while they are close does the LeCaR draw decide. The
  ghost-list learning alone needs many regrets to move the weights, and the random draws it makes
  meanwhile cost hits on a short trace (a recency workload reached only 0.95x LRU's speed).
  As set dueling samples a few cache sets, the shadows replay every SHADOW_EVERY-th MoE layer
  with that share of the capacity: a third of the host time the shadows took, the simulator's
  figures within 1 %.
- Admission by the cost model: only misses the planner streams ask for a slot (a miss the CPU
  absorbs evicts nothing). The planner is told what keeping each missed expert is worth
  (`stream_values`; the planner's `Budgets.stream_values`, passed as an array): its decayed routing rate minus the rate of the expert it would
  displace, over WINDOW steps, times the cost of the miss it saves. Under the LFU expert a
  streamed expert rarer than the victim is used once and not kept.

Host time: this runs on the critical path of every MoE layer, so each of the three calls of a
layer-step is one compiled (numba, `_jit.py`) call plus a little Python: `split` (the misses'
values and `plan`), `touch` (the counts; the ghosts and the sampled shadows stay Python) and
`admit_many` (every admission of the layer-step: the LeCaR draws come from a buffer of the same
generator, in the same order, so the decisions are those of one `admit` per expert). The
executor copies the admitted experts after that call; `discard` forgets an admission whose copy
an error stopped.
"""
from __future__ import annotations

import heapq
import math
from collections import OrderedDict

import numpy as np

from freetoken_py.residency._jit import _admit_core, _min_rate, _miss_values, _split_core, _touch_core, _victim_scan
from freetoken_py.residency.planner import CostModel, LayerStats, Plan, core_costs, plan_from_core

Key = tuple[int, int]
LRU, LFU = 0, 1
WINDOW = 8          # steps over which a kept expert's value is counted
SHADOW_HALF_LIFE = 16.0   # steps over which the shadow caches' hits are compared
SHADOW_MARGIN = 0.02      # a shadow leads "clearly" when ahead by this share of their hits
SHADOW_EVERY = 4          # the shadows replay every 4th MoE layer (set sampling)


class AdaptivePolicy:
    name = "ours"
    evicts = True

    def __init__(self, layers: list[int], num_experts: int, capacity: int, half_life_steps: float = 64.0,
                 learning_rate: float = 0.45, floor_share: float = 0.5, seed: int = 0,
                 shadow_margin: float = SHADOW_MARGIN):
        self.layers = list(layers)
        self.capacity = capacity
        n = max(layers) + 1 if layers else 1
        self.num_experts = num_experts
        self.res = np.zeros((n, num_experts), bool)            # [L, E] resident
        self.count = np.zeros(n, np.int64)                     # [L] resident experts per layer
        self._sets: list[set[int]] = [set() for _ in range(n)]  # [L] the residents, as sets (queried per layer-step)
        # the residents' flat indices (layer * E + expert), unordered, and where each one sits;
        # beside them, in the same order, each resident's layer, last step and count (copies of
        # `last` and `freq`, kept in step): the victim scan reads these contiguously, not every
        # (layer, expert) nor a scattered gather
        self._rlist = np.zeros(n * num_experts, np.int64)
        self._rpos = np.full(n * num_experts, -1, np.int64)
        self._rlayer = np.zeros(n * num_experts, np.int64)
        self._rlast = np.zeros(n * num_experts, np.int64)
        self._rfreq = np.zeros(n * num_experts)
        self._nres = 0
        self.last = np.full((n, num_experts), -1, np.int64)    # [L, E] last step routed
        self.layer_last = np.zeros(n, np.int64)                # [L] last step each layer routed
        # decayed routing count, stored inflated by decay**-step so comparing needs no rescaling
        self.freq = np.zeros((n, num_experts))                 # [L, E]
        self._decay = 0.5 ** (1.0 / half_life_steps)
        # a second, fast-decaying count (half-life 8 steps) so a burst of recent use is valued
        # before the slow count catches up: what a recency-driven workload needs
        self.fast = np.zeros((n, num_experts))
        self._fast_decay = 0.5 ** (1.0 / 8.0)
        self._fast_step = np.zeros((n, num_experts), np.int64)
        self._base = 0                                         # step the inflation is relative to
        # flat views of the [L, E] arrays (index layer * E + expert) for the compiled calls
        self._res_flat, self._last_flat, self._freq_flat = self.res.reshape(-1), self.last.reshape(-1), self.freq.reshape(-1)
        self._fast_flat, self._fast_step_flat = self.fast.reshape(-1), self._fast_step.reshape(-1)
        self.weights = np.array([0.5, 0.5])                    # [w_lru, w_lfu]
        self.learning_rate = learning_rate
        self.floor_share = floor_share
        self.ghosts: OrderedDict[Key, tuple[int, int]] = OrderedDict()   # key -> (expert, step)
        self.shadows = (_LruShadow(), _LfuShadow())           # metadata-only pure-LRU / pure-LFU caches
        # set sampling (as set dueling samples cache sets): the shadows replay every SHADOW_EVERY-th
        # layer, with that share of the capacity; a model with fewer than 2 * SHADOW_EVERY MoE
        # layers has all of them replayed
        self._sampled = set(self.layers[::SHADOW_EVERY]) if len(self.layers) >= 2 * SHADOW_EVERY else set(self.layers)
        self.shadow_hits = np.zeros(2)                         # decayed hits of each shadow
        self._shadow_decay = 0.5 ** (1.0 / SHADOW_HALF_LIFE)
        self._shadow_step = 0
        self.shadow_margin = shadow_margin    # >= 1: the duel never decides (plain LeCaR)
        self._rng = np.random.default_rng(seed)
        self._rbuf, self._rbuf_at = np.zeros(0), 0     # draws of _rng not used yet, in order
        self.draws = 0                                 # LeCaR draws made (a full cache while the duel was close)
        self.now = 0
        self._victim_rate = (-1, 0.0)                          # (step, slowest resident's rate)
        # (layer, candidates, copies) of the last plan: what a shadow may admit, and how many
        self._offered: tuple[int, tuple[int, ...], int] | None = None
        self._arrays: tuple[dict, np.ndarray, np.ndarray] | None = None   # split()'s tokens, as arrays, for touch()

    # ---- queries --------------------------------------------------------------------------
    def resident(self, layer: int) -> frozenset[int]:
        return frozenset(self._sets[layer])

    def is_resident(self, layer: int, expert: int) -> bool:
        return bool(self.res[layer, expert])

    @property
    def keys(self) -> set[Key]:
        return {(int(l), int(e)) for l, e in zip(*np.nonzero(self.res))}

    def _rate_terms(self) -> tuple[float, float, float, float, int]:
        """`_rate`'s scalars at this step: the slow count's inflation and both normalisations."""
        fd = self._fast_decay
        return self._decay ** (self.now - self._base), 1 - self._decay, fd, 1 - fd, self.now

    def _victim_rate_now(self) -> float:
        """The routing rate of the slowest-routed resident, the one a kept miss would displace
        (0.0 while slots are free); a scan of every resident, once per step."""
        if self._nres < self.capacity:
            return 0.0
        if self._victim_rate[0] != self.now:
            n = self._nres
            self._victim_rate = (self.now, _min_rate(self._rlist[:n], self._freq_flat, self._fast_flat,
                                                     self._fast_step_flat, *self._rate_terms()))
        return self._victim_rate[1]

    def stream_values(self, layer: int, misses: list[int], cost: CostModel) -> dict[int, float]:
        """Seconds each missed expert would save over the next WINDOW steps if kept, net of what
        the slowest-routed resident (the one it would displace; none while slots are free) would."""
        ids = np.asarray(misses, np.int64)
        vals = _miss_values(ids, np.zeros(len(ids), np.bool_), self.freq[layer], self.fast[layer],
                            self._fast_step[layer], *self._rate_terms(), self._victim_rate_now(),
                            min(cost.cpu_s(1), cost.copy_s()), float(WINDOW))
        return dict(zip(misses, vals.tolist()))

    def warm_start(self, counts: np.ndarray) -> None:
        """Fill the cache from prior routing counts [L, E] (a calibration run or the last
        session's stats) and seed the frequency estimate with them, scaled to one half-life."""
        total = counts[self.layers].sum(axis=1, keepdims=True).clip(min=1)
        self.freq[self.layers] += counts[self.layers] / total * 8.0 * self._decay ** (self._base - self.now)
        keys = [(l, e) for l in self.layers for e in range(self.num_experts)]
        keys.sort(key=lambda k: (-counts[k], k))
        for l, e in keys[:self.capacity]:
            self._add(l, e)                  # (copies the counts just seeded beside the resident)
        sampled = [(int(l), int(e)) for l, e in zip(*np.nonzero(self.res)) if l in self._sampled]
        sampled.sort(key=lambda k: (self.freq[k], k))   # the LRU shadow's oldest first: the rarest
        for shadow in self.shadows:
            shadow.fill(sampled, self.freq)
            shadow.trim(self._shadow_capacity(), self.freq)

    def _shadow_capacity(self) -> int:
        if len(self._sampled) == len(self.layers):
            return self.capacity
        return max(1, round(self.capacity * len(self._sampled) / max(1, len(self.layers))))

    # ---- the interface --------------------------------------------------------------------
    def split(self, layer: int, stats: LayerStats, cost: CostModel) -> Plan:
        tokens, resident = stats.tokens, stats.resident
        m = len(tokens)
        ids = np.fromiter(tokens, np.int64, m)
        ntok = np.fromiter(tokens.values(), np.int64, m)
        res = np.fromiter((e in resident for e in tokens), np.bool_, m) if resident else np.zeros(m, np.bool_)
        self._arrays = (tokens, ids, ntok)
        victim = self._victim_rate_now() if self.capacity and m > len(resident & tokens.keys()) else 0.0
        costs = core_costs(cost)
        per_miss = cost.__dict__.get("_per_miss_s")
        if per_miss is None:       # (a cache beside the frozen fields, as core_costs')
            per_miss = cost.__dict__["_per_miss_s"] = min(cost.cpu_s(1), cost.copy_s())
        # the misses' values (`stream_values`) and `plan`, in one compiled call
        p = plan_from_core(ids, _split_core(ids, ntok, res, self.freq[layer], self.fast[layer], self._fast_step[layer],
                                            *self._rate_terms(), victim, per_miss, float(WINDOW), self.capacity,
                                            costs))
        # what this layer-step leaves in the accelerator's hands (the streamed misses, most worth
        # keeping first, then the hits), and how many copies the planner found worth making
        # (CPU-evaluated and cut experts never reach a slot)
        if layer in self._sampled:   # (touch() replays only the sampled layers on the shadows)
            self._offered = (layer, p.stream + p.hits, len(p.stream))
        return p

    def touch(self, layer: int, step: int, tokens: dict[int, int]) -> None:
        self.now = step
        scale = self._decay ** (self._base - step)
        ghosts = self.ghosts
        if ghosts:
            for e in tokens:
                if (layer, e) in ghosts:
                    self._regret((layer, e), step)
        cached = self._arrays
        if cached is not None and cached[0] is tokens:     # split() saw this dict: its arrays
            ids, ntok = cached[1], cached[2]
        else:
            ids = np.fromiter(tokens, np.int64, len(tokens))
            ntok = np.fromiter(tokens.values(), np.int64, len(tokens))
        self._arrays = None
        _touch_core(ids, ntok, self.freq[layer], self.fast[layer], self._fast_step[layer], self.last[layer], self._rpos,
                    layer * self.num_experts, self._rfreq, self._rlast, scale, self._fast_decay, step)
        self.layer_last[layer] = step
        if scale > 1e100:        # re-base the inflated counts before they overflow
            self.freq *= self._decay ** (step - self._base)
            self._rfreq[:self._nres] *= self._decay ** (step - self._base)
            self._base = step
            lfu = self.shadows[LFU]
            lfu.fill(list(lfu.resident), self.freq)     # its heap holds the old counts
        self._shadow_touch(layer, step, tokens)

    def _shadow_touch(self, layer: int, step: int, tokens: dict[int, int]) -> None:
        """Replay this layer-step on the pure-LRU and pure-LFU shadows. A shadow admits what the
        accelerator handles this step (the misses the planner streamed, then the real cache's
        hits), as many as the copies the planner made: a shadow lacking one of the real cache's
        hot experts can pick it up when the streamed ones leave room, and no shadow copies more
        per step than the real cache could (a pure LRU offered all of a step's misses loops and never hits). What the
        CPU absorbed or the planner cut reaches no slot. Without a plan for this layer, every
        expert is offered. The LFU shadow, like the real cache under LFU, turns away one rarer
        than its victim."""
        if step != self._shadow_step:
            self.shadow_hits *= self._shadow_decay ** (step - self._shadow_step)
            self._shadow_step = step
        if self.capacity == 0 or layer not in self._sampled:
            self._offered = None
            return
        keys = [(layer, int(e)) for e in tokens]
        offered, budget = keys, len(keys)
        if self._offered is not None and self._offered[0] == layer:
            offered, budget = [(layer, int(e)) for e in self._offered[1]], self._offered[2]
            self._offered = None
        for which, shadow in enumerate(self.shadows):
            self.shadow_hits[which] += shadow.access(keys, self._shadow_capacity(), self.freq, offered, budget)

    def _leader(self) -> int | None:
        """LRU or LFU when its shadow has clearly scored more hits lately; None while they are close."""
        lru, lfu = self.shadow_hits
        if abs(lru - lfu) <= self.shadow_margin * (lru + lfu):
            return None
        return LRU if lru > lfu else LFU

    def admit(self, layer: int, expert: int, step: int) -> list[Key]:
        return self.admit_many(layer, (expert,), step)[0]

    def admit_many(self, layer: int, experts, step: int) -> list[list[Key]]:
        """`admit` for each of `experts` in turn (what each evicted), in one compiled call: the
        leader of the duel cannot change between them, and the LeCaR draws come from a buffer of
        the same generator in the same order."""
        if self.capacity == 0 or not len(experts):
            return [[] for _ in experts]
        leader = self._leader()
        if self._rbuf_at + len(experts) > len(self._rbuf):      # room for one draw per expert
            self._rbuf = np.concatenate((self._rbuf[self._rbuf_at:], self._rng.random(max(64, len(experts)))))
            self._rbuf_at = 0
        E = self.num_experts
        flats = np.asarray(experts, np.int64) + layer * E
        out = np.empty((len(flats), 3), np.int64)
        start = self._rbuf_at
        self._nres, self._rbuf_at = _admit_core(
            flats, layer, E, self.capacity, self._nres, -1 if leader is None else leader, self.weights[LRU],
            self._rbuf, self._rbuf_at, self.now, self._floor(), self._res_flat, self.count,
            self._last_flat, self._freq_flat, self.layer_last, self._rlist, self._rpos, self._rlayer,
            self._rlast, self._rfreq, out)
        self.draws += self._rbuf_at - start
        evicted = []
        for expert, (added, victim, which) in zip(experts, out.tolist()):
            if added:
                self._sets[layer].add(int(expert))
            if victim < 0:
                evicted.append([])
            elif added:
                key = divmod(victim, E)
                self._sets[key[0]].discard(key[1])
                self._remember(key, which, step)
                evicted.append([key])
            else:                                       # refused under LFU: used once, not kept
                self._remember((layer, int(expert)), LFU, step)
                evicted.append([])
        return evicted

    def _floor(self, floor: bool = True) -> int:
        """Residents a layer keeps whatever the scores (`floor_share` of its fair share); -1: none."""
        return int(self.floor_share * self.capacity / len(self.layers)) if floor and self.layers else -1

    def resize(self, capacity: int) -> list[Key]:
        self.capacity = capacity
        evicted = []
        while self._nres > capacity:
            victim = self._victim(LRU if self.weights[LRU] >= self.weights[LFU] else LFU, floor=False)
            self._evict(victim, LRU, self.now)
            evicted.append(victim)
        for shadow in self.shadows:     # the shadows shrink with the cache
            shadow.trim(self._shadow_capacity(), self.freq)
        return evicted

    # ---- internals ------------------------------------------------------------------------
    def _victim(self, which: int, exclude: Key | None = None, floor: bool = True,
                busy_layer: int | None = None) -> Key | None:
        """The resident to evict under LRU or LFU (`_victim_scan`'s order), never `exclude` nor an expert
        `busy_layer` is using this step; with `floor`, outside the layers at or under their floor
        while any other layer has one. One pass over the cache (numba)."""
        fair = self._floor(floor)
        n = self._nres
        flat = _victim_scan(self._rlist[:n], self._rlayer[:n], self._rlast[:n], self._rfreq[:n], self.layer_last,
                            self.count, which == LRU, self.now,
                            -1 if exclude is None else exclude[0] * self.num_experts + exclude[1],
                            -1 if busy_layer is None else busy_layer, fair)
        return divmod(flat, self.res.shape[1]) if flat >= 0 else None

    def _add(self, layer: int, expert: int) -> None:
        self.res[layer, expert] = True
        self.count[layer] += 1
        self._sets[layer].add(int(expert))
        flat = layer * self.num_experts + expert
        i = self._nres
        self._rlist[i], self._rpos[flat], self._rlayer[i] = flat, i, layer
        self._rlast[i], self._rfreq[i] = self.last[layer, expert], self.freq[layer, expert]
        self._nres += 1

    def discard(self, layer: int, expert: int) -> None:
        """Forget an admission that never reached its slot (an error before the copy): out of
        the cache, no ghost (nobody decided against it)."""
        if self.res[layer, expert]:
            self._remove((layer, expert))

    def _evict(self, key: Key, which: int, step: int) -> None:
        self._remove(key)
        self._remember(key, which, step)

    def _remove(self, key: Key) -> None:
        self.res[key] = False
        self.count[key[0]] -= 1
        self._sets[key[0]].discard(int(key[1]))
        flat = key[0] * self.num_experts + key[1]
        i, j = self._rpos[flat], self._nres - 1       # swap-remove: the last entry moves into i
        last = self._rlist[j]
        self._rlist[i], self._rpos[last], self._rpos[flat] = last, i, -1
        self._rlayer[i], self._rlast[i], self._rfreq[i] = self._rlayer[j], self._rlast[j], self._rfreq[j]
        self._nres -= 1

    def _remember(self, key: Key, which: int, step: int) -> None:
        self.ghosts[key] = (which, step)
        self.ghosts.move_to_end(key)
        while len(self.ghosts) > max(1, self.capacity):
            self.ghosts.popitem(last=False)

    def _regret(self, key: Key, step: int) -> None:
        ghost = self.ghosts.pop(key, None)
        if ghost is None:
            return
        which, when = ghost
        discount = 0.005 ** (1.0 / max(1, self.capacity))
        w = [float(self.weights[LRU]), float(self.weights[LFU])]
        w[which] *= math.exp(-self.learning_rate * discount ** (step - when))
        total = w[0] + w[1]
        w = [min(0.99, max(0.01, x / total)) for x in w]             # never lock one out
        total = w[0] + w[1]
        self.weights = np.array([w[0] / total, w[1] / total])


class _LruShadow:
    """Pure LRU over (layer, expert) keys, metadata only: O(1) per access."""

    def __init__(self) -> None:
        self.keys: OrderedDict[Key, None] = OrderedDict()

    def fill(self, keys: list[Key], freq: np.ndarray) -> None:
        self.keys = OrderedDict((k, None) for k in keys)

    def access(self, keys: list[Key], capacity: int, freq: np.ndarray, offered: list[Key], budget: int) -> int:
        """One layer-step's experts `keys`: returns the hits; then up to `budget` of `offered`
        that are missing are admitted in order, the least recently used key out (never one of
        this layer-step's, which are all moved to the end first)."""
        hits = 0
        busy = set(keys)
        for k in keys:
            if k in self.keys:
                hits += 1
                self.keys.move_to_end(k)
        for k in offered:
            if budget <= 0:
                break
            if k not in self.keys:
                budget -= 1
                if len(self.keys) >= capacity:
                    if next(iter(self.keys)) in busy:
                        continue                  # the oldest is this layer-step's: every slot is
                    self.keys.popitem(last=False)
                self.keys[k] = None
        return hits

    def trim(self, capacity: int, freq: np.ndarray) -> None:
        while len(self.keys) > capacity:
            self.keys.popitem(last=False)


class _LfuShadow:
    """Pure LFU (decayed counts, the policy's own `freq`) with the same admission rule as the real
    cache under LFU, metadata only: a lazy min-heap of (count when pushed, order, key), where an
    entry is current only while the key is resident and its count unchanged (counts only grow)."""

    def __init__(self) -> None:
        self.resident: set[Key] = set()
        self.heap: list[tuple[float, int, Key]] = []
        self._order = 0                           # push order: among equal counts the older goes

    def _push(self, key: Key, freq: np.ndarray) -> None:
        self._order += 1
        heapq.heappush(self.heap, (float(freq[key]), self._order, key))

    def fill(self, keys: list[Key], freq: np.ndarray) -> None:
        self.resident, self.heap = set(), []
        for k in keys:
            self.resident.add(k)
            self._push(k, freq)

    def _pop_victim(self, freq: np.ndarray, busy: set[Key]):
        """The resident with the lowest count, not in `busy`; its heap entry stays (peek)."""
        held = []
        victim = None
        while self.heap:
            f, order, k = self.heap[0]
            if k not in self.resident or f != float(freq[k]):
                heapq.heappop(self.heap)          # stale: evicted, or touched since (a newer entry exists)
                continue
            if k in busy:
                held.append(heapq.heappop(self.heap))
                continue
            victim = k
            break
        for entry in held:
            heapq.heappush(self.heap, entry)
        return victim

    def access(self, keys: list[Key], capacity: int, freq: np.ndarray, offered: list[Key], budget: int) -> int:
        """As `_LruShadow.access`, the lowest count out, and a key rarer than it not kept."""
        hits = 0
        busy = set(keys)
        for k in keys:                            # counts were raised by touch(): re-key them
            if k in self.resident:
                hits += 1
                self._push(k, freq)
        for k in offered:
            if budget <= 0:
                break
            if k in self.resident:
                continue
            budget -= 1
            if len(self.resident) >= capacity:
                victim = self._pop_victim(freq, busy)
                if victim is None or freq[k] < freq[victim]:
                    continue                      # rarer than the victim: not kept
                self.resident.discard(victim)
            self.resident.add(k)
            self._push(k, freq)
        if len(self.heap) > 4 * max(64, len(self.resident)):   # drop stale entries now and then
            self.fill(list(self.resident), freq)
        return hits

    def trim(self, capacity: int, freq: np.ndarray) -> None:
        while len(self.resident) > capacity:
            victim = self._pop_victim(freq, set())
            self.resident.discard(victim)
