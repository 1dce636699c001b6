"""Residency telemetry: per-layer hit rate, PCIe bytes, CPU share, stall time, prefetch accuracy.

Stall time is the cost model's prediction of how long each layer waited beyond an all-resident
run (copies not hidden by prefetch, and the CPU side when it finishes last). Under an emulated
accelerator every time here is *emulated* (from the injected profile), never a GPU measurement;
`label` says which.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field


@dataclass
class LayerCounters:
    routed_pairs: int = 0
    hit_pairs: int = 0
    stream_pairs: int = 0
    cpu_pairs: int = 0
    split_pairs: int = 0      # pairs of an expert cut between the accelerator and the CPU
    split_cpu_share: float = 0.0   # of those, the CPU's part (pairs x share of the columns)
    pcie_bytes: int = 0
    stall_s: float = 0.0
    predicted_s: float = 0.0  # the planner's time for the layer's experts + fixed costs (CostModel.layer_step_s)
    measured_s: float = 0.0   # the executor call's time on this machine: wall clock, or the GPU's clock
                              # (CUDA events) when the dense weights are on the GPU
    cpu_tier_s: float = 0.0   # measured wall time in the CPU tier (real even under emulation)
    cpu_tier_bytes: int = 0   # expert weight bytes the CPU tier read
    prefetch_predicted: int = 0   # experts the look-ahead predicted for this layer at decode steps
    prefetch_correct: int = 0     # of those, experts the layer then routed
    prefetch_copies: int = 0      # look-ahead copies into this layer's slots (planner.prefetch_allowance)
    device_steps: int = 0         # layer-steps routed on the device, no host round trip (executor._device_step)


@dataclass
class Telemetry:
    label: str                                    # "emulated:<profile>" or "cuda"
    layers: dict[int, LayerCounters] = field(default_factory=lambda: defaultdict(LayerCounters))
    steps: int = 0
    resizes: list[tuple[int, int]] = field(default_factory=list)   # (step, new slot count)
    oom_retries: int = 0
    kv_grows: list[tuple[int, int]] = field(default_factory=list)  # (step, KV pages after) taken from the slots
    kv_shrinks: list[tuple[int, int]] = field(default_factory=list)  # (step, KV pages after) given back to them

    def checkpoint(self) -> tuple[int, dict[int, dict]]:
        """The per-pass counters as they are now (plain numbers: cheap), for `rewind`."""
        return self.steps, {l: dict(c.__dict__) for l, c in self.layers.items()}

    def rewind(self, mark: tuple[int, dict[int, dict]]) -> None:
        """Back to `checkpoint`'s counters: a forward pass that failed (out of memory) and runs
        again is counted once. Resizes and KV grows are not rewound: they happened."""
        self.steps, saved = mark
        for l in list(self.layers):
            if l in saved:
                self.layers[l].__dict__.update(saved[l])
            else:
                del self.layers[l]

    def totals(self) -> LayerCounters:
        t = LayerCounters()
        for c in self.layers.values():
            for f in t.__dataclass_fields__:
                setattr(t, f, getattr(t, f) + getattr(c, f))
        return t

    def summary(self) -> dict:
        t = self.totals()
        n = max(1, t.routed_pairs)
        return {"label": self.label, "steps": self.steps, "hit_rate": t.hit_pairs / n,
                "stream_share": t.stream_pairs / n,
                # the CPU's share of the routed work: whole experts plus its columns of cut ones
                "cpu_share": (t.cpu_pairs + t.split_cpu_share) / n,
                "split_share": t.split_pairs / n,
                "pcie_bytes": t.pcie_bytes, "stall_s": t.stall_s,
                "prefetch_accuracy": t.prefetch_correct / t.prefetch_predicted if t.prefetch_predicted else None,
                "prefetch_copies": t.prefetch_copies,
                "predicted_s": t.predicted_s, "measured_s": t.measured_s,
                "cpu_tier_s": t.cpu_tier_s,
                "cpu_tier_gbps": t.cpu_tier_bytes / t.cpu_tier_s / 1e9 if t.cpu_tier_s else None,
                "resizes": len(self.resizes), "oom_retries": self.oom_retries,
                "kv_grows": len(self.kv_grows), "kv_shrinks": len(self.kv_shrinks)}

    def as_dict(self) -> dict:
        """`summary()` plus every counter per layer (what `/v1/freetoken/stats` serves)."""
        return {**self.summary(), "layers": {str(l): asdict(c) for l, c in sorted(self.layers.items())}}

    def format_lines(self) -> list[str]:
        """The `freetoken run --stats` table: one line per MoE layer and a total."""
        emu = "EMULATED accelerator, times from the injected profile; " if self.label.startswith("emulated") else ""
        lines = [f"residency ({self.label}; {emu}{self.steps} steps)",
                 f"{'layer':>5} {'hit%':>6} {'stream%':>8} {'cpu%':>6} {'split%':>7} {'PCIe MB':>9} {'stall ms':>9} {'prefetch%':>10}"]
        for layer in sorted(self.layers):
            lines.append(self._line(str(layer), self.layers[layer]))
        t = self.totals()
        lines.append(self._line("all", t))
        if t.measured_s:
            lines.append(f"expert time: predicted {t.predicted_s * 1e3:.1f} ms ({self.label} profile), measured "
                         f"{t.measured_s * 1e3:.1f} ms (this machine's wall clock"
                         f"{'; not comparable under emulation' if self.label.startswith('emulated') else ''})")
        if t.prefetch_predicted or t.prefetch_copies:
            acc = (f"{100 * t.prefetch_correct / t.prefetch_predicted:.1f}% of {t.prefetch_predicted} experts "
                   f"predicted at decode routed" if t.prefetch_predicted else "no decode prediction")
            lines.append(f"look-ahead prefetch: {acc}; {t.prefetch_copies} copied ahead over all steps "
                         f"(only what fits where the copy engine would idle)")
        if t.cpu_tier_s:
            lines.append(f"CPU tier (measured): {t.cpu_tier_bytes / 1e6:.1f} MB of expert weights in "
                         f"{t.cpu_tier_s * 1e3:.1f} ms = {t.cpu_tier_bytes / t.cpu_tier_s / 1e9:.2f} GB/s")
        if self.resizes:
            lines.append(f"elastic VRAM: {len(self.resizes)} resizes, last to {self.resizes[-1][1]} slots; "
                         f"{self.oom_retries} allocation retries")
        if self.kv_grows:
            lines.append(f"KV cache grew {len(self.kv_grows)} times into expert-slot memory, "
                         f"to {self.kv_grows[-1][1]} pages")
        if self.kv_shrinks:
            lines.append(f"KV cache gave its growth back to the expert slots {len(self.kv_shrinks)} times, "
                         f"to {self.kv_shrinks[-1][1]} pages")
        return lines

    @staticmethod
    def _line(name: str, c: LayerCounters) -> str:
        n = max(1, c.routed_pairs)
        pf = f"{100 * c.prefetch_correct / c.prefetch_predicted:9.1f}%" if c.prefetch_predicted else f"{'-':>10}"
        return (f"{name:>5} {100 * c.hit_pairs / n:5.1f}% {100 * c.stream_pairs / n:7.1f}% "
                f"{100 * c.cpu_pairs / n:5.1f}% {100 * c.split_pairs / n:6.1f}% {c.pcie_bytes / 1e6:9.2f} {c.stall_s * 1e3:9.3f} {pf}")
