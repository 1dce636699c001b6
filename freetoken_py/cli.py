"""Command-line entry point. Thin: parse options, build a config, call one entry point.

Heavy imports (torch, numba, transformers) happen inside the commands, so `freetoken --help`
stays fast.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from freetoken_py.errors import FreetokenError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="freetoken: run Mixture-of-Experts models on one machine.",
    pretty_exceptions_enable=False,
)

DEMO_MODEL = Path(__file__).parent / "data" / "demo_model"


def _resolve_model(model: Optional[str], flag: str = "--model") -> Path:
    """--model: a checkpoint directory, or a hub id ORG/NAME[@REV] (downloaded into the hub cache
    when missing; a path that exists wins); none: the bundled demo model."""
    if model is None:
        if not (DEMO_MODEL / "config.json").exists():
            raise FreetokenError(f"the bundled demo model is missing from {DEMO_MODEL}; pass --model DIR")
        print("freetoken: using the bundled demo model (a tiny qwen3_moe trained on Python's standard "
              "library; pass --model DIR or ORG/NAME for a real checkpoint)", file=sys.stderr)
        return DEMO_MODEL
    from freetoken_py.hub import resolve_model

    return resolve_model(model, flag)


_MODEL_HELP = "Checkpoint directory or hub id ORG/NAME or ORG/NAME@REV (default: the bundled demo model)."


def _hub_name(model: Optional[str]) -> Optional[str]:
    """The repo id a hub --model is served as (its snapshot folder is named after a commit)."""
    if model is None or Path(model).expanduser().exists():
        return None
    from freetoken_py.hub import HubRef, parse_spec

    ref = parse_spec(model)
    return ref.repo if isinstance(ref, HubRef) else None


# The expert residency options `run` and `serve` share (one definition, one help text).
_EMULATE_GPU = typer.Option(None, "--emulate-gpu", help="Run the expert residency tiers on an EMULATED accelerator "
                            "with this hardware profile (rtx4060-laptop-8g, rtx4090, rtx5090, rtx-pro-6000); times "
                            "come from the profile. Telemetry: run --stats, serve /v1/freetoken/stats.")
_GPU_EXPERTS = typer.Option(False, "--gpu-experts", help="Run the expert residency tiers on this machine's CUDA GPU "
                            "(VRAM slots, PCIe streaming, CPU tier), planned with its measured profile "
                            "(freetoken probe).")
_VRAM_BUDGET = typer.Option(0.0, "--vram-budget", min=0.0,
                            help="GB of expert slots for the residency tiers (0 = with --gpu-experts, the VRAM "
                            "the dense weights and KV cache leave, less 1 GiB or a tenth of the card if "
                            "more; emulated, half the experts).")
_RESIDENCY_POLICY = typer.Option("ours", "--residency-policy", help="ours, lru or static.")
_KV_SCALES = typer.Option(None, "--kv-scales", help="--kv-dtype fp8: JSON cache of the calibrated per-head scales "
                          "(read when it exists, else calibrated on the shipped text and written).")
_PREFIX_SNAPSHOTS = typer.Option(0, "--prefix-snapshots",
                                 help="Hybrid (Gated DeltaNet) models: recurrent-state snapshot slots kept in the "
                                 "prefix cache, each one request's whole state (0 = auto: a quarter of the KV budget, "
                                 "2 to 4 per sequence; with --kv-cache-gb they come out of it). Other models: ignored.")
_SNAPSHOT_EVERY = typer.Option(0, "--snapshot-every-pages",
                               help="Hybrid models: pages between periodic state snapshots of a long prefill "
                               "(0 = auto: where a snapshot's bytes equal the K/V of the tokens it saves; the "
                               "prompt's last page and the decode position are snapshotted anyway).")
# options `run` and `serve` share (one definition, one help text)
_DTYPE = typer.Option("auto", "--dtype", help="Compute dtype: auto, float32, bfloat16, float16.")
_MAX_MODEL_LEN = typer.Option(0, "--max-model-len", min=0, help="Context limit (0 = the model's).")
_KV_CACHE_GB = typer.Option(0.0, "--kv-cache-gb", min=0.0, help="KV cache size (0 = auto).")
_BACKEND = typer.Option("auto", "--backend", help="auto, cpu (numba kernels) or torch (reference).")
_EXPERT_DTYPE = typer.Option("auto", "--expert-dtype",
                             help="cpu backend and the residency tiers: expert weights as auto (as loaded), "
                             "bf16, fp32, int8, int4.")
_DENSE_DTYPE = typer.Option("auto", "--dense-dtype",
                            help="cpu backend: attention/router/lm_head weights as auto, bf16, fp32, int8, "
                            "int4 (router and lm_head stay int8).")
_EXPERT_CACHE = typer.Option("auto", "--expert-cache", help="cpu backend / --expert-dtype: auto (map the packed-expert cache "
                             "file, else build and write it), off, or rebuild.")
_THREADS = typer.Option(0, "--threads", min=0, help="CPU threads for numba and torch (0 = all cores).")
_PREFILL_EXPERT_DTYPE = typer.Option("auto", "--prefill-expert-dtype",
                                     help="cpu backend: experts of prefill chunks as auto (= --expert-dtype), bf16, "
                                     "fp32 or int8, from a second copy mapped from its cache file; decode steps keep "
                                     "--expert-dtype (e.g. --expert-dtype int4 --prefill-expert-dtype bf16).")


@app.command()
def run(
    prompt: Optional[str] = typer.Argument(None, help="Prompt text. Without it: an interactive chat."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=_MODEL_HELP),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", min=1, help="Maximum tokens to generate."),
    temperature: Optional[float] = typer.Option(None, "--temperature", "-t", min=0.0,
                                                help="0 = greedy (default: generation_config.json, else 1.0)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", min=0.0, max=1.0),
    top_k: Optional[int] = typer.Option(None, "--top-k", min=0),
    min_p: Optional[float] = typer.Option(None, "--min-p", min=0.0, max=1.0),
    repetition_penalty: Optional[float] = typer.Option(
        None, "--repetition-penalty", min=0.0,
        help="HF-style, over prompt + output; also in greedy (default: generation_config.json, else 1.0)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for reproducible sampling."),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt (chat mode)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    dtype: str = _DTYPE,
    max_model_len: int = _MAX_MODEL_LEN,
    kv_cache_gb: float = _KV_CACHE_GB,
    backend: str = _BACKEND,
    expert_dtype: str = _EXPERT_DTYPE,
    dense_dtype: str = _DENSE_DTYPE,
    expert_cache: str = _EXPERT_CACHE,
    prefill_expert_dtype: str = _PREFILL_EXPERT_DTYPE,
    threads: int = _THREADS,
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="KV cache storage: auto (the checkpoint's dtype; fp32 for fp16 on the cpu backend), fp32, bf16 or fp8 "
                                 "(e4m3: twice the tokens in the same memory)."),
    no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache",
                                         help="Do not reuse KV pages of earlier turns/requests."),
    prefix_snapshots: int = _PREFIX_SNAPSHOTS,
    snapshot_every_pages: int = _SNAPSHOT_EVERY,
    kv_scales: Optional[Path] = _KV_SCALES,
    emulate_gpu: Optional[str] = _EMULATE_GPU,
    gpu_experts: bool = _GPU_EXPERTS,
    vram_budget_gb: float = _VRAM_BUDGET,
    residency_policy: str = _RESIDENCY_POLICY,
    stats: bool = typer.Option(False, "--stats", help="Print residency telemetry per layer (hit rate, PCIe bytes, "
                               "CPU share, stall time, prefetch accuracy)."),
    record_routing: Optional[Path] = typer.Option(None, "--record-routing",
                                                  help="Write the routing trace (JSON lines) to this file."),
) -> None:
    """Generate text from a prompt, or chat interactively when no prompt is given."""
    from freetoken_py.cli_run import RunOptions, run_main

    opts = RunOptions(
        model_dir=_resolve_model(model), prompt=prompt, chat=chat, system=system, as_json=as_json, dtype=dtype,
        max_model_len=max_model_len, kv_cache_bytes=int(kv_cache_gb * 2**30), backend=backend,
        expert_dtype=expert_dtype, dense_dtype=dense_dtype, expert_cache=expert_cache, threads=threads,
        prefill_expert_dtype=prefill_expert_dtype,
        kv_dtype=kv_dtype, kv_scales=str(kv_scales or ""), prefix_cache=not no_prefix_cache, stats=stats,
        snapshots=dict(prefix_snapshots=prefix_snapshots, snapshot_every_pages=snapshot_every_pages),
        residency=dict(_residency(emulate_gpu, gpu_experts, vram_budget_gb, residency_policy),
                       record_routing=str(record_routing or "")),
        sampling=dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                      repetition_penalty=repetition_penalty, seed=seed, stop=tuple(stop or ())))
    run_main(opts)


def _residency(emulate_gpu: Optional[str], gpu_experts: bool, vram_budget_gb: float, policy: str) -> dict:
    """EngineConfig's residency fields from the CLI flags."""
    if emulate_gpu and gpu_experts:
        raise FreetokenError("pass --gpu-experts (the real GPU) or --emulate-gpu PROFILE, not both")
    if emulate_gpu and emulate_gpu.startswith("-"):    # `--emulate-gpu --stats`: the next flag taken as its value
        raise FreetokenError(f"--emulate-gpu takes a hardware profile name, got {emulate_gpu!r}; e.g. "
                             "--emulate-gpu rtx4090 (rtx4060-laptop-8g, rtx4090, rtx5090, rtx-pro-6000)")
    mode = "cuda" if gpu_experts else "emulate" if emulate_gpu else "off"
    return dict(residency=mode, residency_profile="measured" if gpu_experts else emulate_gpu or "rtx4090",
                vram_budget_bytes=int(vram_budget_gb * 1e9), residency_policy=policy)


