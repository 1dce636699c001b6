"""Load a checkpoint directory into a ready-to-run `MoeTransformer`."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from freetoken_py.errors import ModelLoadError
from freetoken_py.models import architecture_of, model_module
from freetoken_py.models.args import ConfigReader, ModelArgs
from freetoken_py.models.checkpoint import LogicalReader, TensorInfo, list_checkpoint_tensors, read_json
from freetoken_py.models.moe_transformer import MoeTransformer
from freetoken_py.models.weights import held_bytes, load_weights, validate
from freetoken_py.utils.progress import progress_bar

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sampling: dict  # temperature / top_p / top_k / min_p / repetition_penalty from generation_config.json


def resolve_dtype(name: str, stored: str) -> torch.dtype:
    if name == "auto":
        # bf16 stays bf16; fp16 widens to fp32 (CPU fp16 math is slow and fp16 -> bf16 would drop
        # mantissa bits); fp32 stays fp32.
        return torch.bfloat16 if stored == "BF16" else torch.float32
    if name not in _DTYPES:
        raise ModelLoadError(f"unknown dtype '{name}' (choose auto, float32, bfloat16, float16)")
    return _DTYPES[name]


def host_memory_bytes() -> int:
    """What this process can hold at most: RAM plus swap, or its cgroup's memory limit if lower
    (a container, a systemd MemoryMax=)."""
    have = psutil.virtual_memory().total + psutil.swap_memory().total
    limit = cgroup_memory_limit()
    return min(have, limit) if limit is not None else have


def cgroup_memory_limit(root: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc/self/cgroup")) -> int | None:
    """The lowest memory limit on this process's cgroup and its ancestors (v2 `memory.max`, v1
    `memory.limit_in_bytes`); None where there is none, or no cgroup file system."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":                                   # v2: the unified hierarchy
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):                 # v1: the memory controller's
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        here = Path(path.strip() or "/")
        for part in [here, *here.parents]:
            try:
                value = (base / str(part).lstrip("/") / name).read_text().strip()
            except OSError:
                continue
            if value.isdigit() and int(value) < 1 << 62:        # "max" and v1's huge "unlimited": none
                found.append(int(value))
    return min(found) if found else None


def check_host_memory(model_dir: Path, need: int, dtype: torch.dtype, skip_experts: bool) -> None:
    """Weights that cannot fit in what this process may hold (`host_memory_bytes`) fail now, in
    one line with the fix, not with the out-of-memory killer halfway through the load. `need`:
    `weights.held_bytes`, the copies and the largest moment (views of the checkpoint's mapping
    are file pages, not counted)."""
    have = host_memory_bytes()
    if need <= have:
        return
    what = "its dense weights" if skip_experts else "its weights"
    fixes = [] if skip_experts else ["load the experts through the expert store instead (--expert-dtype int4, int8 "
                                     "or bf16, on the cpu backend or the residency tiers: packed into a cache file "
                                     "and mapped, not held)"]
    if dtype.itemsize > 2:
        fixes.append("load in --dtype bfloat16 (half of float32)")
    fix = " or ".join(fixes) if fixes else "it needs a machine with more memory"
    raise ModelLoadError(f"{model_dir}: {what} need {need / 2**30:.1f} GiB of memory in "
                         f"{str(dtype).removeprefix('torch.')} but this process can hold {have / 2**30:.1f} GiB "
                         f"(RAM and swap, or its memory limit); {fix}")


@dataclass(frozen=True)
class Checkpoint:
    """Stage 1 of loading (docs/architecture.md, "Loading"): a checkpoint directory's config, its
    model file's names and its format. `logical` maps the model file's tensor names to their
    logical shapes, whatever format stores them; `reader()` reads them through the decoder."""
    model_dir: Path
    args: ModelArgs
    scheme: object          # the model file's WeightScheme
    stored: dict[str, TensorInfo]
    decoder: object         # a formats decoder (PlainDecoder, Fp8BlockDecoder, CtInt4Decoder)

    @property
    def logical(self) -> dict[str, TensorInfo]:
        return self.decoder.logical

    def reader(self) -> LogicalReader:
        return LogicalReader(self.stored, self.decoder)


def open_checkpoint(model_dir: Path | str) -> Checkpoint:
    """Config, names, format and headers; no tensor data is read. Bad input: one-line ModelLoadError."""
    from freetoken_py.formats import decoder_for, find_quant_config

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: not a directory")
    cfg = read_json(model_dir / "config.json")
    extra = model_dir / "hf_quant_config.json"
    qcfg, field = find_quant_config(cfg, read_json(extra) if extra.exists() else None)
    args = read_model_args(model_dir)
    stored = _model_names(list_checkpoint_tensors(model_dir), model_module(args.model_type))
    return Checkpoint(model_dir, args, model_module(args.model_type).SCHEME, stored, decoder_for(qcfg, stored, field))


