"""`freetoken probe`: the machine profile, what it means, and (with --model) where a model's
bytes would live and how fast it could decode here. `build_report` makes one plain dict (the
--json output); `render` prints the same content with rich.
"""
from __future__ import annotations

import json
import sys
from typing import Any, Optional

REPORT_VERSION = 1
CPU_SHARE_WARN = 0.75     # below this, a CPU figure was throttled by other processes


def run_probe(model_spec: Optional[str] = None, as_json: bool = False,
              reprofile: bool = False) -> None:
    from freetoken_py.hw.runner import get_profile

    model, hub = read_model(model_spec) if model_spec is not None else (None, None)  # a bad path fails first
    profile = get_profile(reprofile=reprofile, progress=sys.stderr.isatty())
    # the accelerator's expert kernels tuned once on this GPU (cached beside the profile), before
    # anything captures a CUDA graph; off a GPU one line says why not
    from freetoken_py.hw.kernel_tune import probe_tuning

    tuning = probe_tuning(retune=reprofile)
    data = build_report(profile, model, hub)
    data["kernel_tuning"] = tuning
    if as_json:
        print(tuning["line"], file=sys.stderr)
        print(json.dumps(data, indent=1, sort_keys=True))
    else:
        render(data)


def read_model(spec: str) -> tuple[Any, Optional[dict]]:
    """ModelBytes of a directory, or of a hub repo from its config and safetensors headers alone
    (range reads; the same reader and checks, so both give the same bytes and plans), with the
    repo's download facts."""
    from freetoken_py.hub import HubRef, parse_spec, remote_checkpoint
    from freetoken_py.hw.model_bytes import read_model_bytes

    ref = parse_spec(spec)
    if not isinstance(ref, HubRef):
        return read_model_bytes(ref), None
    rc = remote_checkpoint(ref)
    hub = {"repo": ref.repo, "revision": ref.revision, "commit": rc.commit, "download_bytes": rc.download_bytes,
           "total_file_bytes": rc.total_bytes, "cache_dir": str(rc.cache_dir), "disk_free_bytes": rc.disk_free_bytes,
           "fits_disk": rc.download_bytes <= rc.disk_free_bytes}
    return read_model_bytes(rc.folder, rc.tensors, label=f"{ref.repo}@{rc.commit[:12]}"), hub


def build_report(profile: Any, model: Any = None, hub: Optional[dict] = None) -> dict[str, Any]:
    from freetoken_py.hw.profile import profile_path

    report = {
        "report_version": REPORT_VERSION,
        "machine_key": profile.key,
        "cache_path": str(profile_path(profile.key)),
        "gpu_available": bool(profile.gpu.gpus and profile.gpu.torch_cuda_available),
        "gpu_status": profile.gpu.status,
        "figures_gbps": {n: round(f.gbps, 3) for n, f in profile.figures.items()},
        "profile": profile.to_dict(),
        "notes": machine_notes(profile),
        "model": None,
    }
    if model is not None:
        from freetoken_py.hw.fit import fit
        from freetoken_py.hw.tiers import tier_plans

        plans = tier_plans(model, profile)
        report["model"] = {**model.to_dict(), "plans": [p.to_dict() for p in plans], "fit": fit(model, profile),
                           "hub": hub}
        report["notes"] += model_notes(model, plans) + fit_notes(report["model"]["fit"], hub)
    return report


