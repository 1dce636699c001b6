"""`ResidencyExecutor`: the `ExpertExecutor` that runs each layer's routed experts on three tiers.

Per call (one MoE layer of one forward pass):

    routed pairs (token, expert) --group by expert--> tokens per expert
        hits    (resident in a slot)      -> accelerator, from the slot
        stream  (planner: copy is worth it) -> copy into a slot (or staging), then accelerator
        split   (planner decision 5)      -> the first columns of its intermediate dimension
                                             copied to staging and computed on the accelerator,
                                             the other columns computed on the CPU
        cpu     (the rest)                -> host weights, on the CPU
    out = accelerator part + CPU part     (each pair lands in exactly one of the four; a split
                                           pair's two column ranges are disjoint and add up)

Before the CPU part runs, the next MoE layer's experts are predicted through its router from this
layer's input (the residual stream changes little between layers) and as many as fit where the
copy engine would idle (planner.prefetch_allowance, with the measured lead to the next layer)
are copied ahead (look-ahead prefetch), so the copies overlap the CPU's work; the next call
scores the prediction on decode steps. At the
start of each step (a call for a layer not above the previous one) the free-memory probe may
shrink or grow the slot cache (elastic VRAM), and the last step's measured copy times feed the
cost model.

device="cpu" is the emulated accelerator: identical code, CPU tensors, times from the profile.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Optional

import numpy as np
import torch

from freetoken_py.kernels import gpu_moe
from freetoken_py.kernels.gpu_slots import SlotTable, build_table, packed_plan
from freetoken_py.kernels.cpu_moe import ExpertBank, add_moe_experts, moe_experts
from freetoken_py.residency.elastic import ElasticVram
from freetoken_py.residency.formats import ExpertFormat
from freetoken_py.residency.planner import CostModel, LayerStats, Plan, prefetch_allowance
from freetoken_py.residency.policy import look_ahead
from freetoken_py.residency.profiles import GB
from freetoken_py.residency.slots import OOM_ERRORS, SlotCache
from freetoken_py.residency.stats import SigmoidRule, predict_experts
from freetoken_py.residency.streamer import Streamer
from freetoken_py.residency.telemetry import Telemetry
from freetoken_py.residency.transfers import Transfers, on_device, pinned_like

# x joins the packed routing read when a step has at most this many tokens (decode batches; a
# prefill chunk's x is read on its own, and only when the CPU tier has work)
PACK_X_TOKENS = 8


def _fused_ok(device: torch.device, fmt: ExpertFormat) -> bool:
    """Triton's experts for `fmt` (float, int8 or int4) can run on `device` and agree with torch
    there (a one-time self-check; on a failure the torch path stays, with a warning saying why)."""
    import warnings

    if fmt.name not in ("float", *gpu_moe.QUANT_FORMATS):   # (no Triton kernel for it: torch)
        return False
    if not gpu_moe.available(device):      # (a GPU too old, no usable Triton: said in one line, on CUDA)
        if torch.device(device).type == "cuda":
            warnings.warn(f"{gpu_moe.why_not()}; the accelerator tier runs torch's experts", RuntimeWarning,
                          stacklevel=3)
        return False
    if fmt.name == "float":
        problem = gpu_moe.self_check(device, fmt.dtype)
    else:
        problem = gpu_moe.self_check_quant(device, fmt.name, fmt.group_size)
    if problem is not None:
        warnings.warn(f"{problem}; the accelerator tier keeps the torch path", RuntimeWarning, stacklevel=3)
    return problem is None


class _LoneGroups(dict):
    """A lone token's `_group`: {expert: (rows [1] (token 0), routing weight [1])} for its k distinct
    experts, each entry made on first use (the Triton path reads the weights row at once:
    `_pairs_host`)."""

    def __init__(self, one: list[int], weights: torch.Tensor):
        super().__init__()
        self.weights, self.pos = weights, {e: j for j, e in enumerate(one)}
        self._row: Optional[torch.Tensor] = None

    def __missing__(self, e: int):
        j = self.pos[e]                      # (KeyError for an expert the token did not route to)
        if self._row is None:
            self._row = torch.zeros(1, dtype=torch.long, device=self.weights.device)
        got = self[e] = (self._row, self.weights[0, j:j + 1])
        return got

    # (a mapping of every routed expert, in expert order, like `_group`'s other result)
    def __iter__(self):
        return iter(sorted(self.pos))

    def __len__(self) -> int:
        return len(self.pos)

    def __contains__(self, e) -> bool:
        return e in self.pos

    def keys(self):
        return list(self)

    def items(self):
        return [(e, self[e]) for e in self]

    def values(self):
        return [self[e] for e in self]


class ResidencyExecutor:
    oom_errors = OOM_ERRORS      # what an allocation failure raises (the engine shrinks the slots on it)

    def __init__(self, host: list, fmt: ExpertFormat, policy, cost: CostModel, slots: SlotCache, *,
                 routers: Optional[list] = None, top_k: int = 0, elastic: Optional[ElasticVram] = None,
                 memory_probe: Optional[Callable[[], int]] = None, label: str = "emulated",
                 audit: bool = False, measure_live: bool = False, cpu_banks: Optional[list] = None,
                 dense_layer_bytes: Optional[int] = None):
        # per layer: the experts' parts on the host, [E, ...] each (formats.py; float: w13
        # [E, 2I, D] and w2 [E, D, I]), or None (no routed experts)
        self.host, self.fmt = host, fmt
        # per layer: a kernels.cpu_moe.ExpertBank viewing the same host weights (the numba CPU
        # kernels), or None (the CPU tier then runs torch on the host weights)
        self.cpu_banks = cpu_banks
        self.policy, self.cost, self.slots = policy, cost, slots
        self.streamer = Streamer(slots, host, fmt)
        self._cuda = slots.device.type == "cuda"
        self._num_experts = [0 if h is None else h[0].shape[0] for h in host]   # per layer
        self._all_experts = sum(self._num_experts)   # slots for the whole model: the device path's condition
        self.transfers = Transfers(slots.device)     # pooled pinned staging, the packed routing read
        self._host_rules: dict = {}                  # next layer -> its SigmoidRule with the bias on the host
        self.routers, self.top_k = routers, top_k
        self.elastic, self.memory_probe = elastic, memory_probe
        self._slots_lent = 0     # what the KV cache took off the elastic sizing's ceiling (lend_slots)
        self.telemetry = Telemetry(label)
        self.audit: Optional[list] = [] if audit else None   # (step, layer, token, expert, tier)
        self.step, self._last_layer = -1, None
        self._predicted: dict[int, set[int]] = {}
        # the look-ahead copies' lead: the time from one layer's expert work to the next layer's
        # routing (its attention and dense part), per kind of step (decode, prefill). With
        # `dense_layer_bytes` (emulation) it is the profile's: that read at its VRAM rate plus its
        # host work, as the simulator counts it; else measured (an EMA seeded by the first gap):
        # on a GPU on its clock, from the previous call's end event to this call's routing read
        # (read back later, never waited for), on the host from the previous call's return
        self.dense_layer_bytes = dense_layer_bytes
        self._fixed_lead: Optional[tuple[float, float]] = None
        self._lead, self._lead_seen = {True: 0.0, False: 0.0}, {True: False, False: False}
        self._lead_pending: list = []  # CUDA: (previous call's end event, this call's start event, decode)
        self._prev_end = None          # the previous call of this step: its end (event or perf_counter)
        self.prediction_made: Optional[tuple[int, list[int]]] = None   # this call's look-ahead, for a recorder
        # set by the engine before each forward pass: True when every request of the pass brings
        # one generated token (a decode step, alone or batched), False otherwise; None (a caller that does
        # not say): a pass of one token is a decode step. It picks the lead and scores prefetch%
        self.decode_step: Optional[bool] = None
        self._timing: list = []     # (step, layer, start, end) CUDA events of calls with x on the GPU, unread
        # feed the measured CPU-tier speed and copy rate into the cost model: right when the profile
        # describes this machine (cuda), wrong under emulation (the profile is another machine), so opt-in
        self.measure_live = measure_live
        # decode-sized layer-steps' accelerator experts in two Triton launches (kernels/gpu_moe.py):
        # on a CUDA GPU when Triton is there and its self-check passes; never under emulation
        # (tests turn it on with Triton's CPU interpreter)
        self.fused_accel = self.slots.device.type == "cuda" and _fused_ok(self.slots.device, fmt)
        self._table: Optional[tuple[int, SlotTable]] = None     # (the slots' layout version, its table)
        self._step_plans: dict = {}      # the Triton steps' plans over the kept device buffers (`_run_fused`)
        self._slot_maps: dict = {}       # layer -> (the slots' assignment version, its expert -> slot map)
        self._lone: dict = {}            # k -> a lone token's pairs on the device (`_device_step`)
        if slots.device.type == "cpu":    # (emulated: the banks the engine pins on CUDA; the routers in VRAM)
            pinned_like(*(part for parts in host if parts is not None for part in parts))
            on_device(*(t for r in routers or () if r is not None for t in r.tensors()), always=True)
        self.sync_slots()

    def sync_slots(self) -> None:
        """Copy in every expert the policy holds resident but no slot has (a static or warm-started
        policy decides its set before the first step)."""
        for layer, expert in sorted(self.policy.keys):
            if (layer, expert) not in self.slots:
                self.streamer.to_slot(layer, expert)

    # ---- the ExpertExecutor call ------------------------------------------------------------
    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        if self._last_layer is None or layer <= self._last_layer:
            self._new_step()
        self._last_layer = layer
        # x with the accelerator (on its device; emulated, both on the host): the routing, the
        # look-ahead's logits and, when the CPU tier may have work, x come to the host in one
        # packed read, which also zeroes the layer's output buffer (transfers.read_packed)
        with_accel = x.device == self.slots.device
        if with_accel:
            on_device(x, ids, weights)        # (emulated: the accelerator's, for transfers.counting)
        nxt = self._next_moe_layer(layer) if self.top_k > 0 and self.slots.num_slots else None
        resident = self.policy.resident(layer)
        # (only where no eviction can follow: a policy that never evicts, or slots for every expert
        # of the model; the policy's statistics, which that path does not update, then decide nothing)
        if with_accel and self.fused_accel and ids.shape[0] == 1 and self.audit is None \
                and (not self.policy.evicts or self.slots.num_slots >= self._all_experts) \
                and len(resident) == self._num_experts[layer] \
                and (nxt is None or len(self.policy.resident(nxt)) == self._num_experts[nxt]):
            out = self._device_step(layer, x, ids, weights, t0)
            if out is not None:
                return out
        ids, weights, logits, x_host, out_dev, timing = self._read_routing(layer, nxt, x, ids, weights, resident)
        decode = ids.shape[0] == 1 if self.decode_step is None else self.decode_step
        self._measure_lead(decode, timing[0] if timing is not None else None)
        # reading the routing back waits for the compute stream (ids are where x is): after this
        # no earlier compute reads a slot any more
        self.streamer.new_call(with_accel and self._cuda)
        one, tokens = self._tokens(layer, ids)
        self._score_prefetch(layer, tokens, decode)
        plan = self.policy.split(layer, LayerStats(tokens, resident), self.cost)
        self.policy.touch(layer, self.step, tokens)
        cuts = [(e, self._cut_columns(layer, f)) for e, f in plan.split]
        accel = [*plan.hits, *plan.stream, *(e for e, c in cuts if c)]   # experts the accelerator computes
        # (token rows, routing weights) per expert: not needed by a lone token's whole CPU experts
        lone_cpu = one is not None and not accel and not cuts and self._bank(layer) is not None
        groups = None if lone_cpu else self._group(ids, weights, one)
        if x_host is None and (plan.cpu or plan.split):   # (a prefill chunk's x, not in the packed read)
            x_host = self.transfers.read(x, role="read_x")
        # the next layer's experts, predicted from this layer's input (the logits came with the routing)
        predicted = None if logits is None else (nxt, predict_experts(logits, self.top_k, self._host_rule(nxt)))
        out, ready = (self._accelerator_part(layer, x, plan, cuts, accel, groups, out_dev) if accel or plan.stream
                      else (None, None))
        # the next layer's look-ahead copies are issued before the CPU tier runs, and the CPU tier
        # runs while the accelerator works: on a GPU the three overlap (the planner's max(gpu, cpu))
        if predicted is not None:
            self._prefetch(predicted, prefetch_allowance(plan, self.cost, self.lead(decode)))
        else:
            self.prediction_made = None
        cpu_cuts = [(e, cols) for e, cols in cuts if cols < self.fmt.inter] if cuts else cuts
        # (x with the accelerator: the CPU's part goes there from staging, where a lone token's
        # one-row kernel call writes it directly)
        cpu_part = (self._cpu_tier(layer, x_host, groups, plan.cpu, cpu_cuts, one, weights, stage=with_accel)
                    if plan.cpu or cpu_cuts else None)
        out = self._sum_parts(out, ready, cpu_part, out_dev, x, with_accel)
        self._count(layer, plan, tokens, cuts, one is not None)
        self._end_timing(layer, plan, timing, t0)
        return out

    def _device_step(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     t0: float) -> Optional[torch.Tensor]:
        """A lone token's layer-step whose experts are all in slots, with no look-ahead to make (the
        next MoE layer's are all resident too, or there is none) and no eviction to follow (a policy
        that never evicts, or slots for every expert of the model): routed on the device, through
        the layer's slot map (`_slot_map`), into the Triton experts: no read, no copy, no host
        work per expert (the index, the weights in fp32 where they are not, the zeroed output and
        the experts' two kernels). The routing stays on the device, so the policy's statistics
        and the prefetch score skip such a step; its k pairs count as hits. None (the host path
        runs) when a slot of the layer is not where the map needs it."""
        smap = self._slot_map(layer)
        if smap is None:
            return None
        self.streamer.wait_layer(layer)           # (a look-ahead copy into one of its slots, still pending)
        self.streamer.reading = None              # no routing read: a later copy into a slot waits for compute
        timing = None
        if self._cuda:
            self.flush_timing(wait=False)
            timing = (self.transfers.event(True), self.transfers.event(True))
            timing[0].record()
        self._prev_end = None
        k = ids.shape[1]
        rows, members = self._lone_pairs(k)
        wts = weights.reshape(-1).to(x.dtype).float()       # (rounded as the host path rounds them)
        slots = smap[ids.reshape(-1)]
        out = torch.zeros_like(x)
        gpu_moe.run(out, x if x.stride(-1) == 1 else x.contiguous(), rows, wts,
                    gpu_moe.plan_of(self._slot_table(), slots, members, 1, k))
        self._predicted.pop(layer, None)
        self.prediction_made = None
        c = self.telemetry.layers[layer]
        c.routed_pairs += k
        c.hit_pairs += k
        c.device_steps += 1
        one_s = self.cost.gpu_compute_s(1)
        self._end_timing(layer, Plan(tuple(range(k)), (), (), k * one_s, 0.0), timing, t0)
        return out

    def _slot_map(self, layer: int) -> Optional[torch.Tensor]:
        """The layer's expert -> slot map on the device (int64 [E]), made when the slots'
        assignment changes (one copy from pinned staging), or None when an expert has no slot."""
        version = self.slots.assign_version.get(layer, 0)
        got = self._slot_maps.get(layer)
        if got is not None and got[0] == version:
            return got[1]
        slot_of = self.slots.slot_of
        keys = [(layer, e) for e in range(self._num_experts[layer])]
        if not all(key in slot_of for key in keys):
            return None
        smap = self.transfers.to_device([torch.tensor([slot_of[key] for key in keys])], f"slot_map{layer}")[0]
        self._slot_maps[layer] = (version, smap)
        return smap

    def _lone_pairs(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A lone token's k pairs on the device: their rows (all 0) and, a group a pair, the
        groups' members (0 .. k-1); made once per k."""
        got = self._lone.get(k)
        if got is None:
            got = self._lone[k] = tuple(self.transfers.to_device(
                [torch.zeros(k, dtype=torch.long), torch.arange(k)], f"lone_pairs{k}"))
        return got

    def _read_routing(self, layer: int, nxt, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, resident):
        """(ids, weights, logits, x_host, out_dev, timing) on the host. x with the accelerator (on
        its device; emulated, both on the host): the routing, the look-ahead's logits (for the
        next MoE layer `nxt`) and, when the CPU tier may have work, x come to the host in one
        packed read, which also zeroes the layer's output buffer (transfers.read_packed)."""
        with_accel = x.device == self.slots.device
        logits = self._router_logits(nxt, x)
        if not with_accel:
            return ids, weights, logits, x, None, None
        # (the CPU tier may get work unless every expert of the layer is resident)
        pack_x = ids.shape[0] <= PACK_X_TOKENS and len(resident) < self._num_experts[layer]
        (ids, weights, logits, x_host), out_dev = self.transfers.read_packed(
            [ids, weights, logits, x if pack_x else None], out_like=x)
        timing = None
        if self._cuda:
            self.flush_timing(wait=False)      # that read waited for the GPU: earlier layers' events are done
            timing = (self.transfers.event(True), self.transfers.event(True))
            timing[0].record()                 # the experts' time on the GPU's clock, from here
        return ids, weights, logits, x_host, out_dev, timing

    def _tokens(self, layer: int, ids: torch.Tensor) -> tuple[list | None, dict]:
        """(a lone token's k distinct experts or None, {expert: tokens routed to it})."""
        one = ids.tolist()[0] if ids.shape[0] == 1 else None
        if one is not None and len(set(one)) < len(one):
            one = None                        # (repeated experts: the general path)
        if one is not None:                   # decode: k distinct experts, a pair each
            return one, dict.fromkeys(sorted(one), 1)
        counts = torch.bincount(ids.flatten(), minlength=self.host[layer][0].shape[0]).tolist()
        return None, {e: n for e, n in enumerate(counts) if n}

    def _end_timing(self, layer: int, plan, timing, t0: float) -> None:
        """The layer-step's predicted time, and its measured one: on the GPU's clock (read back
        later, no wait now) or, without events, the host's."""
        c = self.telemetry.layers[layer]
        c.predicted_s += self.cost.layer_step_s(plan)     # (the simulator's layer-step, fixed costs included)
        if timing is not None:     # ends when the two parts' sum is ready
            timing[1].record()
            self._prev_end = timing[1]
            self._timing.append((self.step, layer, *timing))
        else:                      # the accelerator's part has been waited for above
            self._prev_end = time.perf_counter()
            c.measured_s += self._prev_end - t0

    def _sum_parts(self, out, ready, cpu_part, out_dev, x, send: bool):
        """The layer's output on x's device: the accelerator's part (`out`, read back when x is on
        the host: `ready`) plus the CPU's part, sent from pinned staging when x is with the
        accelerator (`send`; one more launch when both have work)."""
        if ready is not None:
            ready.synchronize()           # the accelerator's part has reached the host
            self.transfers.release(ready, timing=False)
            out = out.clone()             # (out of the pooled buffer before the next layer reuses it)
        if cpu_part is not None and send:
            cpu_part = self.transfers.to_device([cpu_part], "cpu_part")[0]
        if out is None:                   # nothing ran on the accelerator
            if cpu_part is not None:
                return cpu_part
            return out_dev if out_dev is not None else torch.zeros_like(x)
        if cpu_part is not None:
            out.add_(cpu_part)
        return out

    def _router_logits(self, nxt: Optional[int], x: torch.Tensor):
        """The next MoE layer's router applied to this layer's input (its logits [T, E], on x's
        device), or None without a next layer or slots."""
        if nxt is None:
            return None
        return self.routers[nxt](x)

    def _host_rule(self, nxt: int):
        """The next layer's choice rule (a sigmoid router's: SigmoidRule) with its bias on the
        host, read once per bias tensor; None for a softmax router."""
        rule = getattr(self.routers[nxt], "rule", None)
        if rule is None or rule.bias is None or rule.bias.device.type == "cpu":
            return rule
        key = (nxt, rule.bias.data_ptr())
        if key not in self._host_rules:
            self._host_rules[key] = SigmoidRule(self.transfers.read(rule.bias).clone(), rule.n_group, rule.topk_group)
        return self._host_rules[key]

    def _accelerator_part(self, layer: int, x: torch.Tensor, plan, cuts, accel: list[int], groups,
                          out_dev: Optional[torch.Tensor] = None):
        """The hits, the streamed misses (admitted now, copied into their slots or staging) and
        the cut experts' first columns on the accelerator, added into `out_dev` (zeroed by the
        routing read; None: x is on the host, and it is made here): (their sum on x's device, an
        event to wait on before reading it, or None)."""
        if out_dev is None:           # x on the host, slots on a GPU: x goes there from staging
            xd = self.transfers.to_device([x], "x")[0]
            out_dev = torch.zeros_like(xd)  # [T, D] accelerator part
        else:
            xd = x
        # decode-sized: the experts read in their slots go to the Triton kernels in one batch each
        # for the hits and for the streamed ones (weights read once per pair: few tokens only),
        # which send their pairs with their plan; the others' pairs go in one copy (fused: the cut
        # experts' and the streamed ones that land in staging, once the admissions are known)
        fused = self.fused_accel and all(self._pairs_of(groups, e) <= gpu_moe.MAX_TOKENS_PER_EXPERT for e in accel)
        on_dev = {} if fused else self._to_device(groups, accel, out_dev.dtype)
        batch: list = []
        for e in plan.hits:
            self.streamer.wait_for((layer, e))     # a look-ahead copy into this slot, if still pending
            self.streamer.mark_read((layer, e))    # a copy into its slot (an eviction) waits for this compute
            if fused:
                batch.append((e, "hit"))
            else:
                self._run_accel(out_dev, xd, on_dev[e], self.slots.get((layer, e)), layer, e, "hit", groups[e][0])
        evictions = self.policy.admit_many(layer, plan.stream, self.step)   # one call for the layer-step
        if fused and (cuts or plan.stream):   # (a streamed expert the policy no longer holds goes to staging)
            on_dev = self._to_device(groups, [*(e for e, c in cuts if c),
                                              *(e for e in plan.stream if not self.policy.is_resident(layer, e))],
                                     out_dev.dtype)
        # the hits and the streamed experts in one batch (two launches, not four), after the
        # copies, unless an admission evicts a hit: its slot is then overwritten, so the hits run
        # first (a copy into a slot a queued batch reads waits for it: `mark_read`)
        hit_keys = {(layer, e) for e in plan.hits}
        if not plan.stream or any(key in hit_keys for evicted in evictions for key in evicted):
            self._run_fused(out_dev, xd, groups, batch, layer, "fused_hits")
        # a streamed expert the policy no longer holds (evicted again by a later one of this
        # layer-step) is copied to staging, not into a slot: it runs right after its copy
        placed = 0
        try:
            for e, evicted in zip(plan.stream, evictions):
                parts = self._stream_in(layer, e, evicted)
                placed += 1
                in_slot = (layer, e) in self.slots.slot_of      # (else staging, which every copy waits for)
                if in_slot:
                    self.streamer.mark_read((layer, e))
                if fused and in_slot:
                    batch.append((e, "stream"))
                else:
                    self._run_accel(out_dev, xd, on_dev[e], parts, layer, e, "stream", groups[e][0])
        except BaseException:     # (an out-of-memory error: the pass runs again) slots and policy agree
            self._unadmit(layer, plan.stream[placed:], evictions[placed:])
            raise
        self._run_fused(out_dev, xd, groups, batch, layer, "fused")
        for e, cols in cuts:
            if cols:
                self._run_accel(out_dev, xd, on_dev[e], self.streamer.to_staging_columns(layer, e, cols), layer, e,
                                "split", groups[e][0])
        return self._to_host(out_dev, x)

    def flush_timing(self, wait: bool = True) -> None:
        """Add the GPU-clock times of finished layer calls (x on the GPU) to `measured_s`; with
        `wait`, wait for the last ones first (before reading the telemetry)."""
        if wait and self._timing:
            self._timing[-1][3].synchronize()
        if wait and self._lead_pending:
            self._lead_pending[-1][1].synchronize()
        pending = []
        for step, layer, start, end in self._timing:
            if end.query():
                self.telemetry.layers[layer].measured_s += start.elapsed_time(end) / 1e3
            else:
                pending.append((step, layer, start, end))
        self._timing = pending
        waiting = []
        for prev, routed, decode in self._lead_pending:
            if prev.query() and routed.query():
                self._add_lead(decode, prev.elapsed_time(routed) / 1e3)
            else:
                waiting.append((prev, routed, decode))
        self._lead_pending = waiting

    def checkpoint(self) -> tuple:
        """What `rewind_pass` needs to forget the coming forward pass: the counters, the GPU-clock
        timings not read yet (the pass's first call reads earlier steps' into the counters) and
        the audit's length."""
        return self.telemetry.checkpoint(), list(self._timing), len(self.audit) if self.audit is not None else 0

    def rewind_pass(self, mark: tuple) -> None:
        """The forward pass begun after `checkpoint` failed and will run again: its counters, its
        calls' GPU-clock timings and its audit entries are forgotten, so the step is counted once.
        Not rewound: the step number (the retry is the next one), the look-ahead's lead (the failed
        pass's gaps were real, on the host and on the GPU's clock alike), and the policy, which keeps
        what it saw (the experts it admitted are in their slots, and the retry counts them as
        hits)."""
        counters, timing, audited = mark
        self.telemetry.rewind(counters)
        self._timing = timing
        if self.audit is not None:
            del self.audit[audited:]

    def _to_host(self, out_dev: torch.Tensor, x: torch.Tensor):
        """The accelerator's part on x's device: with x on the host and the part on CUDA, an
        asynchronous copy into a pooled pinned buffer and a pooled event to wait on before
        reading it (the CPU tier runs meanwhile; `_sum_parts` takes it out of the pool's buffer);
        otherwise as is (x with the accelerator: the part stays there)."""
        if out_dev.device == x.device:
            return out_dev, None
        host = self.transfers.host("accel_part", out_dev.numel() * out_dev.element_size())
        host = host.view(out_dev.dtype).view(out_dev.shape)
        host.copy_(out_dev, non_blocking=True)
        ready = self.transfers.event()
        ready.record()
        return host, ready

    # ---- pieces ---------------------------------------------------------------------------
    @staticmethod
    def _group(ids: torch.Tensor, weights: torch.Tensor, one: Optional[list[int]] = None
               ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """expert -> (token rows [n], routing weights [n]) for every routed pair, by expert id.
        `one`: the single token's k distinct experts (`ids[0]` as a list), when that is the case:
        then a `_LoneGroups`, whose entries are made on first use."""
        k = ids.shape[1]
        if one is not None:          # decode: k distinct experts (no sort, no per-expert tensors up front)
            return _LoneGroups(one, weights)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        rows = (order // k).split(counts.tolist())
        wts = weights.flatten()[order].split(counts.tolist())
        return {int(e): (r, w) for e, r, w in zip(experts.tolist(), rows, wts)}

    @staticmethod
    def _pairs_of(groups, e: int) -> int:
        return 1 if isinstance(groups, _LoneGroups) else len(groups[e][0])

    def _to_device(self, groups, experts: list[int], dtype: torch.dtype) -> dict:
        """The experts' (token rows, routing weights) on the accelerator's device, in one copy
        from pinned staging for all of them. The weights are rounded to `dtype` (the output's)
        and sent as fp32 (exact)."""
        if not experts:
            return {}
        sizes = [len(groups[e][0]) for e in experts]
        rows, wts = self.transfers.to_device(self._pairs_host(groups, experts, dtype), "pairs")
        return dict(zip(experts, zip(rows.split(sizes), wts.split(sizes))))

    @staticmethod
    def _pairs_host(groups, experts: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
        """[token rows [P] int64, routing weights [P] fp32 rounded to `dtype`] of the experts'
        pairs, expert after expert, on the host."""
        if isinstance(groups, _LoneGroups):     # (a lone token: row 0, its weights picked in one op)
            return [torch.zeros(len(experts), dtype=torch.long),
                    groups.weights[0].index_select(0, torch.tensor([groups.pos[e] for e in experts])).to(dtype).float()]
        return [torch.cat([groups[e][0] for e in experts]), torch.cat([groups[e][1] for e in experts]).to(dtype).float()]

    def _run_accel(self, out, x, group, parts, layer: int, expert: int, tier: str, host_rows) -> None:
        """`_run` on the accelerator (torch's ops, one expert)."""
        self._run(out, x, group, parts, layer, expert, tier, host_rows)

    def _run(self, out, x, group, parts, layer: int, expert: int, tier: Optional[str],
             host_rows: Optional[torch.Tensor] = None) -> None:
        """out[rows] += w * expert(x[rows]); `group` = (rows, weights) on out's device, `parts` the
        expert's weights (formats.py) on the same device."""
        rows, w = group
        y = self.fmt.compute(x[rows], parts)  # [n, D]
        out.index_add_(0, rows, y * w.to(out.dtype)[:, None])
        if self.audit is not None and tier is not None:   # a cut expert's CPU columns: audited once, above
            rows = rows if host_rows is None else host_rows
            self.audit.extend((self.step, layer, int(t), expert, tier) for t in rows.tolist())

    def _run_fused(self, out, x, groups, batch: list, layer: int, role: str) -> None:
        """`batch` [(expert, tier)] of experts in their slots: every pair of those experts in one
        planned step of the Triton kernels (`gpu_moe.run`: two launches), reading the experts
        in place through the slot cache's table (`_slot_table`: built when the slots change, not
        per call). The pairs and the step's plan go to the device in one copy from pinned
        staging (its `role`'s: a layer-step's two batches must not share one). Empties the batch."""
        if not batch:
            return
        experts = [e for e, _ in batch]
        table, slot_of = self._slot_table(), self.slots.slot_of
        pair_slots = [slot_of[(layer, e)] for e in experts for _ in range(self._pairs_of(groups, e))]
        host_plan, n_groups, nt = packed_plan(pair_slots, table)
        rows, wts, plan = self.transfers.to_device([*self._pairs_host(groups, experts, out.dtype), host_plan], role,
                                                   keep=True)
        if x.stride(-1) != 1:
            x = x.contiguous()
        # (the kept device buffers are the same call after call: so is the step's plan over them)
        key = (self._table[0], plan.data_ptr(), n_groups, nt, len(pair_slots))
        step = self._step_plans.get(key)
        if step is None:
            if len(self._step_plans) >= 256:
                self._step_plans.clear()
            step = self._step_plans[key] = gpu_moe.step_plan(table, plan, n_groups, nt, len(pair_slots))
        gpu_moe.run(out, x, rows, wts, step)
        if self.audit is not None:
            self.audit.extend((self.step, layer, int(t), e, tier) for e, tier in batch
                              for t in groups[e][0].tolist())
        batch.clear()

    def _slot_table(self) -> SlotTable:
        """The slot cache's `gpu_slots.SlotTable` with its offsets on the device: every slot's parts
        checked once and located from one base per part (across chunks), rebuilt when the chunks
        change (a resize); the Triton steps then carry slot ids only."""
        key = self.slots.layout_version
        if self._table is None or self._table[0] != key:
            views = [self.slots.views(s) for s in range(self.slots.num_slots)]
            self._table = (key, build_table(views, self.fmt.name, self.fmt.group_size).to_device(self.slots.device))
        return self._table[1]

    def _run_bank(self, out, x, groups, experts, bank, layer: int, tier: Optional[str] = "cpu",
                  expert: Optional[int] = None) -> None:
        """Whole CPU experts through the numba kernels: every (token, expert) pair as one row
        (its token's activations, its expert id, its routing weight), summed back per token.
        `expert`: the layer's expert id when `bank` is a one-expert bank (`_rest_bank`)."""
        rows = torch.cat([groups[e][0] for e in experts])                          # [P] token of each pair
        wts = torch.cat([groups[e][1] for e in experts]).float()[:, None]          # [P, 1]
        ids = torch.cat([torch.full((len(groups[e][0]),), e) for e in experts])[:, None]  # [P, 1]
        y = moe_experts(bank, x[rows].float(), ids, wts)                          # [P, D] fp32
        out.index_add_(0, rows, y.to(out.dtype))
        if self.audit is not None and tier is not None:
            self.audit.extend((self.step, layer, int(t), int(e if expert is None else expert), tier)
                              for t, e in zip(rows.tolist(), ids[:, 0].tolist()))

    def _rest_bank(self, layer: int, expert: int, cols: int):
        """A quantised expert's columns [cols, I) as a one-expert `ExpertBank` (contiguous copies
        of its rows and column ranges, about the bytes the kernel then reads): the CPU's side of a
        cut runs in the numba kernels too. `cols` is whole activation blocks and scale groups, so
        the kernel's blocks of h are the full expert's."""
        def arr(t: torch.Tensor) -> np.ndarray:
            a = t.contiguous().numpy()
            return (a.view(np.uint16) if a.dtype == np.int16 else a)[None]   # int4 scales: fp16 bits

        return ExpertBank(self.fmt.name, self.fmt.group_size,
                          *(arr(t) for t in self.fmt.rest(self._host_expert(layer, expert), cols)))

    def _cut_columns(self, layer: int, fraction: float) -> int:
        """The planner's fraction as a column count of the intermediate dimension, in whole
        blocks (`ExpertFormat.cut_block`: 32 columns, an int4 scale group if wider), at least
        one block on each side when the dimension has two. With fewer, float weights cut at any
        column; a quantised expert goes whole to the side with the larger share."""
        inter, block = self.fmt.inter, self.fmt.cut_block
        blocks = inter // block
        if blocks < 2:
            if self.fmt.name != "float":
                return inter if fraction >= 0.5 else 0
            return int(round(fraction * inter))
        return block * min(blocks - 1, max(1, int(round(fraction * blocks))))

    def _bank_row(self, x: torch.Tensor, weights: torch.Tensor, one: list[int], experts, bank,
                  layer: int, stage: bool = False) -> torch.Tensor:
        """A lone token's whole CPU experts in one kernel call: one row holding all of them,
        summed inside the kernel in fp32 (the batch-1 decode call `freetoken probe` measures, with
        no per-pair gather or scatter). Returns the sum [1, D] in x's dtype. `one`: the token's
        experts in routing order (the columns of `weights`)."""
        w = dict(zip(one, weights.tolist()[0]))                            # expert -> routing weight
        wts = np.array([[w[e] for e in experts]], np.float32)              # [1, n] (bf16 and fp32 exact)
        xs = np.ascontiguousarray(x.detach().float().numpy())             # [1, D] fp32
        out = np.zeros(xs.shape, np.float32)
        add_moe_experts(bank, xs, np.asarray([experts], np.int64), wts, out)
        if self.audit is not None:
            self.audit.extend((self.step, layer, 0, int(e), "cpu") for e in experts)
        if stage:          # rounded to x's dtype straight into the pooled staging `_sum_parts` sends from
            staged = self.transfers.staged(x.shape, x.dtype, "cpu_part")
            staged.copy_(torch.from_numpy(out))
            return staged
        return torch.from_numpy(out).to(x.dtype)

    def _bank(self, layer: int):
        return self.cpu_banks[layer] if self.cpu_banks else None

    def _cpu_tier(self, layer: int, x: torch.Tensor, groups, experts, cuts=(), one: Optional[list[int]] = None,
                  weights: Optional[torch.Tensor] = None, stage: bool = False) -> torch.Tensor:
        """The CPU's part [T, D] on the host: `experts` whole, `cuts` (expert, columns the
        accelerator took) for the remaining columns. `one` (a lone token's distinct experts, with
        its routing `weights`) takes the one-row kernel call; with `stage` (the part goes to the
        accelerator next) that call's result is written into the staging buffer it is sent from."""
        t0 = time.perf_counter()
        bank = self._bank(layer)
        if bank is not None and experts and one is not None:
            out_cpu = self._bank_row(x, weights, one, experts, bank, layer, stage and not cuts)
        elif bank is not None and experts:
            out_cpu = torch.zeros_like(x)  # [T, D] host part
            self._run_bank(out_cpu, x, groups, experts, bank, layer)
        else:
            out_cpu = torch.zeros_like(x)
            for e in experts:
                self._run(out_cpu, x, groups[e], self._host_expert(layer, e), layer, e, "cpu")
        for e, cols in cuts:          # the columns the accelerator did not take (cols < I)
            tier = "split" if not cols else None    # (a cut's pairs are audited once, on the accelerator's side)
            if bank is not None and cols == 0:     # all of it: the layer's bank, as a whole CPU expert
                self._run_bank(out_cpu, x, groups, [e], bank, layer, tier)
            elif bank is not None and self.fmt.name != "float":   # quantised: its columns as a bank of one
                self._run_bank(out_cpu, x, {0: groups[e]}, [0], self._rest_bank(layer, e, cols), layer, tier, e)
            else:
                self._run(out_cpu, x, groups[e], self.fmt.rest(self._host_expert(layer, e), cols), layer, e, tier)
        seconds = time.perf_counter() - t0
        share = len(experts) + sum(1 - cols / self.fmt.inter for _, cols in cuts)
        c = self.telemetry.layers[layer]       # measured on this machine, emulated or not
        c.cpu_tier_s += seconds
        c.cpu_tier_bytes += int(share * self.cost.expert_bytes)
        # the rate is observed net of the fixed cost per call the planner adds on its own (cpu_call_s)
        net = seconds - self.cost.profile.cpu_call_s
        if self.measure_live and net > 0 and share > 0:
            self.cost = self.cost.observe(cpu_gbps=share * self.cost.expert_bytes / net / 1e9)
        return out_cpu

    def _host_expert(self, layer: int, expert: int) -> tuple:
        return tuple(part[expert] for part in self.host[layer])

    def _stream_in(self, layer: int, expert: int, evicted: list) -> tuple[torch.Tensor, ...]:
        """Copy a streamed expert in: into a slot when the policy (still) holds it, after its
        victims, `evicted`, leave theirs, else into staging. A victim with no slot is one admitted
        earlier in the same layer-step and evicted again before its copy (a policy may do that
        when the layer streams more experts than it has slots): it went to staging."""
        for key in evicted:
            if key in self.slots.slot_of:
                self.slots.evict(key)
        if self.policy.is_resident(layer, expert):
            return self.streamer.to_slot(layer, expert)
        return self.streamer.to_staging(layer, expert)

    def _unadmit(self, layer: int, experts, evictions) -> None:
        """A layer-step's streaming stopped at an error after the policy admitted `experts` (with
        `evictions`) and before they were copied: their victims leave their slots, as they left
        the policy, and the experts leave the policy (and a slot reserved for a copy that did not
        finish), so the next pass sees the slots and the policy agree."""
        for e, evicted in zip(experts, evictions):
            for key in [*evicted, (layer, e)]:
                if key in self.slots.slot_of:
                    self.slots.evict(key)
            self.policy.discard(layer, e)

    def _count(self, layer: int, plan, tokens: dict[int, int], cuts=(), single: bool = False) -> None:
        """`single`: every expert in `tokens` has one token (a lone token's distinct experts)."""
        c = self.telemetry.layers[layer]
        if single:
            c.routed_pairs += len(tokens)
            c.hit_pairs += len(plan.hits)
            c.stream_pairs += len(plan.stream)
            c.cpu_pairs += len(plan.cpu)
            c.split_pairs += len(plan.split)
            one_s = self.cost.gpu_compute_s(1)
            resident_s = sum(one_s for _ in tokens)       # (the same sum, in the same order)
        else:
            n_of = tokens.__getitem__
            c.routed_pairs += sum(tokens.values())
            c.hit_pairs += sum(map(n_of, plan.hits))
            c.stream_pairs += sum(map(n_of, plan.stream))
            c.cpu_pairs += sum(map(n_of, plan.cpu))
            c.split_pairs += sum(tokens[e] for e, _ in plan.split)
            resident_s = sum(map(self.cost.gpu_compute_s, tokens.values()))
        c.pcie_bytes += len(plan.stream) * self.cost.expert_bytes
        if cuts:
            inter = self.fmt.inter
            c.pcie_bytes += sum(self.cost.expert_bytes * cols // inter for _, cols in cuts)
            c.split_cpu_share += sum(tokens[e] * (1 - cols / inter) for e, cols in cuts)
        c.stall_s += max(0.0, plan.seconds - resident_s)

    # ---- look-ahead prefetch ----------------------------------------------------------------
    def _next_moe_layer(self, layer: int) -> Optional[int]:
        if not self.routers:
            return None
        return next((l for l in range(layer + 1, len(self.routers)) if self.routers[l] is not None), None)

    def _predict_next(self, layer: int, x: torch.Tensor) -> Optional[tuple[int, list[int]]]:
        """(next MoE layer, its experts most routed by this layer's input through that layer's
        router), best first; None without a next layer or slots."""
        nxt = self._next_moe_layer(layer)
        if nxt is None or self.top_k <= 0 or self.slots.num_slots == 0:
            return None
        # this layer's input stands in for the next one's (one device-to-host read)
        r = self.routers[nxt]   # (a RoutePredictor carries its layer's choice rule: sigmoid bias, groups)
        return nxt, predict_experts(r(x), self.top_k, getattr(r, "rule", None))

    def lead(self, decode: bool = True) -> float:
        """The lead (seconds) the look-ahead copies of a decode (or a prefill) step may use."""
        if self._fixed_lead is not None:
            return self._fixed_lead[0 if decode else 1]
        if self.dense_layer_bytes is not None:
            p = self.cost.profile
            return self.dense_layer_bytes / (p.vram_gbps * GB) + p.host_layer_s + self.cost.host_step_s
        return self._lead[decode]

    def fix_lead(self, decode_s: Optional[float], prefill_s: Optional[float] = None) -> None:
        """Use these leads from now on (decode steps, other steps: default the same; None: back
        to the profile's or the measured one)."""
        self._fixed_lead = None if decode_s is None else (decode_s, decode_s if prefill_s is None else prefill_s)

    def _measure_lead(self, decode: bool, routed=None) -> None:
        """Called once the routing is on the host (`routed`: an event recorded then, on a GPU): the
        time since the previous layer's expert work (same step) joins that kind of step's EMA."""
        prev, self._prev_end = self._prev_end, None
        if prev is None or self._fixed_lead is not None or self.dense_layer_bytes is not None:
            return
        if isinstance(prev, float):       # host: from the previous call's return
            self._add_lead(decode, time.perf_counter() - prev)
        elif routed is not None:          # GPU clock: read back in flush_timing, once both have happened
            self._lead_pending.append((prev, routed, decode))

    def _add_lead(self, decode: bool, gap: float) -> None:
        seen, self._lead_seen[decode] = self._lead_seen[decode], True
        self._lead[decode] = 0.8 * self._lead[decode] + 0.2 * gap if seen else gap

    def _prefetch(self, prediction: Optional[tuple[int, list[int]]], allowed: int) -> None:
        """Admit the predicted experts the policy wants, best first, and copy them in ahead (not
        waited for), at most `allowed` copies (planner.prefetch_allowance: what fits where the
        copy engine would idle before the next layer's experts start), with `policy.look_ahead`'s
        stop. The prediction is scored either way (`prefetch%`)."""
        self.prediction_made = prediction
        if prediction is None:
            return
        nxt, predicted = prediction
        self._predicted[nxt] = set(predicted)
        c = self.telemetry.layers[nxt]

        def on_admit(e, evicted, admitted):
            for key in evicted:
                self.slots.evict(key)
            if admitted:
                self.streamer.to_slot(nxt, e, ahead=True)
                c.pcie_bytes += self.cost.expert_bytes
                c.prefetch_copies += 1

        look_ahead(self.policy, nxt, predicted, allowed, self.step, on_admit)

    def _score_prefetch(self, layer: int, tokens: dict[int, int], decode: bool) -> None:
        """`prefetch%` counts the decode steps' predictions (a prefill chunk's routes to nearly
        every expert: its predictions would be right whatever they were)."""
        predicted = self._predicted.pop(layer, None)
        if predicted is not None and decode:
            c = self.telemetry.layers[layer]
            c.prefetch_predicted += len(predicted)
            c.prefetch_correct += len(predicted & set(tokens))

    # ---- elastic VRAM -----------------------------------------------------------------------
    def _new_step(self) -> None:
        self.step += 1
        self.telemetry.steps += 1
        self._predicted.clear()
        self._prev_end = None
        self._observe_copies()
        if self.elastic is not None and self.memory_probe is not None:
            target = self.elastic.target(self.memory_probe(), self.slots.num_slots)
            if target < self.slots.num_slots:        # a shrink frees whole chunks only
                target = self.slots.held_after_shrink(target)
            if target != self.slots.num_slots:
                self.resize(target)

    def shrink_after_oom(self) -> bool:
        """An allocation failed elsewhere (a forward's activations): give back at least one chunk
        of slots, about half of them, and never grow past what is left (the free-memory probe
        would otherwise count the freed memory and grow straight back). False when there is
        nothing left to give."""
        held = self.slots.num_slots
        if held == 0:
            return False
        target = min(held // 2, self.slots.boundaries()[-2])   # the last chunk goes at least
        reached = self.resize(target)
        if self.elastic is not None:
            self.elastic = replace(self.elastic, max_slots=reached)
        self.telemetry.oom_retries += 1
        return reached < held

    def lend_slots(self, num_slots: int) -> None:
        """The KV cache took `num_slots` slots' worth of memory (`Engine._more_pages`): the elastic
        sizing may not grow back into it until `reclaim_slots`."""
        if self.elastic is not None:
            before = self.elastic.max_slots
            self.elastic = replace(self.elastic, max_slots=max(0, before - num_slots))
            self._slots_lent += before - self.elastic.max_slots

    def reclaim_slots(self) -> None:
        """The KV cache went back to its start-up size (`KvSlotSplit.return_pages`): the elastic sizing's
        ceiling gets back exactly what `lend_slots` took off it."""
        if self.elastic is not None:
            self.elastic = replace(self.elastic, max_slots=self.elastic.max_slots + self._slots_lent)
        self._slots_lent = 0

    def _observe_copies(self) -> None:
        """Feed the measured PCIe rate of last step's copies into the cost model (EMA), with the
        same opt-in as the CPU tier's speed: a measurement only describes this machine."""
        nbytes, seconds = self.streamer.finished_copies()
        if self.measure_live and nbytes and seconds > 0:
            self.cost = self.cost.observe(copy_gbps=nbytes / seconds / 1e9)

    def resize(self, num_slots: int) -> int:
        """Shrink or grow the slot cache (`SlotCache.resize`: a shrink allocates nothing, a grow
        keeps what it could allocate). Returns the slot count reached; never raises for lack of
        memory, and the policy's capacity follows what is held."""
        self.streamer.wait_all()                  # slots may move: no look-ahead copy in flight
        self.streamer.reading = None              # the moves are queued compute: copies wait until the next sync
        if num_slots < self.slots.num_slots:
            num_slots = self.slots.held_after_shrink(num_slots)   # evict no more than is freed
            for key in self.policy.resize(num_slots):
                self.slots.evict(key)
        shrink = num_slots < self.slots.num_slots
        # the kept slot table, the step plans over it and the slot maps hold views of the slots'
        # chunks: dropped, so that a shrink frees its chunks (each is remade on its next use)
        self._table = None
        self._step_plans.clear()
        self._slot_maps.clear()
        reached = self.slots.resize(num_slots)
        if shrink and self.slots.device.type == "cuda":
            torch.cuda.empty_cache()    # the freed chunks go back to the driver: the process that took memory gets them
        if reached < num_slots:
            self.telemetry.oom_retries += 1     # the grow stopped at an allocation failure
        self.policy.resize(reached)
        self.telemetry.resizes.append((self.step, reached))
        return reached
