"""`GET /metrics`: the engine's counters in the Prometheus text format (exposition format 0.0.4).

The page is rendered from the same snapshot `/v1/freetoken/stats` serves as JSON (`render`), so
the two always agree. Names follow Prometheus' conventions: a `freetoken_` prefix, base units
(seconds, bytes), `_total` on counters. The expert residency counters (`--emulate-gpu` /
`--gpu-experts`) are per MoE layer (label `layer`) and carry the tier's label
(`accelerator="emulated:<profile>"` under emulation, where every time is the injected profile's
prediction, never a GPU measurement; `"cuda"` on a GPU).

The request histograms (`Histogram`) are kept by the engine thread: time to first token (taken
at the first token, so a request aborted later counts) and the whole request (taken when the
engine finishes it), as the server measures them (from the request's arrival at the engine).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# upper bounds, seconds: interactive first tokens to long agent turns on a CPU
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


@dataclass
class Histogram:
    """Observations counted under fixed upper bounds (`le`), as Prometheus histograms are."""
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)   # per bucket, not cumulative; the last is +Inf
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError("histogram bounds must be increasing")
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += 1
        self.sum += value
        self.count += 1

    def as_dict(self) -> dict:
        """{"buckets": [[upper bound, observations at or under it], ...], "sum", "count"}; the
        last bound is +Inf (JSON: the string "+Inf")."""
        out, running = [], 0
        for b, n in zip((*self.bounds, math.inf), self.counts):
            running += n
            out.append(["+Inf" if b == math.inf else b, running])
        return {"buckets": out, "sum": self.sum, "count": self.count}


# snapshot key -> (metric, type, help)
_ENGINE = (
    ("num_requests", "freetoken_requests_received_total", "counter", "Requests admitted to the engine."),
    ("num_finished", "freetoken_requests_finished_total", "counter",
     "Requests the engine finished: stop, length, or ended by the engine itself (a KV integrity failure)."),
    ("num_aborted", "freetoken_requests_aborted_total", "counter",
     "Requests aborted for the client (it went away, or the server shut down)."),
    ("num_rejected_queue_full", "freetoken_requests_rejected_total", "counter",
     "Requests refused with 429 because every request slot was busy."),
    ("num_steps", "freetoken_engine_steps_total", "counter", "Engine steps (one forward pass each)."),
    ("prompt_tokens", "freetoken_prompt_tokens_total", "counter", "Prompt tokens of requests that started generating."),
    ("cached_prompt_tokens", "freetoken_prompt_tokens_cached_total", "counter",
     "Of those, tokens whose KV came from the prefix cache."),
    ("generation_tokens", "freetoken_generation_tokens_total", "counter", "Tokens generated."),
    ("active", "freetoken_requests_active", "gauge", "Requests admitted and not finished."),
    ("max_queue", "freetoken_requests_active_max", "gauge", "The most requests admitted at once (--max-queue)."),
    ("running", "freetoken_requests_running", "gauge", "Requests in the running batch."),
    ("waiting", "freetoken_requests_waiting", "gauge", "Requests waiting for KV pages."),
    ("num_pages", "freetoken_kv_pages", "gauge", "KV cache pages."),
    ("free_pages", "freetoken_kv_pages_free", "gauge", "KV cache pages free."),
    ("cached_pages", "freetoken_kv_pages_cached", "gauge", "KV cache pages held by the prefix cache."),
    ("page_size", "freetoken_kv_page_size_tokens", "gauge", "Tokens per KV page."),
    ("kv_fp8_clipped", "freetoken_kv_fp8_clipped_total", "counter",
     "FP8 KV values clipped to the e4m3 range since start-up (0 without --kv-dtype fp8)."),
    ("max_abort_lag_steps", "freetoken_abort_lag_steps_max", "gauge",
     "The most engine steps between a client leaving and its request being aborted."),
)
_HISTOGRAMS = (
    ("ttft_seconds", "freetoken_time_to_first_token_seconds", "Time from a request's arrival to its first token."),
    ("request_seconds", "freetoken_request_duration_seconds",
     "Time from a request's arrival to its end (requests the engine finished)."),
)
# residency telemetry: per-layer counter -> (metric, help)
_LAYER = (
    ("routed_pairs", "freetoken_expert_routed_pairs_total", "Routed (token, expert) pairs."),
    ("hit_pairs", "freetoken_expert_hit_pairs_total", "Pairs whose expert was resident in an accelerator slot."),
    ("stream_pairs", "freetoken_expert_stream_pairs_total", "Pairs whose expert was copied over PCIe."),
    ("cpu_pairs", "freetoken_expert_cpu_pairs_total", "Pairs computed on the CPU tier."),
    ("split_pairs", "freetoken_expert_split_pairs_total", "Pairs of an expert cut between accelerator and CPU."),
    ("split_cpu_share", "freetoken_expert_split_cpu_pairs_total", "The CPU's part of the cut pairs (pairs x columns)."),
    ("pcie_bytes", "freetoken_expert_pcie_bytes_total", "Expert bytes copied host to accelerator."),
    ("stall_s", "freetoken_expert_stall_seconds_total",
     "Predicted wait beyond an all-resident run (cost model; emulated: the injected profile's)."),
    ("predicted_s", "freetoken_expert_predicted_seconds_total", "The planner's predicted time for the layer's experts."),
    ("measured_s", "freetoken_expert_measured_seconds_total",
     "Measured time of the layer's expert call on this machine (GPU clock with --gpu-experts)."),
    ("cpu_tier_s", "freetoken_expert_cpu_tier_seconds_total", "Measured time in the CPU tier."),
    ("cpu_tier_bytes", "freetoken_expert_cpu_tier_bytes_total", "Expert bytes the CPU tier read."),
    ("prefetch_predicted", "freetoken_expert_prefetch_predicted_total",
     "Experts the look-ahead predicted for decode steps."),
    ("prefetch_correct", "freetoken_expert_prefetch_correct_total", "Of those, experts the layer then routed."),
    ("prefetch_copies", "freetoken_expert_prefetch_copies_total",
     "Look-ahead copies issued (as many as fit where the copy engine would idle)."),
    ("device_steps", "freetoken_expert_device_steps_total",
     "Layer-steps routed on the accelerator with no host round trip (every expert of the layer resident)."),
)
_RESIDENCY = (
    ("expert_slots", "freetoken_expert_slots", "gauge", "Expert slots in accelerator memory now."),
    ("steps", "freetoken_residency_steps_total", "counter", "Forward passes through the residency tiers."),
    ("resizes", "freetoken_expert_slot_resizes_total", "counter", "Slot cache resizes (elastic VRAM)."),
    ("oom_retries", "freetoken_expert_oom_retries_total", "counter",
     "Forward passes retried after an out-of-memory error (with fewer slots)."),
    ("kv_grows", "freetoken_kv_grows_total", "counter", "KV cache grows into memory the slots gave up."),
    ("kv_shrinks", "freetoken_kv_shrinks_total", "counter", "KV cache shrinks back, the slots growing."),
)


def _value(v) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


def _label(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(pairs: dict) -> str:
    return "{" + ",".join(f'{k}="{_label(v)}"' for k, v in pairs.items()) + "}" if pairs else ""


def render(snapshot: dict) -> str:
    """The Prometheus text page for a `/v1/freetoken/stats` snapshot (`AsyncEngine.snapshot`).
    A key the snapshot lacks (e.g. the page counts while a long step holds the engine thread)
    is left out, not reported as 0."""
    lines: list[str] = []

    def family(name: str, kind: str, text: str, samples: list[tuple[str, dict, object]]) -> None:
        if not samples:
            return
        lines.append(f"# HELP {name} {_help(text)}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{suffix}{_labels(labels)} {_value(v)}" for suffix, labels, v in samples)

    for key, name, kind, text in _ENGINE:
        if snapshot.get(key) is not None:
            family(name, kind, text, [("", {}, snapshot[key])])
    family("freetoken_engine_failed", "gauge", "1 once the engine thread has failed (see /ready).",
           [("", {}, bool(snapshot.get("failed")))])
    family("freetoken_accepting", "gauge", "1 while new requests are admitted (0 while shutting down).",
           [("", {}, bool(snapshot.get("accepting")))])
    for key, name, text in _HISTOGRAMS:
        h = snapshot.get(key)
        if h is None:
            continue
        samples = [("_bucket", {"le": le if le == "+Inf" else _value(float(le))}, n) for le, n in h["buckets"]]
        samples += [("_sum", {}, float(h["sum"])), ("_count", {}, h["count"])]
        family(name, "histogram", text, samples)
    res = snapshot.get("residency")
    if res:
        tier = {"accelerator": res["label"]}
        for key, name, kind, text in _RESIDENCY:
            if res.get(key) is not None:
                family(name, kind, text, [("", tier, res[key])])
        layers = sorted(res.get("layers", {}).items(), key=lambda kv: int(kv[0]))
        for key, name, text in _LAYER:       # (a counter a snapshot lacks is left out)
            samples = [("", {**tier, "layer": layer}, c[key]) for layer, c in layers if key in c]
            if samples:
                family(name, "counter", text, samples)
    return "\n".join(lines) + "\n"
