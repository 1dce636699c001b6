"""Build a `ResidencyExecutor` for a loaded model and plug it in as the model's expert executor.

Duck-typed on the model (`model.weights.layers[i].w13 / w2 / router`, `model.args.top_k`) so this
package does not import `models`; with `--expert-dtype` the experts come instead as the expert
store's banks (`banks=`), in any of its formats (formats.py). Under "emulate" the accelerator tier runs on CPU tensors and
every time is taken from the injected profile; "cuda" is the same code on the GPU (slots and the
copy stream in VRAM, host banks pinned); it ran on an H200 once (2026-12-04: the placement tests pass).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from freetoken_py.errors import FreetokenError
from freetoken_py.residency.adaptive import AdaptivePolicy
from freetoken_py.residency.calibrate import with_host_costs
from freetoken_py.residency.elastic import ElasticVram, cuda_free_bytes
from freetoken_py.residency.executor import ResidencyExecutor
from freetoken_py.residency.formats import ExpertFormat, bank_parts
from freetoken_py.residency.planner import CostModel
from freetoken_py.residency.policy import LruPolicy, StaticPolicy
from freetoken_py.residency.profiles import emulated, from_hardware_profile, get_profile
from freetoken_py.residency.slots import SlotCache
from freetoken_py.residency.stats import route_predictors

POLICIES = ("ours", "lru", "static")
CUDA_RESERVE_BYTES = 2**30   # VRAM left free on a GPU: this, or a tenth of the card if more (activations, staging)


def make_policy(name: str, layers: list[int], num_experts: int, capacity: int, profile):
    if name == "ours":
        return AdaptivePolicy(layers, num_experts, capacity)
    if name == "lru":
        return LruPolicy(capacity, profile.pcie_gbps / (profile.pcie_gbps + profile.cpu_expert_gbps))
    if name == "static":
        return StaticPolicy(layers, num_experts, capacity)
    raise ValueError(f"unknown residency policy {name!r}; choose one of {', '.join(POLICIES)}")


def attach_residency(model, mode: str, profile_name: str, vram_budget_bytes: int = 0, policy: str = "ours",
                     memory_probe: Optional[Callable[[], int]] = None, audit: bool = False,
                     prefetch: bool = True, cpu_kernels: bool = True, banks: Optional[list] = None
                     ) -> ResidencyExecutor:
    """`build_residency`, plugged in as the model's expert executor."""
    executor = build_residency(model, mode, profile_name, vram_budget_bytes, policy, memory_probe, audit, prefetch,
                               cpu_kernels, banks)
    model.experts = executor
    return executor


