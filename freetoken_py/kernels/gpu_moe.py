"""The accelerator tier's experts for decode-sized batches: one Triton family for every format.

The torch path (`residency.formats.swiglu` per expert) issues about nine operations per expert
(gather, two GEMVs, chunk, SiLU, multiply, scale, scatter): at decode, with one token and up to
top-k experts on the accelerator, that is ~70 kernel launches and their Python per MoE layer.
Here a layer-step's (token, expert) pairs are grouped by expert (`gpu_slots.plan`: each expert
is read once for up to 8 of its tokens) and run in two launches (`launches`):

    gate_up_kernel   grid (groups, I / BLOCK_N, SPLIT):  h[p] = silu(gate . x_t) * (up . x_t)   (fp32; x
                                                  and h rounded as the CPU kernels see them where they
                                                  are; D split SPLIT ways where the grid is short of a
                                                  wave, `split_k`, the shares summed in a fixed order)
    down_kernel      grid (groups, D / BLOCK_N):  y[p] = w_p * (down . h[p]), then the last program of
                                                  each row block: out[t] += sum of y[p] over t's pairs,
                                                  in pair order (no atomics on values)

for bf16 / fp16 / fp32, int8, int4 (g >= 8 columns a group, fp16 scales), fp8 (e4m3, a scale a
row and block of columns) and nvfp4 experts in the expert store's layouts, read in place: an
expert is found through a slot table (`gpu_slots.SlotTable`, int64 offsets on the device, built
and checked once when its slots are admitted), the pairs carry slot ids. `moe_slots` is that
API; `moe_pairs` / `moe_pairs_quant` take the experts per pair and build the table per call.
The residency executor keeps one table over its slot cache (rebuilt when the cache's chunks
change) and sends each step's plan with its pairs from its own pinned staging (`step_plan`:
the scratch rows come from a per-device pool, so a step allocates nothing).
The kernels' design (pipelined K loop, the reduction deferred to the epilogue, word reads and
arithmetic decoding) is in `_triton_moe`, their launch configurations in `gpu_autotune`.

Triton is optional: CUDA builds of torch ship it; without it, on a CPU-only torch or on a GPU
below compute capability 8.0, `available()` is False (`why_not()` says why in one line) and
the executor keeps the torch path. Under `TRITON_INTERPRET=1` the same kernels run on CPU
tensors through Triton's interpreter: that is how CI checks them against a float64 reference
(tests/test_triton_experts.py, tests/test_gpu_moe.py); tests/test_triton_compile.py compiles
them for sm_80 .. sm_120 without a GPU (no spills, 16-byte weight loads). Their speed is only
measured on a GPU (bench/gpu_moe_kernels.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from freetoken_py.errors import first_line
from freetoken_py.kernels.gpu_autotune import finalize, kernel_config
from freetoken_py.kernels.gpu_slots import UNIT, SlotTable, build_table, packed_plan

MAX_TOKENS_PER_EXPERT = 8          # tokens of one expert read in one group (gpu_slots.MAX_GROUP)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
QUANT_FORMATS = ("int8", "int4", "fp8", "nvfp4")
COMBINE_BLOCK = 1024
MAX_FUSED_TOKENS = 16              # up to this many tokens the down kernel sums the pairs itself

_kernels = None
_why_not: str | None = None


class _Launches:
    """Every Triton launch of this module passes through `_launch`, which counts it (`count`) and
    says it is at work (`inside`: a counter of torch's operations, residency.transfers.counting,
    ignores what Triton's interpreter does with the tensors then)."""
    count = 0
    inside = False


LAUNCHES = _Launches()


def _launch(kernel, grid: tuple, *args, **kwargs) -> None:
    LAUNCHES.count += 1
    LAUNCHES.inside = True
    try:
        kernel[grid](*args, **kwargs)
    finally:
        LAUNCHES.inside = False


def available(device: torch.device | str) -> bool:
    """Whether the kernels can run for tensors on `device`: Triton importable (any failure to
    import it counts as absent), and the device a CUDA GPU of compute capability >= 8.0 (or any
    device under TRITON_INTERPRET=1, Triton's CPU interpreter). `why_not()` says why not."""
    global _why_not
    dev = torch.device(device)
    if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        _why_not = f"{dev} is not a CUDA GPU"
        return False
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 0):
        cap = torch.cuda.get_device_capability(dev)
        _why_not = f"GPU compute capability {cap[0]}.{cap[1]} is below 8.0, which these Triton kernels need"
        return False
    try:
        _load()
    except Exception as exc:           # not installed, or a build that does not match this torch
        _why_not = f"Triton is not usable here ({type(exc).__name__}: {first_line(exc, 120)})"
        return False
    _why_not = None
    return True


