"""The expert store (engine/expert_store.py): banks built straight from the checkpoint are
bit-identical to `ExpertBank.from_weights` on the torch loader's stacks; the disk cache round-trips
(mapped, same bytes, builder not called), is rebuilt with one warning when truncated, corrupt or
stale; greedy tokens on the cpu backend equal the torch reference; and loading never holds a
second full copy of the experts (peak RSS, in a subprocess)."""
from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from freetoken_py.config import EngineConfig
from freetoken_py.core import SamplingParams
from freetoken_py.engine import expert_store as es
from freetoken_py.errors import FreetokenError
from freetoken_py.kernels import ExpertBank
from freetoken_py.llm import LLM
from freetoken_py.models.loader import load_model
from conftest import StandInCudart, random_prompt

ARRAYS = ("w13", "s13", "w2", "s2")


def reference_banks(path: Path, fmt: str, group_size: int, dtype: str = "auto") -> tuple[list, object]:
    """The old path: the torch loader's stacked experts, converted by ExpertBank.from_weights."""
    model = load_model(path, dtype, show_progress=False)
    banks = []
    for lw in model.weights.layers:
        if lw.w13 is None:
            banks.append(None)
            continue
        inter = lw.w13.shape[1] // 2
        banks.append(ExpertBank.from_weights(lw.w13[:, :inter], lw.w13[:, inter:], lw.w2, fmt=fmt,
                                             group_size=group_size))
    return banks, model


def assert_same_banks(ours: list, ref: list) -> None:
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert (a is None) == (b is None), f"layer {i}: dense/sparse mismatch"
        if a is None:
            continue
        assert (a.fmt, a.group_size) == (b.fmt, b.group_size)
        for name in ARRAYS:
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and x.shape == y.shape, (i, name)
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), f"layer {i} {name} differs"  # bit-exact


def private_copy(path: Path, tmp_path: Path) -> Path:
    """A checkpoint directory of this test's own (the cache files and mtimes are mutated)."""
    out = tmp_path / path.name
    shutil.copytree(path, out, ignore=shutil.ignore_patterns("freetoken-experts-*"))
    return out


def is_mapped(a: np.ndarray) -> bool:
    while a is not None and not isinstance(a, mmap.mmap):
        a = a.obj if isinstance(a, memoryview) else a.base  # ndarray -> ... -> memoryview -> mmap
    return isinstance(a, mmap.mmap)


CASES = [(arch, torch.float32, fmt, 32) for arch in ("qwen3_moe", "mixtral", "olmoe") for fmt in ("bf16", "fp32", "int8")]
CASES += [(arch, torch.float32, "int4", g) for arch in ("mixtral", "qwen3_moe_step2") for g in (32, 64)]
CASES += [("qwen3_moe", torch.bfloat16, "int8", 32), ("mixtral", torch.bfloat16, "int4", 64),
          ("olmoe", torch.bfloat16, "bf16", 32), ("olmoe", torch.float16, "bf16", 32)]


@pytest.mark.parametrize("arch,ckpt_dtype,fmt,group_size", CASES)
def test_store_banks_bit_identical_to_from_weights(arch, ckpt_dtype, fmt, group_size, checkpoint_factory):
    path = checkpoint_factory(arch, dtype=ckpt_dtype)
    ref, model = reference_banks(path, fmt, group_size)
    store = es.open_expert_store(path, model.args, model.dtype, fmt, group_size, cache="off", show_progress=False)
    assert store.source == "built" and store.path is None
    assert_same_banks(store.banks, ref)


