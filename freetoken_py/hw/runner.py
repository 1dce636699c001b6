"""Measure the machine, or load the cached profile and revalidate it quickly.

A `Probe` measures one or more figures with `run(quick)`; the quick variant is what start-up
revalidation runs (smaller buffers, fewer repetitions). A figure whose quick value left its
recorded band by more than the tolerance is measured again in full — and only that probe.
The probe list is a parameter, so tests can count which measurements ran.
"""
from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

from freetoken_py.hw.profile import (PROFILE_VERSION, Figure, HardwareProfile, load_profile,
                                     profile_path, save_profile)

DRIFT_TOLERANCE = 0.20
REVALIDATE_BUDGET_S = 4.0


@dataclass(frozen=True)
class Probe:
    names: tuple[str, ...]                       # figures this probe produces, in order
    label: str                                   # what the progress bar says
    run: Callable[[bool], Sequence[Figure]]      # run(quick) -> one Figure per name


@dataclass
class Outcome:
    figures: dict[str, Figure]
    unavailable: dict[str, str]


@contextmanager
def _progress(enabled: bool, total: int) -> Iterator[Callable[[str], None]]:
    """Yields step(label): advance a rich progress bar (on stderr, so --json stays clean)."""
    if not enabled:
        yield lambda label: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("probing", total=total)
        first = [True]

        def step(label: str) -> None:
            if not first[0]:
                bar.advance(task)
            first[0] = False
            bar.update(task, description=label)

        yield step


def run_probes(probes: Sequence[Probe], quick: bool, step: Callable[[str], None]) -> Outcome:
    """Run each probe; a failing probe records why instead of stopping the others."""
    out = Outcome({}, {})
    for probe in probes:
        step(("checking " if quick else "measuring ") + probe.label)
        try:
            figures = probe.run(quick)
        except Exception as exc:   # one broken measurement must not cost the whole profile
            reason = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            out.unavailable.update({n: reason for n in probe.names})
            continue
        out.figures.update({f.name: f for f in figures})
    return out


def measure_all(probes: Sequence[Probe], progress: bool = True) -> Outcome:
    with _progress(progress, len(probes)) as step:
        return run_probes(probes, quick=False, step=step)


def revalidate(profile: HardwareProfile, probes: Sequence[Probe], unavailable: dict[str, str],
               tolerance: float = DRIFT_TOLERANCE, budget_s: float = REVALIDATE_BUDGET_S,
               progress: bool = True) -> HardwareProfile:
    """Quick-check cached figures (least recently checked first, within `budget_s`); measure again
    in full only the probes with a drifted figure, plus probes whose figures are missing."""
    t_start = time.perf_counter()
    last = dict(profile.revalidation.get("last_checked", {}))
    known = [p for p in probes if all(n in profile.figures for n in p.names)]
    missing = [p for p in probes if p not in known]
    known.sort(key=lambda p: min(last.get(n, 0.0) for n in p.names))
    figures = dict(profile.figures)
    new_unavailable = {**profile.unavailable, **unavailable}
    checks: dict[str, dict] = {}
    remeasured: list[str] = []
    with _progress(progress, len(known) + len(missing)) as step:
        for i, probe in enumerate(known):
            if i and time.perf_counter() - t_start > budget_s:   # at least one check per start
                break
            quick = run_probes([probe], quick=True, step=step)
            now = time.time()
            drifted = False
            for name in probe.names:
                old, new = profile.figures[name], quick.figures.get(name)
                if new is None:
                    continue
                last[name] = now
                bad = old.drifted(new, tolerance)
                drifted |= bad
                checks[name] = {"cached_gbps": old.gbps, "quick_gbps": new.gbps,
                                "drift": round(old.drift(new), 3), "drifted": bad}
            if drifted:
                full = run_probes([probe], quick=False, step=step)
                figures.update(full.figures)
                remeasured += [n for n in probe.names if n in full.figures]
        measured_new = run_probes(missing, quick=False, step=step)
    figures.update(measured_new.figures)
    for name in measured_new.figures:
        new_unavailable.pop(name, None)
    new_unavailable.update(measured_new.unavailable)
    record = {"mode": "revalidated", "at": time.time(),
              "seconds": round(time.perf_counter() - t_start, 3), "tolerance": tolerance,
              "checked": checks, "remeasured": remeasured,
              "newly_measured": sorted(measured_new.figures),
              "unchecked": sorted(n for p in known for n in p.names if n not in checks),
              "last_checked": last}
    return dataclasses.replace(profile, figures=figures, unavailable=new_unavailable,
                               revalidation=record)


def get_profile(reprofile: bool = False, progress: bool = True,
                probes: Optional[Sequence[Probe]] = None) -> HardwareProfile:
    """The machine's profile: cached and revalidated, or measured now (`reprofile` forces it).

    Saved back to the cache either way, so the next start-up sees what this one measured.
    """
    from freetoken_py.hw import registry
    from freetoken_py.hw.sysinfo import collect_cpu, collect_gpus, collect_memory

    cpu, memory, gpu = collect_cpu(), collect_memory(), collect_gpus()
    ctx = registry.ProbeContext(cpu, memory, gpu)
    try:
        if probes is None:
            probes, unavailable = registry.default_probes(ctx)
        else:
            unavailable = {}
        base = HardwareProfile(version=PROFILE_VERSION, cpu=cpu, memory=memory, gpu=gpu,
                               figures={}, created_at=time.time())
        path = profile_path(base.key)
        cached = None if reprofile else load_profile(path)
        if cached is not None and cached.key == base.key:
            # keep the cached figures, refresh what can change between runs (free RAM / VRAM)
            cached = dataclasses.replace(cached, cpu=cpu, memory=memory, gpu=gpu)
            profile = revalidate(cached, probes, unavailable, progress=progress)
        else:
            t0 = time.perf_counter()
            outcome = measure_all(probes, progress=progress)
            outcome.unavailable.update(unavailable)
            profile = dataclasses.replace(
                base, figures=outcome.figures, unavailable=outcome.unavailable,
                revalidation={"mode": "measured", "at": time.time(),
                              "seconds": round(time.perf_counter() - t0, 3),
                              "reason": "--reprofile" if reprofile else "no cached profile"})
        save_profile(profile, path)
        return profile
    finally:
        ctx.close()
