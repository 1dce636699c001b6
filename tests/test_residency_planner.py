"""The placement planner as a pure function: exact decisions for hand-built stats and profiles.

Expert: Qwen3-30B-A3B's (2048 x 768 x 3 weights at 4.5 bits = 2.65 MB). Expected decisions are
derived by hand from the profile numbers in the comments, not from the planner.
"""
from __future__ import annotations

import pytest

from freetoken_py.residency.planner import Budgets, CostModel, LayerStats, core_costs, evaluate, plan
from freetoken_py.residency.profiles import FRONTIER_MODELS, H200_SEEDS, PROFILES, TierProfile, emulated, get_profile

SPEC = FRONTIER_MODELS["qwen3-30b-a3b"]
DECODE = LayerStats({5: 1, 9: 1, 12: 1}, frozenset({5}))   # one hit (5), two misses (9, 12)


def cost(name: str) -> CostModel:
    return CostModel(PROFILES[name], SPEC.expert_bytes, SPEC.expert_flops_per_token)


def test_expert_geometry():
    assert SPEC.expert_bytes == 3 * 2048 * 768 * 9 // 16
    assert SPEC.expert_flops_per_token == 2 * 3 * 2048 * 768


def test_laptop_slow_pcie_fast_dram_sends_misses_to_cpu():
    # copy 2.65 MB / 12.5 GB/s + 5 us = 217 us; CPU 2.65 MB / 35 GB/s = 76 us (+30 us call):
    # even two misses on the CPU (182 us) finish before one copy
    c = cost("rtx4060-laptop-8g")
    assert c.copy_s() == pytest.approx(SPEC.expert_bytes / 12.5e9 + 5e-6)
    p = plan(DECODE, c, Budgets(stream_slots=8))
    assert (p.hits, p.stream, p.cpu) == ((5,), (), (9, 12))
    assert p.cpu_s == pytest.approx(2 * SPEC.expert_bytes / 35e9 + 30e-6)


def test_workstation_fast_pcie_streams_misses():
    # copy 2.65 MB / 50 GB/s + 5 us = 58 us per expert; CPU 88 us + 30 us call: two copies
    # (116 us + compute) still beat one expert on the CPU (118 us)
    p = plan(DECODE, cost("rtx5090"), Budgets(stream_slots=8))
    assert (p.hits, p.stream, p.cpu) == ((5,), (9, 12), ())
    assert p.cpu_s == 0.0


def test_many_misses_are_split_so_both_sides_finish_together():
    # laptop, 8 misses of one token: CPU 76 us each (+30 us once), copy 217 us each
    stats = LayerStats({e: 1 for e in range(8)}, frozenset())
    p = plan(stats, cost("rtx4060-laptop-8g"), Budgets(stream_slots=8))
    assert len(p.stream) == 2 and len(p.cpu) == 6
    assert sorted(p.stream + p.cpu) == list(range(8))
    # moving any one expert to the other side makes the layer slower
    c = cost("rtx4060-laptop-8g")
    for e in range(8):
        moved = tuple(set(p.stream) ^ {e})
        assert evaluate(stats, moved, c).seconds >= p.seconds - 1e-12


def test_prefill_brings_weights_to_the_gpu():
    # 64 tokens per expert: CPU is compute-bound, 64 x 9.4 MFLOP / 0.6 TFLOP/s = 1.0 ms per
    # expert, a copy is 217 us: on the same laptop the misses now stream
    stats = LayerStats({5: 64, 9: 64, 12: 64}, frozenset({5}))
    p = plan(stats, cost("rtx4060-laptop-8g"), Budgets(stream_slots=8))
    assert (p.stream, p.cpu) == ((9, 12), ())


def test_largest_miss_is_placed_first_and_ties_go_to_streaming():
    stats = LayerStats({3: 1, 4: 40}, frozenset())
    p = plan(stats, cost("rtx4060-laptop-8g"), Budgets(stream_slots=8))
    assert p.stream[0] == 4                      # 40 tokens: compute-bound on the CPU
    assert p.reasons[4].startswith("stream")