def test_cache_round_trip_maps_the_file_and_skips_the_builder(checkpoint_factory, tmp_path):
    path = private_copy(checkpoint_factory("qwen3_moe"), tmp_path)
    ref, model = reference_banks(path, "int8", 32)
    args, dtype = model.args, model.dtype
    built = es.open_expert_store(path, args, dtype, "int8", 32, show_progress=False)
    assert built.source == "built" and built.path.parent == path
    assert all(is_mapped(b.w13) for b in built.banks if b is not None)  # the built banks are dropped, the file mapped
    count = es.LAYER_BUILDS
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a valid cache never warns
        cached = es.open_expert_store(path, args, dtype, "int8", 32, show_progress=False)
    assert es.LAYER_BUILDS == count, "a cache hit must not build any layer"
    assert cached.source == "cache" and cached.path == built.path
    assert all(is_mapped(getattr(b, n)) for b in cached.banks if b is not None for n in ("w13", "w2"))
    assert all(b.w13.ctypes.data % 4096 == 0 and b.w2.ctypes.data % 4096 == 0 for b in cached.banks if b is not None)
    assert_same_banks(cached.banks, ref)
    # other formats / group sizes get their own file; "rebuild" rebuilds; "off" writes nothing
    es.open_expert_store(path, args, dtype, "bf16", 32, show_progress=False)
    assert len(list(path.glob("freetoken-experts-*.bin"))) == 2
    es.open_expert_store(path, args, dtype, "int8", 32, cache="rebuild", show_progress=False)
    assert es.LAYER_BUILDS == count + 2 * sum(args.sparse_layers)
    es.open_expert_store(path, args, dtype, "fp32", 32, cache="off", show_progress=False)
    assert len(list(path.glob("freetoken-experts-*"))) == 2  # no fp32 file, no temp files left


def _truncate(cache: Path, ckpt: Path) -> None:
    os.truncate(cache, cache.stat().st_size - 4096)


def _flip_header_byte(cache: Path, ckpt: Path) -> None:
    raw = bytearray(cache.read_bytes())
    raw[60] ^= 0x01  # inside the JSON header (which starts at byte 48): the checksum catches it
    cache.write_bytes(bytes(raw))


