"""kernels/cpu_mla.mla_decode against the torch reference layers.mla.absorbed_decode, on fp32,
bf16 and FP8 latent caches read through a paged slot list (several tokens, contexts of different
lengths, chunked and not), and the absorbed form against expanding K/V through kv_b."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken_py.kernels.cpu_decode import fp8_table
from freetoken_py.kernels.cpu_mla import mla_decode
from freetoken_py.kvcache import KVCache, PagedLatent
from freetoken_py.layers.mla import absorbed_decode

H, DN, DR, DV, R = 4, 16, 8, 24, 32


def _view(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_kernel_matches_torch_reference_over_paged_latents(kv_dtype, w_dtype):
    """W_UK / W_UV read in place from kv_b [H, dn + dv, R] at its stored precision (fp32, bf16 bits)."""
    g = torch.Generator().manual_seed(0)
    lengths = [1, 7, 300]  # 300 keys: several chunks merged
    cache = KVCache.for_spec(PagedLatent(R, DR), 1, 40, 16, kv_dtype)
    perm = torch.randperm(40 * 16, generator=g)  # tokens scattered over the pool
    total = sum(lengths)
    c_all, r_all = torch.randn(total, R, generator=g), torch.randn(total, DR, generator=g)
    slots = perm[:total]
    cache.write(0, slots, c_all[:, None], r_all[:, None])
    w_uk, w_uv = torch.randn(H, DN, R, generator=g) * 0.2, torch.randn(H, DV, R, generator=g) * 0.2
    kv_b = torch.cat([w_uk, w_uv], dim=1).to(w_dtype)  # kv_b_proj's weight [H*(dn+dv), R], viewed per head
    w_uk, w_uv = kv_b[:, :DN].float(), kv_b[:, DN:].float()  # the reference sees the stored values
    q_nope, q_rope = torch.randn(3, H, DN, generator=g), torch.randn(3, H, DR, generator=g)
    offs = np.cumsum([0] + lengths)
    out = np.zeros((3, H * DV), np.float32)
    fp8 = cache.quantized
    lut = fp8_table() if fp8 else np.ones(1, np.float32)
    ks, vs = (float(cache.k_scale[0, 0]), float(cache.v_scale[0, 0])) if fp8 else (1.0, 1.0)
    last = offs[1:] - 1
    mla_decode(q_nope.numpy(), q_rope.numpy(), _view(kv_b), _view(cache.k[0]), _view(cache.v[0]),
               ks, vs, lut, c_all[last].numpy(), r_all[last].numpy(), fp8, slots.numpy(), offs, 0.3, out)
    for t in range(3):
        cc, kr = cache.read(0, slots[offs[t]:offs[t + 1]])
        cc, kr = cc[:, 0].float(), kr[:, 0].float()
        if fp8:
            cc[-1], kr[-1] = c_all[last[t]], r_all[last[t]]
        ref = absorbed_decode(q_nope[t], q_rope[t], cc, kr, w_uk, w_uv, 0.3).flatten()
        assert np.abs(out[t] - ref.numpy()).max() <= 1e-4


def test_absorbed_equals_expanded_attention():
    """The absorption identity itself: scores and values through W_UK / W_UV on the latent equal
    ordinary attention over K/V expanded by kv_b (float64)."""
    g = torch.Generator().manual_seed(1)
    n = 9
    c, kr = torch.randn(n, R, generator=g, dtype=torch.float64), torch.randn(n, DR, generator=g, dtype=torch.float64)
    w_uk, w_uv = torch.randn(H, DN, R, generator=g, dtype=torch.float64), torch.randn(H, DV, R, generator=g,
                                                                                        dtype=torch.float64)
    qn, qr = torch.randn(H, DN, generator=g, dtype=torch.float64), torch.randn(H, DR, generator=g, dtype=torch.float64)
    k = torch.cat([torch.einsum("hdr,nr->hnd", w_uk, c), kr[None].expand(H, -1, -1)], dim=-1)  # [H, n, dn+dr]
    v = torch.einsum("hvr,nr->hnv", w_uv, c)  # [H, n, dv]
    q = torch.cat([qn, qr], dim=-1)[:, None]  # [H, 1, dn+dr]
    expanded = torch.softmax(q @ k.transpose(1, 2) * 0.25, dim=-1) @ v  # [H, 1, dv]
    assert torch.allclose(absorbed_decode(qn, qr, c, kr, w_uk, w_uv, 0.25), expanded[:, 0], atol=1e-10)