def test_no_slot_means_cpu_and_no_host_copy_means_stream():
    c = cost("rtx5090")
    p = plan(DECODE, c, Budgets(stream_slots=0))
    assert (p.stream, p.cpu) == ((), (9, 12)) and p.reasons[9] == "cpu: no slot to stream into"
    p = plan(DECODE, cost("rtx4060-laptop-8g"), Budgets(stream_slots=0, cpu_enabled=False))
    assert (p.stream, p.cpu) == ((9, 12), ())


def test_live_measurement_moves_the_decision():
    # the 5090 box measures only 2 GB/s over PCIe (another device on the bus): after five EMA
    # updates PCIe = 50*0.8^5 + 2*(1-0.8^5) = 17.7 GB/s, a copy 155 us > CPU 118 us: the first
    # miss goes to the CPU, the second streams so both finish together
    c = cost("rtx5090")
    for _ in range(5):
        c = c.observe(copy_gbps=2.0)
    assert c.pcie_gbps == pytest.approx(50 * 0.8**5 + 2 * (1 - 0.8**5))
    p = plan(DECODE, c, Budgets(stream_slots=8))
    assert (p.stream, p.cpu) == ((12,), (9,))


def test_stream_value_tips_a_close_call_toward_keeping_the_expert():
    c = cost("rtx4060-laptop-8g")
    one_miss = LayerStats({5: 1, 9: 1}, frozenset({5}))
    assert plan(one_miss, c, Budgets(8)).cpu == (9,)
    assert plan(one_miss, c, Budgets(8, stream_value_s=200e-6)).stream == (9,)


def test_all_hits_plan_is_gpu_only():
    p = plan(LayerStats({1: 1, 2: 1}, frozenset({1, 2, 3})), cost("rtx4090"), Budgets(0))
    assert (p.hits, p.stream, p.cpu, p.cpu_s) == ((1, 2), (), (), 0.0)


def test_profiles():
    assert set(PROFILES) == {"rtx4060-laptop-8g", "rtx4090", "rtx5090", "rtx-pro-6000"}
    e = emulated(get_profile("rtx4090"))
    assert e.emulated and e.name == "emulated:rtx4090" and e.pcie_gbps == 25
    with pytest.raises(ValueError, match="unknown hardware profile"):
        get_profile("h100")
    with pytest.raises(ValueError, match="pcie_gbps"):
        TierProfile("bad", 1, 1, 0, 1, 1, 1)
    # the 235B model does not fit any of the four; dense + KV leave room for some experts on each
    big = FRONTIER_MODELS["qwen3-235b-a22b"]
    assert not any(big.fits_in_vram(p) for p in PROFILES.values())
    assert all(big.expert_slots(p) > 0 for p in PROFILES.values())
    assert SPEC.fits_in_vram(PROFILES["rtx4090"]) and not SPEC.fits_in_vram(PROFILES["rtx4060-laptop-8g"])


