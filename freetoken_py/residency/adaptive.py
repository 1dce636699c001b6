"""Our cache policy: learns online how much recency vs frequency the running workload rewards.

LeCaR-style (Vietri et al., HotStorage '18): two experts, LRU (evict the least recently routed)
and LFU (evict the lowest decayed routing count), each eviction drawn from one of them with
probability w_lru / w_lfu. Every evicted or refused key is remembered in a ghost list with the
expert that decided; when a ghost is routed again soon, that decision was a regret and its
expert's weight shrinks by exp(-learning_rate * discount**age).

Changes from plain LeCaR, each for a reason measured on MoE routing:
- Recency is in *steps*, not a global access counter, so layer 0 is not "older" than layer 40
  within one forward pass (with a global counter one end of the network crowds the other out).
- Per-layer fairness: a layer holding no more than `floor_share` of its fair share
  (capacity / layers) never loses a slot.
- Admission by the cost model: only misses the planner streams ask for a slot (a miss the CPU
  absorbs evicts nothing). The planner is told what keeping each missed expert is worth
  (`Budgets.stream_values`): its decayed routing rate minus the rate of the expert it would
  displace, over WINDOW steps, times the cost of the miss it saves. Under the LFU expert a
  streamed expert rarer than the victim is used once and not kept.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

from freetoken_py.residency.planner import Budgets, CostModel, LayerStats, Plan, plan

Key = tuple[int, int]
LRU, LFU = 0, 1
WINDOW = 8          # steps over which a kept expert's value is counted


class AdaptivePolicy:
    name = "ours"

    def __init__(self, layers: list[int], num_experts: int, capacity: int, half_life_steps: float = 64.0,
                 learning_rate: float = 0.45, floor_share: float = 0.5, seed: int = 0):
        self.layers = list(layers)
        self.capacity = capacity
        n = max(layers) + 1 if layers else 1
        self.num_experts = num_experts
        self.res = np.zeros((n, num_experts), bool)            # [L, E] resident
        self.count = np.zeros(n, np.int64)                     # [L] resident experts per layer
        self.last = np.full((n, num_experts), -1, np.int64)    # [L, E] last step routed
        # decayed routing count, stored inflated by decay**-step so comparing needs no rescaling
        self.freq = np.zeros((n, num_experts))                 # [L, E]
        self._decay = 0.5 ** (1.0 / half_life_steps)
        # a second, fast-decaying count (half-life 8 steps) so a burst of recent use is valued
        # before the slow count catches up: what a recency-driven workload needs
        self.fast = np.zeros((n, num_experts))
        self._fast_decay = 0.5 ** (1.0 / 8.0)
        self._fast_step = np.zeros((n, num_experts), np.int64)
        self._base = 0                                         # step the inflation is relative to
        self.weights = np.array([0.5, 0.5])                    # [w_lru, w_lfu]
        self.learning_rate = learning_rate
        self.floor_share = floor_share
        self.ghosts: OrderedDict[Key, tuple[int, int]] = OrderedDict()   # key -> (expert, step)
        self._rng = np.random.default_rng(seed)
        self.now = 0

    # ---- queries --------------------------------------------------------------------------
    def resident(self, layer: int) -> frozenset[int]:
        return frozenset(np.flatnonzero(self.res[layer]).tolist())

    def is_resident(self, layer: int, expert: int) -> bool:
        return bool(self.res[layer, expert])

    @property
    def keys(self) -> set[Key]:
        return {(int(l), int(e)) for l, e in zip(*np.nonzero(self.res))}

    def _rates(self, idx) -> np.ndarray:
        """Routes per step lately (1.0: routed every step): the larger of the slow and the fast
        decayed count, each normalised to a rate."""
        slow = self.freq[idx] * self._decay ** (self.now - self._base) * (1 - self._decay)
        fast = self.fast[idx] * self._fast_decay ** (self.now - self._fast_step[idx]) * (1 - self._fast_decay)
        return np.maximum(slow, fast)

    def stream_values(self, layer: int, misses: list[int], cost: CostModel) -> dict[int, float]:
        """Seconds each missed expert would save over the next WINDOW steps if kept, net of what
        the slowest-routed resident (the one it would displace; none while slots are free) would."""
        victim = 0.0
        if self.count.sum() >= self.capacity:
            victim = float(np.where(self.res, self._rates(np.s_[:]), np.inf).min())
        rates = self._rates((layer, misses))
        per_miss = min(cost.cpu_s(1), cost.copy_s())
        return {e: max(0.0, float(r) - victim) * WINDOW * per_miss for e, r in zip(misses, rates)}

    def warm_start(self, counts: np.ndarray) -> None:
        """Fill the cache from prior routing counts [L, E] (a calibration run or the last
        session's stats) and seed the frequency estimate with them, scaled to one half-life."""
        keys = [(l, e) for l in self.layers for e in range(self.num_experts)]
        keys.sort(key=lambda k: (-counts[k], k))
        for l, e in keys[:self.capacity]:
            self.res[l, e] = True
            self.count[l] += 1
        total = counts[self.layers].sum(axis=1, keepdims=True).clip(min=1)
        self.freq[self.layers] += counts[self.layers] / total * 8.0 * self._decay ** (self._base - self.now)

    # ---- the interface --------------------------------------------------------------------
    def split(self, layer: int, stats: LayerStats, cost: CostModel) -> Plan:
        misses = [e for e in stats.tokens if e not in stats.resident]
        values = self.stream_values(layer, misses, cost) if misses and self.capacity else {}
        return plan(stats, cost, Budgets(stream_slots=self.capacity, stream_values=values))

    def touch(self, layer: int, step: int, tokens: dict[int, int]) -> None:
        self.now = step
        scale = self._decay ** (self._base - step)
        for e, n in tokens.items():
            self._regret((layer, e), step)
            self.freq[layer, e] += n * scale
            self.fast[layer, e] = self.fast[layer, e] * self._fast_decay ** (step - self._fast_step[layer, e]) + n
            self._fast_step[layer, e] = step
            self.last[layer, e] = step
        if scale > 1e100:        # re-base the inflated counts before they overflow
            self.freq *= self._decay ** (step - self._base)
            self._base = step

    def admit(self, layer: int, expert: int, step: int) -> list[Key]:
        if self.capacity == 0 or self.res[layer, expert]:
            return []
        evicted = []
        if self.count.sum() >= self.capacity:
            which = LRU if self._rng.random() < self.weights[LRU] else LFU
            victim = self._victim(which, exclude=(layer, expert), busy_layer=layer)
            if victim is None:
                return []
            if which == LFU and self.freq[layer, expert] < self.freq[victim]:
                self._remember((layer, expert), LFU, step)     # refused: used once, not kept
                return []
            self._evict(victim, which, step)
            evicted.append(victim)
        self.res[layer, expert] = True
        self.count[layer] += 1
        return evicted

    def resize(self, capacity: int) -> list[Key]:
        self.capacity = capacity
        evicted = []
        while self.count.sum() > capacity:
            victim = self._victim(LRU if self.weights[LRU] >= self.weights[LFU] else LFU, floor=False)
            self._evict(victim, LRU, self.now)
            evicted.append(victim)
        return evicted

    # ---- internals ------------------------------------------------------------------------
    def _victim(self, which: int, exclude: Key | None = None, floor: bool = True,
                busy_layer: int | None = None) -> Key | None:
        if which == LRU:   # oldest step first; among equals the rarer
            score = self.last + 0.5 * self.freq / (1.0 + self.freq.max())
        else:              # rarest first; among equals the older
            score = self.freq + 1e-9 * (self.last + 1) / (self.now + 2)
        score = np.where(self.res, score, np.inf)
        if exclude is not None:
            score[exclude] = np.inf
        if busy_layer is not None:                     # experts this layer-step is using stay
            score[busy_layer, self.last[busy_layer] == self.now] = np.inf
        if floor and self.layers:
            fair = int(self.floor_share * self.capacity / len(self.layers))
            guarded = score.copy()
            guarded[self.count <= fair] = np.inf        # protected layers
            if np.isfinite(guarded).any():
                score = guarded
        flat = int(np.argmin(score))
        return divmod(flat, self.res.shape[1]) if np.isfinite(score.flat[flat]) else None

    def _evict(self, key: Key, which: int, step: int) -> None:
        self.res[key] = False
        self.count[key[0]] -= 1
        self._remember(key, which, step)

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
        self.weights[which] *= math.exp(-self.learning_rate * discount ** (step - when))
        self.weights = np.clip(self.weights / self.weights.sum(), 0.01, 0.99)  # never lock one out
        self.weights /= self.weights.sum()