def build_residency(model, mode: str, profile_name: str, vram_budget_bytes: int = 0, policy: str = "ours",
                    memory_probe: Optional[Callable[[], int]] = None, audit: bool = False,
                    prefetch: bool = True, cpu_kernels: bool = True, banks: Optional[list] = None
                    ) -> ResidencyExecutor:
    """The tiers' executor for `model` (the caller makes it the model's expert executor).
    `vram_budget_bytes`: bytes for expert slots (0 = on CUDA, the free VRAM less max(1 GiB, a
    tenth of the card) (call it after the dense weights and the KV cache are placed); emulated, room for half the
    model's experts, so a tiny model exercises hits, streaming and the CPU at once). `banks`: per
    layer the expert store's `ExpertBank` (`--expert-dtype`: bf16, fp32, int8 or int4; None for
    a dense layer), whose arrays become the host banks the streamer copies from and the CPU
    kernels read; without, the model's torch expert stacks (the checkpoint's precision).
    `cpu_kernels`: with the torch stacks, the CPU tier runs the numba expert kernels on views of
    them (bf16 / fp32 SwiGLU experts); False, or any other dtype, runs torch there."""
    activation = getattr(model.args, "hidden_act", "silu")
    host, moe, fmt = _host_experts(model, banks, activation)
    num_experts, expert_bytes = host[moe[0]][0].shape[0], fmt.expert_bytes
    kernels = banks is not None or (cpu_kernels and activation == "silu")   # the CPU tier on the numba kernels
    profile = _tier_profile(model, mode, profile_name, fmt, num_experts, kernels)
    if mode == "cuda" and banks is None:   # pinned banks make the host -> device copies asynchronous DMA
        _pin_in_place(model, moe, host)
    # (the expert store's banks are page-locked where they lie by the engine: engine.expert_store.pin_banks)
    # room for activations on a GPU: a tenth of the card, at least CUDA_RESERVE_BYTES
    reserve = max(CUDA_RESERVE_BYTES, torch.cuda.mem_get_info()[1] // 10) if mode == "cuda" else 0
    if vram_budget_bytes:
        budget = vram_budget_bytes
    elif mode == "cuda":   # what the dense weights and the KV cache left, less room for activations
        budget = max(0, cuda_free_bytes() - reserve)
    else:
        budget = expert_bytes * (len(moe) * num_experts // 2)
    num_slots = min(budget // expert_bytes, len(moe) * num_experts)
    slots = SlotCache(num_slots, fmt.specs, "cpu" if mode == "emulate" else "cuda")
    cost = CostModel(profile, expert_bytes, 2.0 * 3 * fmt.inter * fmt.hidden)   # flops: gate+up [2I, D], down [D, I]
    routers = route_predictors(model, set(moe)) if prefetch else None
    elastic = ElasticVram(expert_bytes, num_slots) if memory_probe is not None else None
    if mode == "cuda" and memory_probe is None:
        memory_probe = cuda_free_bytes
        # the same room for activations the start-up budget left (the default 256 MiB is less than
        # a prefill's activations need: the probe would grow the slots into them)
        elastic = ElasticVram(expert_bytes, num_slots, reserve_bytes=reserve)
    # the look-ahead's lead: measured on a GPU; emulated, the profile's (a layer's dense read and
    # host work, as the simulator counts it), not this host's CPU-side dense compute
    dense_layer = dense_weight_bytes(model) // len(moe) if mode == "emulate" else None
    if banks is not None:
        cpu_banks = banks
        _warm(banks[moe[0]])
    else:
        cpu_banks = _cpu_banks(host, activation) if cpu_kernels else None
    return ResidencyExecutor(host, fmt, make_policy(policy, moe, num_experts, num_slots, profile), cost, slots,
                             routers=routers, top_k=model.args.top_k, elastic=elastic,
                             memory_probe=memory_probe, label=profile.name if mode == "emulate" else "cuda",
                             audit=audit, measure_live=mode == "cuda", cpu_banks=cpu_banks,
                             dense_layer_bytes=dense_layer)


def _host_experts(model, banks: Optional[list], activation: str):
    """Per layer the host expert weights the tiers serve ((w13, w2) parts, None for a dense layer),
    the MoE layers' indices and their `ExpertFormat`."""
    if any(getattr(layer.ffn, "expert_bias", False) for layer in model.layers):
        raise FreetokenError(f"the residency tiers do not run biased experts yet ({model.args.model_type}); "
                             "use --backend cpu or torch")
    if banks is not None:
        if activation != "silu":
            raise FreetokenError(f"the residency tiers compute SwiGLU experts; this model's are {activation!r}")
        host = [bank_parts(b) if b is not None else None for b in banks]
    else:
        host = [(lw.w13, lw.w2) if lw.w13 is not None else None for lw in model.weights.layers]
    moe = [i for i, h in enumerate(host) if h is not None]
    if not moe:
        raise ValueError("this model has no routed experts")
    fmt = ExpertFormat.of_bank(banks[moe[0]]) if banks is not None else ExpertFormat.of_float(*host[moe[0]])
    return host, moe, fmt


def _tier_profile(model, mode: str, profile_name: str, fmt: ExpertFormat, num_experts: int, kernels: bool):
    """The tier profile: a hand-built one by name, or "measured" (this machine's, with its fixed
    host costs timed on the real executor); emulated when the accelerator tier runs on CPU."""
    profile = _measured_profile(_probe_format(fmt)) if profile_name == "measured" else get_profile(profile_name)
    if profile_name == "measured":
        profile = with_host_costs(profile, num_experts, fmt, model.args.top_k, kernels)
    return emulated(profile) if mode == "emulate" else profile


def _pin_in_place(model, moe: list[int], host: list) -> None:
    """Page-lock the torch expert stacks where they lie (`utils.host_memory.register`: no second
    copy, no rounding up to a power of two). A stack the driver will not register is copied into
    PyTorch's pinned memory instead, layer by layer, replacing the model's own reference (one
    host copy, not two). A stack that views the checkpoint's file mapping (stored fused, in the
    load dtype) is copied into the process's own memory first and the copy registered: a file
    mapping is never registered (`utils.host_memory`)."""
    from freetoken_py.utils.host_memory import file_mapped, register

    layers = model.weights.layers
    model.experts = None   # the torch executor's references to the weights go first (they may be replaced)
    for i in moe:
        pair = []
        for t in (layers[i].w13, layers[i].w2):
            t = t.contiguous()
            if file_mapped(t.data_ptr()):
                t = t.clone()
            pair.append(t if register(t.data_ptr(), t.nbytes, t).ok else t.pin_memory())
        layers[i].w13, layers[i].w2 = pair
        host[i] = tuple(pair)


def dense_weight_bytes(model) -> int:
    """Bytes of the weights every token reads besides the routed experts (attention, norms,
    routers, dense MLPs, the LM head; the embedding is one row per token)."""
    w = model.weights      # tensors (norms) and linear layers (torch or numba): each has nbytes
    return w.final_norm.nbytes + w.lm_head.nbytes + sum(obj.nbytes for lw in w.layers for obj in lw.dense().values())


def _cpu_banks(host: list, activation: str) -> Optional[list]:
    """Per layer, a numba ExpertBank viewing the host expert weights (no copy); None where the
    kernels cannot take them (fp16 weights, another activation)."""
    from freetoken_py.kernels.cpu_moe import ExpertBank

    if activation != "silu":
        return None
    try:
        banks = [ExpertBank.view_of(*h) if h is not None else None for h in host]
    except ValueError:
        return None
    bank = next((b for b in banks if b is not None), None)
    if bank is None:
        return None
    _warm(bank)
    return banks


def _warm(bank) -> None:
    """Compile / load the CPU tier's kernel for `bank`'s format now, not in the first step."""
    from freetoken_py.kernels.cpu_moe import moe_experts

    moe_experts(bank, torch.zeros(1, bank.hidden), torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1))


def _probe_format(fmt: ExpertFormat) -> str:
    """The probe's name for the CPU kernel that runs experts of format `fmt`."""
    if fmt.name != "float":
        return fmt.name
    return "fp32" if fmt.dtype == torch.float32 else "bf16"


def _measured_profile(expert_format: str = "bf16"):
    """This machine's tier profile from `freetoken probe` (cached, revalidated, or measured now)."""
    from freetoken_py.hw import get_profile as machine_profile

    profile = from_hardware_profile(machine_profile(progress=False), expert_format=expert_format)
    if profile is None:
        raise FreetokenError("this machine's profile has no GPU figures (PCIe, VRAM); run `freetoken probe` "
                             "with the GPU visible, or name a hand-built profile")
    return profile
