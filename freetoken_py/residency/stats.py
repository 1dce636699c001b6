"""Routing statistics and the routing-trace file format.

Trace file (JSON lines, written by `freetoken run --record-routing FILE`):

    {"format": "freetoken-routing-trace", "version": 1, "num_layers": L, "num_experts": E,
     "top_k": k, "source": "..."}                                   <- header, line 1
    {"step": 0, "tokens": T, "layers": {"0": [[e, e], ...], ...},    <- one line per forward pass
     "predicted": {"1": [e, ...], ...}}                               <- optional

`layers[l]` holds the routed expert ids [T][k] of MoE layer l; dense layers are absent. A step is
one forward pass (a prefill chunk or a decode batch). A decode step is a pass in which every
request brings one token it generated: a lone token, or a batch of T requests decoding together.
Where that differs from T == 1 the line says so (`"decode": true` for a decode batch, `false` for
a prompt's last token computed alone); files without it read T == 1 as decode. `predicted[l]`, when
present, is the look-ahead prediction for MoE layer l made at the MoE layer before it
(`predict_experts`: that layer's input through layer l's router), as the executor's prefetch
makes it; the simulator replays it (`simulate(..., prefetch=True)`). Files without it are read
as before.
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
    # step -> predicted layer -> the experts predicted for it, best first (may be shorter than steps)
    predicted: list[dict[int, list[int]]] = field(default_factory=list)
    # step -> whether it was a decode step, where recorded (None or past the end: T == 1)
    decode: list[bool | None] = field(default_factory=list)

    def add_step(self, layers: dict[int, np.ndarray], predicted: dict[int, list[int]] | None = None,
                 decode: bool | None = None) -> None:
        self.steps.append({int(l): np.asarray(ids, dtype=np.int64) for l, ids in layers.items()})
        if predicted:
            self.predicted += [{}] * (len(self.steps) - 1 - len(self.predicted))
            self.predicted.append({int(l): [int(e) for e in v] for l, v in predicted.items()})
        if decode is not None:
            self.set_decode(len(self.steps) - 1, decode)

    def set_decode(self, step: int, decode: bool) -> None:
        self.decode += [None] * (step + 1 - len(self.decode))
        self.decode[step] = bool(decode)

    def tokens(self, step: int) -> int:
        """The tokens of a step (its rows: one per request of a decode batch)."""
        return next(iter(self.steps[step].values())).shape[0] if self.steps[step] else 0

    def is_decode(self, step: int) -> bool:
        """Whether `step` was a decode step: as recorded, else a step of one token."""
        kind = self.decode[step] if step < len(self.decode) else None
        return self.tokens(step) == 1 if kind is None else kind

    def prediction(self, step: int, layer: int) -> list[int] | None:
        """The experts predicted for `layer` at `step` (None: no prediction recorded)."""
        return self.predicted[step].get(layer) if step < len(self.predicted) else None

    @property
    def has_predictions(self) -> bool:
        return any(self.predicted)

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
                tokens = self.tokens(i)
                rec = {"step": i, "tokens": tokens, "layers": {str(l): ids.tolist() for l, ids in sorted(step.items())}}
                if self.is_decode(i) != (tokens == 1):        # only where T == 1 would say otherwise
                    rec["decode"] = self.is_decode(i)
                if i < len(self.predicted) and self.predicted[i]:
                    rec["predicted"] = {str(l): v for l, v in sorted(self.predicted[i].items())}
                f.write(json.dumps(rec) + "\n")

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
                                    for l, v in rec["layers"].items()}, rec.get("predicted"), rec.get("decode"))
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


@dataclass(frozen=True)
class SigmoidRule:
    """A sigmoid router's choice rule (DeepSeek / GLM / MiniMax; layers.moe.sigmoid_group_route):
    the correction bias shifts the choice, and with n_group > 1 only the topk_group best groups
    (a group scores the sum of its top-2 biased scores) may be picked."""
    bias: object = None     # [E] torch tensor (e_score_correction_bias) or None
    n_group: int = 1
    topk_group: int = 1


class RoutePredictor:
    """A MoE layer's router for the look-ahead: called on hidden states it gives the router's
    logits (what `predict_experts` ranks), and `rule` says how that layer picks from them (None:
    top-k of the logits, a softmax router; a SigmoidRule otherwise). Duck-typed on the model's
    LayerWeights (`router`, `router_bias`) and ModelArgs (`router`, `n_group`, `topk_group`); reads
    them at call time, so a model moved to another device predicts there."""

    def __init__(self, lw, args):
        self.lw, self.sigmoid = lw, getattr(args, "router", "softmax") == "sigmoid"
        self.n_group, self.topk_group = getattr(args, "n_group", 1) or 1, getattr(args, "topk_group", 1) or 1

    def __call__(self, x):
        return self.lw.router(x.float() if self.sigmoid else x)

    def tensors(self) -> list:
        """The tensors a call reads besides x (the router's weight and bias)."""
        r = self.lw.router
        return [t for t in (getattr(r, "weight", None), getattr(r, "bias", None)) if t is not None]

    @property
    def rule(self) -> SigmoidRule | None:
        if not self.sigmoid:
            return None
        return SigmoidRule(self.lw.router_bias, self.n_group, self.topk_group)


def route_predictors(model, moe_layers=None) -> list:
    """Per layer: a RoutePredictor for each MoE layer (those in `moe_layers` when given), None
    elsewhere: the `routers` the residency executor and the routing recorder predict with."""
    layers, args = model.weights.layers, model.args
    return [RoutePredictor(lw, args) if lw.router is not None and (moe_layers is None or i in moe_layers)
            else None for i, lw in enumerate(layers)]


def predict_experts(logits, top_k: int, rule: SigmoidRule | None = None) -> list[int]:
    """The look-ahead prediction from a router's logits [T, E] (torch): every expert some token
    would route to (its top-k), best first: the most tokens, then the most routing probability
    summed over the tokens, then the lower id. A decode token gives its k experts by probability;
    a prefill chunk nearly every expert, the busiest first. The executor's prefetch copies these
    in order, as many as fit (`planner.prefetch_allowance`); the recorder writes them.

    `rule` (a sigmoid router): the tokens' experts are the ones the layer itself picks
    (layers.moe.sigmoid_group_route: the bias for the choice, group-limited top-k), ranked by
    their routing weight (a token) or by count, then summed sigmoid score (a chunk)."""
    import torch

    logits = logits.float()
    if rule is not None:
        from freetoken_py.layers.moe import sigmoid_group_route

        ids, weights = sigmoid_group_route(logits, rule.bias, top_k, rule.n_group, rule.topk_group)
        if logits.shape[0] == 1:
            w, i = torch.stack((weights[0], ids[0].to(weights.dtype))).cpu().tolist()
            return [int(e) for _, e in sorted(zip((-t for t in w), i))]
        counts = torch.bincount(ids.flatten(), minlength=logits.shape[-1]).to(logits.dtype)
        mass = torch.sigmoid(logits).sum(dim=0)
    else:
        if logits.shape[0] == 1:   # decode: the token's top-k by logit (~10x cheaper than the counting below)
            v, i = torch.topk(logits[0], top_k)
            vals, ids = torch.stack((v, i.to(v.dtype))).cpu().tolist()      # one device-to-host read
            return [int(e) for _, e in sorted(zip((-t for t in vals), ids))]
        ids = torch.topk(logits, top_k, dim=-1).indices.flatten()
        counts = torch.bincount(ids, minlength=logits.shape[-1]).to(logits.dtype)
        mass = torch.softmax(logits, dim=-1).sum(dim=0)
    counts, mass = torch.stack([counts, mass]).cpu().numpy()      # one device-to-host read
    order = np.lexsort((np.arange(len(counts)), -mass, -counts))  # last key first
    return [int(e) for e in order if counts[e] > 0]


def iter_layer_steps(trace: RoutingTrace) -> Iterator[tuple[int, int, np.ndarray]]:
    """(step, layer, ids [T, k]) in execution order: layers in order within each step."""
    for s, step in enumerate(trace.steps):
        for layer in sorted(step):
            yield s, layer, step[layer]


class RoutingRecorder:
    """An `ExpertExecutor` wrapper that records routing and delegates the compute unchanged.

    A call for a layer not above the previous call's layer starts a new step (a new forward pass).
    With `routers` (per layer, the MoE layers' router as a callable x -> logits, None elsewhere;
    `route_predictors(model)`: with each router's choice `rule`),
    each call also records the look-ahead prediction for the next MoE layer from this layer's
    input (`predict_experts`), what the executor's prefetch copies. Over the residency executor
    it records that executor's own (`prediction_made`: no second router call), and nothing where
    it made none (no slots, prefetch off); over any other executor it computes them here.
    """

    def __init__(self, inner, num_layers: int, num_experts: int, top_k: int, source: str = "",
                 routers=None):
        self.inner = inner
        self.trace = RoutingTrace(num_layers, num_experts, top_k, source)
        self.routers = routers
        self._last_layer = None
        self.decode_step: bool | None = None   # set by the engine before each pass (None: T == 1)

    def __call__(self, layer, x, ids, weights):
        if self._last_layer is None or layer <= self._last_layer:
            self.trace.steps.append({})
            if self.decode_step is not None:
                self.trace.set_decode(len(self.trace.steps) - 1, self.decode_step)
            if self.routers is not None:
                self.trace.predicted += [{}] * (len(self.trace.steps) - len(self.trace.predicted))
        self.trace.steps[-1][int(layer)] = ids.detach().cpu().numpy().astype(np.int64)
        self._last_layer = layer
        out = self.inner(layer, x, ids, weights)
        if self.routers is not None:
            nxt = next((l for l in range(layer + 1, len(self.routers)) if self.routers[l] is not None), None)
            if hasattr(self.inner, "prediction_made"):    # the residency executor: what it acted on, if anything
                made = self.inner.prediction_made
                if made is not None and made[0] == nxt:
                    self.trace.predicted[-1][nxt] = list(made[1])
            elif nxt is not None:
                r = self.routers[nxt]
                self.trace.predicted[-1][nxt] = predict_experts(r(x), self.trace.top_k, getattr(r, "rule", None))
        return out

    def rewind(self, num_steps: int) -> None:
        """Forget every step after the first `num_steps` (a forward pass that failed and will be
        run again); the next call starts a new step."""
        del self.trace.steps[num_steps:]
        del self.trace.predicted[num_steps:]
        del self.trace.decode[num_steps:]
        self._last_layer = None

    def __getattr__(self, name):   # telemetry etc. of the wrapped executor stay reachable
        return getattr(self.inner, name)