def _touch_model(cache: Path, ckpt: Path) -> None:
    st = (ckpt / "model.safetensors").stat()
    os.utime(ckpt / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def _tiny_file(cache: Path, ckpt: Path) -> None:
    cache.write_bytes(b"FTEXPB01")


@pytest.mark.parametrize("damage,reason", [(_truncate, "truncated"), (_flip_header_byte, "checksum"),
                                           (_touch_model, "identity differs"), (_tiny_file, "too short")])
def test_damaged_or_stale_cache_is_rebuilt_with_one_warning(damage, reason, checkpoint_factory, tmp_path):
    path = private_copy(checkpoint_factory("mixtral"), tmp_path)
    ref, model = reference_banks(path, "int4", 32)
    first = es.open_expert_store(path, model.args, model.dtype, "int4", 32, show_progress=False)
    damage(first.path, path)
    count = es.LAYER_BUILDS
    with pytest.warns(es.ExpertCacheWarning, match=reason) as record:
        again = es.open_expert_store(path, model.args, model.dtype, "int4", 32, show_progress=False)
    assert len(record) == 1
    assert again.source == "built" and es.LAYER_BUILDS == count + model.args.num_layers
    assert_same_banks(again.banks, ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert es.open_expert_store(path, model.args, model.dtype, "int4", 32, show_progress=False).source == "cache"


def test_unwritable_model_location_falls_back_to_the_user_cache_dir(checkpoint_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path / "cache"))
    path = private_copy(checkpoint_factory("olmoe"), tmp_path)
    model = load_model(path, show_progress=False)
    (path / "freetoken-experts-bf16-g32-from-float32.bin").mkdir()  # occupies the name: writing there fails
    with pytest.warns(es.ExpertCacheWarning) as record:
        store = es.open_expert_store(path, model.args, model.dtype, "bf16", 32, show_progress=False)
    assert ["cannot read" in str(w.message) for w in record] == [True, False]  # the occupied name, then ...
    assert "cannot write" in str(record[1].message)
    assert store.path.is_relative_to(tmp_path / "cache" / "experts") and store.path.is_file()
    header = json.loads(store.path.read_bytes()[48:48 + int.from_bytes(store.path.read_bytes()[8:16], "little")])
    assert header["fmt"] == "bf16" and header["identity"]["files"][0][0] == "model.safetensors"


def test_bad_options_are_clear_errors(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe")
    model = load_model(path, show_progress=False, experts="skip")
    assert all(lw.w13 is None and lw.w2 is None for lw in model.weights.layers)
    with pytest.raises(FreetokenError, match="divisible by the group size"):
        es.open_expert_store(path, model.args, model.dtype, "int4", 32, cache="off")  # expert width 48
    with pytest.raises(FreetokenError, match="group size must be 32, 64 or 128"):
        es.open_expert_store(path, model.args, model.dtype, "int4", 16, cache="off")
    with pytest.raises(FreetokenError, match="expert cache must be"):
        es.open_expert_store(path, model.args, model.dtype, "bf16", 32, cache="sometimes")
    with pytest.raises(FreetokenError, match="expert cache must be auto, off or rebuild"):
        EngineConfig(model="m", expert_cache="yes")
    proc = subprocess.run([sys.executable, "-m", "freetoken_py", "run", "hi", "--model", str(path),
                           "--expert-cache", "bogus"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "expert cache must be auto, off or rebuild" in proc.stderr


@pytest.mark.parametrize("cache", ["off", "auto"])
def test_greedy_tokens_equal_the_torch_reference(cache, checkpoint_factory, tmp_path):
    path = private_copy(checkpoint_factory("qwen3_moe", dtype=torch.bfloat16), tmp_path)
    prompt = random_prompt(20, seed=11)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = LLM(path, show_progress=False, backend="torch").generate([prompt], params)[0].token_ids
    sources = []
    for _ in range(2 if cache == "auto" else 1):  # auto: the second engine maps the file the first wrote
        llm = LLM(path, show_progress=False, backend="cpu", expert_cache=cache)
        sources.append(llm.loaded.expert_store.source)
        assert llm.generate([prompt], params)[0].token_ids == expected
    assert sources == (["built", "cache"] if cache == "auto" else ["built"])


_PEAK_SCRIPT = r"""
import sys
import psutil, torch
torch.set_num_threads(1)
from freetoken_py.engine.cpu_backend import load_cpu_model, use_cpu_kernels
from freetoken_py.models.loader import load_model
import freetoken_py.kernels.cpu_moe, freetoken_py.engine.expert_store  # imports before the baseline
mode, path = sys.argv[1:]
base = psutil.Process().memory_info().rss
if mode == "store":
    load_cpu_model(path, expert_cache="off", show_progress=False)
else:  # the old path: torch stacks of every expert, then converted
    use_cpu_kernels(load_model(path, show_progress=False))
# VmHWM, not ru_maxrss: ru_maxrss survives exec, so it would report pytest's own (forked) peak
hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(int(hwm.split()[1]) * 1024 - base)
"""


def test_peak_memory_has_no_second_copy_of_the_experts(tmp_path):
    """Experts are ~99 % of this bf16 checkpoint (8 layers x 12.6 MB). The store's peak stays under
    dense + experts + 2 layers + slack; the old stack-then-convert path exceeds that bound, which
    shows the bound is tight enough to catch a second full copy."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=160, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=256,
                         num_experts=32, num_experts_per_tok=2)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    expert_bytes = 8 * 32 * 3 * 256 * 256 * 2
    total = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    dense_bytes, layer_bytes = total - expert_bytes, expert_bytes // 8
    bound = 2 * dense_bytes + expert_bytes + 2 * layer_bytes + 24 * 2**20  # dense counted twice: torch + kernel copy
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))

    def peak(mode: str) -> int:
        proc = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, mode, str(tmp_path)], capture_output=True,
                              text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout.split()[-1])

    ours, old = peak("store"), peak("old")
    print(f"peak above baseline: store {ours / 2**20:.0f} MiB, old path {old / 2**20:.0f} MiB, "
          f"bound {bound / 2**20:.0f} MiB (experts {expert_bytes / 2**20:.0f} MiB)")
    assert ours < bound
    assert old > bound


def test_registration_unregisters_on_collection_and_refuses_file_mappings(monkeypatch, tmp_path):
    """utils.host_memory.register against a stand-in CUDA runtime: memory of the process's own is
    registered plainly and unregistered when its owner is collected, not before; an address in a
    file mapping is refused without asking the driver (registering one hung on the H200 box); a
    driver refusal is reported with its text and the runtime's error is cleared."""
    import gc

    from freetoken_py.utils import host_memory

    rt, cleared = StandInCudart(), []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(host_memory, "clear_cuda_error", lambda: cleared.append(1))
    owner = np.zeros(4096, np.uint8)
    ptr = owner.ctypes.data
    assert host_memory.register(ptr, owner.nbytes, owner) == (True, None)
    assert rt.calls == [(ptr, 4096, host_memory.PORTABLE)] and cleared == [] and rt.unregistered == []
    assert host_memory.register(ptr, 0, owner).ok and len(rt.calls) == 1     # nothing to pin
    del owner
    gc.collect()
    assert rt.unregistered == [ptr]

    f = tmp_path / "bank.bin"
    f.write_bytes(b"\1" * 8192)
    with open(f, "r+b") as fh:
        m = mmap.mmap(fh.fileno(), 8192, flags=mmap.MAP_PRIVATE)
    view = np.frombuffer(m, np.uint8)
    assert host_memory.file_mapped(view.ctypes.data) and not host_memory.file_mapped(np.ones(8).ctypes.data)
    r = host_memory.register(view.ctypes.data, view.nbytes, view)
    assert not r.ok and "file mapping" in r.error and len(rt.calls) == 1     # the driver was not asked
    del view
    m.close()

    rt = StandInCudart(broken=True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    bank = ExpertBank.empty("int8", 2, 64, 32, 32)
    r = host_memory.register(bank.w13.ctypes.data, bank.w13.nbytes, bank.w13)
    assert not r.ok and "operation not supported" in r.error and cleared == [1]


def test_pin_banks_copies_a_mapped_cache_file_into_memory_and_registers_the_copies(
        checkpoint_factory, tmp_path, monkeypatch):
    """The GPU tiers' page-locking (engine.expert_store.pin_banks) on a store mapped from its cache
    file: each bank is replaced in the store's list by a copy in the process's own memory, byte
    for byte equal to the file's, and the copies (never the mapping) are registered; a copy that
    would not fit is a one-line error naming the fix, before any copying; a bank built in memory
    is registered where it lies; arrays the driver refuses stay pageable, said in one warning."""
    from freetoken_py.models import loader
    from freetoken_py.utils import host_memory

    rt = StandInCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    path = private_copy(checkpoint_factory("qwen3_moe"), tmp_path)
    model = load_model(path, "float32", show_progress=False, experts="skip")
    es.open_expert_store(path, model.args, model.dtype, "int8", 32, cache="auto", show_progress=False)
    store = es.open_expert_store(path, model.args, model.dtype, "int8", 32, cache="auto", show_progress=False)
    assert store.source == "cache"
    mapped = list(store.banks)
    arrays = [getattr(b, n) for b in mapped if b is not None for n in es.fc.ARRAYS]
    assert all(host_memory.file_mapped(a.ctypes.data) for a in arrays if a.nbytes)
    total = sum(a.nbytes for a in arrays)

    with monkeypatch.context() as m:
        m.setattr(loader, "host_memory_bytes", lambda: 1)
        with pytest.raises(FreetokenError) as err:
            es.pin_banks(store.banks)
    assert "\n" not in str(err.value) and "--gpu-experts" in str(err.value)
    assert store.banks == mapped and rt.calls == []

    assert es.pin_banks(store.banks) == total
    copies = [getattr(b, n) for b in store.banks if b is not None for n in es.fc.ARRAYS]
    assert not any(host_memory.file_mapped(a.ctypes.data) for a in copies)
    assert sorted(c[0] for c in rt.calls) == sorted(a.ctypes.data for a in copies if a.nbytes)
    assert_same_banks(store.banks, mapped)
    for b in store.banks:
        if b is not None:
            assert all(getattr(b, n).ctypes.data % es.PAGE_BYTES == 0 for n in es.fc.ARRAYS)

    rt = StandInCudart()                     # a bank built in memory: registered where it lies, not copied
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    built = [None, ExpertBank.empty("int8", 2, 64, 32, 32)]
    own = [getattr(built[1], n) for n in es.fc.ARRAYS]
    assert es.pin_banks(built) == sum(a.nbytes for a in own) and all(
        getattr(built[1], n) is a for n, a in zip(es.fc.ARRAYS, own))
    assert sorted(c[0] for c in rt.calls) == sorted(a.ctypes.data for a in own if a.nbytes)

    rt = StandInCudart(broken=True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    layers = sum(b is not None for b in store.banks)
    with pytest.warns(es.ExpertCacheWarning, match=rf"failed for {4 * layers} arrays \(operation not supported"):
        assert es.pin_banks(store.banks) == 0


def test_opening_the_store_pins_nothing(checkpoint_factory, tmp_path, monkeypatch):
    """Page-locking is the residency tiers' business on a GPU (llm pins their banks): the CPU
    backend's store, built or mapped, never registers a page, even with CUDA present."""
    from freetoken_py.utils import host_memory

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(host_memory, "register", lambda *a, **k: calls.append(a))
    path = private_copy(checkpoint_factory("qwen3_moe"), tmp_path)
    model = load_model(path, "float32", show_progress=False, experts="skip")
    for cache in ("off", "auto", "auto"):           # in memory, built to the file, mapped from it
        es.open_expert_store(path, model.args, model.dtype, "int8", 32, cache=cache, show_progress=False)
    assert calls == []


def test_experts_packed_in_memory_must_fit_beside_what_the_process_holds(checkpoint_factory, monkeypatch):
    """--expert-cache off keeps the packed experts in memory: more than this process can hold
    beside what it already holds is a one-line error with the fix before packing starts; with
    room, the same call builds the banks."""
    import psutil

    from freetoken_py.models import loader

    path = checkpoint_factory("qwen3_moe")
    model = load_model(path, "float32", show_progress=False, experts="skip")
    ref, _ = reference_banks(path, "int8", 32)
    packed = sum(a.nbytes for b in ref if b is not None for a in (b.w13, b.s13, b.w2, b.s2))
    count = es.LAYER_BUILDS

    def own():        # what the process holds of its own (mapped file pages left out)
        mem = psutil.Process().memory_info()
        return mem.rss - mem.shared

    monkeypatch.setattr(loader, "host_memory_bytes", lambda: own() + packed // 2)
    with pytest.raises(FreetokenError) as err:
        es.open_expert_store(path, model.args, model.dtype, "int8", 32, cache="off", show_progress=False)
    assert "\n" not in str(err.value) and "--expert-cache auto" in str(err.value) and es.LAYER_BUILDS == count
    monkeypatch.setattr(loader, "host_memory_bytes", lambda: own() + 64 * packed)
    store = es.open_expert_store(path, model.args, model.dtype, "int8", 32, cache="off", show_progress=False)
    assert_same_banks(store.banks, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a GPU machine)")
def test_cuda_registration_pins_in_place_and_a_refusal_leaves_no_error_behind():
    """On a real GPU (bench/gpu_session.sh runs it): an array is page-locked where it lies and
    copies from it arrive intact; registering it again is refused (already registered), and the
    next kernel launch does not see that refusal (host_memory.clear_cuda_error); a mapped file
    is refused without the driver being asked."""
    from freetoken_py.utils import host_memory

    a = np.arange(1 << 20, dtype=np.float32)
    assert host_memory.register(a.ctypes.data, a.nbytes, a).ok
    again = host_memory.register(a.ctypes.data, a.nbytes, a)
    assert not again.ok and again.error
    y = torch.zeros(4, device="cuda").add_(1)            # a kernel launch: its check reads the last error
    x = torch.from_numpy(a).to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(x.cpu(), torch.from_numpy(a)) and y.sum().item() == 4
    b = np.ones(1 << 20, np.float32)
    assert host_memory.register(b.ctypes.data, b.nbytes, b).ok
    assert torch.from_numpy(b).to("cuda", non_blocking=True).sum().item() == b.size