def why_not() -> str | None:
    """One line: why the last `available()` said False (None when it said True)."""
    return _why_not


def _load():
    global _kernels
    if _kernels is None:
        from freetoken_py.kernels import _triton_moe, gpu_autotune

        _kernels = _triton_moe
        gpu_autotune.use_cache()        # this GPU's tuned configurations, if `tune` has run here
    return _kernels


def time_config(out, x, rows, weights, plan: StepPlan, kernel: str, config: dict, reps: int = 5) -> float:
    """Seconds a planned step takes with `kernel` launched at `config` (the other at its current
    one): median of `reps` runs after a warm-up (CUDA events on a GPU, else wall clock). The
    `time_config` that `gpu_autotune.tune` calls."""
    import statistics
    import time

    cuda = x.device.type == "cuda"
    run(out, x, rows, weights, plan, {kernel: config})
    got = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run(out, x, rows, weights, plan, {kernel: config})
            b.record()
            b.synchronize()
            got.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            run(out, x, rows, weights, plan, {kernel: config})
            got.append(time.perf_counter() - t0)
    return statistics.median(got)


def seen_by_cpu_kernels(v: torch.Tensor) -> torch.Tensor:
    """An activation [n, K] fp32, on any device, as the CPU kernels multiply it with int8 / int4 /
    nvfp4 weights (`_dots.INT_ACT`): on the int8 path every 32-element block rounded to int8 against
    max|block| / 127 and back (a partial last block as if zero-padded; the arithmetic of
    `quant.roundtrip_act_q8`, which works on the host), else as is."""
    from freetoken_py.kernels._dots import INT_ACT

    if INT_ACT != "int8":
        return v
    k = v.shape[-1]
    blocks = torch.nn.functional.pad(v, (0, -k % 32)).view(*v.shape[:-1], -1, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.round(blocks / torch.where(scale > 0, scale, 1.0)).clamp_(-127, 127)
    return (q * scale).view(*v.shape[:-1], -1)[..., :k]


def launches(tokens: int = 1) -> int:
    """Kernel launches of one `moe_slots` / `run` call for `tokens` rows of x, whatever the format:
    gate/up and down (a separate per-token sum past MAX_FUSED_TOKENS)."""
    return 2 if tokens <= MAX_FUSED_TOKENS else 3


def _rounds(fmt: str) -> bool:
    """Whether a format's activations are rounded as the CPU kernels see them (int8 / int4 /
    nvfp4 on the int8-activation path; fp8 and float multiply exact activations)."""
    from freetoken_py.kernels._dots import INT_ACT

    return fmt in ("int8", "int4", "nvfp4") and INT_ACT == "int8"


@dataclass
class StepPlan:
    """One layer-step's device-side plan (`prepare`): everything its launches read besides x,
    rows and weights, so `run` only launches kernels (and can be captured in a CUDA graph)."""
    table: SlotTable
    offsets: torch.Tensor      # int64 [4 * S] on the device
    slots: torch.Tensor        # int64 [groups]
    pairs: torch.Tensor        # int64 [groups * NT]: pair indices, -1 padded
    groups: int
    nt: int
    n_pairs: int
    h: torch.Tensor            # fp32 [P, I] scratch
    y: torch.Tensor            # fp32 [P, D] scratch
    counters: torch.Tensor     # int32, zero between launches: the down kernel's row blocks (`_counters`)


def prepare(table: SlotTable, pair_slots: Sequence[int], device: torch.device | str) -> StepPlan:
    """The plan of one step whose pair p reads slot pair_slots[p] of `table`: one host->device copy
    of the groups and, when the table has no device copy, its offsets (a caller with pooled
    pinned staging sends `gpu_slots.packed_plan` itself and calls `step_plan`)."""
    dev = torch.device(device)
    host, groups, nt = packed_plan(pair_slots, table)
    buf = host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else host.to(dev)
    if table.device_offsets is None:
        tab, buf = buf[:table.offsets.numel()], buf[table.offsets.numel():]
        table = replace(table, device_offsets=tab)
    return step_plan(table, buf, groups, nt, len(pair_slots))


def step_plan(table: SlotTable, plan: torch.Tensor, groups: int, nt: int, pairs: int) -> StepPlan:
    """The StepPlan of a packed plan already on the device (`gpu_slots.packed_plan(pair_slots,
    table)` of a table with its offsets there: int64 [groups + groups * nt]), with the scratch
    rows from a per-device pool (grown, never shrunk: no allocation per step)."""
    return plan_of(table, plan[:groups], plan[groups:], nt, pairs)


def plan_of(table: SlotTable, slots: torch.Tensor, members: torch.Tensor, nt: int, pairs: int) -> StepPlan:
    """The StepPlan of a step's group slots (int64 [groups]) and their pair indices (int64
    [groups * nt], -1 padded), both already on the device (made there, e.g. from the routing's
    ids through a slot map, with no host round trip; or `step_plan`'s halves of a packed plan)."""
    dev = slots.device
    h, y = _scratch(dev, pairs * table.inter, pairs * table.hidden)
    return StepPlan(table, table.device_offsets, slots, members, slots.shape[0], nt, pairs,
                    h.view(pairs, table.inter), y.view(pairs, table.hidden), _counters(dev, table.hidden))


_scratch_bufs: dict = {}


def _scratch(dev: torch.device, h: int, y: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scratch of at least h and y elements on `dev` (the gate_up kernel's h, the down
    kernel's y): rewritten by each step in stream order, so one pair serves every step; a grown
    one keeps the old alive while a plan or a captured graph still points at it."""
    bufs = _scratch_bufs.get(dev)
    if bufs is None or bufs[0].numel() < h or bufs[1].numel() < y:
        old = bufs or (torch.empty(0), torch.empty(0))
        bufs = tuple(b if b.numel() >= n else torch.empty(max(n, 2 * b.numel(), 1 << 14), dtype=torch.float32,
                                                           device=dev) for b, n in zip(old, (h, y)))
        _scratch_bufs[dev] = bufs
        if old[0].numel():
            _split_kept.extend(old)
    return bufs[0][:h], bufs[1][:y]


_counter_bufs: dict = {}
_split_bufs: dict = {}
_split_kept: list = []
# resident programs an SM holds, by warps a program: at up to 128 registers a thread, 64K
# registers an SM hold 4 programs of 4 warps (sm_80 .. sm_120 alike)
RESIDENT_WARPS = 16
MIN_SPLIT_STEPS = 4          # BLOCK_K steps a split-K share keeps at least (the pipeline fills)
MAX_SPLIT = 8
split_k_override: int | None = None      # a fixed SPLIT for every launch (tests, the interpreter)


def split_k(programs: int, k_steps: int, dev: torch.device, warps: int = 4) -> int:
    """The gate_up kernel's split of its columns (D): 1 unless its grid (`programs`) is short of one
    wave (SMs x resident programs), then the largest power of two (at most MAX_SPLIT) whose grid
    still fits a wave and whose shares keep MIN_SPLIT_STEPS steps of BLOCK_K each (decode at one
    token on a wide D). Off CUDA: 1, or `split_k_override`."""
    if split_k_override is not None:
        return split_k_override
    if dev.type != "cuda":
        return 1
    return split_for_wave(programs, k_steps,
                          torch.cuda.get_device_properties(dev).multi_processor_count * max(1, RESIDENT_WARPS // warps))


def split_for_wave(programs: int, k_steps: int, wave: int) -> int:
    """`split_k`'s rule for a wave of `wave` resident programs."""
    split = 1
    while split < MAX_SPLIT and programs * split * 2 <= wave and k_steps >= MIN_SPLIT_STEPS * split * 2:
        split *= 2
    return split


def _split_buffers(dev: torch.device, floats: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K partials (fp32) and a zeroed int32 counter per group and row block, kept per
    device and grown as needed (each launch's last program of a block resets its counter; the
    partials are rewritten by every launch, in stream order)."""
    part, cnt = _split_bufs.get(dev, (None, None))
    if part is None or part.numel() < floats:
        if part is not None:
            _split_kept.append(part)     # (a captured CUDA graph may still point at the old one)
        part = torch.empty(max(floats, 1 << 16), dtype=torch.float32, device=dev)
    if cnt is None or cnt.numel() < counters:
        if cnt is not None:
            _split_kept.append(cnt)
        cnt = torch.zeros(max(counters, 1024), dtype=torch.int32, device=dev)
    _split_bufs[dev] = (part, cnt)
    return part, cnt


def _counters(dev: torch.device, hidden: int) -> torch.Tensor:
    """A zeroed int32 counter per row block of the down kernel (at least 16 rows a block), kept per
    device: each launch's last program of a block resets its counter, so one buffer serves every
    launch on a stream (and the same address every CUDA graph replay)."""
    need = -(-hidden // 16)
    buf = _counter_bufs.get(dev)
    if buf is None or buf.numel() < need:
        buf = _counter_bufs[dev] = torch.zeros(max(need, 1024), dtype=torch.int32, device=dev)
    return buf


def run(out: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, plan: StepPlan,
        configs: dict | None = None) -> None:
    """The launches of one planned step: out[rows[p]] += weights[p] * expert(x[rows[p]]). `configs`
    {"gate_up" | "down": launch configuration} overrides the tuned / default ones (tuning)."""
    k, table, dev = _load(), plan.table, x.device
    hidden, inter, tokens = table.hidden, table.inter, out.shape[0]
    lp = _launch_plan(table, plan.nt, plan.groups, tokens, dev, configs)
    split = lp.gate_up["SPLIT"]
    part, cnt = _split_buffers(dev, plan.groups * split * 2 * plan.nt * inter, plan.groups * lp.grids[0][1]) \
        if split > 1 else (plan.h, plan.counters)
    _launch(k.gate_up_kernel, lp.grids[0],
        x, x.stride(0), rows, plan.pairs, plan.slots, plan.offsets, table.slots, table.bases[0], table.bases[1],
        plan.h, lp.rows[0], lp.rows[1], inter, hidden // 16, part, cnt, **lp.gate_up)
    _launch(k.down_kernel, lp.grids[1],
        plan.h, weights, plan.pairs, plan.slots, plan.offsets, table.slots, table.bases[2], table.bases[3], plan.y,
        lp.rows[2], lp.rows[3], hidden, inter // 16, out, out.stride(0), rows, tokens,
        plan.n_pairs, plan.counters, **lp.down)
    if lp.down["TB"] == 0:
        _launch(k.combine_kernel, lp.grids[2], out, out.stride(0), plan.y, rows, plan.n_pairs, hidden,
                BLOCK=min(COMBINE_BLOCK, 1 << (hidden - 1).bit_length()))


@dataclass(frozen=True)
class LaunchPlan:
    gate_up: dict        # the gate_up kernel's keyword arguments (constants and configuration)
    down: dict           # the down kernel's
    grids: tuple         # gate_up's, down's and combine's grids
    rows: tuple          # the row lengths in loaded elements: gate_up's weights and scales, down's


_launch_plans: dict = {}


def _launch_plan(table: SlotTable, nt: int, groups: int, tokens: int, dev: torch.device,
                 configs: dict | None = None) -> LaunchPlan:
    """The kernels' arguments that depend on the step's shape only (`LaunchPlan`): derived once per
    (format, geometry, NT, groups, tokens, device, tuned configurations) and kept, so a decode
    step's launches do no lookups (`configs`: a tuning's override, not kept)."""
    from freetoken_py.kernels import gpu_autotune

    key = (table.fmt, table.group_size, table.hidden, table.inter, table.align, nt, groups, tokens, dev,
           gpu_autotune._Configs.version, split_k_override)
    got = None if configs else _launch_plans.get(key)
    if got is not None:
        return got
    fid, hidden, inter, configs = table.fmt_id, table.hidden, table.inter, configs or {}
    native = dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 9)
    common = dict(FMT=fid, G=table.group_size, NT=nt, UNIT=UNIT[fid], NATIVE=native, ALIGN=table.align)
    shape = (hidden, inter)
    cu = finalize(configs["gate_up"], table.fmt, table.group_size) if "gate_up" in configs else \
        kernel_config(table.fmt, nt, "gate_up", _rounds(table.fmt), table.group_size, shape)
    blocks = -(-inter // cu["BLOCK_N"])
    if cu.get("SPLIT") is None:      # split-K only where the grid is short of a wave
        cu["SPLIT"] = split_k(groups * blocks, -(-hidden // cu["BLOCK_K"]), dev, cu.get("num_warps", 4))
    cd = finalize(configs["down"], table.fmt, table.group_size) if "down" in configs else \
        kernel_config(table.fmt, nt, "down", False, table.group_size, shape)
    tb = 1 << (tokens - 1).bit_length() if tokens <= MAX_FUSED_TOKENS else 0     # the sum in the down kernel
    blk = min(COMBINE_BLOCK, 1 << (hidden - 1).bit_length())
    got = LaunchPlan(dict(ROUND=_rounds(table.fmt), **common, **cu), dict(TB=tb, **common, **cd),
                     ((groups, blocks, cu["SPLIT"]), (groups, -(-hidden // cd["BLOCK_N"])), (tokens, -(-hidden // blk))),
                     (table.row_words(hidden), table.scale_row(hidden), table.row_words(inter), table.scale_row(inter)))
    if not configs:
        if len(_launch_plans) >= 256:
            _launch_plans.clear()
        _launch_plans[key] = got
    return got


def moe_slots(out: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
              table: SlotTable, pair_slots: Sequence[int]) -> None:
    """out[rows[p]] += weights[p] * expert(x[rows[p]]) for every pair p, with the expert the one
    in slot pair_slots[p] of `table` (built and checked once, `gpu_slots.build_table`). x [T, D]
    (unit column stride), rows [P] int64 and weights [P] fp32 on x's device. Each slot is read
    once for up to 8 of its pairs; fp32 sums, per token in pair order, added into out once in
    its dtype. `prepare` then `run`: `launches(T)` kernel launches."""
    if len(pair_slots):
        run(out, x, rows, weights, prepare(table, pair_slots, x.device))


def _pair_slots(experts: Sequence[tuple]) -> tuple[list[tuple], list[int]]:
    """The distinct experts (by where their parts lie) and each pair's index among them."""
    index: dict[tuple, int] = {}
    unique, slots = [], []
    for parts in experts:
        key = tuple(t.data_ptr() for t in parts)
        if key not in index:
            index[key] = len(unique)
            unique.append(parts)
        slots.append(index[key])
    return unique, slots


def _prepare(out, x, rows, weights, pairs: int, hidden: int, who: str):
    if x.dim() == 2 and x.stride(1) != 1:     # the kernels read a token's row as one run
        x = x.contiguous()
    if x.dim() != 2 or x.shape[1] != hidden or rows.numel() != pairs or weights.numel() != pairs \
            or out.dim() != 2 or out.shape[1] != hidden or out.stride(1) != 1:
        raise ValueError(f"{who}: x {tuple(x.shape)}, out {tuple(out.shape)}, {rows.numel()} rows, "
                         f"{weights.numel()} weights for {pairs} pairs of D = {hidden} experts")
    return x, rows.to(x.device, torch.int64).contiguous(), weights.to(x.device, torch.float32).contiguous()


def moe_pairs(out: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
              w13: Sequence[torch.Tensor], w2: Sequence[torch.Tensor]) -> None:
    """out[rows[p]] += weights[p] * expert_p(x[rows[p]]) for every pair p, with expert_p the SwiGLU
    of w13[p] [2I, D] (gate rows, then up rows) and w2[p] [D, I] (contiguous, one dtype, on x's
    device; the same expert may appear in several pairs, and is then read once). x [T, D] (made
    contiguous if its columns are strided); rows [P] int64 and weights [P] on x's device. Sums
    in fp32 (each token's pairs in pair order) and adds into out once, in out's dtype."""
    pairs = len(w13)
    if pairs == 0:
        return
    if len(w2) != pairs:
        raise ValueError(f"moe_pairs: {pairs} w13 parts but {len(w2)} w2 parts")
    unique, slots = _pair_slots(list(zip(w13, w2)))
    try:
        table = build_table(unique, "float")
    except ValueError as exc:
        raise ValueError(f"moe_pairs: {exc} (every expert must be contiguous)") from None
    x, rows, weights = _prepare(out, x, rows, weights, pairs, table.hidden, "moe_pairs")
    moe_slots(out, x, rows, weights, table, slots)


def moe_pairs_quant(out: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
                    experts: Sequence[tuple], fmt: str, group_size: int = 32) -> None:
    """`moe_pairs` for quantised experts: `experts[p]` = (q13, s13, q2, s2) of pair p's expert in
    the expert store's layouts (`residency.formats`: int8, int4 with fp16 scales as int16 bits,
    fp8 with a scale a row and block of `group_size` columns, nvfp4), each part contiguous and of
    one dtype across pairs. x and h are seen as the CPU kernels see them (`seen_by_cpu_kernels`;
    fp8: exact), so a pair gives the CPU tier's result up to fp32 rounding."""
    pairs = len(experts)
    if pairs == 0:
        return
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"moe_pairs_quant: format must be one of {QUANT_FORMATS}, got {fmt!r}")
    unique, slots = _pair_slots(experts)
    try:
        table = build_table(unique, fmt, group_size)
    except ValueError as exc:
        raise ValueError(f"moe_pairs_quant: {exc} (every expert's parts must be contiguous)") from None
    x, rows, weights = _prepare(out, x, rows, weights, pairs, table.hidden, "moe_pairs_quant")
    moe_slots(out, x, rows, weights, table, slots)


def _fp8_parts(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> the fp8 bank's (e4m3 bytes [N, K], per-row block scales [N, ceil(K/block)])."""
    from freetoken_py.quant.fp8 import expand_block_scales, quantize_fp8_blocks

    codes, grid = quantize_fp8_blocks(w, (block, block))
    return codes.view(torch.uint8), expand_block_scales(grid, w.shape[0], block)


def self_check_quant(device: torch.device | str, fmt: str, group_size: int = 32) -> str | None:
    """`self_check` for `moe_pairs_quant`: a small random int8 / int4 / fp8 / nvfp4 case against the torch path
    (`quant_swiglu`: the same experts dequantised, the activations rounded alike; 2e-3 relative)."""
    try:
        from freetoken_py.quant import quantize_int4, quantize_int8

        g = torch.Generator().manual_seed(0)
        hidden, inter = 2 * max(32, group_size), max(64, 2 * group_size)
        parts = []
        for _ in range(3):
            w13 = torch.randn(2 * inter, hidden, generator=g) / 10
            w2 = torch.randn(hidden, inter, generator=g) / 9
            if fmt == "int4":
                (a, sa), (b, sb) = (quantize_int4(w, group_size, torch.float16) for w in (w13, w2))
                sa, sb = sa.view(torch.int16), sb.view(torch.int16)
            elif fmt == "fp8":
                (a, sa), (b, sb) = (_fp8_parts(w, group_size) for w in (w13, w2))
            elif fmt == "nvfp4":
                from freetoken_py.quant.nvfp4 import quantize_nvfp4

                (a, sa), (b, sb) = (quantize_nvfp4(w, group_size) for w in (w13, w2))
            else:
                (a, sa), (b, sb) = (quantize_int8(w) for w in (w13, w2))
                sa, sb = sa[:, None].contiguous(), sb[:, None].contiguous()
            parts.append(tuple(t.to(device) for t in (a, sa, b, sb)))
        x = torch.randn(2, hidden, generator=g).to(device)
        pairs = [(0, 0), (0, 2), (1, 1), (1, 2)]
        rows = torch.tensor([t for t, _ in pairs], device=device)
        wts = torch.tensor([0.5, 0.25, 0.75, 0.125], device=device)
        out = torch.zeros(2, hidden, device=device)
        moe_pairs_quant(out, x, rows, wts, [parts[e] for _, e in pairs], fmt, group_size)
        ref = torch.zeros(2, hidden, device=device)
        for (t, e), w in zip(pairs, wts.tolist()):
            ref[t] += w * quant_swiglu(x[t:t + 1], parts[e], fmt, group_size)[0]
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        # (2e-3: room for one element of h rounded a step apart near an int8 tie, ~1e-3 at this
        # size; a wrong nibble, scale or group is off by far more)
        return None if err <= 2e-3 else f"Triton {fmt} experts differ from torch by {err:.2e} (relative) on {device}"
    except Exception as exc:
        return f"Triton {fmt} experts failed on {device}: {type(exc).__name__}: {exc}"


def dequant_int4(packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """int4 rows (uint8 [N, K/2], low nibble the even column, value + 8; fp16 scale bits
    [N, K/g] as int16) -> fp32 [N, K], on their device: what the accelerator's torch path
    computes from."""
    p = packed.to(torch.int16)
    w = torch.stack([p & 15, p >> 4], dim=-1).reshape(p.shape[0], -1).float() - 8.0
    scale = scales.view(torch.float16).float()
    return (w.view(w.shape[0], scale.shape[1], group_size) * scale[..., None]).reshape(w.shape)


def quant_swiglu(x: torch.Tensor, parts: tuple, fmt: str, group_size: int = 32) -> torch.Tensor:
    """One int8 / int4 / nvfp4 / fp8 expert (q13, s13, q2, s2, as `moe_pairs_quant` takes them) in torch, on
    their device: x [n, D] -> [n, D] in x's dtype, from the dequantised weights in fp32 with x
    and h seen as the CPU kernels see them. The accelerator's path without the Triton kernels."""
    q13, s13, q2, s2 = parts
    if fmt == "fp8":     # the numba fp8 kernel multiplies exact fp32 activations: no rounding of x or h
        from freetoken_py.quant.fp8 import dequantize_fp8

        w13, w2 = dequantize_fp8(q13, s13, group_size), dequantize_fp8(q2, s2, group_size)
        gate, up = torch.nn.functional.linear(x.float(), w13).chunk(2, dim=-1)
        return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2).to(x.dtype)
    if fmt == "nvfp4":   # the numba nvfp4 kernel rounds x and h as the int4 one does (INT_ACT)
        from freetoken_py.quant.nvfp4 import dequantize_nvfp4

        w13, w2 = dequantize_nvfp4(q13, s13, group_size), dequantize_nvfp4(q2, s2, group_size)
    elif fmt == "int4":
        w13, w2 = dequant_int4(q13, s13, group_size), dequant_int4(q2, s2, group_size)
    else:
        w13, w2 = q13.float() * s13.float(), q2.float() * s2.float()      # [N, K] * [N, 1]
    gate, up = torch.nn.functional.linear(seen_by_cpu_kernels(x.float()), w13).chunk(2, dim=-1)
    return torch.nn.functional.linear(seen_by_cpu_kernels(torch.nn.functional.silu(gate) * up), w2).to(x.dtype)


def self_check(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Run the kernels once on a small random case against a plain torch SwiGLU on `device`:
    None when they agree (fp32 accumulation: 1e-4 relative in fp32, 2e-2 in 16-bit types), else
    what went wrong. The executor runs it before using the kernels on a GPU (a Triton or driver
    problem then costs the torch path, not wrong outputs)."""
    try:
        g = torch.Generator().manual_seed(0)
        hidden, inter = 96, 80                       # off the block grid on both axes
        w13 = [(torch.randn(2 * inter, hidden, generator=g) / 10).to(device, dtype) for _ in range(3)]
        w2 = [(torch.randn(hidden, inter, generator=g) / 9).to(device, dtype) for _ in range(3)]
        x = torch.randn(2, hidden, generator=g).to(device, dtype)
        pairs = [(0, 0), (0, 2), (1, 1), (1, 2)]
        rows = torch.tensor([t for t, _ in pairs], device=device)
        wts = torch.tensor([0.5, 0.25, 0.75, 0.125], device=device)
        out = torch.zeros(2, hidden, device=device, dtype=dtype)
        moe_pairs(out, x, rows, wts, [w13[e] for _, e in pairs], [w2[e] for _, e in pairs])
        ref = torch.zeros(2, hidden, device=device)
        for (t, e), w in zip(pairs, wts.tolist()):
            gate, up = (x[t].float() @ w13[e].float().T).chunk(2)
            ref[t] += w * (w2[e].float() @ (torch.nn.functional.silu(gate) * up))
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        return None if err <= tol else f"Triton experts differ from torch by {err:.2e} (relative) on {device}"
    except Exception as exc:           # a compile or launch failure: report it, the caller falls back
        return f"Triton experts failed on {device}: {type(exc).__name__}: {exc}"