def _model_names(tensors: dict[str, TensorInfo], module) -> dict[str, TensorInfo]:
    """The checkpoint's tensors under the model file's names: a module's `rename(stored) -> name |
    None` (kimi_k25: the `language_model.` prefix, `blocks` spelled `layers`; None = not loaded).
    Each TensorInfo keeps its stored name, which the reader uses."""
    rename = getattr(module, "rename", None)
    if rename is not None:
        out = {}
        for name, info in tensors.items():
            new = rename(name)
            if new is not None:
                out[new] = info
        module.note_skipped(len(tensors) - len(out))
        tensors = out
    expand = getattr(module, "expand", None)  # one stored tensor read as several (fused expert stacks)
    return tensors if expand is None else expand(tensors)


def read_model_args(model_dir: Path) -> ModelArgs:
    cfg = read_json(model_dir / "config.json")
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str):
        raise ModelLoadError(f"{model_dir / 'config.json'}: missing 'model_type'")
    return model_module(model_type).parse_config(ConfigReader(cfg, model_dir / "config.json"))


def read_generation_defaults(model_dir: Path) -> GenerationDefaults:
    cfg = read_json(model_dir / "config.json")
    path = model_dir / "generation_config.json"
    gen = read_json(path) if path.exists() else {}
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    # As transformers' generate and vLLM's `--generation-config auto`: the sampling knobs count when
    # the config samples; repetition_penalty is a logits processor and counts in greedy decoding too.
    sampling = {k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p")
                if gen.get(k) is not None and gen.get("do_sample", True)}
    if gen.get("repetition_penalty") not in (None, 1.0):
        sampling["repetition_penalty"] = gen["repetition_penalty"]
    for key, value in sampling.items():   # (ranges: SamplingParams' own checks, run by LLM at load)
        if isinstance(value, bool) or not isinstance(value, int if key == "top_k" else (int, float)):
            kind = "an integer" if key == "top_k" else "a number"
            raise ModelLoadError(f"{path}: {key!r} must be {kind}, got {value!r}")
    return GenerationDefaults(eos_ids, gen.get("bos_token_id", cfg.get("bos_token_id")), sampling)


def load_model(model_dir: "Path | str | Checkpoint", dtype: str = "auto", show_progress: bool = True,
               experts: str = "load", defer: frozenset = frozenset()) -> MoeTransformer:
    """experts="skip" loads everything but the routed experts (`w13`/`w2` stay None): for the cpu
    backend, whose expert store builds its banks from the checkpoint itself. Such a model runs only
    after an expert executor is attached (`engine.cpu_backend.load_cpu_model` does this).
    defer: logical names loaded as shape-only (meta) placeholders, never read or dequantised: the
    cpu backend's packed dense weights, which it replaces with the checkpoint's own codes."""
    if experts not in ("load", "skip"):
        raise ValueError(f"experts must be 'load' or 'skip', got {experts!r}")
    ckpt = model_dir if isinstance(model_dir, Checkpoint) else open_checkpoint(model_dir)
    model_dir, args, scheme, tensors = ckpt.model_dir, ckpt.args, ckpt.scheme, ckpt.logical
    arch = architecture_of(args)   # the model file's layers: validation, loading and the forward share it
    validate(args, scheme, tensors, model_dir, arch)
    stored = tensors["model.embed_tokens.weight"].dtype
    torch_dtype = resolve_dtype(dtype, stored)
    held, moment = held_bytes(args, scheme, tensors, torch_dtype, experts == "skip", arch)
    check_host_memory(model_dir, held + moment, torch_dtype, experts == "skip")
    reader = ckpt.reader() if not defer else _Deferring(ckpt.reader(), defer, tensors)
    with progress_bar(f"Loading {model_dir.name}", total=args.num_layers, enabled=show_progress) as advance:
        weights = load_weights(args, scheme, reader, torch_dtype, progress=advance, skip_experts=experts == "skip",
                               arch=arch)
    reader.close()
    return MoeTransformer(args, weights, torch_dtype, arch=arch)


class _Deferring:
    """A reader that hands out meta tensors (shape only) for the deferred names."""

    def __init__(self, reader, defer: frozenset, tensors: dict):
        self._reader, self._defer, self._tensors = reader, defer, tensors

    def get(self, name: str) -> torch.Tensor:
        if name in self._defer:
            return torch.empty(self._tensors[name].shape, dtype=torch.float32, device="meta")
        return self._reader.get(name)

    def __getattr__(self, name: str):
        return getattr(self._reader, name)
