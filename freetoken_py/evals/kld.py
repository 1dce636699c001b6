"""`freetoken eval kld`: how far a fast configuration's next-token distributions are from a
reference configuration's, teacher-forced over real text.

Both engines see the same windows of token ids (the fast model's tokenizer). Each window is
computed in chunks of `chunk` tokens through the engine's own KV cache and every position's
logits are kept (`ModelRunner.forward_batch(all_rows=True)`): with chunk 1 every step is a
decode step that reads all earlier tokens back from the cache, FP8 included. Per position
t (predicting token t+1), in float64:

    KL(ref || fast) = sum_v p_ref(v) * (log p_ref(v) - log p_fast(v))

mean / p99 / max over all positions, the share of positions whose arg-max agrees, and each
engine's perplexity exp(mean -log p(token t+1)).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from freetoken_py.errors import FreetokenError

CORPUS_DIR = Path(__file__).resolve().parent.parent / "data" / "corpus"
DEFAULT_TEXTS = (CORPUS_DIR / "prose.txt", CORPUS_DIR / "code.txt")


@dataclass(frozen=True)
class KldOptions:
    model_dir: Path
    against: Path | None = None          # reference checkpoint; None = model_dir at its own precision
    files: tuple[Path, ...] = ()         # text files; () = the shipped corpus
    window: int = 256                    # tokens per window
    max_windows: int = 16                # evenly spaced over all windows of the text
    chunk: int = 1                       # tokens per forward pass (1 = decode steps)
    fast: dict = field(default_factory=dict)        # EngineConfig overrides of the fast engine
    reference: dict = field(default_factory=dict)   # ... and of the reference (backend, dtype)
    as_json: bool = False
    show_progress: bool = True


@dataclass(frozen=True)
class KldResult:
    windows: int
    positions: int
    mean_kld: float
    p99_kld: float
    max_kld: float
    same_top1: float          # share of positions, 0..1
    ppl_fast: float
    ppl_ref: float

    def as_dict(self) -> dict:
        return asdict(self)


def read_windows(tokenizer, files: tuple[Path, ...], window: int, max_windows: int) -> list[list[int]]:
    """Each file tokenised on its own (no special tokens) and cut into whole windows; at most
    `max_windows` of them, evenly spaced over the list (so every file is sampled)."""
    if window < 2:
        raise FreetokenError(f"--window must be at least 2 tokens (got {window})")
    windows, total = [], 0
    for path in files:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise FreetokenError(f"{path}: cannot read as UTF-8 text ({exc})") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        total += len(ids)
        windows += [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]
    if not windows:
        raise FreetokenError(f"the text has {total} tokens, shorter than one window of {window} "
                             "(pass more text or a smaller --window)")
    if len(windows) > max_windows:
        step = len(windows) / max_windows
        windows = [windows[int(i * step)] for i in range(max_windows)]
    return windows


def window_logits(llm, tokens: list[int], chunk: int):
    """fp32 logits [len(tokens), V] of every position, computed `chunk` tokens per forward pass
    through `llm`'s engine and KV cache (a throwaway request: nothing reaches the prefix cache)."""
    import torch

    from freetoken_py.core import Request, SamplingParams
    from freetoken_py.engine.runner import ScheduledChunk

    req = Request(list(tokens), SamplingParams())
    req.page_table = llm.allocator.allocate(-(-len(tokens) // llm.config.page_size))
    rows = []
    try:
        while req.num_computed < len(tokens):
            n = min(chunk, len(tokens) - req.num_computed)
            rows.append(llm.runner.forward_batch([ScheduledChunk(req, n)], all_rows=True))
    finally:
        llm.allocator.release(req.page_table)
    return torch.cat(rows).float()


def window_stats(fast_logits, ref_logits, tokens: list[int]):
    """Per position t < W-1: KL(ref || fast), arg-max agreement, -log p(tokens[t+1]) of each."""
    import torch

    lf = torch.log_softmax(fast_logits[:-1].double(), dim=-1)   # [W-1, V]
    lr = torch.log_softmax(ref_logits[:-1].double(), dim=-1)
    kl = (lr.exp() * (lr - lf)).sum(-1)                          # [W-1]
    nxt = torch.tensor(tokens[1:])[:, None]
    return kl, lf.argmax(-1) == lr.argmax(-1), -lf.gather(1, nxt)[:, 0], -lr.gather(1, nxt)[:, 0]


def compare(fast, ref, windows: list[list[int]], chunk: int, show_progress: bool = False) -> KldResult:
    """KLD of engine `fast` against engine `ref` over `windows` (both LLMs, same vocabulary)."""
    import torch

    from freetoken_py.utils.progress import progress_bar

    parts = []
    with progress_bar(f"KLD over {len(windows)} windows", len(windows), show_progress) as advance:
        for tokens in windows:
            parts.append(window_stats(window_logits(fast, tokens, chunk), window_logits(ref, tokens, chunk), tokens))
            advance()
    kl, same, nll_f, nll_r = (torch.cat(p) for p in zip(*parts))
    return KldResult(windows=len(windows), positions=len(kl), mean_kld=kl.mean().item(),
                     p99_kld=torch.quantile(kl, 0.99).item(), max_kld=kl.max().item(),
                     same_top1=same.double().mean().item(), ppl_fast=nll_f.mean().exp().item(),
                     ppl_ref=nll_r.mean().exp().item())


def load_engines(opts: KldOptions):
    """The fast and the reference LLM; one-line errors for a reference of another vocabulary,
    a model without a tokenizer or a window longer than the context."""
    from freetoken_py.llm import LLM

    common = dict(max_num_seqs=1, enable_prefix_cache=False, show_progress=opts.show_progress)
    fast = LLM(opts.model_dir, **common, **opts.fast)
    if fast.tokenizer is None:
        raise FreetokenError(f"--model {opts.model_dir}: no tokenizer.json; eval kld tokenises text with it")
    if opts.window > min(fast.max_model_len, fast.kv_capacity_tokens):
        raise FreetokenError(f"--window {opts.window} is longer than the context "
                             f"({min(fast.max_model_len, fast.kv_capacity_tokens)} tokens)")
    ref = LLM(opts.against or opts.model_dir, **common, **opts.reference)
    if ref.args.vocab_size != fast.args.vocab_size:
        raise FreetokenError(f"--against {opts.against}: a vocabulary of {ref.args.vocab_size} tokens, the model's "
                             f"has {fast.args.vocab_size}; KLD compares distributions over the same vocabulary")
    return fast, ref


def kld_main(opts: KldOptions) -> dict:
    """Run the comparison, print the report (or one JSON line), return the JSON object."""
    import json

    t0 = time.perf_counter()
    missing = [str(p) for p in opts.files if not Path(p).is_file()]
    if missing:      # before any model loads
        raise FreetokenError(f"{missing[0]}: no such text file")
    fast, ref = load_engines(opts)
    windows = read_windows(fast.tokenizer, opts.files or DEFAULT_TEXTS, opts.window, opts.max_windows)
    res = compare(fast, ref, windows, opts.chunk, opts.show_progress and not opts.as_json)
    out = {"eval": "kld", "model": str(opts.model_dir), "against": str(opts.against or opts.model_dir),
           "fast": opts.fast, "reference": opts.reference or "the checkpoint's own precision",
           "texts": [str(p) for p in opts.files] or "shipped corpus (prose.txt, code.txt)",
           "window": opts.window, "chunk": opts.chunk, **res.as_dict(),
           "kv_fp8_clipped": fast.runner.cache.clipped, "kv_calibration": fast.kv_calibration,
           "seconds": round(time.perf_counter() - t0, 2)}
    print(json.dumps(out) if opts.as_json else _report(out))
    return out


def _report(o: dict) -> str:
    fast = ", ".join(f"{k} {v}" for k, v in o["fast"].items()) or "defaults"
    lines = [f"fast:      {o['model']} ({fast})",
             f"reference: {o['against']} ({o['reference']})",
             f"text:      {o['windows']} windows x {o['window']} tokens = {o['positions']} predictions, "
             f"{o['chunk']} token(s) per forward pass",
             f"KLD:       mean {o['mean_kld']:.6f}  p99 {o['p99_kld']:.6f}  max {o['max_kld']:.6f}",
             f"top-1:     {100 * o['same_top1']:.2f}% the same",
             f"perplexity: fast {o['ppl_fast']:.4f}  reference {o['ppl_ref']:.4f}"]
    if o["kv_calibration"]:
        lines.append(f"FP8 KV:    scales from {o['kv_calibration'].get('source')}; "
                     f"{o['kv_fp8_clipped']} values clipped")
    return "\n".join(lines)
