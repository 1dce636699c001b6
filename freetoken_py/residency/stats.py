"""Routing statistics and the routing-trace file format.

Trace file (JSON lines, written by `freetoken run --record-routing FILE`):

    {"format": "freetoken-routing-trace", "version": 1, "num_layers": L, "num_experts": E,
     "top_k": k, "source": "..."}                                   <- header, line 1
    {"step": 0, "tokens": T, "layers": {"0": [[e, e], ...], ...}}   <- one line per forward pass

`layers[l]` holds the routed expert ids [T][k] of MoE layer l; dense layers are absent. A step is
one forward pass (a prefill chunk or a decode batch), so T > 1 marks prefill.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

TRACE_FORMAT = "freetoken-routing-trace"
TRACE_VERSION = 1


@dataclass
class RoutingTrace:
    num_layers: int
    num_experts: int
    top_k: int
    source: str = ""
    steps: list[dict[int, np.ndarray]] = field(default_factory=list)   # step -> layer -> ids [T, k]

    def add_step(self, layers: dict[int, np.ndarray]) -> None:
        self.steps.append({int(l): np.asarray(ids, dtype=np.int64) for l, ids in layers.items()})

    @property
    def moe_layers(self) -> list[int]:
        return sorted({l for s in self.steps for l in s})

    def num_pairs(self) -> int:
        return sum(ids.size for s in self.steps for ids in s.values())

    def save(self, path: Path | str) -> None:
        with open(path, "w") as f:
            header = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "num_layers": self.num_layers,
                      "num_experts": self.num_experts, "top_k": self.top_k, "source": self.source}
            f.write(json.dumps(header) + "\n")
            for i, step in enumerate(self.steps):
                tokens = next(iter(step.values())).shape[0] if step else 0
                layers = {str(l): ids.tolist() for l, ids in sorted(step.items())}
                f.write(json.dumps({"step": i, "tokens": tokens, "layers": layers}) + "\n")

    @classmethod
    def load(cls, path: Path | str) -> "RoutingTrace":
        with open(path) as f:
            lines = iter(f)
            header = json.loads(next(lines, "{}"))
            if header.get("format") != TRACE_FORMAT or header.get("version") != TRACE_VERSION:
                raise ValueError(f"{path}: not a {TRACE_FORMAT} v{TRACE_VERSION} file")
            trace = cls(header["num_layers"], header["num_experts"], header["top_k"], header.get("source", ""))
            for line in lines:
                if line.strip():
                    rec = json.loads(line)
                    trace.add_step({int(l): np.array(v, dtype=np.int64).reshape(-1, trace.top_k)
                                    for l, v in rec["layers"].items()})
        return trace


def tokens_per_expert(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """ids [T, k] -> counts [E]: how many tokens of this step route to each expert."""
    return np.bincount(np.asarray(ids).reshape(-1), minlength=num_experts)


@dataclass
class RoutingStats:
    """Running per-layer counts: total routed pairs per expert and a decayed (recent) count."""
    num_layers: int
    num_experts: int
    half_life_steps: float = 256.0
    counts: np.ndarray = field(init=False)      # [L, E] all-time routed pairs
    recent: np.ndarray = field(init=False)      # [L, E] exponentially decayed pairs
    last_step: np.ndarray = field(init=False)   # [L, E] last step each expert was routed (-1 never)

    def __post_init__(self) -> None:
        shape = (self.num_layers, self.num_experts)
        self.counts, self.recent = np.zeros(shape, np.int64), np.zeros(shape)
        self.last_step = np.full(shape, -1, np.int64)
        self._decay = 0.5 ** (1.0 / self.half_life_steps)

    def observe(self, layer: int, step: int, ids: np.ndarray) -> np.ndarray:
        """Record one layer-step; returns its tokens per expert [E]."""
        n = tokens_per_expert(ids, self.num_experts)
        self.counts[layer] += n
        self.recent[layer] *= self._decay
        self.recent[layer] += n
        self.last_step[layer, n > 0] = step
        return n


def routing_counts(trace: RoutingTrace) -> np.ndarray:
    """[L, E] routed pairs per (layer, expert) over the whole trace (a calibration run's counts)."""
    counts = np.zeros((trace.num_layers, trace.num_experts), np.int64)
    for _, layer, ids in iter_layer_steps(trace):
        counts[layer] += tokens_per_expert(ids, trace.num_experts)
    return counts


def iter_layer_steps(trace: RoutingTrace) -> Iterator[tuple[int, int, np.ndarray]]:
    """(step, layer, ids [T, k]) in execution order: layers in order within each step."""
    for s, step in enumerate(trace.steps):
        for layer in sorted(step):
            yield s, layer, step[layer]


class RoutingRecorder:
    """An `ExpertExecutor` wrapper that records routing and delegates the compute unchanged.

    A call for a layer not above the previous call's layer starts a new step (a new forward pass).
    """

    def __init__(self, inner, num_layers: int, num_experts: int, top_k: int, source: str = ""):
        self.inner = inner
        self.trace = RoutingTrace(num_layers, num_experts, top_k, source)
        self._last_layer = None

    def __call__(self, layer, x, ids, weights):
        if self._last_layer is None or layer <= self._last_layer:
            self.trace.steps.append({})
        self.trace.steps[-1][int(layer)] = ids.detach().cpu().numpy().astype(np.int64)
        self._last_layer = layer
        return self.inner(layer, x, ids, weights)

    def rewind(self, num_steps: int) -> None:
        """Forget every step after the first `num_steps` (a forward pass that failed and will be
        run again); the next call starts a new step."""
        del self.trace.steps[num_steps:]
        self._last_layer = None

    def __getattr__(self, name):   # telemetry etc. of the wrapped executor stay reachable
        return getattr(self.inner, name)
