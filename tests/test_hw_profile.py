"""HardwareProfile: JSON round trip, cache key, cache location, and start-up revalidation.

References: a profile must equal itself after JSON (round trip); the key is compared across
machines that differ in exactly one identifying field; revalidation is checked by counting which
measure callables ran (quick vs full) on a profile with one figure deliberately 3x off.
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from freetoken_py.hw.profile import (PROFILE_VERSION, CpuInfo, Figure, GpuInfo, GpuSystem,
                                     HardwareProfile, MemoryInfo, load_profile, machine_key,
                                     profile_path, save_profile)
from freetoken_py.hw.runner import Probe, get_profile, revalidate

GIB = 2**30


def fig(name: str, gbps: float, spread: float = 0.05) -> Figure:
    samples = [gbps * (1 - spread), gbps, gbps * (1 + spread)]
    return Figure.from_samples(name, samples, f"fake {name}", {"bytes": 1}, 0.01)


def machine(**changes) -> HardwareProfile:
    cpu = CpuInfo(model="AMD EPYC 9654", vendor="AuthenticAMD", family="25", model_id="17",
                  stepping="1", physical_cores=8, logical_cores=16, usable_cores=16,
                  topology_source="psutil", isa={"avx2": True, "avx512f": True, "amx": False},
                  isa_source="/proc/cpuinfo flags", l3_bytes=32 * 2**20)
    mem = MemoryInfo(total_bytes=64 * GIB, available_bytes=50 * GIB, numa_nodes=1,
                     numa_source="/sys/devices/system/node")
    gpu0 = GpuInfo(index=0, name="NVIDIA GeForce RTX 5090", uuid="GPU-aaaa", vram_total_bytes=32 * GIB,
                   vram_free_bytes=30 * GIB, pcie_gen_current=1, pcie_gen_max=5,
                   pcie_width_current=16, pcie_width_max=16, compute_capability="12.0")
    gpu = GpuSystem(gpus=(gpu0,), driver_version="575.51", cuda_driver_version="12.9",
                    cuda_runtime_version="12.8", torch_cuda_available=True, status="1 GPU(s)")
    prof = HardwareProfile(version=PROFILE_VERSION, cpu=cpu, memory=mem, gpu=gpu,
                           figures={"dram_read_all_cores": fig("dram_read_all_cores", 60.0),
                                    "pcie_h2d_pinned": fig("pcie_h2d_pinned", 50.0)},
                           unavailable={"cpu_expert_int4": "failed: ValueError: x"},
                           created_at=123.0, revalidation={"mode": "measured"})
    for path, value in changes.items():
        part, _, attr = path.partition("__")
        if part == "gpu0":
            new_gpu = dataclasses.replace(prof.gpu.gpus[0], **{attr: value})
            prof = dataclasses.replace(prof, gpu=dataclasses.replace(prof.gpu, gpus=(new_gpu,)))
        else:
            obj = getattr(prof, part)
            prof = dataclasses.replace(prof, **{part: dataclasses.replace(obj, **{attr: value})})
    return prof


def test_profile_round_trips_through_json(tmp_path):
    prof = machine()
    assert HardwareProfile.from_json(prof.to_json()) == prof
    path = tmp_path / "p.json"
    save_profile(prof, path)
    assert load_profile(path) == prof
    assert prof.figure("pcie_h2d_pinned").gbps == pytest.approx(50.0)
    with pytest.raises(KeyError, match="failed: ValueError"):
        prof.figure("cpu_expert_int4")


def test_other_versions_and_broken_files_are_not_loaded(tmp_path):
    path = tmp_path / "p.json"
    data = machine().to_dict()
    data["version"] = PROFILE_VERSION + 1
    path.write_text(json.dumps(data))
    assert load_profile(path) is None
    path.write_text("{not json")
    assert load_profile(path) is None
    assert load_profile(tmp_path / "missing.json") is None


def test_cache_key_changes_exactly_when_the_machine_does():
    base = machine().key
    # what can change between two runs on the same machine keeps the key
    same = [machine(memory__available_bytes=10 * GIB), machine(gpu0__vram_free_bytes=GIB),
            machine(gpu0__pcie_gen_current=5), machine(memory__total_bytes=64 * GIB + 2**20)]
    assert {m.key for m in same} == {base}
    other = [machine(cpu__model="Intel(R) Xeon(R) w7-3465X"), machine(memory__total_bytes=128 * GIB),
             machine(gpu0__uuid="GPU-bbbb"), machine(gpu__driver_version="580.10"),
             machine(cpu__physical_cores=16)]
    keys = [m.key for m in other]
    assert base not in keys and len(set(keys)) == len(keys)
    m = machine()
    assert machine_key(m.cpu, m.memory, m.gpu) == base


def test_cache_location_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path / "ft"))
    assert profile_path("k") == tmp_path / "ft" / "hw" / "profile-k.json"
    monkeypatch.delenv("FREETOKEN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert profile_path("k") == tmp_path / "xdg" / "freetoken" / "hw" / "profile-k.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert profile_path("k") == tmp_path / "home" / ".cache" / "freetoken" / "hw" / "profile-k.json"


def test_drift_is_judged_against_the_recorded_band():
    old = Figure.from_samples("d", [34.0, 35.0, 52.0], "m", {}, 0.0)   # bimodal, median 35
    assert not old.drifted(fig("d", 50.0), 0.2)      # inside the recorded samples
    assert not old.drifted(fig("d", 30.0), 0.2)      # within 20% of the median
    assert old.drifted(fig("d", 27.0), 0.2)
    assert old.drifted(fig("d", 3 * 52.0), 0.2)


class Machine:
    """Fake probes with fixed true values; records every call as (name, quick)."""

    def __init__(self, truth: dict[str, float]):
        self.truth, self.calls = truth, []

    def probe(self, name: str) -> Probe:
        def run(quick: bool) -> list[Figure]:
            self.calls.append((name, quick))
            return [fig(name, self.truth[name], spread=0.01)]
        return Probe((name,), name, run)

    def probes(self) -> list[Probe]:
        return [self.probe(n) for n in self.truth]


def test_revalidation_remeasures_only_the_drifted_figure():
    truth = {"dram_read_all_cores": 60.0, "dram_read_single_core": 30.0, "cpu_expert_bf16": 40.0}
    cached = {n: fig(n, v) for n, v in truth.items()}
    cached["dram_read_single_core"] = fig("dram_read_single_core", 3 * 30.0)   # 3x off
    prof = dataclasses.replace(machine(), figures=cached, unavailable={})
    fake = Machine(truth)
    new = revalidate(prof, fake.probes(), {}, progress=False)
    assert sorted(n for n, q in fake.calls if q) == sorted(truth)                 # all checked
    assert [n for n, q in fake.calls if not q] == ["dram_read_single_core"]      # one re-measured
    assert new.figure("dram_read_single_core").gbps == pytest.approx(30.0)
    for name in ("dram_read_all_cores", "cpu_expert_bf16"):
        assert new.figures[name] is cached[name]                                # kept as cached
    assert new.revalidation["remeasured"] == ["dram_read_single_core"]
    assert new.revalidation["checked"]["dram_read_single_core"]["drifted"] is True


def test_revalidation_measures_missing_figures_and_respects_budget():
    truth = {"a": 10.0, "b": 20.0, "c": 30.0}
    prof = dataclasses.replace(machine(), figures={"a": fig("a", 10.0), "b": fig("b", 20.0)},
                               unavailable={"c": "failed: earlier"})
    fake = Machine(truth)
    new = revalidate(prof, fake.probes(), {}, budget_s=0.0, progress=False)
    # budget 0: the first (never checked) probe is checked, the other is left for next time
    assert fake.calls == [("a", True), ("c", False)]
    assert new.revalidation["unchecked"] == ["b"] and "c" not in new.unavailable
    fake.calls.clear()
    revalidate(new, fake.probes(), {}, budget_s=0.0, progress=False)
    assert fake.calls[0] == ("b", True)                      # least recently checked goes first


def test_get_profile_measures_then_revalidates_then_reprofiles(monkeypatch, tmp_path):
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path))
    fake = Machine({"dram_read_all_cores": 60.0, "dram_read_single_core": 30.0})
    first = get_profile(progress=False, probes=fake.probes())
    assert {q for _, q in fake.calls} == {False} and len(fake.calls) == 2
    assert first.revalidation["mode"] == "measured"
    assert profile_path(first.key).is_file()
    fake.calls.clear()
    second = get_profile(progress=False, probes=fake.probes())
    assert {q for _, q in fake.calls} == {True}              # quick checks only, nothing drifted
    assert second.revalidation["mode"] == "revalidated"
    assert second.figures["dram_read_all_cores"] == first.figures["dram_read_all_cores"]
    fake.calls.clear()
    get_profile(reprofile=True, progress=False, probes=fake.probes())
    assert {q for _, q in fake.calls} == {False}


def test_report_says_when_the_run_compiled_kernels():
    from freetoken_py.hw.report import machine_notes

    base = machine()
    hot = Figure.from_samples("cpu_expert_nvfp4", [5.0, 5.1, 5.2], "fake",
                              {"kernels_compiled": 12, "first_call_s": 95.6, "cpu_share": 1.0}, 0.5)
    prof = dataclasses.replace(base, figures={**base.figures, "cpu_expert_nvfp4": hot})
    said = [n for n in machine_notes(prof) if n.startswith("numba compiled")]
    assert said == ["numba compiled 12 kernels for 1 figure(s) during this run (96 s, not timed): "
                    "once per install and kernel variant, then loaded from its disk cache."]
    # a revalidated start shows the cached figures: their first run's compiles are old news
    later = dataclasses.replace(prof, revalidation={"mode": "revalidated"})
    assert not [n for n in machine_notes(later) if n.startswith("numba compiled")]
    assert not [n for n in machine_notes(base) if n.startswith("numba compiled")]