@app.command()
def serve(
    model: Optional[str] = typer.Option(None, "--model", "-m", help=_MODEL_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; anything but loopback needs --api-key."),
    port: int = typer.Option(8000, "--port", "-p", min=0, max=65535, help="TCP port."),
    api_key: Optional[str] = typer.Option(None, "--api-key",
                                          help="Require this key (x-api-key or Authorization: Bearer)."),
    max_queue: int = typer.Option(64, "--max-queue", min=1,
                                  help="Requests admitted at once (running + waiting); more get 429."),
    drain_timeout: float = typer.Option(30.0, "--drain-timeout", min=0.0,
                                        help="On SIGTERM: seconds running requests may finish before they are aborted."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                    help="Model id reported by /v1/models (default: folder name)."),
    dtype: str = _DTYPE,
    max_model_len: int = _MAX_MODEL_LEN,
    max_num_seqs: int = typer.Option(16, "--max-num-seqs", min=1, help="Sequences decoded together."),
    kv_cache_gb: float = _KV_CACHE_GB,
    backend: str = _BACKEND,
    expert_dtype: str = _EXPERT_DTYPE,
    dense_dtype: str = _DENSE_DTYPE,
    expert_cache: str = _EXPERT_CACHE,
    prefill_expert_dtype: str = _PREFILL_EXPERT_DTYPE,
    threads: int = _THREADS,
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="KV cache storage: auto (the checkpoint's dtype; fp32 for fp16 on the cpu backend), fp32, bf16 or fp8."),
    no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache", help="Do not reuse KV pages across requests."),
    prefix_snapshots: int = _PREFIX_SNAPSHOTS,
    snapshot_every_pages: int = _SNAPSHOT_EVERY,
    kv_scales: Optional[Path] = _KV_SCALES,
    emulate_gpu: Optional[str] = _EMULATE_GPU,
    gpu_experts: bool = _GPU_EXPERTS,
    vram_budget_gb: float = _VRAM_BUDGET,
    residency_policy: str = _RESIDENCY_POLICY,
) -> None:
    """Serve the model over HTTP: OpenAI (/v1/chat/completions) and Anthropic (/v1/messages) APIs."""
    from freetoken_py.server.protocol import ServerLimits
    from freetoken_py.server.serve import ServeOptions, serve_main

    engine = dict(dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                  kv_cache_bytes=int(kv_cache_gb * 2**30), backend=backend, expert_dtype=expert_dtype,
                  dense_dtype=dense_dtype, expert_cache=expert_cache, kv_dtype=kv_dtype, kv_scales=str(kv_scales or ""),
                  prefill_expert_dtype=prefill_expert_dtype,
                  enable_prefix_cache=not no_prefix_cache, prefix_snapshots=prefix_snapshots,
                  snapshot_every_pages=snapshot_every_pages,
                  **_residency(emulate_gpu, gpu_experts, vram_budget_gb, residency_policy))
    serve_main(ServeOptions(model_dir=_resolve_model(model), host=host, port=port, api_key=api_key,
                            max_queue=max_queue, model_name=served_model_name or _hub_name(model), threads=threads, engine=engine,
                            limits=ServerLimits(drain_timeout_s=drain_timeout)))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(
    ctx: typer.Context,
    agent: str = typer.Argument(..., help="claude (Claude Code), opencode (OpenCode) or codex (Codex CLI)."),
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="The running `freetoken serve`."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="The server's --api-key, if it has one."),
    max_output_tokens: Optional[int] = typer.Option(None, "--max-output-tokens", min=1,
                                                    help="Output limit given to the agent (default: context/8)."),
    agent_bin: Optional[str] = typer.Option(None, "--bin", help="Path of the agent's executable (default: PATH)."),
    print_config: bool = typer.Option(False, "--print-config", help="Print the command, environment and files; "
                                      "start nothing."),
) -> None:
    """Start a coding agent pointed at a running server. Extra arguments go to the agent."""
    from freetoken_py.launch import launch_main

    raise typer.Exit(launch_main(agent, url, api_key, ctx.args, max_output_tokens, agent_bin, print_config))


