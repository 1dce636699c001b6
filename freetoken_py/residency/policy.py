"""Cache policies: which experts stay in VRAM slots, which misses stream, what gets evicted.

All four share one interface so the simulator and the executor drive them the same way:

    split(layer, stats, cost) -> Plan       which misses stream and which go to the CPU
    touch(layer, step, tokens)              record that these experts were routed
    admit(layer, expert, step) -> evicted   a streamed expert asks for a slot
    admit_many(layer, experts, step)        `admit` for each in turn -> what each evicted
    discard(layer, expert)                  an admission whose copy never happened is forgotten
    resize(capacity) -> evicted             elastic VRAM

Baselines: `StaticPolicy` (llama.cpp `--n-cpu-moe`: the first layers' experts on the CPU, the rest
resident, no streaming), `PinPolicy` (KTransformers-style frequency pinning, counts given up front,
no streaming), `LruPolicy` (one global LRU, misses split by a fixed ratio from an offline
benchmark). Ours is `AdaptivePolicy`.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from freetoken_py.residency.planner import CostModel, LayerStats, Plan, evaluate

Key = tuple[int, int]   # (layer, expert)


def look_ahead(policy, layer: int, predicted, allowed: int, step: int, on_admit=None) -> tuple[set[int], int, bool]:
    """The look-ahead prefetch's admissions for `layer` (the executor's `_prefetch` and the
    simulator's replay both run this): the `predicted` experts, best first, are offered to the
    policy until `allowed` of them were copied; an admission that evicts a better-ranked
    predicted expert (one already resident, or copied here) ends it, as the guesses further down
    are worth less than the one it pushed out. `on_admit(expert, evicted, admitted)` runs after
    each admission (the executor frees the victims' slots and copies an admitted expert).
    Returns (the experts copied here and still resident, the copies made, whether it stopped)."""
    mine: set[int] = set()       # copied here
    seen: set[int] = set()       # better guesses already passed (resident, or copied here)
    copies = 0
    for e in predicted:
        if len(mine) >= allowed:
            break
        if policy.is_resident(layer, e):
            seen.add(e)
            continue
        evicted = policy.admit(layer, e, step)
        admitted = policy.is_resident(layer, e)
        if on_admit is not None:
            on_admit(e, evicted, admitted)
        lost = {k[1] for k in evicted if k[0] == layer and k[1] in seen}
        mine -= lost
        seen -= lost
        if admitted:
            mine.add(e)
            seen.add(e)
            copies += 1
        if lost:
            return mine, copies, True
    return mine, copies, False


class _SetPolicy:
    """A fixed resident set; every miss runs on the CPU."""
    name = "set"
    evicts = False    # nothing it holds ever leaves for another expert (its statistics decide nothing)

    def __init__(self, resident: set[Key]):
        self._resident = set(resident)
        self._by_layer: dict[int, frozenset[int]] = {}
        self._index()

    def _index(self) -> None:
        layers: dict[int, set[int]] = {}
        for l, e in self._resident:
            layers.setdefault(l, set()).add(e)
        self._by_layer = {l: frozenset(es) for l, es in layers.items()}

    def resident(self, layer: int) -> frozenset[int]:
        return self._by_layer.get(layer, frozenset())

    def is_resident(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._resident

    def split(self, layer: int, stats: LayerStats, cost: CostModel) -> Plan:
        return evaluate(stats, (), cost)

    def touch(self, layer: int, step: int, tokens: dict[int, int]) -> None:
        pass

    def admit(self, layer: int, expert: int, step: int) -> list[Key]:
        return []

    def admit_many(self, layer: int, experts, step: int) -> list[list[Key]]:
        return [[] for _ in experts]

    def discard(self, layer: int, expert: int) -> None:
        pass

    def resize(self, capacity: int) -> list[Key]:
        if capacity >= len(self._resident):
            return []
        drop = sorted(self._resident)[capacity:]
        self._resident -= set(drop)
        self._index()
        return drop

    @property
    def keys(self) -> set[Key]:
        return set(self._resident)


class StaticPolicy(_SetPolicy):
    """llama.cpp `--n-cpu-moe N`: whole layers resident from the last layer down; the rest CPU."""
    name = "static"

    def __init__(self, layers: list[int], num_experts: int, capacity: int):
        n_gpu = min(len(layers), capacity // num_experts)
        gpu_layers = layers[len(layers) - n_gpu:]
        super().__init__({(l, e) for l in gpu_layers for e in range(num_experts)})


class PinPolicy(_SetPolicy):
    """Pin the `capacity` most frequently routed (layer, expert) pairs of `counts` [L, E]."""
    name = "pin"

    def __init__(self, layers: list[int], counts: np.ndarray, capacity: int):
        keys = [(l, e) for l in layers for e in range(counts.shape[1])]
        keys.sort(key=lambda k: (-counts[k], k))
        super().__init__(set(keys[:capacity]))


class LruPolicy:
    """One global LRU over (layer, expert); a fixed share of misses streams (and is admitted)."""
    name = "lru"
    evicts = True

    def __init__(self, capacity: int, stream_share: float):
        self.capacity = capacity
        self.stream_share = stream_share
        self._lru: OrderedDict[Key, None] = OrderedDict()
        self._by_layer: dict[int, set[int]] = {}
        self._credit = 0.0

    def resident(self, layer: int) -> frozenset[int]:
        return frozenset(self._by_layer.get(layer, ()))

    def warm_start(self, counts) -> None:
        """Fill from prior routing counts [L, E], most frequent last (= most recently used)."""
        keys = [(l, e) for l in range(counts.shape[0]) for e in range(counts.shape[1]) if counts[l, e] > 0]
        keys.sort(key=lambda k: (-counts[k], k))
        for l, e in reversed(keys[:self.capacity]):
            self._lru[(l, e)] = None
            self._by_layer.setdefault(l, set()).add(e)

    def is_resident(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._lru

    def split(self, layer: int, stats: LayerStats, cost: CostModel) -> Plan:
        stream = []
        for e in sorted(stats.tokens, key=lambda e: (-stats.tokens[e], e)):
            if e in stats.resident or self.capacity == 0:
                continue
            self._credit += self.stream_share
            if self._credit >= 1.0:
                self._credit -= 1.0
                stream.append(e)
        return evaluate(stats, stream, cost)

    def touch(self, layer: int, step: int, tokens: dict[int, int]) -> None:
        for e in tokens:
            if (layer, e) in self._lru:
                self._lru.move_to_end((layer, e))

    def admit(self, layer: int, expert: int, step: int) -> list[Key]:
        if self.capacity == 0:
            return []
        self._lru[(layer, expert)] = None
        self._lru.move_to_end((layer, expert))
        self._by_layer.setdefault(layer, set()).add(expert)
        return self.resize(self.capacity)

    def admit_many(self, layer: int, experts, step: int) -> list[list[Key]]:
        return [self.admit(layer, e, step) for e in experts]

    def discard(self, layer: int, expert: int) -> None:
        if (layer, expert) in self._lru:
            del self._lru[(layer, expert)]
            self._by_layer[layer].discard(expert)

    def resize(self, capacity: int) -> list[Key]:
        self.capacity = capacity
        evicted = []
        while len(self._lru) > capacity:
            key = self._lru.popitem(last=False)[0]
            self._by_layer[key[0]].discard(key[1])
            evicted.append(key)
        return evicted

    @property
    def keys(self) -> set[Key]:
        return set(self._lru)
