"""`freetoken eval kld`: how far a fast configuration's next-token distributions are from a
reference configuration's, teacher-forced over real text.

Both engines see the same windows of token ids (the fast model's tokenizer). Each window is
computed in chunks of `chunk` tokens through the engine's own KV cache and every position's
logits are kept (`ModelRunner.forward_batch(all_rows=True)`): with chunk 1 every step is a
decode step that reads all earlier tokens back from the cache, FP8 included. Per position
t (predicting token t+1), in float64:

    KL(ref || fast) = sum_v p_ref(v) * (log p_ref(v) - log p_fast(v))

mean / p99 / max over all positions, the share of positions whose arg-max agrees, and each
engine's perplexity exp(mean -log p(token t+1)). With `prefill` N > 0 the first N tokens of each
window are one prefill chunk (a prompt) and the rest go `chunk` at a time (decode steps), and the
mean over the positions after the prompt is reported too (`--prefill-expert-dtype` shows there).

Per-layer error of the expert outputs: every call of the fast engine's expert executor is also
run through the reference engine's executor on the same inputs (hidden rows, routed ids and
weights: the fast engine's, teacher-forced), and per MoE layer

    rel_l2 = sqrt(sum ||out_fast - out_ref||^2 / sum ||out_ref||^2)

over every row of every window (None for dense layers). It isolates each layer's own expert
error (quantisation) from what earlier layers passed on; 0 where the experts are the same.
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
    prefill: int = 0                     # first N tokens of each window as one prefill chunk
    layer_error: bool = True             # per-layer relative L2 error of the expert outputs


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
    mean_kld_after_prefill: float | None = None   # positions after the prefill chunk (prefill > 0)
    expert_rel_l2: list | None = None             # per layer (None: dense layer); None: not measured

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


def window_logits(llm, tokens: list[int], chunk: int, prefill: int = 0):
    """fp32 logits [len(tokens), V] of every position, computed `chunk` tokens per forward pass
    (after a first pass of `prefill` tokens, when > 0) through `llm`'s engine and KV cache (a
    throwaway request: nothing reaches the prefix cache)."""
    import torch

    from freetoken_py.core import Request, SamplingParams
    from freetoken_py.engine.runner import ScheduledChunk

    req = Request(list(tokens), SamplingParams())
    req.page_table = llm.allocator.allocate(-(-len(tokens) // llm.config.page_size))
    rows = []
    try:
        while req.num_computed < len(tokens):
            n = min(prefill if req.num_computed == 0 and prefill > 0 else chunk, len(tokens) - req.num_computed)
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


class ExpertErrorProbe:
    """Wraps the fast engine's expert executor for one comparison: each call's output is
    returned as it is and compared with the reference executor's on the same inputs (float64
    sums of squares per layer). While it is attached the fused decode step calls it per layer
    (the generic path: the same kernels' results to rounding)."""

    def __init__(self, inner, ref_experts, ref_dtype, num_layers: int):
        import torch

        self.inner, self.ref, self.ref_dtype = inner, ref_experts, ref_dtype
        self.err = torch.zeros(num_layers, dtype=torch.float64)
        self.norm = torch.zeros(num_layers, dtype=torch.float64)
        self.seen = [False] * num_layers

    def __getattr__(self, name):   # activation, banks, ... of the wrapped executor
        return getattr(self.inner, name)

    def __call__(self, layer, x, ids, weights):
        import torch

        out = self.inner(layer, x, ids, weights)
        with torch.no_grad():
            ref = self.ref(layer, x.to(self.ref_dtype), ids, weights.to(self.ref_dtype)).double()
            self.err[layer] += (out.double() - ref).pow(2).sum()
            self.norm[layer] += ref.pow(2).sum()
        self.seen[layer] = True
        return out

    def rel_l2(self) -> list:
        return [round(((e / n) ** 0.5).item(), 8) if s and n > 0 else None
                for e, n, s in zip(self.err, self.norm, self.seen)]


def _probe_for(fast, ref):
    """An ExpertErrorProbe when both engines run their experts through an executor of the same
    layer / expert layout (not the residency tiers); else None (the error is not reported)."""
    fa, ra = fast.args, ref.args
    same = (fa.num_layers, fa.num_experts, fa.hidden_size, fa.moe_intermediate_size) == \
           (ra.num_layers, ra.num_experts, ra.hidden_size, ra.moe_intermediate_size)
    if not same or fast.residency is not None or ref.residency is not None or not any(fa.sparse_layers):
        return None
    return ExpertErrorProbe(fast.model.experts, ref.model.experts, ref.model.dtype, fa.num_layers)


def compare(fast, ref, windows: list[list[int]], chunk: int, show_progress: bool = False, prefill: int = 0,
            layer_error: bool = False) -> KldResult:
    """KLD of engine `fast` against engine `ref` over `windows` (both LLMs, same vocabulary);
    layer_error: also the per-layer error of the expert outputs (ExpertErrorProbe)."""
    import torch

    from freetoken_py.utils.progress import progress_bar

    parts, after = [], []
    probe = _probe_for(fast, ref) if layer_error else None
    if probe is not None:
        fast.model.experts = probe
    try:
        with progress_bar(f"KLD over {len(windows)} windows", len(windows), show_progress) as advance:
            for tokens in windows:
                st = window_stats(window_logits(fast, tokens, chunk, prefill), window_logits(ref, tokens, chunk, prefill),
                                  tokens)
                parts.append(st)
                after.append(st[0][prefill:])
                advance()
    finally:
        if probe is not None:
            fast.model.experts = probe.inner
    kl, same, nll_f, nll_r = (torch.cat(p) for p in zip(*parts))
    tail = torch.cat(after)
    return KldResult(windows=len(windows), positions=len(kl), mean_kld=kl.mean().item(),
                     p99_kld=torch.quantile(kl, 0.99).item(), max_kld=kl.max().item(),
                     same_top1=same.double().mean().item(), ppl_fast=nll_f.mean().exp().item(),
                     ppl_ref=nll_r.mean().exp().item(),
                     mean_kld_after_prefill=tail.mean().item() if prefill > 0 and len(tail) else None,
                     expert_rel_l2=probe.rel_l2() if probe is not None else None)


def load_engines(opts: KldOptions):
    """The fast and the reference LLM; one-line errors for a reference of another vocabulary,
    a model without a tokenizer or a window longer than the context."""
    from freetoken_py.llm import LLM

    common = dict(max_num_seqs=1, enable_prefix_cache=False, show_progress=opts.show_progress)
    fast = LLM(opts.model_dir, **common, **opts.fast)
    if fast.tokenizer is None:
        raise FreetokenError(f"--model {opts.model_dir}: no tokenizer.json; eval kld tokenises text with it")
    if opts.prefill >= opts.window:
        raise FreetokenError(f"--prefill {opts.prefill} must be shorter than the window ({opts.window} tokens)")
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
    res = compare(fast, ref, windows, opts.chunk, opts.show_progress and not opts.as_json, opts.prefill,
                  opts.layer_error)
    out = {"eval": "kld", "model": str(opts.model_dir), "against": str(opts.against or opts.model_dir),
           "fast": opts.fast, "reference": opts.reference or "the checkpoint's own precision",
           "texts": [str(p) for p in opts.files] or "shipped corpus (prose.txt, code.txt)",
           "window": opts.window, "chunk": opts.chunk, "prefill": opts.prefill, **res.as_dict(),
           "kv_fp8_clipped": fast.runner.cache.clipped, "kv_calibration": fast.kv_calibration,
           "seconds": round(time.perf_counter() - t0, 2)}
    print(json.dumps(out) if opts.as_json else _report(out))
    return out


def _report(o: dict) -> str:
    fast = ", ".join(f"{k} {v}" for k, v in o["fast"].items()) or "defaults"
    lines = [f"fast:      {o['model']} ({fast})",
             f"reference: {o['against']} ({o['reference']})",
             f"text:      {o['windows']} windows x {o['window']} tokens = {o['positions']} predictions, "
             f"{o['chunk']} token(s) per forward pass" + (f" after a prefill of {o['prefill']}" if o["prefill"] else ""),
             f"KLD:       mean {o['mean_kld']:.6f}  p99 {o['p99_kld']:.6f}  max {o['max_kld']:.6f}",
             f"top-1:     {100 * o['same_top1']:.2f}% the same",
             f"perplexity: fast {o['ppl_fast']:.4f}  reference {o['ppl_ref']:.4f}"]
    if o["mean_kld_after_prefill"] is not None:
        lines.append(f"KLD after the prefill: mean {o['mean_kld_after_prefill']:.6f}")
    if o["expert_rel_l2"] is not None:
        lines.append("expert error (relative L2 per MoE layer, same inputs): " + "  ".join(
            f"{i}:{e:.2e}" for i, e in enumerate(o["expert_rel_l2"]) if e is not None))
    if o["kv_calibration"]:
        lines.append(f"FP8 KV:    scales from {o['kv_calibration'].get('source')}; "
                     f"{o['kv_fp8_clipped']} values clipped")
    return "\n".join(lines)