@app.command()
def probe(
    model: Optional[str] = typer.Option(None, "--model", help="Checkpoint directory, or hub id ORG/NAME or "
                                        "ORG/NAME@REV (read from its config and safetensors headers, nothing "
                                        "downloaded): how its bytes split across tiers, the decode roofline, "
                                        "whether it fits."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the report."),
    reprofile: bool = typer.Option(False, "--reprofile", help="Ignore the cached profile and measure everything again."),
) -> None:
    """Measure this machine (DRAM, PCIe, VRAM, expert kernels) and print what it means."""
    from freetoken_py.hw.report import run_probe

    run_probe(model_spec=model, as_json=as_json, reprofile=reprofile)


@app.command()
def quantize(
    src: str = typer.Argument(..., help="Float checkpoint directory or hub id ORG/NAME or ORG/NAME@REV "
                              "(bf16 / fp16 / fp32 safetensors)."),
    out: Path = typer.Argument(..., help="New directory to write (must not exist)."),
    to: str = typer.Option(..., "--to", help="int4 (compressed-tensors pack-quantized, group 32), fp8 "
                           "(block-scaled e4m3, 128 x 128) or nvfp4 (compressed-tensors nvfp4-pack-quantized, group 16)."),
) -> None:
    """Write a quantised checkpoint that freetoken, vLLM and SGLang load as it is (layer by layer)."""
    from freetoken_py.loading.quantize import quantize_checkpoint

    typer.echo(f"wrote {quantize_checkpoint(_resolve_model(src, 'SRC'), out, to)}")


# `freetoken eval ...`: one command per measurement (evals/); each imports its implementation lazily.
eval_app = typer.Typer(no_args_is_help=True, help="Measure what a fast configuration changes, against a reference.")
app.add_typer(eval_app, name="eval")


@eval_app.command("kld")
def eval_kld(
    files: Optional[list[Path]] = typer.Argument(None, help="Text files (default: the shipped corpus, "
                                                 "freetoken_py/data/corpus: prose and Python source)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=_MODEL_HELP),
    against: Optional[str] = typer.Option(None, "--against", help="Reference checkpoint or hub id (default: --model at its "
                                           "own precision). Must have the same vocabulary."),
    expert_dtype: str = typer.Option("auto", "--expert-dtype", help="Fast configuration: experts as auto, bf16, "
                                     "fp32, int8, int4."),
    dense_dtype: str = typer.Option("auto", "--dense-dtype", help="Fast configuration: attention/router/lm_head "
                                    "weights as auto, bf16, fp32, int8, int4."),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="Fast configuration: KV cache as auto, fp32, bf16, fp8."),
    kv_scales: Optional[Path] = _KV_SCALES,
    prefill_expert_dtype: str = typer.Option("auto", "--prefill-expert-dtype", help="Fast configuration: experts "
                                             "of prefill chunks as auto (= --expert-dtype), bf16, fp32, int8 (see "
                                             "--prefill)."),
    backend: str = typer.Option("auto", "--backend", help="Both engines: auto, cpu or torch."),
    dtype: str = typer.Option("auto", "--dtype", help="Both engines' compute dtype."),
    window: int = typer.Option(256, "--window", min=2, help="Tokens per window (each starts a fresh context)."),
    windows: int = typer.Option(16, "--windows", min=1, help="Windows at most, evenly spread over the text."),
    chunk: int = typer.Option(1, "--chunk", min=1, help="Tokens per forward pass (1: every position is a decode "
                              "step reading its history from the KV cache)."),
    prefill: int = typer.Option(0, "--prefill", min=0, help="The first N tokens of each window as one prefill "
                                "chunk, the rest --chunk at a time (a prompt, then decode steps)."),
    threads: int = typer.Option(0, "--threads", min=0, help="CPU threads (0 = all cores)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON line."),
) -> None:
    """KL divergence of next-token distributions, teacher-forced over real text: mean / p99 / max,
    same top-1 %, perplexity of both."""
    from freetoken_py.evals.kld import KldOptions, kld_main
    from freetoken_py.kernels import configure_threads

    against_dir = None if against is None else _resolve_model(against, "--against")
    configure_threads(threads or None)
    fast = {k: v for k, v in dict(expert_dtype=expert_dtype, dense_dtype=dense_dtype, kv_dtype=kv_dtype,
                                  prefill_expert_dtype=prefill_expert_dtype).items() if v != "auto"}
    both = {k: v for k, v in dict(backend=backend, dtype=dtype).items() if v != "auto"}
    kld_main(KldOptions(_resolve_model(model), against_dir, tuple(files or ()), window, windows, chunk,
                        fast={**both, **fast, **({"kv_scales": str(kv_scales)} if kv_scales else {})},
                        reference=both, as_json=as_json, show_progress=not as_json, prefill=prefill))


@eval_app.command("tools")
def eval_tools(
    model: Optional[str] = typer.Option(None, "--model", "-m", help=_MODEL_HELP),
    samples: int = typer.Option(2, "--samples", min=1, help="Seeds per request of the suite."),
    num_requests: int = typer.Option(0, "--requests", min=0, help="The suite's first N requests (0: all 16)."),
    max_tokens: int = typer.Option(160, "--max-tokens", min=1, help="Tokens per generation at most."),
    temperature: Optional[float] = typer.Option(None, "--temperature", min=0.0,
                                                help="Default: the model's generation_config.json."),
    threads: int = typer.Option(0, "--threads", min=0, help="CPU threads (0 = all cores)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON line."),
) -> None:
    """Tool-call validity on a fixed suite of coding-agent requests (rendered and parsed as the
    server does): share parseable, naming a declared tool, validating against its schema, with
    and without grammar-constrained decoding."""
    from freetoken_py.evals.tools import ToolsEvalOptions, tools_main
    from freetoken_py.kernels import configure_threads

    configure_threads(threads or None)
    tools_main(ToolsEvalOptions(_resolve_model(model), samples, num_requests, max_tokens, temperature, as_json))


def main() -> None:
    try:
        app()
    except FreetokenError as exc:
        print(f"freetoken: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
