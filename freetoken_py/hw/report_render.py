"""Rich renderables for `freetoken probe`, built from the plain report dict (the --json output),
so the text report can never show something the JSON does not contain."""
from __future__ import annotations

from typing import Any

from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from freetoken_py.hw.report import size


def _kv_table(title: str) -> Table:
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    return t


def machine_table(prof: dict) -> Table:
    cpu, mem = prof["cpu"], prof["memory"]
    t = _kv_table("Machine")
    t.add_row("CPU", f"{cpu['model']} ({cpu['vendor']} family {cpu['family']} model "
                     f"{cpu['model_id']})")
    t.add_row("cores", f"{cpu['physical_cores']} physical ({cpu['topology_source']}), "
                       f"{cpu['logical_cores']} logical, {cpu['usable_cores']} usable")
    isa = "  ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["isa"].items())
    t.add_row("ISA", f"{isa}  [dim]({cpu['isa_source']})[/dim]")
    t.add_row("L3", size(cpu["l3_bytes"]))
    t.add_row("RAM", f"{size(mem['total_bytes'])} total, {size(mem['available_bytes'])} available")
    t.add_row("NUMA nodes", f"{mem['numa_nodes']} ({mem['numa_source']})")
    return t


def gpu_section(prof: dict) -> Any:
    gpu = prof["gpu"]
    if not gpu["gpus"]:
        return Panel(Text(gpu["status"]), title="GPU: none", title_align="left")
    t = Table(title=f"GPUs — driver {gpu['driver_version']}, CUDA driver "
                    f"{gpu['cuda_driver_version']}, torch CUDA {gpu['cuda_runtime_version']}",
              title_justify="left")
    for col in ("#", "name", "UUID", "VRAM free / total", "PCIe gen cur/max", "width cur/max", "cc"):
        t.add_column(col)
    for g in gpu["gpus"]:
        t.add_row(str(g["index"]), g["name"], g["uuid"],
                  f"{size(g['vram_free_bytes'])} / {size(g['vram_total_bytes'])}",
                  f"{g['pcie_gen_current']}/{g['pcie_gen_max']}",
                  f"x{g['pcie_width_current']}/x{g['pcie_width_max']}",
                  str(g["compute_capability"]))
    return t


def figures_table(prof: dict) -> Table:
    t = Table(title="Measured figures (GB/s = 10^9 B/s; median is what the planner uses)",
              title_justify="left")
    for col, kw in (("figure", {"no_wrap": True}), ("median", {"justify": "right"}),
                    ("best", {"justify": "right"}), ("n", {"justify": "right"}), ("method", {})):
        t.add_column(col, **kw)
    for name, f in prof["figures"].items():
        t.add_row(name, f"{f['gbps']:.2f}", f"{f['best_gbps']:.2f}", str(len(f["samples"])),
                  f["method"])
    by_reason: dict[str, list[str]] = {}
    for name, why in prof["unavailable"].items():
        if name not in prof["figures"]:
            by_reason.setdefault(why, []).append(name)
    for why, names in by_reason.items():
        t.add_row(Text("\n".join(names), style="dim"), "—", "—", "0", Text(why, style="dim"))
    return t


def cache_line(data: dict) -> Text:
    rv = data["profile"]["revalidation"]
    if rv.get("mode") == "measured":
        what = f"measured now in {rv.get('seconds')} s ({rv.get('reason')})"
    else:
        what = (f"cached, revalidated in {rv.get('seconds')} s: {len(rv.get('checked', {}))} "
                f"checked, re-measured {rv.get('remeasured') or 'none'}")
    return Text(f"Profile {data['machine_key']}: {what}\n  {data['cache_path']}")


def model_table(model: dict) -> Table:
    t = _kv_table(f"Model {model['model_dir']} ({model['model_type']})")
    t.add_row("total", f"{size(model['total_bytes'])} in {len(model['files'])} file(s); dtypes "
                       + ", ".join(f"{k} {size(v)}" for k, v in model["dtypes"].items()))
    for cat, n in sorted(model["by_category"].items(), key=lambda kv: -kv[1]):
        t.add_row(cat, f"{size(n)} ({n / model['total_bytes']:.1%})")
    t.add_row("experts", f"{model['num_experts']} routed per MoE layer, top-{model['top_k']}, "
                         f"stored as {model['expert_dtype']}")
    pt = model["per_token"]
    t.add_row("read per token", f"{size(model['per_token_bytes'])}: "
              + ", ".join(f"{k} {size(v)}" for k, v in pt.items()))
    t.add_row("KV per token", size(model["kv_bytes_per_token"]))
    if model.get("state_bytes_per_request"):   # hybrids: the linear-attention layers' fixed state
        t.add_row("state per request", size(model["state_bytes_per_request"]) + " (conv + recurrent, fp32)")
    if model.get("window_bytes_per_request"):   # sliding-window layers: their window, whatever the context
        t.add_row("window KV per request", size(model["window_bytes_per_request"]) + " (sliding layers, bf16)")
    return t


def layers_table(model: dict) -> Table:
    """Per-layer bytes; runs of identical layers are folded into one row."""
    t = Table(title="Per layer", title_justify="left")
    for col in ("layers", "dense", "experts", "per expert"):
        t.add_column(col, justify="right" if col != "layers" else "left")
    rows: list[list] = []
    for layer in model["layers"]:
        sig = (layer["dense_bytes"], layer["num_experts"], layer["bytes_per_expert"])
        if rows and rows[-1][2] == sig:
            rows[-1][1] = layer["layer"]
        else:
            rows.append([layer["layer"], layer["layer"], sig])
    for first, last, (dense, n, per) in rows:
        span = str(first) if first == last else f"{first}–{last}"
        t.add_row(span, size(dense), f"{n} x {size(per)} = {size(n * per)}" if n else "dense",
                  size(per) if n else "—")
    return t


def plans_table(model: dict) -> Table:
    t = Table(title="Decode roofline per tier plan (bytes read per token / measured GB/s)",
              title_justify="left")
    for col in ("plan", "tokens/s", "VRAM", "host", "why"):
        t.add_column(col, justify="right" if col in ("tokens/s", "VRAM", "host") else "left")
    for p in model["plans"]:
        tps = f"{p['tokens_per_s']:.1f}" if p["feasible"] else "—"
        place = p["placement_bytes"]
        t.add_row(p["name"], tps, size(place.get("vram")) if "vram" in place else "—",
                  size(place.get("host")) if "host" in place else "—", p["reason"])
    return t


def notes_panel(notes: list[str]) -> Panel:
    return Panel("\n".join(f"• {n}" for n in notes), title="What it means", title_align="left")
