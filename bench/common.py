"""Shared pieces of the bench scripts: the locally built benchmark model, bytes-per-token
arithmetic, the DRAM roofline from the probe, and llama.cpp (llama-cpp-python) as the peer.

Nothing here downloads weights: models are built with transformers' classes (random weights) and
converted with llama.cpp's own convert_hf_to_gguf.py from the llama-cpp-python source package.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORK = Path(os.environ.get("FREETOKEN_BENCH_DIR", REPO / "bench" / "_work"))
DEMO = REPO / "freetoken_py" / "data" / "demo_model"

# ~0.49B-parameter qwen3_moe from the issues: hidden 1024, 8 layers, 64 experts, top-8, width 256
QWEN3_05B = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=64, intermediate_size=2816, moe_intermediate_size=256,
                 num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
                 rope_theta=1e6, tie_word_embeddings=False)


def bench_args(doc: str):
    """The options every engine-level bench shares; callers add their own before parse_args()."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama-cpp", action="store_true")
    return ap


def setup(args) -> tuple[Path, list[int]]:
    """Thread budget, the benchmark checkpoint, and a seeded random prompt of --prompt-len tokens."""
    from freetoken_py.kernels import configure_threads

    configure_threads(args.threads)
    model_dir = build_qwen3_moe(WORK / "qwen3moe-0.5b-bf16")
    return model_dir, random_prompt(QWEN3_05B["vocab_size"], args.prompt_len)


def random_prompt(vocab_size: int, length: int) -> list[int]:
    """A seeded random prompt: the same token ids on every run."""
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (length,), generator=g).tolist()


