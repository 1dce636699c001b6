"""`freetoken eval kld`'s per-layer error of the expert outputs against an independent
computation: the reference outputs of the very inputs the fast engine's experts saw (recorded
here) computed by transformers' own expert module in float64; and the invariants (0 where
the experts are the same, None for dense layers). Also `--prefill`'s split."""
from __future__ import annotations

import pytest
import torch

from freetoken_py.evals.kld import compare
from freetoken_py.llm import LLM

KW = dict(backend="cpu", max_num_seqs=1, enable_prefix_cache=False, show_progress=False,
          kv_cache_bytes=1 << 20, max_model_len=128)


@pytest.fixture(scope="module")
def ckpt(checkpoint_factory):
    return checkpoint_factory("qwen3_moe_step2", dtype=torch.bfloat16)


def _windows(vocab: int, n: int = 2, length: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


class Recorder:
    """Keeps every (layer, x, ids, weights, output) of the executor it wraps (observes only)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, layer, x, ids, weights):
        out = self.inner(layer, x, ids, weights)
        self.calls.append((layer, x.clone(), ids.clone(), weights.clone(), out.clone()))
        return out


def _experts_float64(mod, x, ids, w):
    """sum_k w_k * down_e(silu(gate_e x) * up_e x) from transformers' fused expert tensors."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, wt in zip(ids[t].tolist(), w[t]):
            gate, up = (mod.gate_up_proj[e] @ x[t]).chunk(2)
            out[t] += wt * (mod.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def test_per_layer_expert_error_equals_transformers_float64_on_the_same_inputs(ckpt):
    from transformers import AutoModelForCausalLM

    fast, ref = LLM(ckpt, expert_dtype="int8", **KW), LLM(ckpt, **KW)
    rec = Recorder(fast.model.experts)
    fast.model.experts = rec
    res = compare(fast, ref, _windows(fast.args.vocab_size), chunk=4, prefill=8, layer_error=True)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).double().eval()
    err = torch.zeros(fast.args.num_layers, dtype=torch.float64)
    norm = torch.zeros_like(err)
    with torch.no_grad():
        for layer, x, ids, w, out in rec.calls:
            want = _experts_float64(hf.model.layers[layer].mlp.experts, x.double(), ids, w.double())
            err[layer] += (out.double() - want).pow(2).sum()
            norm[layer] += want.pow(2).sum()
    mine = [((e / n) ** 0.5).item() if n > 0 else None for e, n in zip(err, norm)]
    assert [m is None for m in mine] == [not s for s in fast.args.sparse_layers]
    assert [r is None for r in res.expert_rel_l2] == [m is None for m in mine]
    for got, want in zip(res.expert_rel_l2, mine):
        if want is not None:
            assert want > 1e-4 and abs(got - want) <= 1e-3 * want, (res.expert_rel_l2, mine)
    assert res.mean_kld_after_prefill is not None and res.mean_kld_after_prefill >= 0


def test_same_experts_give_zero_error_and_prefill_splits_the_positions(ckpt):
    fast, ref = LLM(ckpt, kv_dtype="fp8", **KW), LLM(ckpt, **KW)
    windows = _windows(fast.args.vocab_size)
    res = compare(fast, ref, windows, chunk=1, prefill=8, layer_error=True)
    assert all(e == 0.0 for e, s in zip(res.expert_rel_l2, fast.args.sparse_layers) if s)
    assert res.positions == len(windows) * 19
    plain = compare(fast, ref, windows, chunk=1)          # no probe: the same figures, no error list
    assert plain.expert_rel_l2 is None and plain.mean_kld_after_prefill is None
    assert abs(plain.mean_kld - compare(fast, ref, windows, chunk=1, layer_error=True).mean_kld) < 1e-9
