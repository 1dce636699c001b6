"""`--model ORG/NAME` against a stand-in hub over real HTTP on 127.0.0.1 (tests/hub_stub.py:
the routes and headers huggingface_hub uses), HF_ENDPOINT pointing at it, HF_HOME in a tmp dir.

References: the bundled demo model run from its own directory (same token ids), the stub's
request log (a resumed Range GET after a cut; no request when offline; header-only reads of a
repo declared tens of GB), the local header reader (`probe --model DIR` on the same files:
same bytes, same plans), and checkpoints `freetoken quantize` writes (the quantised variant's
estimated size). Bad input: one line on stderr, exit code 2.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hub_stub import Repo, StubHub, lazy_safetensors, repo_from_dir

DEMO = Path(__file__).resolve().parents[1] / "freetoken_py" / "data" / "demo_model"
PROMPT = "def main("
CUT_AT = 17_000_000      # past huggingface_hub's first 10 MiB chunk: the retry resumes from there


def huge_repo(layers: int = 48, experts: int = 128, hidden: int = 2048, inter: int = 768,
              shards: int = 4) -> Repo:
    """A Qwen3-30B-A3B-shaped qwen3_moe (~58 GiB of bf16 tensors) whose shards hold a header only."""
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
           "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
           "num_experts": experts, "num_experts_per_tok": 8, "moe_intermediate_size": inter,
           "intermediate_size": 6144, "vocab_size": 151936, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}
    bf = "BF16"
    per_layer = []
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {p + "self_attn.q_proj.weight": (bf, [4096, hidden]), p + "self_attn.k_proj.weight": (bf, [512, hidden]),
             p + "self_attn.v_proj.weight": (bf, [512, hidden]), p + "self_attn.o_proj.weight": (bf, [hidden, 4096]),
             p + "self_attn.q_norm.weight": (bf, [128]), p + "self_attn.k_norm.weight": (bf, [128]),
             p + "input_layernorm.weight": (bf, [hidden]), p + "post_attention_layernorm.weight": (bf, [hidden]),
             p + "mlp.gate.weight": (bf, [experts, hidden])}
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            t |= {q + "gate_proj.weight": (bf, [inter, hidden]), q + "up_proj.weight": (bf, [inter, hidden]),
                  q + "down_proj.weight": (bf, [hidden, inter])}
        per_layer.append(t)
    files: dict = {"config.json": json.dumps(cfg).encode()}
    weight_map = {}
    step = layers // shards
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {k: v for t in per_layer[s * step:(s + 1) * step] for k, v in t.items()}
        if s == 0:
            tensors["model.embed_tokens.weight"] = (bf, [151936, hidden])
        if s == shards - 1:
            tensors |= {"model.norm.weight": (bf, [hidden]), "lm_head.weight": (bf, [151936, hidden])}
        files[name] = lazy_safetensors(tensors)
        weight_map |= {k: name for k in tensors}
    files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    return Repo(files)


@pytest.fixture(scope="module")
def hub():
    demo = repo_from_dir(DEMO)
    pickle_only = {k: v for k, v in demo.files.items() if not k.endswith(".safetensors")}
    pickle_only["pytorch_model.bin"] = b"\x80\x02not really a pickle"
    vast = {"config.json": demo.files["config.json"],
            "model.safetensors": lazy_safetensors({"w": ("BF16", [2**25, 2**24])})}   # 1 PiB declared
    repos = {"org/tiny": demo, "org/tiny2": repo_from_dir(DEMO), "org/killed": repo_from_dir(DEMO), "org/gated": Repo(dict(demo.files), gated=True),
             "org/pickle": Repo(pickle_only), "org/vast": Repo(vast), "org/huge": huge_repo()}
    with StubHub(repos) as stub:
        yield stub


def env_for(hub: StubHub, home: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    return {**env, "HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1", **extra}


def cli(env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "freetoken_py", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def tokens(env: dict, model: str) -> list[int]:
    proc = cli(env, "run", "--model", model, "-n", "8", "-t", "0", "--json", PROMPT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)["token_ids"]


def one_line_error(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("freetoken: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert all(w in errors[0] for w in words), errors[0]
    return errors[0]


def test_run_by_hub_id_downloads_resumes_and_matches_the_local_dir(hub, tmp_path):
    env = env_for(hub, tmp_path / "hf")
    hub.cut_once["org/tiny/model.safetensors"] = CUT_AT
    n_before = len(hub.log)
    assert tokens(env, "org/tiny") == tokens(env, str(DEMO))
    ranges = hub.gets("org/tiny", "model.safetensors")
    # the cut GET, then one resumed from where the received whole chunks end (not from 0)
    assert ranges[0] == "" and len(ranges) == 2 and ranges[1].startswith("bytes=") and ranges[1] != "bytes=0-"
    assert 0 < int(ranges[1][6:-1]) <= CUT_AT
    snap = next((tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots").iterdir())
    for f in DEMO.iterdir():
        if f.is_file():
            assert hashlib.sha256((snap / f.name).read_bytes()).digest() == hashlib.sha256(f.read_bytes()).digest()
    fetched = {p.rsplit("/", 1)[1] for m, p, _ in hub.log[n_before:] if m == "GET" and "/resolve/" in p}
    assert fetched == {f.name for f in DEMO.iterdir() if f.is_file()}
    # offline: the cache alone, not one request
    n = len(hub.log)
    assert tokens(env_for(hub, tmp_path / "hf", HF_HUB_OFFLINE="1"), "org/tiny") == tokens(env, str(DEMO))
    assert len(hub.log) == n


def test_local_path_wins_over_a_hub_id(hub, tmp_path):
    (tmp_path / "org").mkdir()
    shutil.copytree(DEMO, tmp_path / "org" / "tiny")
    env = env_for(hub, tmp_path / "hf")
    n = len(hub.log)
    proc = subprocess.run([sys.executable, "-c", "from freetoken_py.hub import resolve_model; "
                           "print(resolve_model('org/tiny'))"], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0 and Path(proc.stdout.strip()) == Path("org/tiny") and len(hub.log) == n


@pytest.mark.parametrize("model, extra, words", [
    ("org/nope", {}, ["org/nope", "no such model"]),
    ("org/gated", {}, ["org/gated", "gated", "HF_TOKEN"]),
    ("org/pickle", {}, ["org/pickle", "pytorch_model.bin", "safetensors"]),
    ("org/tiny@v9", {}, ["org/tiny@v9", "no revision 'v9'"]),
    ("org/tiny2", {"HF_ENDPOINT": "http://127.0.0.1:9"}, ["org/tiny2", "cannot be reached"]),
    ("org/tiny2", {"HF_HUB_OFFLINE": "1"}, ["org/tiny2", "not in the hub cache", "HF_HUB_OFFLINE"]),
    ("org/vast", {}, ["org/vast", "the download needs", "GiB free"]),
    ("org tiny", {}, ["org tiny", "not a hub id"]),
])
def test_bad_hub_input_is_one_line_exit_2(hub, tmp_path, model, extra, words):
    proc = cli(env_for(hub, tmp_path / "hf", **extra), "run", "--model", model, "-n", "1", "x")
    one_line_error(proc, *words)
    assert not [p for m, p, _ in hub.log if m == "GET" and (p.endswith(".bin") or p.startswith("/org/vast/resolve/")
                                                           and p.endswith(".safetensors"))]
    assert not hub.body_reads


def test_a_partial_snapshot_is_never_used(hub, tmp_path):
    """org/vast's config is cached before the disk check refuses its weights: offline, that
    snapshot is refused (one line), not loaded."""
    home = tmp_path / "hf"
    one_line_error(cli(env_for(hub, home), "run", "--model", "org/vast", "-n", "1", "x"), "the download needs")
    assert list(home.glob("hub/models--org--vast/snapshots/*/config.json"))
    one_line_error(cli(env_for(hub, home, HF_HUB_OFFLINE="1"), "run", "--model", "org/vast", "-n", "1", "x"),
                   "org/vast", "lacks model.safetensors", "HF_HUB_OFFLINE")


_REPORT = """
import dataclasses, json, sys
sys.path.insert(0, {tests!r})
from test_hw_profile import fig, machine
from freetoken_py.hw.report import build_report, read_model
prof = machine()
prof = dataclasses.replace(prof, memory=dataclasses.replace(prof.memory, available_bytes=int(sys.argv[2])),
                           figures={{n: fig(n, g) for n, g in (("dram_read_all_cores", 50.0), ("vram_d2d", 1000.0),
                                    ("pcie_h2d_pinned_concurrent", 20.0), ("cpu_expert_bf16_concurrent", 30.0))}})
