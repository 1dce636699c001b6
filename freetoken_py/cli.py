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


def _resolve_model(model: Optional[Path]) -> Path:
    if model is None:
        if not (DEMO_MODEL / "config.json").exists():
            raise FreetokenError(f"the bundled demo model is missing from {DEMO_MODEL}; pass --model DIR")
        print("freetoken: using the bundled demo model (a tiny qwen3_moe trained on Python's standard "
              "library; pass --model DIR for a real checkpoint)", file=sys.stderr)
        return DEMO_MODEL
    if not model.is_dir():
        raise FreetokenError(f"--model {model}: no such directory (expected a Hugging Face checkpoint folder)")
    return model


@app.command()
def run(
    prompt: Optional[str] = typer.Argument(None, help="Prompt text. Without it: an interactive chat."),
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="Hugging Face checkpoint directory "
                                         "(default: the bundled demo model)."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", min=1, help="Maximum tokens to generate."),
    temperature: Optional[float] = typer.Option(None, "--temperature", "-t", min=0.0,
                                                help="0 = greedy (default: generation_config.json, else 1.0)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", min=0.0, max=1.0),
    top_k: Optional[int] = typer.Option(None, "--top-k", min=0),
    min_p: Optional[float] = typer.Option(None, "--min-p", min=0.0, max=1.0),
    repetition_penalty: Optional[float] = typer.Option(None, "--repetition-penalty", min=0.0),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for reproducible sampling."),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt (chat mode)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    dtype: str = typer.Option("auto", "--dtype", help="Compute dtype: auto, float32, bfloat16, float16."),
    max_model_len: int = typer.Option(0, "--max-model-len", min=0, help="Context limit (0 = the model's)."),
    kv_cache_gb: float = typer.Option(0.0, "--kv-cache-gb", min=0.0, help="KV cache size (0 = auto)."),
    backend: str = typer.Option("auto", "--backend", help="auto, cpu (numba kernels) or torch (reference)."),
    expert_dtype: str = typer.Option("auto", "--expert-dtype",
                                     help="cpu backend: expert weights as auto (as loaded), bf16, fp32, int8, int4."),
    dense_dtype: str = typer.Option("auto", "--dense-dtype",
                                    help="cpu backend: attention/router/lm_head weights as auto, bf16, fp32, int8."),
    threads: int = typer.Option(0, "--threads", min=0, help="CPU threads for numba and torch (0 = all cores)."),
) -> None:
    """Generate text from a prompt, or chat interactively when no prompt is given."""
    from freetoken_py.cli_run import RunOptions, run_main

    opts = RunOptions(
        model_dir=_resolve_model(model), prompt=prompt, chat=chat, system=system, as_json=as_json, dtype=dtype,
        max_model_len=max_model_len, kv_cache_bytes=int(kv_cache_gb * 2**30), backend=backend,
        expert_dtype=expert_dtype, dense_dtype=dense_dtype, threads=threads,
        sampling=dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                      repetition_penalty=repetition_penalty, seed=seed, stop=tuple(stop or ())))
    run_main(opts)


@app.command()
def probe(
    model: Optional[Path] = typer.Option(None, "--model", help="Model directory: show how its bytes split across tiers."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the report."),
    reprofile: bool = typer.Option(False, "--reprofile", help="Ignore the cached profile and measure everything again."),
) -> None:
    """Measure this machine (DRAM, PCIe, VRAM, expert kernels) and print what it means."""
    from freetoken_py.hw.report import run_probe

    run_probe(model_dir=model, as_json=as_json, reprofile=reprofile)


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
