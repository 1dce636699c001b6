"""Expert residency: where each routed expert runs, re-decided per layer and per step.

Three tiers: a VRAM slot cache (hits run on the accelerator), PCIe streaming into a slot (a miss
copied in, then computed on the accelerator), and CPU evaluation (activations go to the host
weights). `planner.plan` is the pure per-layer decision, `policy` the cache policies (ours and the
static / pin / lru baselines), `executor.ResidencyExecutor` the `ExpertExecutor` that applies them.

Imports only torch, numpy, `hw` (profile types) and `layers` (the executor protocol); never
engine, scheduler, server or llm. Modules import torch lazily where they can so the planner and
the simulator are usable without it.
"""
