"""The blocked prefill attention against torch's SDPA with the same boolean mask (the reference),
over odd sizes, GQA groups, a cached prefix (n < ctx) and a sliding window."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from freetoken_py.layers.attention import _prefill_attention


@pytest.mark.parametrize("n,ctx,hq,hkv,window,block", [
    (1, 1, 2, 1, None, 64), (17, 17, 4, 2, None, 64), (130, 130, 8, 2, None, 64),
    (5, 300, 4, 4, None, 2), (70, 200, 6, 2, 32, 16), (64, 64, 4, 1, 8, 64)])
def test_blocked_prefill_attention_matches_sdpa(n, ctx, hq, hkv, window, block):
    g = torch.Generator().manual_seed(n * 1000 + ctx)
    q, k, v = (torch.randn(h, m, 32, generator=g) for h, m in ((hq, n), (hkv, ctx), (hkv, ctx)))
    q_pos = torch.arange(ctx - n, ctx)[:, None]
    k_pos = torch.arange(ctx)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    out = _prefill_attention(q, k, v, mask, 0.3, block=block)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= 1e-5