def test_measured_hardware_profile_converts_with_concurrent_figures_first():
    import dataclasses

    from test_hw_profile import fig, machine

    from freetoken_py.residency.profiles import from_hardware_profile

    hw = machine()                                            # RTX 5090 box: DRAM 60, PCIe 50, no VRAM figure
    assert from_hardware_profile(hw) is None
    figures = dict(hw.figures, vram_d2d=fig("vram_d2d", 1500.0),
                   pcie_h2d_pinned_concurrent=fig("pcie_h2d_pinned_concurrent", 41.0),
                   cpu_expert_bf16_concurrent=fig("cpu_expert_bf16_concurrent", 22.0))
    tp = from_hardware_profile(dataclasses.replace(hw, figures=figures), name="this box")
    assert (tp.name, tp.vram_bytes, tp.vram_gbps, tp.pcie_gbps, tp.cpu_expert_gbps) == \
        ("this box", 32 * 2**30, 1500.0, 41.0, 22.0)
    assert tp.host_ram_bytes == hw.memory.total_bytes > 0                 # the machine's, not an assumption
    no_gpu = dataclasses.replace(hw, gpu=dataclasses.replace(hw.gpu, gpus=()), figures=figures)
    assert from_hardware_profile(no_gpu) is None
    # bytes at the VRAM read rate: the batch-1 expert kernel's figure (launches included, which the
    # fixed step costs now count) only where the probe has no VRAM rate; the fixed costs are the
    # H200 run's until the probe measures them
    with_kernel = dict(figures, gpu_expert_kernel=fig("gpu_expert_kernel", 240.0))
    measured = from_hardware_profile(dataclasses.replace(hw, figures=with_kernel))
    assert measured.vram_gbps == measured.expert_gbps == 1500.0
    assert (measured.gpu_step_s, measured.host_step_s) == (H200_SEEDS["gpu_step_s"], H200_SEEDS["host_step_s"])
    no_d2d = {k: v for k, v in with_kernel.items() if k != "vram_d2d"}
    assert from_hardware_profile(dataclasses.replace(hw, figures=no_d2d)).vram_gbps == 240.0
    # another expert format's CPU rate: its kernel's figure, scaled by the concurrent bf16 one's share
    q = dict(figures, cpu_expert_bf16=fig("cpu_expert_bf16", 25.0), cpu_expert_int4=fig("cpu_expert_int4", 15.0))
    assert from_hardware_profile(dataclasses.replace(hw, figures=q), expert_format="int4").cpu_expert_gbps == \
        pytest.approx(22.0 * 15.0 / 25.0)
    assert from_hardware_profile(dataclasses.replace(hw, figures=q), expert_format="bf16").cpu_expert_gbps == 22.0
    # and the accelerator's: the int4 kernels' own figure where the probe measured it
    # (without a VRAM rate; for the experts only: the dense weights are read at the same rate
    # whatever the experts' format)
    q4 = {k: v for k, v in dict(q, gpu_expert_kernel=fig("gpu_expert_kernel", 240.0),
                                gpu_expert_kernel_int4=fig("gpu_expert_kernel_int4", 90.0)).items() if k != "vram_d2d"}
    int4 = from_hardware_profile(dataclasses.replace(hw, figures=q4), expert_format="int4")
    int8 = from_hardware_profile(dataclasses.replace(hw, figures=q4), expert_format="int8")
    assert (int4.expert_gbps, int4.vram_gbps) == (90.0, 240.0) and (int8.expert_gbps, int8.vram_gbps) == (240.0, 240.0)
    cost = CostModel(int4, 10**6, 1.0)
    assert cost.gpu_compute_s(1) == pytest.approx(1e6 / 90e9) and core_costs(cost)[2] == 90e9


def test_one_miss_is_cut_so_both_sides_finish_together():
    # PRO 6000, one decode miss, nothing resident. Whole: CPU 2.65 MB / 110 GB/s + 30 us call
    # = 54 us beats a copy (51 us + 5 us + 1.5 us compute). Cut at fraction f of the columns:
    #   accelerator: 5 us + f * (copy 51.0 us + compute 1.48 us); CPU: 30 us + (1 - f) * 24.1 us
    # equal at f = (30 + 24.1 - 5) / (51.0 + 1.48 + 24.1) = 0.641, layer time 38.7 us.
    c = cost("rtx-pro-6000")
    b = SPEC.expert_bytes
    copy, comp, cpu = b / 52e9, b / 1792e9, b / 110e9
    f = (30e-6 + cpu - 5e-6) / (copy + comp + cpu)
    stats = LayerStats({9: 1}, frozenset())
    whole = plan(stats, c, Budgets(stream_slots=8))
    assert (whole.stream, whole.cpu, whole.split) == ((), (9,), ())
    p = plan(stats, c, Budgets(stream_slots=8, split_experts=True))
    assert (p.stream, p.cpu) == ((), ()) and p.split[0][0] == 9
    assert p.split[0][1] == pytest.approx(f, rel=1e-6)
    assert p.gpu_s == pytest.approx(p.cpu_s, rel=1e-6) == pytest.approx(5e-6 + f * (copy + comp), rel=1e-6)
    assert p.seconds < 0.72 * whole.seconds and p.reasons[9].startswith("split")