def machine_notes(profile: Any) -> list[str]:
    """What the figures mean, in plain sentences."""
    notes = []
    cpu, g = profile.cpu, profile.gbps
    if not (profile.gpu.gpus and profile.gpu.torch_cuda_available):
        notes.append(f"No usable GPU ({profile.gpu.status}). PCIe, VRAM and concurrent figures "
                     f"are not measured; only the all-CPU plan applies.")
    if cpu.topology_source.startswith("topology hidden"):
        notes.append("CPU topology is hidden (container?): physical cores assumed = logical.")
    if g("dram_read_all_cores") and g("dram_read_single_core"):
        notes.append(f"Host DRAM reads {g('dram_read_all_cores'):.1f} GB/s with "
                     f"{min(cpu.physical_cores, cpu.usable_cores)} cores, "
                     f"{g('dram_read_single_core'):.1f} GB/s with one: the decode ceiling for "
                     f"weights in host RAM.")
    kernel = g("cpu_expert_bf16")
    if kernel and g("dram_read_all_cores"):
        notes.append(f"The CPU expert kernel (bf16, batch 1) streams {kernel:.1f} GB/s = "
                     f"{kernel / g('dram_read_all_cores'):.0%} of the DRAM figure.")
    pcie, cpu_c = g("pcie_h2d_pinned_concurrent"), g("cpu_expert_bf16_concurrent")
    if pcie and cpu_c:
        faster = "evaluating them on the CPU" if cpu_c > pcie else "streaming them over PCIe"
        notes.append(f"While both run, PCIe H2D gives {pcie:.1f} GB/s and the CPU kernel "
                     f"{cpu_c:.1f} GB/s: non-resident experts are cheaper by {faster}.")
    starved = {n: f.params["cpu_share"] for n, f in profile.figures.items()
               if f.params.get("cpu_share", 1.0) < CPU_SHARE_WARN}
    if starved:
        worst = min(starved.values())
        notes.append(f"{len(starved)} CPU figure(s) were measured while other processes held the "
                     f"cores (as little as {worst:.0%} of the CPU time the probe asked for): they "
                     f"understate this machine; run `freetoken probe --reprofile` when it is quiet.")
    if profile.revalidation.get("mode") == "measured":
        compiled = {n: f for n, f in profile.figures.items() if f.params.get("kernels_compiled")}
        if compiled:
            secs = sum(f.params.get("first_call_s", 0.0) for f in compiled.values())
            notes.append(f"numba compiled {sum(f.params['kernels_compiled'] for f in compiled.values())} "
                         f"kernels for {len(compiled)} figure(s) during this run ({secs:.0f} s, not "
                         f"timed): once per install and kernel variant, then loaded from its disk cache.")
    missing_isa = [k for k in ("avx512f", "avx512_bf16", "avx512_vnni", "amx") if not cpu.isa.get(k)]
    if missing_isa:
        notes.append(f"ISA ({cpu.isa_source}) lacks {', '.join(missing_isa)}.")
    return notes


def model_notes(model: Any, plans: list) -> list[str]:
    pt = model.per_token
    notes = [f"Each decode token reads {size(model.per_token_bytes)}: dense {size(pt['dense'])}, "
             f"experts {size(pt['routed_experts'])} (top-{model.top_k}), lm_head "
             f"{size(pt['lm_head'])}, one embedding row {size(pt['embedding_row'])}."]
    if model.format_error:
        notes.insert(0, f"freetoken cannot load this checkpoint's format (the plans below are its bytes only): "
                        f"{model.format_error}")
    elif model.weight_format != "unquantised":
        notes.insert(0, f"Weights stored as {model.weight_format}: they run in that format (its own bytes).")
    feasible = [p for p in plans if p.feasible]
    if feasible:
        best = max(feasible, key=lambda p: p.tokens_per_s)
        notes.append(f"Best plan here: {best.name}, roofline {best.tokens_per_s:.1f} tokens/s.")
    notes += [f"{p.name}: not possible here — {p.reason}." for p in plans if not p.feasible]
    return notes


def fit_notes(f: dict, hub: Optional[dict]) -> list[str]:
    room = f["ram_available_bytes"] + f["vram_free_bytes"]
    notes = []
    if hub is not None:
        where = f"{hub['cache_dir']} has {size(hub['disk_free_bytes'])} free"
        notes.append(f"Download: {size(hub['download_bytes'])} of {size(hub['total_file_bytes'])} still to fetch "
                     f"({hub['repo']} at {hub['commit'][:12]}); {where}" + ("." if hub["fits_disk"] else
                                                                           ": NOT enough disk."))
    verdict = "fits" if f["fits_memory"] else "does NOT fit"
    notes.append(f"Weights + KV for 4096 tokens need {size(f['need_bytes'])}: {verdict} in available RAM + free "
                 f"VRAM ({size(room)}).")
    v = f["variant"]
    if not f["fits_memory"]:
        notes.append("No quantised variant fits either." if v is None else
                     f"The {v['format']} variant (a pre-quantised repo, or freetoken quantize --to {v['format']}) "
                     f"needs {size(v['need_bytes'])} "
                     f"and fits" + (f": {v['plan']}, roofline {v['tokens_per_s']:.1f} tokens/s." if v["plan"] else "."))
    return notes


def size(n: Optional[float]) -> str:
    """Bytes for people: 1.50 GiB, 12.00 KiB, 384 B."""
    if n is None:
        return "?"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def render(data: dict[str, Any]) -> None:
    from rich.console import Console

    from freetoken_py.hw import report_render as rr

    console = Console()
    prof = data["profile"]
    console.print(rr.machine_table(prof))
    console.print(rr.gpu_section(prof))
    console.print(rr.figures_table(prof))
    console.print(rr.cache_line(data))
    if data.get("kernel_tuning"):
        console.print(data["kernel_tuning"]["line"], markup=False, highlight=False)
    if data["model"]:
        console.print(rr.model_table(data["model"]))
        console.print(rr.layers_table(data["model"]))
        console.print(rr.plans_table(data["model"]))
    console.print(rr.notes_panel(data["notes"]))