model, hub = read_model(sys.argv[1])
print(json.dumps(build_report(prof, model, hub)["model"]))
"""


def report(env: dict, spec: str, ram: int = 50 * 2**30) -> dict:
    code = _REPORT.format(tests=str(Path(__file__).parent))
    proc = subprocess.run([sys.executable, "-c", code, spec, str(ram)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_remote_probe_equals_the_local_probe_on_the_same_files(hub, tmp_path):
    env = env_for(hub, tmp_path / "hf")
    n = len(hub.log)
    remote, local = report(env, "org/tiny2"), report(env, str(DEMO))
    assert hub.gets("org/tiny2", "model.safetensors") == ["bytes=0-99999"]     # its header, one range read
    # the config files are in the cache now; the weights are what `run` would still fetch
    assert remote.pop("hub")["download_bytes"] == (DEMO / "model.safetensors").stat().st_size
    assert local.pop("hub") is None
    assert remote.pop("model_dir").startswith("org/tiny2@") and local.pop("model_dir") == str(DEMO)
    assert remote == local and remote["plans"][0]["tokens_per_s"] > 0


def test_probe_of_a_huge_repo_reads_headers_only(hub, tmp_path):
    env = env_for(hub, tmp_path / "hf")
    repo = hub.repos["org/huge"]
    declared = sum(d.size for f, d in repo.files.items() if f.endswith(".safetensors"))
    n = len(hub.log)
    data = report(env, "org/huge", ram=20 * 2**30)
    assert not hub.body_reads
    reads = [(p, r) for m, p, r in hub.log[n:] if m == "GET" and p.endswith(".safetensors")]
    assert reads and all(r.startswith("bytes=") for _, r in reads)
    for p, r in reads:   # every byte read lies inside that shard's stored header
        end = int(r.split("-")[1])
        assert end < len(repo.files[p.rsplit("/", 1)[1]].prefix) or r == "bytes=0-99999"
    header_bytes = sum(len(d.prefix) for f, d in repo.files.items() if f.endswith(".safetensors"))
    assert data["total_bytes"] == declared - header_bytes > 50 * 2**30
    assert data["hub"]["download_bytes"] == declared
    cpu = data["plans"][0]
    assert cpu["feasible"] and cpu["tokens_per_s"] == pytest.approx(50e9 / data["per_token_bytes"])
    # 58 GiB of bf16 does not fit 20 GiB of RAM + 29 GiB of VRAM; fp8 (~29 GiB) does
    assert not data["fit"]["fits_memory"] and data["fit"]["variant"]["format"] == "fp8"


@pytest.mark.parametrize("to", ["fp8", "int4"])
def test_the_variant_estimate_matches_what_quantize_writes(tmp_path, to):
    from freetoken_py.hw.fit import VARIANTS, variant
    from freetoken_py.hw.model_bytes import read_model_bytes
    from freetoken_py.loading.quantize import quantize_checkpoint

    out = quantize_checkpoint(DEMO, tmp_path / to, to, show_progress=False)
    real = read_model_bytes(out)
    _, per_weight, dtype = next(v for v in VARIANTS if v[0] == to)
    est = variant(read_model_bytes(DEMO), to, per_weight, dtype)
    assert est.total_bytes == pytest.approx(real.total_bytes, rel=0.01)
    assert est.per_token_bytes == pytest.approx(real.per_token_bytes, rel=0.01)


_SEED_PROFILE = """
import time
from freetoken_py.hw import registry
from freetoken_py.hw.profile import PROFILE_VERSION, Figure, HardwareProfile, profile_path, save_profile
from freetoken_py.hw.sysinfo import collect_cpu, collect_gpus, collect_memory
cpu, mem, gpu = collect_cpu(), collect_memory(), collect_gpus()
ctx = registry.ProbeContext(cpu, mem, gpu)
probes, unavailable = registry.default_probes(ctx)
figs = {n: Figure.from_samples(n, [1e-3, 10.0, 1e6], "seeded", {}, 0.0) for p in probes for n in p.names}
prof = HardwareProfile(PROFILE_VERSION, cpu, mem, gpu, figs, dict(unavailable), time.time())
save_profile(prof, profile_path(prof.key))
ctx.close()
"""


def test_probe_cli_by_hub_id(hub, tmp_path):
    """`freetoken probe --model ORG/NAME --json` end to end. The machine's cached profile is
    seeded with 10 GB/s figures whose recorded spread no quick re-check leaves (so nothing is
    measured again in full, and the roofline is known)."""
    env = env_for(hub, tmp_path / "hf", FREETOKEN_CACHE_DIR=str(tmp_path / "ft"))
    seeded = subprocess.run([sys.executable, "-c", _SEED_PROFILE], env=env, capture_output=True, text=True, timeout=120)
    assert seeded.returncode == 0, seeded.stderr[-2000:]
    one_line_error(cli(env, "probe", "--model", "org/nope"), "org/nope", "no such model")
    proc = cli(env, "probe", "--model", "org/huge", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    model = data["model"]
    assert data["profile"]["revalidation"]["remeasured"] == []
    assert model["total_bytes"] > 50 * 2**30 and model["hub"]["repo"] == "org/huge" and not hub.body_reads
    assert model["plans"][0]["tokens_per_s"] == pytest.approx(10e9 / model["per_token_bytes"])
    assert any(n.startswith("Download: ") for n in data["notes"])


def test_serve_names_a_hub_model_by_its_repo_id(tmp_path, monkeypatch):
    """The snapshot folder is named after a commit; /v1/models reports the repo id instead."""
    from freetoken_py.cli import _hub_name

    monkeypatch.chdir(tmp_path)
    assert _hub_name("org/tiny@v1") == "org/tiny" and _hub_name(None) is None
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    assert _hub_name("org/tiny") is None          # a directory of that name wins: its folder name is used


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def test_quantize_by_hub_id_writes_what_quantize_of_the_directory_writes(hub, tmp_path):
    import torch

    env = env_for(hub, tmp_path / "hf")
    for src, out in (("org/tiny2", tmp_path / "hub_q"), (str(DEMO), tmp_path / "dir_q")):
        proc = cli(env, "quantize", "--to", "int4", src, str(out))
        assert proc.returncode == 0, proc.stderr[-2000:]
    from_hub, from_dir = _tensors(tmp_path / "hub_q"), _tensors(tmp_path / "dir_q")
    assert from_hub.keys() == from_dir.keys() and any(k.endswith("weight_packed") for k in from_hub)
    assert all(torch.equal(from_hub[k], from_dir[k]) for k in from_hub)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hub_q" / name).read_bytes() == (tmp_path / "dir_q" / name).read_bytes(), name
    one_line_error(cli(env, "quantize", "--to", "int4", "org/pickle", str(tmp_path / "p")), "org/pickle", "pickle")


def test_eval_kld_by_hub_id_equals_eval_of_the_directory(hub, tmp_path):
    env = env_for(hub, tmp_path / "hf")
    rows = []
    for model in ("org/tiny2", str(DEMO)):
        proc = cli(env, "eval", "kld", "--model", model, "--expert-dtype", "int8", "--window", "32",
                   "--windows", "2", "--threads", "1", "--json")
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    from_hub, from_dir = rows
    assert set(from_hub) == set(from_dir)
    differ = {k for k in from_hub if from_hub[k] != from_dir[k]}
    assert differ <= {"model", "against", "seconds"}, {k: (from_hub[k], from_dir[k]) for k in differ}
    assert from_hub["mean_kld"] > 0   # int8 experts against the model's own precision: a real difference
    one_line_error(cli(env, "eval", "kld", "--model", "org/nope", "--json"), "org/nope", "no such model")


def test_a_killed_download_is_never_used_and_the_next_run_completes_it(hub, tmp_path):
    """The process is killed (SIGKILL) mid-transfer of the weights: the cache keeps an incomplete
    blob, no snapshot file; offline, that snapshot is refused in one line; online, the next run
    fetches the file again and gives the local directory's tokens from a byte-identical file.
    (huggingface_hub >= 2 downloads into a temp file unique to the process, so a later process
    refetches from 0 rather than resuming, and the killed one's temp file stays behind, unused.)"""
    import time

    home = tmp_path / "hf"
    env = env_for(hub, home)
    hub.stall_once["org/killed/model.safetensors"] = CUT_AT
    hub.stalled.clear()
    hub.release.clear()
    n_before = len(hub.log)
    proc = subprocess.Popen([sys.executable, "-m", "freetoken_py", "run", "--model", "org/killed", "-n", "8", "-t",
                             "0", "--json", PROMPT], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    blobs = home / "hub" / "models--org--killed" / "blobs"
    try:
        assert hub.stalled.wait(120), "the weights' transfer never started"
        deadline = time.monotonic() + 60       # until huggingface_hub has written its first 10 MiB chunk
        while not [p for p in blobs.glob("*.incomplete") if p.stat().st_size >= 10 * 2**20]:
            assert time.monotonic() < deadline and proc.poll() is None, "no partial blob written"
            time.sleep(0.05)
        proc.kill()
        proc.wait(30)
    finally:
        hub.release.set()
    (partial,) = blobs.glob("*.incomplete")
    written = partial.stat().st_size
    assert 0 < written <= CUT_AT < (DEMO / "model.safetensors").stat().st_size
    assert not list(home.glob("hub/models--org--killed/snapshots/*/model.safetensors"))
    one_line_error(cli(env_for(hub, home, HF_HUB_OFFLINE="1"), "run", "--model", "org/killed", "-n", "1", "x"),
                   "org/killed", "lacks model.safetensors")
    assert tokens(env, "org/killed") == tokens(env, str(DEMO))
    first, *rest = [r for m, p, r in hub.log[n_before:]
                    if m == "GET" and p.startswith("/org/killed/resolve/") and p.endswith("/model.safetensors")]
    assert first == "" and len(rest) == 1                       # the killed GET, then one more
    assert rest[0] == "" or 0 < int(rest[0][6:-1]) <= written   # a refetch, or a resume from what was on disk
    (snap,) = home.glob("hub/models--org--killed/snapshots/*/model.safetensors")
    assert snap.read_bytes() == (DEMO / "model.safetensors").read_bytes()
    assert [(p, p.stat().st_size) for p in blobs.glob("*.incomplete")] in ([], [(partial, written)])