def test_the_cut_expert_comes_from_the_side_that_finishes_last():
    c = cost("rtx5090")          # PCIe faster than the CPU: both misses stream, the copies end last
    whole = plan(DECODE, c, Budgets(stream_slots=8))
    assert whole.stream == (9, 12) and whole.gpu_s > whole.cpu_s
    p = plan(DECODE, c, Budgets(stream_slots=8, split_experts=True))
    assert p.stream == (9,) and p.cpu == () and p.split[0][0] == 12     # the last-placed stream
    assert 0 < p.split[0][1] < 1 and p.gpu_s == pytest.approx(p.cpu_s, rel=1e-6) and p.seconds < whole.seconds
    # worth keeping for longer than the cut saves: streamed whole, and the other one is cut
    kept = plan(DECODE, c, Budgets(stream_slots=8, split_experts=True, stream_values={12: 1e-3}))
    assert kept.stream == (12,) and kept.split[0][0] == 9


def test_no_cut_without_a_cpu_or_when_the_sides_already_balance():
    c = cost("rtx4060-laptop-8g")
    stats = LayerStats({e: 1 for e in range(4)}, frozenset())
    p = plan(stats, c, Budgets(stream_slots=0, cpu_enabled=False, split_experts=True))
    assert p.split == () and len(p.stream) == 4
    p = plan(LayerStats({1: 1}, frozenset({1})), c, Budgets(stream_slots=8, split_experts=True))
    assert (p.hits, p.split) == ((1,), ())


def test_among_equal_misses_the_one_worth_keeping_streams():
    # RTX 5090 (PCIe faster than the CPU), three decode misses and one slot: the first placed
    # streams, the others go to the CPU for want of a slot. Without values that is the lowest id;
    # a tiny value (too small to change any stream-or-CPU call) puts its expert first
    stats = LayerStats({3: 1, 8: 1, 11: 1}, frozenset())
    base = plan(stats, cost("rtx5090"), Budgets(stream_slots=1))
    valued = plan(stats, cost("rtx5090"), Budgets(stream_slots=1, stream_values={11: 1e-9}))
    assert (base.stream, base.cpu) == ((3,), (8, 11))
    assert (valued.stream, valued.cpu) == ((11,), (3, 8))


@pytest.mark.parametrize("seed", range(4))
def test_compiled_plan_matches_the_python_reference(seed):
    # the compiled planner against the plain Python it was first written in (tests/plan_reference):
    # random token counts (decode and prefill), residents, per-expert values with ties, budgets,
    # profiles and live-measured bandwidths; decisions, reasons and times must be identical
    import random

    import plan_reference

    rng = random.Random(seed)
    names = sorted(PROFILES)
    for case in range(400):
        c = cost(rng.choice(names))
        if rng.random() < 0.3:
            c = c.observe(copy_gbps=rng.uniform(1, 60), cpu_gbps=rng.uniform(5, 120))
        experts = rng.sample(range(128), rng.randint(0, 24))
        big = rng.random() < 0.3
        tokens = {e: (rng.randint(1, 96) if big else rng.choice((1, 1, 1, 2))) for e in experts}
        resident = frozenset(e for e in range(128) if rng.random() < rng.choice((0.0, 0.1, 0.5)))
        values = {}
        if rng.random() < 0.7:
            levels = [0.0, 1e-9, 5e-6, 4e-5, 2e-4, 1e-3]
            values = {e: rng.choice(levels) for e in experts if rng.random() < 0.9}
        budgets = Budgets(stream_slots=rng.choice((0, 1, 2, 4, 8, 128)), cpu_enabled=rng.random() < 0.85,
                          stream_value_s=rng.choice((0.0, 0.0, 3e-5)), stream_values=values,
                          split_experts=rng.random() < 0.6)
        stats = LayerStats(tokens, resident)
        got, want = plan(stats, c, budgets), plan_reference.plan(stats, c, budgets)
        assert got == want, (seed, case, stats, budgets)