def moe_setup(doc: str, layers: int, experts: int, tiny_help: str):
    """bench_args plus --precisions / --layers / --experts / --tiny, parsed, thread budget set."""
    from freetoken_py.kernels import configure_threads

    ap = bench_args(doc)
    ap.add_argument("--precisions", default="bf16,int8,int4")
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--experts", type=int, default=experts)
    ap.add_argument("--tiny", action="store_true", help=tiny_help)
    args = ap.parse_args()
    configure_threads(args.threads)
    return args


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def build_qwen3_moe(out: Path, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Random-weight checkpoint written by transformers' save_pretrained, with the demo tokenizer."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    log(f"building {out.name} (random weights, {dtype})")
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(**QWEN3_05B)
    with torch.device("cpu"):
        model = Qwen3MoeForCausalLM(cfg)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (DEMO / name).exists():
            shutil.copy(DEMO / name, out / name)
    return out


def bytes_per_token(args, bytes_per_weight: float) -> dict:
    """Weights read for one decode token: attention, router, top-k experts, lm_head (+ norms)."""
    d, hd = args.hidden_size, args.head_dim
    attn = d * hd * (2 * args.num_heads + 2 * args.num_kv_heads)
    experts = dense = router = 0
    for sparse in args.sparse_layers:
        if sparse:
            router += args.num_experts * d
            experts += args.top_k * 3 * d * args.moe_intermediate_size
        else:
            dense += 3 * d * args.intermediate_size
    weights = args.num_layers * attn + router + experts + dense + args.vocab_size * d
    return {"weights_per_token": weights, "bytes_per_token": weights * bytes_per_weight}


def dram_gbps() -> tuple[float, str]:
    """DRAM read bandwidth (all cores) from the machine profile; a quick numpy figure if unavailable."""
    try:
        from freetoken_py.hw import get_profile

        prof = get_profile(progress=False)
        return prof.figure("dram_read_all_cores").gbps, "freetoken probe (dram_read_all_cores)"
    except Exception as exc:  # the probe is optional for the bench
        import numpy as np

        buf = np.ones(256 * 2**20 // 8)
        t = time.perf_counter()
        for _ in range(4):
            buf.sum()
        return 4 * buf.nbytes / (time.perf_counter() - t) / 1e9, f"numpy single-thread sum (probe unavailable: {exc})"


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---- llama.cpp --------------------------------------------------------------------------------

def llama_cpp_source() -> Path:
    """llama.cpp's source tree as shipped in the installed llama-cpp-python's sdist (for the converter)."""
    import llama_cpp

    version = llama_cpp.__version__
    root = WORK / f"llama_cpp_python-{version}"
    if not (root / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").exists():
        WORK.mkdir(parents=True, exist_ok=True)
        log(f"fetching llama-cpp-python {version} sdist for convert_hf_to_gguf.py")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                        f"llama-cpp-python=={version}", "-d", str(WORK)], check=True)
        with tarfile.open(next(WORK.glob(f"llama_cpp_python-{version}.tar.gz"))) as tar:
            tar.extractall(WORK, filter="data")
    return root / "vendor" / "llama.cpp"


def _gguf_py() -> None:
    """Make llama.cpp's own `gguf` package (its source tree's gguf-py) importable: the one its
    converter and quantizer match, not a PyPI release that may lag behind."""
    path = str(llama_cpp_source() / "gguf-py")
    if path not in sys.path:
        sys.path.insert(0, path)


def gguf_decode_bytes(gguf: Path, top_k: int, num_experts: int) -> int:
    """Bytes llama.cpp streams per decode token from a GGUF: every tensor but the token embedding
    (one row is gathered), the routed experts at top_k / num_experts of their size."""
    _gguf_py()
    from gguf import GGUFReader

    total = 0
    for t in GGUFReader(str(gguf)).tensors:
        if t.name == "token_embd.weight":
            continue
        total += t.n_bytes * top_k // num_experts if "_exps." in t.name else t.n_bytes
    return int(total)


_CONVERT = """
import sys
sys.path.insert(0, {src!r})
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"  # synthetic tokenizer: same split regex
{prelude}
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outtype", {outtype!r}, "--outfile", {out!r}, *{extra!r}]
convert_hf_to_gguf.main()
"""


# The demo tokenizer has none of GLM's special tokens ([gMASK], <|user|>, ...) that the GLM
# converters' _set_vocab_glm looks up: write its vocabulary the plain gpt2 way instead.
GLM_VOCAB = "base.TextModel._set_vocab_glm = base.TextModel._set_vocab_gpt2"


def convert_to_gguf(model_dir: Path, outtype: str, extra: tuple[str, ...] = (), prelude: str = "") -> Path:
    """extra: more converter options (e.g. ("--no-mtp",) for a Qwen3.5 checkpoint without MTP layers);
    prelude: Python run after the converter's modules are imported and before it starts (patches
    for synthetic checkpoints, e.g. GLM_VOCAB)."""
    out = model_dir.parent / f"{model_dir.name}-{outtype}.gguf"
    if not out.exists():
        src = llama_cpp_source()
        log(f"converting {model_dir.name} to GGUF {outtype} with llama.cpp's convert_hf_to_gguf.py")
        code = _CONVERT.format(src=str(src), model=str(model_dir), outtype=outtype, out=str(out), extra=tuple(extra),
                               prelude=prelude)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if proc.returncode != 0:
            out.unlink(missing_ok=True)
            raise RuntimeError(f"convert_hf_to_gguf failed for {model_dir.name}:\n{proc.stderr[-3000:]}")
    return out


def quantize_gguf(src: Path, ftype_name: str, output_type: str | None = None) -> Path:
    """Quantize a GGUF with llama.cpp's own quantizer (e.g. ftype_name='Q4_0'). `output_type` (a
    ggml type name, e.g. 'BF16') sets the output tensor's type instead of llama.cpp's default for
    the ftype (Q6_K for Q4_0, Q8_0 for Q8_0)."""
    import ctypes

    import llama_cpp

    _gguf_py()
    import gguf

    llama_cpp_without_amx()   # before llama.cpp reads its buffer-type list
    tail = f"-{ftype_name.lower()}" + (f"-out{output_type.lower()}" if output_type else "")
    out = src.with_name(src.stem.rsplit("-", 1)[0] + f"{tail}.gguf")
    if not out.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
        if output_type:
            params.output_tensor_type = int(gguf.GGMLQuantizationType[output_type.upper()])
        params.nthread = os.cpu_count() or 2
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize failed ({rc})")
    return out


_AMX_STATE: dict = {}


def llama_cpp_without_amx() -> str | None:
    """Take the AMX buffer type out of llama.cpp's CPU extra buffer types, in this process, before a
    model is loaded: the same placement as a llama.cpp built without AMX (or run on a CPU without
    it, e.g. an AMD EPYC): repackable weights (x86: Q4_0, Q4_K, IQ4_NL, MXFP4) still go to
    CPU_REPACK, the rest to plain CPU buffers. Why: on a CPU with AMX (Intel Xeon, `amx_int8`)
    llama.cpp puts Q4_0 / Q4_1 / Q8_0 matmul weights (attention, output, dense FFN) into its AMX
    buffer, and its AMX mul_mat segfaults here (llama.cpp issue #20824, open; #16315: AMX Q4_0
    results wrong) - every Q8_0 / Q4_0 peer crashed at its first prefill. The list is a static
    std::vector in libggml-cpu (ggml_backend_cpu_get_extra_buffer_types(), read lazily by the model
    loader); its AMX entry is removed in place. Returns a note for the bench line (None: no AMX in
    this build)."""
    if "note" in _AMX_STATE:
        return _AMX_STATE["note"]
    import llama_cpp

    # the copies llama_cpp loaded (the wheel ships libggml-cpu.so, .so.0 and .so.0.25.3 as separate
    # files, so opening another name would load a second, unused copy)
    loaded = {Path(line.split()[-1]).name.split(".so")[0]: line.split()[-1]
              for line in open("/proc/self/maps") if "/llama_cpp/lib/" in line}
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    cpu, base = (ctypes.CDLL(loaded.get(n, str(lib_dir / f"{n}.so"))) for n in ("libggml-cpu", "libggml-base"))
    try:
        get = cpu._Z39ggml_backend_cpu_get_extra_buffer_typesv   # std::vector<ggml_backend_buffer_type_t> &
    except AttributeError:   # another build (symbol not exported): leave llama.cpp as it is
        _AMX_STATE["note"] = None
        return None
    get.restype = ctypes.c_void_p
    name = base.ggml_backend_buft_name
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    vec = get()
    begin, end = (ctypes.c_void_p.from_address(vec + 8 * i).value for i in range(2))
    items = [ctypes.c_void_p.from_address(begin + 8 * i).value for i in range((end - begin) // 8)]
    names = [name(b).decode() for b in items]
    keep = [b for b, n in zip(items, names) if n != "AMX"]
    note = None
    if len(keep) != len(items):
        for i, b in enumerate(keep):
            ctypes.c_void_p.from_address(begin + 8 * i).value = b
        ctypes.c_void_p.from_address(vec + 8).value = begin + 8 * len(keep)
        # the device's own NULL-terminated copy (ggml_backend_dev_get_extra_bufts, what the model
        # loader asks for; made when the CPU backend registered, i.e. already at `import llama_cpp`)
        cpu.ggml_backend_cpu_reg.restype = ctypes.c_void_p
        reg = cpu.ggml_backend_cpu_reg()
        base.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
        base.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        base.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
        base.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        fn = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(
            base.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts"))
        arr = fn(base.ggml_backend_reg_dev_get(reg, 0))
        copy = []
        while (b := ctypes.c_void_p.from_address(arr + 8 * len(copy)).value):
            copy.append(b)
        kept = [b for b in copy if name(b).decode() != "AMX"]
        for i in range(len(copy)):
            ctypes.c_void_p.from_address(arr + 8 * i).value = kept[i] if i < len(kept) else None
        note = (f"AMX buffer type removed from llama.cpp's CPU extra buffers ({names} -> "
                f"{[n for n in names if n != 'AMX']}): its AMX mul_mat segfaults here (llama.cpp #20824); "
                "weights placed as on a CPU without AMX")
        log(note)
    _AMX_STATE["note"] = note
    return note


class LlamaCppPeer:
    def __init__(self, gguf: Path, threads: int, n_ctx: int = 2048, **kw):
        """kw: more llama_cpp.Llama options (e.g. flash_attn=True; llama-cpp-python's default is off,
        llama.cpp's own tools default to auto, i.e. on for the CPU). `self.amx`: the note from
        llama_cpp_without_amx (None where the build has no AMX buffer type)."""
        from llama_cpp import Llama

        self.amx = llama_cpp_without_amx()
        opts = {"n_batch": 512, "n_ubatch": 512, "verbose": False, **kw}
        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, **opts)

    def logits(self):
        """The last evaluated token's logits (a numpy view of llama.cpp's buffer). `Llama.scores`
        is only filled with logits_all=True in llama-cpp-python 0.3.x (it samples inside llama.cpp):
        without it every row stays zero, so argmax over `scores` always gave token 0."""
        import llama_cpp
        import numpy as np

        ptr = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.llm.n_vocab(),))

    def prefill_tps(self, prompt: list[int]) -> float:
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(prompt)
        return len(prompt) / (time.perf_counter() - t)

    def decode_tps(self, prompt: list[int], num_tokens: int) -> float:
        self.llm.reset()
        self.llm.eval(prompt)
        tok = int(self.logits().argmax())
        t = time.perf_counter()
        for _ in range(num_tokens):
            self.llm.eval([tok])
            tok = int(self.logits().argmax())
        return num_tokens / (time.perf_counter() - t)

    def greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        self.llm.reset()
        self.llm.eval(prompt)
        out = []
        for _ in range(num_tokens):
            tok = int(self.logits().argmax())
            out.append(tok)
            self.llm.eval([tok])
        return out


    def forced(self, prompt: list[int], tokens: list[int]):
        """Logits [1 + len(tokens), V] (torch fp32) at the prompt's last position and after each of
        `tokens`, fed one at a time (teacher forcing)."""
        import numpy as np
        import torch

        self.llm.reset()
        self.llm.eval(prompt)
        rows = [np.array(self.logits())]
        for tok in tokens:
            self.llm.eval([tok])
            rows.append(np.array(self.logits()))
        return torch.tensor(np.stack(rows)).float()


# ---- llama.cpp's KV state, written for a context it never prefilled ---------------------------

def _kv_parse(buf: memoryview, off: int) -> tuple[dict, int]:
    """One llama_kv_cache's part of a sequence state (llama-kv-cache.cpp state_write): stream count,
    cell count, per cell (pos, n_seq_id, seq ids), then v_trans, n_layer and each layer's K rows.
    Only caches without V tensors (MLA: the latent is the key) are handled."""
    import numpy as np

    def u32(o):
        return int(np.frombuffer(buf, np.uint32, 1, o)[0]), o + 4

    n_stream, off = u32(off)
    if n_stream != 1:
        raise RuntimeError(f"llama.cpp state: {n_stream} KV streams (expected 1)")
    count, off = u32(off)
    for _ in range(count):
        n_seq = int(np.frombuffer(buf, np.uint32, 1, off + 4)[0])
        off += 8 + 4 * n_seq
    v_trans, off = u32(off)
    n_layer, off = u32(off)
    layers = []
    for _ in range(n_layer):
        ktype = int(np.frombuffer(buf, np.int32, 1, off)[0])
        row = int(np.frombuffer(buf, np.uint64, 1, off + 4)[0])
        off += 12
        layers.append((ktype, row, np.frombuffer(buf, np.uint8, row * count, off).reshape(count, row)))
        off += row * count
    return {"count": count, "v_trans": v_trans, "layers": layers}, off


def _kv_write(kv: dict, cells: int, seq_id: int = 0) -> list[bytes]:
    """That cache's state for `cells` cells at positions 0..cells-1, each layer's rows tiled from
    the parsed ones (the values a prefill would leave, in scale)."""
    import numpy as np

    meta = np.empty((cells, 3), np.int32)
    meta[:, 0], meta[:, 1], meta[:, 2] = np.arange(cells), 1, seq_id
    out = [np.array([1, cells], np.uint32).tobytes(), meta.tobytes(),
           np.array([kv["v_trans"], len(kv["layers"])], np.uint32).tobytes()]
    for ktype, row, rows in kv["layers"]:
        out += [np.array([ktype], np.int32).tobytes(), np.array([row], np.uint64).tobytes(),
                rows[np.arange(cells) % rows.shape[0]].tobytes()]
    return out


def llama_cpp_state_bytes(peer) -> bytes:
    import ctypes

    import llama_cpp

    size = llama_cpp.llama_state_seq_get_size(peer.llm.ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    n = llama_cpp.llama_state_seq_get_data(peer.llm.ctx, buf, size, 0)
    if n != size:
        raise RuntimeError(f"llama_state_seq_get_data wrote {n} of {size} bytes")
    return bytes(buf)


def llama_cpp_fill_context(peer, seed: list[int], cells: int, state: bytes | None = None) -> dict:
    """Put `cells` tokens into llama.cpp's KV cache without prefilling them: prefill `seed` (its
    real prefill), read the sequence state, write it back with the rows tiled to `cells` cells at
    positions 0..cells-1 (every cache of the model: for GLM-DSA the MLA latents and the indexer
    keys), and set llama-cpp-python's token count so the next eval() decodes at position `cells`.
    `state`: a seed state read earlier (skips the seed prefill). Returns the seed state, the KV
    bytes per cell and the cache's own position count after the write (`pos_max` + 1)."""
    import ctypes

    import llama_cpp

    if state is None:
        peer.llm.reset()
        peer.llm.eval(seed)
        state = llama_cpp_state_bytes(peer)
    view = memoryview(state)
    caches, off = [], 8                                   # magic u32 + seq id i32
    while off < len(view):
        kv, off = _kv_parse(view, off)
        caches.append(kv)
    if off != len(view):
        raise RuntimeError("llama.cpp state: unexpected layout (parsed past the end)")
    blob = state[:8] + b"".join(b for kv in caches for b in _kv_write(kv, cells))
    peer.llm.reset()
    mem = llama_cpp.llama_get_memory(peer.llm.ctx)
    llama_cpp.llama_memory_clear(mem, True)
    src = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
    if llama_cpp.llama_state_seq_set_data(peer.llm.ctx, src, len(blob), 0) != len(blob):
        raise RuntimeError(f"llama_state_seq_set_data refused a {cells}-cell state")
    peer.llm.n_tokens = cells
    held = int(llama_cpp.llama_memory_seq_pos_max(mem, 0)) + 1
    if held != cells:
        raise RuntimeError(f"llama.cpp holds {held} positions after writing {cells}")
    return {"state": state, "kv_bytes_per_token": sum(r for kv in caches for _, r, _ in kv["layers"]),
            "positions_held": held, "caches": len(caches)}


# ---- agreement: ours and llama.cpp (and a reference) on the same weights ------------------------

def ours_drive(llm, prompt: list[int], steps: int):
    """Our greedy tokens and the logits at each sampled position (the prompt's last, then `steps`
    cached decode steps), as tests/parity_util.drive records them."""
    import torch

    from freetoken_py.core import SamplingParams

    req = llm.add_request(prompt, SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
    rows = []
    while len(req.output_token_ids) <= steps:
        logits = llm.runner.forward_batch(llm.scheduler.schedule())
        if len(logits):
            rows.append(logits[0].float())
            req.output_token_ids.append(int(logits[0].argmax()))
    while not req.finished:   # let the scheduler retire the request
        llm.step()
    return list(req.output_token_ids[:steps + 1]), torch.stack(rows)


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy runs share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def agreement(llm, peer, prompt: list[int], steps: int) -> dict:
    """Ours vs llama.cpp along our greedy path: max |logit difference| (and our logits' std, for
    scale), the positions where both pick the same token (llama.cpp teacher-forced on ours), and
    the greedy tokens both runs share from the start."""
    tokens, ours = ours_drive(llm, prompt, steps)
    theirs = peer.forced(prompt, tokens[:-1])
    own = peer.greedy(prompt, steps + 1)
    diff = (ours - theirs).abs()
    return {"steps": steps + 1, "max_abs_logit_diff": round(diff.max().item(), 4),
            "first_step_max_abs_logit_diff": round(diff[0].max().item(), 4),
            "logit_std": round(ours.std().item(), 4),
            "argmax_equal_forced": int((ours.argmax(-1) == theirs.argmax(-1)).sum()),
            "greedy_shared_prefix": shared_prefix(tokens, own)}


def cpu_fields() -> dict:
    """The CPU's name and the SIMD path freetoken's kernels take on it, for every bench line."""
    import platform

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    try:
        from freetoken_py.kernels import _simd
        simd = "avx512" if _simd.HAS_AVX512 else ("avx2" if _simd.HAS_AVX2 else "portable")
    except Exception as exc:  # noqa: BLE001 - the name still goes out
        simd = f"unknown ({exc})"
    return {"cpu": name, "isa": simd}


# ---- engine adapters: (prefill_tps(prompt), decode_tps(prompt, n)) -----------------------------

def freetoken_timers(llm):
    from freetoken_py.core import SamplingParams

    def prefill(prompt):
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))[0]
        return len(prompt) / out.ttft_s

    def decode(prompt, n):
        out = llm.generate([prompt], SamplingParams(max_tokens=n + 1, temperature=0, ignore_eos=True))[0]
        return n / (out.total_s - out.ttft_s)

    return prefill, decode


def transformers_timers(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()

    def gen(prompt, new):
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0)
        return time.perf_counter() - t

    def prefill(prompt):
        return len(prompt) / gen(prompt, 1)

    def decode(prompt, n):
        return n / (gen(prompt, n + 1) - gen(prompt, 1))

    return prefill, decode


def llama_cpp_timers(gguf: Path, threads: int):
    peer = LlamaCppPeer(gguf, threads)
    return peer.prefill_tps, peer.decode_tps



def llama_cpp_seq_state(peer, vocab_size: int) -> dict:
    """llama.cpp's sequence-state bytes after 64 and 192 prompt tokens (llama_state_seq_get_size):
    the difference per token is its KV cache per token, what is left at zero tokens its fixed
    (recurrent + conv) state."""
    import llama_cpp

    prompt, sizes = random_prompt(vocab_size, 192), []
    for n in (64, 192):
        peer.llm.reset()
        peer.llm.eval(prompt[:n])
        sizes.append(int(llama_cpp.llama_state_seq_get_size(peer.llm.ctx, 0)))
    per_token = (sizes[1] - sizes[0]) / 128
    return {"state_bytes_per_request": int(round(sizes[0] - 64 * per_token)), "kv_bytes_per_token": round(per_token),
            "seq_state_bytes_at_64": sizes[0]}


def time_rounds(engines: dict, prompt: list[int], n: int, rounds: int, digits: int = 1,
                dram: list[float] | None = None) -> dict:
    """Warm-up (numba compile / page-in: one full untimed round), then interleaved rounds over every engine's
    (prefill, decode) timers: {name: {"prefill": [tok/s], "decode": [tok/s]}}. `dram`: a list that
    gets one DRAM read sample (GB/s, all cores, `round_dram_gbps`) after each round, so a reader can
    see the machine's bandwidth move between rounds (a shared VM's swung 35 <-> 55 GB/s within a
    minute, docs/performance.md)."""
    short = prompt[:16]
    for prefill, decode in engines.values():   # a whole untimed round: every engine's first timed round
        prefill(prompt)                        # was its slowest (Xeon 6 and Zen 4 runs), e.g. pages of
        decode(short, n)                       # experts first touched there
    samples = {name: {"prefill": [], "decode": []} for name in engines}
    for r in range(rounds):
        for name, (prefill, decode) in engines.items():
            samples[name]["decode"].append(decode(short, n))
            samples[name]["prefill"].append(prefill(prompt))
            log(f"round {r} {name}: decode {samples[name]['decode'][-1]:.{digits}f} tok/s, "
                f"prefill {samples[name]['prefill'][-1]:.1f} tok/s")
        if dram is not None:
            dram.append(round_dram_gbps())
            log(f"round {r} DRAM read {dram[-1]:.1f} GB/s")
    return samples


_DRAM_BUF: list = []


def round_dram_gbps() -> float:
    """One all-core DRAM read sample (freetoken_py.hw.measure_dram, a 512 MiB buffer kept for the
    process: >> any L3 here, small beside the engines), the median of two passes."""
    from freetoken_py.hw.measure_dram import make_buffer, read_samples
    from freetoken_py.kernels.threads import configured_threads

    if not _DRAM_BUF:
        _DRAM_BUF.append(make_buffer(512 << 20))
    return statistics.median(read_samples(_DRAM_BUF[0], configured_threads(), 2, 5.0))


def paired_ratio(ours: list[float], peer: list[float]) -> float | None:
    """Median over rounds of ours / peer within each round: with both timed seconds apart in one
    round, the machine's bandwidth drift between rounds cancels (the ratio of the two medians
    can pair one engine's fast round with the other's slow one)."""
    pairs = [a / b for a, b in zip(ours, peer) if b > 0]
    return round(median(pairs), 3) if pairs else None


def peer_fields(ours: dict, peer: dict, kind: str, peer_bpt: int, digits: int = 2, samples: bool = True) -> dict:
    """llama.cpp's figures beside ours (samples as from time_rounds) and the freetoken / llama.cpp
    ratios, for a result row; decode rounded to `digits`, prefill to one fewer."""
    dec, pre = median(ours["decode"]), median(ours["prefill"])
    pd, pp = median(peer["decode"]), median(peer["prefill"])
    lc = {"type": kind, "decode_tps": round(pd, digits), "prefill_tps": round(pp, digits - 1),
          "bytes_per_token": peer_bpt, "decode_gbps": round(pd * peer_bpt / 1e9, 2)}
    if samples:
        lc["decode_samples"] = [round(x, digits) for x in peer["decode"]]
    return {"llama_cpp": lc, "ratio_decode": round(dec / pd, 3), "ratio_prefill": round(pre / pp, 3),
            "paired_ratio_decode": paired_ratio(ours["decode"], peer["decode"]),
            "paired_ratio_prefill": paired_ratio(ours["prefill"], peer["prefill"])}


def emit(result: dict, out: Path | None = None) -> int:
    """Print the bench's one JSON line (and write it to `out` too, when given); returns 0."""
    line = json.dumps(result)
    print(line, flush=True)
    if out:
        Path(out).write_text(line + "\n")
    return 0


def residency_decode(llm, ex, prompt: list[int], n: int) -> dict:
    """Greedy decode of n tokens after the prompt on an LLM with the residency tiers (`ex` its
    executor). Returns the decode steps' wall seconds, n, the trace step where decoding starts (0
    when routing is not recorded) and every telemetry counter's change over the decode steps only
    (prefill excluded)."""
    from freetoken_py.core import SamplingParams

    req = llm.add_request(prompt, SamplingParams(max_tokens=n + 1, temperature=0, ignore_eos=True))
    while not req.output_token_ids:                         # prefill (in chunks if long) + the first token
        llm.step()
    first_decode_step = len(llm.routing_recorder.trace.steps) if llm.routing_recorder else 0
    ex.flush_timing()                                       # GPU-clock times of the calls so far
    before = ex.telemetry.totals()
    t0 = time.perf_counter()
    while not req.finished:
        llm.step()
    seconds = time.perf_counter() - t0
    ex.flush_timing()
    after = ex.telemetry.totals()
    diff = {f: getattr(after, f) - getattr(before, f) for f in after.__dataclass_fields__}
    return {"seconds": seconds, "tokens": n, "first_decode_step": first_decode_step, **diff}
