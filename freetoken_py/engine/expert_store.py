"""Expert store: every MoE layer's routed experts as one `ExpertBank`, built straight from the
checkpoint's per-expert safetensors tensors, optionally cached on disk as raw page-aligned arrays.

    store = open_expert_store(model_dir, model.args, torch.bfloat16, fmt="int4", group_size=64)
    store.banks   # per layer: ExpertBank (MoE layer) or None (dense layer)
    store.source  # "built" (from the checkpoint) | "cache" (mapped from the cache file)

Building goes one layer at a time, one expert at a time (so peak memory is the dense weights,
the banks already built, and one layer in flight; int8 / int4 never hold a high-precision copy of
more than one expert matrix). With the cache on (`cache="auto"`, the default) each built layer is
written to the cache file and dropped, and the finished file is mapped read-only: the next start
maps it without touching the checkpoint's expert tensors. See docs/kernels.md#expert-store.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import psutil
import torch

from freetoken_py import envs
from freetoken_py.engine import expert_cache as fc
from freetoken_py.errors import FreetokenError
from freetoken_py.kernels._buffers import PAGE_BYTES, R16_SCALES, aligned_empty, row_layout, scale_dtype
from freetoken_py.kernels.cpu_moe import ExpertBank, preferred_layout
from freetoken_py.models import loader
from freetoken_py.models.args import ModelArgs
from freetoken_py.utils.progress import progress_bar

CACHE_MODES = ("auto", "off", "rebuild")
LAYER_BUILDS = 0  # layers encoded from the checkpoint in this process (tests: a cache hit adds none)


class ExpertCacheWarning(UserWarning):
    """A cache file was unusable (and is being rebuilt) or could not be written."""


@dataclass
class ExpertStore:
    banks: list[ExpertBank | None]
    source: str  # "built" | "cache"
    path: Path | None  # the cache file in use, if any


def open_expert_store(model_dir: Path | str, args: ModelArgs, dtype: torch.dtype, fmt: str, group_size: int = 32,
                      cache: str = "auto", show_progress: bool = True, layout: str = "rows") -> ExpertStore:
    """Banks for every layer. `dtype` is the load dtype: tensors are cast to it before encoding,
    exactly as the torch loader would, so the bytes match `ExpertBank.from_weights` on its stacks.
    layout: the banks' layout ("rows"; "auto" for banks only the CPU kernels read: what
    `cpu_moe.preferred_layout` picks on this CPU, "r16" int4 / nvfp4 slabs with int8 activations
    (AVX2 or AVX-512 VNNI), int8 slabs on AVX-512 VNNI, fp8 slabs with AVX512-BF16 + VBMI); an "r16" store has its own cache file."""
    if cache not in CACHE_MODES:
        raise FreetokenError(f"expert cache must be one of {', '.join(CACHE_MODES)} (got {cache!r})")
    model_dir = Path(model_dir)
    if layout == "auto":
        layout = preferred_layout(fmt, args.moe_intermediate_size, args.hidden_size, group_size)
    job = _Job(model_dir, args, dtype, fmt, group_size, show_progress, layout)
    if cache == "off":
        _check_in_memory(job, "--expert-cache off holds them in memory; use --expert-cache auto (a cache file, mapped)")
        return ExpertStore(job.build_in_memory(), "built", None)
    paths = _candidate_paths(model_dir, job.file_name)
    if cache == "auto":
        for path in paths:
            store = _try_map(path, job)
            if store is not None:
                return store
    for path in paths:
        try:
            job.build_to_file(path)
        except OSError as exc:
            _warn(f"expert cache: cannot write {path} ({exc.strerror or exc}); trying the next location")
            continue
        return ExpertStore(_mapped_banks(path, job), "built", path)
    _check_in_memory(job, "no cache location is writable; point FREETOKEN_CACHE_DIR at a writable directory "
                          "with room for them")
    _warn("expert cache: no writable location; keeping the experts in memory (next start rebuilds)")
    return ExpertStore(job.build_in_memory(), "built", None)


def _check_in_memory(job: "_Job", fix: str) -> None:
    """Packed experts that would not fit beside what this process already holds fail now, in one
    line with `fix`, not with the out-of-memory killer halfway through the packing."""
    _check_room(job.header["file_bytes"], f"{job.model_dir}: the packed {job.fmt} experts take", fix)


def _check_room(need: int, subject: str, fix: str) -> None:
    """`need` more bytes that would not fit beside what this process already holds (mapped file
    pages, the checkpoint's views, left out) is a one-line error: `subject` ... `fix`."""
    mem = psutil.Process().memory_info()
    used, have = mem.rss - getattr(mem, "shared", 0), loader.host_memory_bytes()
    if used + need > have:
        raise FreetokenError(f"{subject} {need / 2**30:.1f} GiB and this process, holding {used / 2**30:.1f} GiB "
                             f"already, can hold {have / 2**30:.1f} GiB; {fix}")


def _warn(msg: str) -> None:
    # explicit location: the CLI prints one line ("freetoken:0: ExpertCacheWarning: ..."), not a source line
    warnings.warn_explicit(msg, ExpertCacheWarning, "freetoken", 0, module=__name__)


def _try_map(path: Path, job: "_Job") -> ExpertStore | None:
    if not path.exists():
        return None
    try:
        fc.check_header(fc.read_header(path), job.header, path)
        return ExpertStore(_mapped_banks(path, job), "cache", path)
    except (fc.CacheInvalid, OSError, ValueError) as exc:
        _warn(f"expert cache {path}: {exc}; rebuilding")
        return None


_PACKAGE_DIR = Path(__file__).resolve().parent.parent


def _candidate_paths(model_dir: Path, name: str) -> list[Path]:
    """Next to the model when that directory is writable, else the user cache dir. The bundled
    demo model always uses the user cache dir (never write into the installed package / checkout)."""
    resolved = model_dir.resolve()
    key = hashlib.sha256(str(resolved).encode()).hexdigest()[:16]
    user = envs.cache_dir() / "experts" / key / name
    if os.access(model_dir, os.W_OK) and not resolved.is_relative_to(_PACKAGE_DIR):
        return [model_dir / name, user]
    return [user]


def _mapped_banks(path: Path, job: "_Job") -> list[ExpertBank | None]:
    banks = [None if a is None else ExpertBank(job.fmt, job.group_size, a["w13"], a["s13"], a["w2"], a["s2"])
             for a in fc.map_arrays(path, job.header)]
    return banks


class _Job:
    """What to build (names, shapes, format) and the cache header that describes it."""

    def __init__(self, model_dir: Path, args: ModelArgs, dtype: torch.dtype, fmt: str, group_size: int,
                 show_progress: bool, layout: str = "rows"):
        _check_format(args, fmt, group_size)
        self.model_dir, self.args, self.dtype, self.fmt, self.group_size = model_dir, args, dtype, fmt, group_size
        self.layout = layout
        self.show_progress = show_progress
        self.ckpt = loader.open_checkpoint(model_dir)
        self.scheme = self.ckpt.scheme
        self.tensors = self.ckpt.stored
        dec = self.ckpt.decoder
        # the checkpoint's own execution format: its codes and scales are copied, never re-encoded
        self.copy_packed = dec.exec_format == fmt and dec.group_size == group_size
        src = str(dtype).removeprefix("torch.")
        shape = "" if layout == "rows" else f"-{layout}"
        self.file_name = f"freetoken-experts-{fmt}-g{group_size}{shape}-from-{src}.bin"
        files = sorted({t.file for t in self.tensors.values()})
        identity = {"model_type": args.model_type, "load_dtype": src, "format": dec.name,
                    "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]}
        specs = [self._spec() if sparse else None for sparse in args.sparse_layers]
        self.raw_header, self.header = fc.plan_layout(
            specs, {"identity": identity, "fmt": fmt, "group_size": group_size, "layout": layout})

    def _spec(self) -> dict:
        a = self.args
        e, i, d = a.num_experts, a.moe_intermediate_size, a.hidden_size
        dt13, items13, g13 = row_layout(self.fmt, d, self.group_size)
        dt2, items2, g2 = row_layout(self.fmt, i, self.group_size)
        sdt = (R16_SCALES[self.fmt] if self.layout == "r16" else scale_dtype(self.fmt)).str   # r16: int16 / int8 / int32
        return {"w13": (dt13.str, (e, 2 * i, items13)), "s13": (sdt, (e, 2 * i, g13)),
                "w2": (dt2.str, (e, d, items2)), "s2": (sdt, (e, d, g2))}

    def layers(self, transient: bool = False):
        """Yields (layer index, ExpertBank) for each MoE layer, built from the checkpoint.
        transient: each bank lives in its own anonymous mapping, returned to the system when the
        caller drops it (the cache build writes it out and drops it: peak one layer in flight; a
        heap block would stay in the process, malloc keeps freed blocks under kernels.threads'
        tune_allocator)."""
        sparse = [i for i, s in enumerate(self.args.sparse_layers) if s]
        reader = self.ckpt.reader()
        with progress_bar(f"Packing experts ({self.fmt})", total=len(sparse), enabled=self.show_progress) as advance:
            for i in sparse:
                bank = self._build_layer(reader, i, transient)
                reader.close()  # unmap the shards: their touched pages would otherwise stay resident
                yield i, bank
                advance()

    def _build_layer(self, reader, i: int, transient: bool = False) -> ExpertBank:
        global LAYER_BUILDS
        a, s = self.args, self.scheme
        bank = (_transient_bank(self.fmt, self.group_size, self.header["layers"][i]) if transient else
                ExpertBank.empty(self.fmt, a.num_experts, a.moe_intermediate_size, a.hidden_size, self.group_size,
                                 self.layout))
        prefix = s.layer.format(i=i)
        for e in range(a.num_experts):
            names = [f"{prefix}{s.expert.format(e=e)}{proj}.weight" for proj in s.expert_proj]  # gate, up, down
            packed = [reader.packed(n) for n in names] if self.copy_packed else [None]
            if all(p is not None for p in packed):
                bank.set_expert_packed(e, *packed)
            else:   # plain weights, or a conversion asked for: dequantised at the load dtype, then encoded
                bank.set_expert(e, *(reader.get(n).to(self.dtype) for n in names))
        LAYER_BUILDS += 1
        return bank

    def build_in_memory(self) -> list[ExpertBank | None]:
        banks: list[ExpertBank | None] = [None] * self.args.num_layers
        for i, bank in self.layers():
            banks[i] = bank
        return banks

    def build_to_file(self, path: Path) -> None:
        """Stream every layer into `path` (via a temp file + rename, so a crash leaves no half file)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                fc.write_prefix(f, self.raw_header)
                for i, bank in self.layers(transient=True):
                    fc.write_layer(f, self.header["layers"][i],
                                   {"w13": bank.w13, "s13": bank.s13, "w2": bank.w2, "s2": bank.s2})
                f.truncate(self.header["file_bytes"])
            os.replace(tmp, path)
        except BaseException:
            fc.remove_quietly(tmp)
            raise


def _transient_bank(fmt: str, group_size: int, layer: dict) -> ExpertBank:
    """An empty bank with the cache plan's arrays (`layer`: name -> dtype, shape) in one
    anonymous mapping, each array page-aligned; unmapped when the last array is dropped."""
    sizes = [(n, np.dtype(layer[n]["dtype"]), layer[n]["shape"]) for n in fc.ARRAYS]
    spans = [-(-int(np.prod(shape, dtype=np.int64)) * dt.itemsize // PAGE_BYTES) * PAGE_BYTES
             for _, dt, shape in sizes]
    mm = mmap.mmap(-1, max(sum(spans), PAGE_BYTES))
    arrays, pos = {}, 0
    for (name, dt, shape), span in zip(sizes, spans):
        count = int(np.prod(shape, dtype=np.int64))
        arrays[name] = np.frombuffer(mm, dt, count, pos).reshape(shape)   # each view keeps mm alive
        pos += span
    return ExpertBank(fmt, group_size, arrays["w13"], arrays["s13"], arrays["w2"], arrays["s2"])


def _check_format(args: ModelArgs, fmt: str, group_size: int) -> None:
    if fmt not in ("bf16", "fp32", "int8", "int4", "fp8", "nvfp4"):
        raise FreetokenError(f"expert format must be bf16, fp32, int8, int4, fp8 or nvfp4 (got {fmt!r})")
    if fmt == "nvfp4" and (group_size != 16 or args.hidden_size % 16 or args.moe_intermediate_size % 16):
        raise FreetokenError(f"nvfp4 experts need group 16 (got {group_size}) and hidden size ({args.hidden_size}) "
                             f"and expert width ({args.moe_intermediate_size}) divisible by 16")
    if fmt == "fp8" and (group_size <= 0 or group_size % 2):
        raise FreetokenError(f"fp8 experts need an even column block (got {group_size})")
    if fmt == "int4":
        if group_size not in (32, 64, 128):
            raise FreetokenError(f"int4 group size must be 32, 64 or 128 (got {group_size})")
        if args.hidden_size % group_size or args.moe_intermediate_size % group_size:
            raise FreetokenError(f"int4 experts need hidden size ({args.hidden_size}) and expert width "
                                 f"({args.moe_intermediate_size}) divisible by the group size {group_size}")


def pin_banks(banks: list[ExpertBank | None], show_progress: bool = False) -> int:
    """Page-lock the banks' memory, so host->device expert copies are asynchronous (the residency
    tiers on a CUDA GPU call this; nothing else needs it). Returns the bytes registered. Banks in
    memory of the process's own (built in memory) are registered where they lie; banks mapped
    from the cache file (`utils.host_memory.file_mapped`) are first copied into page-aligned
    memory of the process's own, replacing them in `banks`, and the copies are registered:
    `cudaHostRegister` on the file mapping did not return within 85 s for 256 MiB on the H200
    machine (the same size of anonymous memory: 0.01 s), and registering a copy-on-write mapping
    plainly would give it private copies of its pages anyway. The copy must fit beside what the
    process holds (one-line error before it starts). An array the driver refuses stays pageable
    (its copies are synchronous; the banks still work), one warning says how many. Each array is
    unregistered when it is garbage-collected, before its memory can go back."""
    if not torch.cuda.is_available():
        return 0
    from freetoken_py.utils.host_memory import file_mapped, register

    _into_memory(banks, [i for i, b in enumerate(banks) if b is not None and file_mapped(b.w13.ctypes.data)],
                 show_progress)
    done, failed, error = 0, 0, None
    for bank in banks:
        for a in () if bank is None else (getattr(bank, name) for name in fc.ARRAYS):
            r = register(a.ctypes.data, a.nbytes, a)
            if r.ok:
                done += a.nbytes
            else:
                failed, error = failed + 1, r.error
    if failed:
        _warn(f"expert store: cudaHostRegister failed for {failed} arrays ({error}); their copies to the GPU "
              "will not be asynchronous")
    return done


def _into_memory(banks: list[ExpertBank | None], layers: list[int], show_progress: bool) -> None:
    """Replace banks[i] for i in `layers` (mapped from the cache file) by a copy of its arrays in
    page-aligned memory of the process's own (the file's pages stay in the page cache,
    reclaimable, once unmapped)."""
    if not layers:
        return
    need = sum(getattr(banks[i], name).nbytes for i in layers for name in fc.ARRAYS)
    _check_room(need, "the page-locked host copy of the experts (for the GPU tiers) takes",
                "free memory, or leave out --gpu-experts (the cpu backend reads the cache file in place)")
    with progress_bar("Page-locking experts", total=len(layers), enabled=show_progress) as advance:
        for i in layers:
            fields = {}
            for name in fc.ARRAYS:
                a = getattr(banks[i], name)
                fields[name] = aligned_empty(a.shape, a.dtype)
                np.copyto(fields[name], a)
            banks[i] = replace(banks[i], **fields)
            advance()
