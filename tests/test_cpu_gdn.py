"""kernels/cpu_gdn.py against transformers' own Gated DeltaNet torch functions (the recurrent and the
chunked gated delta rule, RMSNormGated) and a plain F.conv1d causal convolution, fp32."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from freetoken_py.kernels import cpu_gdn

SMALL = (2, 4, 16, 16)  # Hk, Hv, dk, dv
REAL = (16, 32, 128, 128)  # Qwen3-Next / Qwen3.5-3.6 MoE widths


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _inputs(g, N, L, Hk, Hv, dk, dv):
    q = torch.randn(N, L, Hk, dk, generator=g)
    k = torch.randn(N, L, Hk, dk, generator=g)
    v = torch.randn(N, L, Hv, dv, generator=g)
    decay = -F.softplus(torch.randn(N, L, Hv, generator=g)) * torch.rand(Hv, generator=g)  # log decay <= 0
    beta = torch.rand(N, L, Hv, generator=g)
    return q, k, v, decay, beta


def _reference(q, k, v, decay, beta, s0):
    """transformers: the recurrent rule for one token, the chunked (chunk 64) one for longer runs."""
    fn = hf.torch_recurrent_gated_delta_rule if q.shape[1] == 1 else hf.torch_chunk_gated_delta_rule
    return fn(q, k, v, g=decay, beta=beta, initial_state=s0.clone(), output_final_state=True,
              use_qk_l2norm_in_kernel=True)


def _run_delta(q, k, v, decay, beta, s0):
    N, L, Hv, dv = v.shape
    state = s0.clone().numpy()
    out = np.empty((N, L, Hv, dv), np.float32)
    cpu_gdn.delta_rule(q.numpy(), k.numpy(), v.numpy(), decay.numpy(), beta.numpy(), state,
                       np.arange(N, dtype=np.int64), out)
    return out, state


@pytest.mark.parametrize("L", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("init", ["zero", "state"])
def test_delta_rule_matches_transformers(L, init):
    Hk, Hv, dk, dv = SMALL
    g = torch.Generator().manual_seed(L * 7 + (init == "state"))
    q, k, v, decay, beta = _inputs(g, 2, L, Hk, Hv, dk, dv)
    s0 = torch.zeros(2, Hv, dk, dv) if init == "zero" else torch.randn(2, Hv, dk, dv, generator=g) * 0.3
    ref_o, ref_s = _reference(q, k, v, decay, beta, s0)
    out, state = _run_delta(q, k, v, decay, beta, s0)
    assert _rel(out, ref_o) <= 1e-4
    assert _rel(state, ref_s) <= 1e-4
    # the recurrence itself, token by token, agrees too (catches a chunk-reference-only coincidence)
    if L in (1, 65):
        rec_o, rec_s = hf.torch_recurrent_gated_delta_rule(q, k, v, g=decay, beta=beta, initial_state=s0.clone(),
                                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert _rel(out, rec_o) <= 1e-4 and _rel(state, rec_s) <= 1e-4


@pytest.mark.parametrize("L", [1, 65])
def test_delta_rule_real_width(L):
    Hk, Hv, dk, dv = REAL
    g = torch.Generator().manual_seed(100 + L)
    q, k, v, decay, beta = _inputs(g, 1, L, Hk, Hv, dk, dv)
    s0 = torch.randn(1, Hv, dk, dv, generator=g) * 0.05
    ref_o, ref_s = _reference(q, k, v, decay, beta, s0)
    out, state = _run_delta(q, k, v, decay, beta, s0)
    assert _rel(out, ref_o) <= 1e-4
    assert _rel(state, ref_s) <= 1e-4


def test_delta_rule_slots_pick_state_rows():
    """Request n reads and writes state row slots[n] only; other rows stay untouched."""
    Hk, Hv, dk, dv = SMALL
    g = torch.Generator().manual_seed(5)
    q, k, v, decay, beta = _inputs(g, 2, 1, Hk, Hv, dk, dv)
    pool = torch.randn(4, Hv, dk, dv, generator=g) * 0.3
    slots = np.array([3, 1], np.int64)
    state = pool.clone().numpy()
    out = np.empty((2, 1, Hv, dv), np.float32)
    cpu_gdn.delta_rule(q.numpy(), k.numpy(), v.numpy(), decay.numpy(), beta.numpy(), state, slots, out)
    ref_o, ref_s = _reference(q, k, v, decay, beta, pool[slots])
    assert _rel(out, ref_o) <= 1e-4 and _rel(state[slots], ref_s) <= 1e-4
    assert np.array_equal(state[[0, 2]], pool[[0, 2]].numpy())


def _conv_reference(x, w, st):
    """silu(causal depthwise conv) over [state | x]; x [L, C], w [C, K], st [C, W] -> out [L, C], new state."""
    ext = torch.cat([st, x.T], dim=1)  # [C, W + L]
    out = F.conv1d(ext[None], w[:, None, :], groups=w.shape[0])[0, :, -x.shape[0]:]  # causal: valid conv
    return F.silu(out).T, ext[:, -st.shape[1]:]


@pytest.mark.parametrize("L", [1, 3, 65])
@pytest.mark.parametrize("W", [3, 4])
def test_conv1d_update_matches_torch(L, W):
    C, K = 1100, 4  # C not a multiple of the channel block
    g = torch.Generator().manual_seed(L + 10 * W)
    x, w = torch.randn(2, L, C, generator=g), torch.randn(C, K, generator=g)
    st0 = torch.randn(2, C, W, generator=g)
    state, out = st0.clone().numpy(), np.empty((2, L, C), np.float32)
    cpu_gdn.conv1d_update(x.numpy(), w.numpy(), state, np.arange(2, dtype=np.int64), out)
    for n in range(2):
        ref_o, ref_s = _conv_reference(x[n], w, st0[n])
        assert _rel(out[n], ref_o) <= 1e-5
        assert np.array_equal(state[n], ref_s.numpy())


def test_conv_from_zero_state_is_transformers_prefill_conv():
    """A zero conv state is exactly transformers' causal_conv1d_fn (zero left padding)."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf35
    C, K, L = 64, 4, 70
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(1, L, C, generator=g), torch.randn(C, K, generator=g)
    state, out = np.zeros((1, C, K - 1), np.float32), np.empty((1, L, C), np.float32)
    cpu_gdn.conv1d_update(x.numpy(), w.numpy(), state, np.zeros(1, np.int64), out)
    ref = hf35.causal_conv1d_fn(x.transpose(1, 2), w, None, activation="silu").transpose(1, 2)
    assert _rel(out, ref) <= 1e-5


def test_gated_rmsnorm_matches_transformers():
    dv = 128
    g = torch.Generator().manual_seed(4)
    norm = hf.Qwen3NextRMSNormGated(dv, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(dv, generator=g))
    x, z = torch.randn(33, dv, generator=g) * 3, torch.randn(33, dv, generator=g)
    out = np.empty((33, dv), np.float32)
    cpu_gdn.gated_rmsnorm(x.numpy(), z.numpy(), norm.weight.detach().numpy(), 1e-6, out)
    with torch.no_grad():
        assert _rel(out, norm(x, z)) <= 1e-5


def _core_reference(qkv, z, b, a, conv_w, conv_st, rec_st, A_log, dt_bias, norm, Hk, dk):
    """The layer core the way transformers' Qwen3NextGatedDeltaNet.forward computes it after the projections."""
    L, C = qkv.shape
    Hv, dv = rec_st.shape[1], rec_st.shape[3]
    xc, new_conv = _conv_reference(qkv, conv_w, conv_st)
    q, k, v = xc.split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
    beta = b.sigmoid()
    decay = -A_log.exp() * F.softplus(a + dt_bias)
    o, s = _reference(q.reshape(1, L, Hk, dk), k.reshape(1, L, Hk, dk), v.reshape(1, L, Hv, dv),
                      decay[None], beta[None], rec_st)
    out = norm(o.reshape(L * Hv, dv), z.reshape(L * Hv, dv)).reshape(L, Hv * dv)
    return out, new_conv, s


@pytest.mark.parametrize("geom", [SMALL, REAL], ids=["small", "real"])
def test_gdn_core_prefill_then_decode(geom):
    """Two requests in one pool: a prefill of 65 tokens from a non-zero state, then 3 decode steps
    batched across both requests (slots), each against the transformers-composed reference."""
    Hk, Hv, dk, dv = geom
    C, K, P = 2 * Hk * dk + Hv * dv, 4, 3
    g = torch.Generator().manual_seed(sum(geom))
    conv_w = torch.randn(C, K, generator=g) * 0.5
    A_log, dt_bias = torch.randn(Hv, generator=g), torch.randn(Hv, generator=g)
    norm = hf.Qwen3NextRMSNormGated(dv, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(dv, generator=g))
    nw = norm.weight.detach().numpy()
    conv_pool = torch.randn(P, C, K - 1, generator=g)
    rec_pool = torch.randn(P, Hv, dk, dv, generator=g) * 0.05
    conv_np, rec_np = conv_pool.clone().numpy(), rec_pool.clone().numpy()
    ref_conv, ref_rec = {s: conv_pool[s] for s in range(P)}, {s: rec_pool[s:s + 1] for s in range(P)}

    def step(slots, L):
        N = len(slots)
        qkv = torch.randn(N, L, C, generator=g)
        z = torch.randn(N, L, Hv * dv, generator=g)
        b, a = torch.randn(N, L, Hv, generator=g), torch.randn(N, L, Hv, generator=g)
        out = np.empty((N, L, Hv * dv), np.float32)
        cpu_gdn.gdn_core(qkv.numpy(), z.numpy(), b.numpy(), a.numpy(), conv_w.numpy(), conv_np, rec_np,
                         np.asarray(slots, np.int64), A_log.numpy(), dt_bias.numpy(), nw, 1e-6, Hk, dk, out)
        for n, s in enumerate(slots):
            with torch.no_grad():
                ro, ref_conv[s], ref_rec[s] = _core_reference(qkv[n], z[n], b[n], a[n], conv_w, ref_conv[s],
                                                              ref_rec[s], A_log, dt_bias, norm, Hk, dk)
            assert _rel(out[n], ro) <= 1e-4
            assert _rel(conv_np[s], ref_conv[s]) <= 1e-6
            assert _rel(rec_np[s], ref_rec[s][0]) <= 1e-4

    step([2], 65)
    for _ in range(3):
        step([2, 0], 1)
    assert np.array_equal(conv_np[1], conv_pool[1].numpy()) and np.array_equal(rec_np[1], rec_pool[1].numpy())


def test_cpu_mixer_matches_torch_layer_on_a_mixed_batch():
    """layers/gdn_cpu.gated_deltanet_cpu (numba) against layers/gated_deltanet.gated_deltanet (torch,
    itself tested against transformers) on one batch of two decode rows and two prefill chunks
    (65 and 3 tokens), from non-zero states, then a second pass continuing from the states left."""
    from freetoken_py.layers.attention import AttentionMetadata, SeqAttention
    from freetoken_py.layers.gated_deltanet import GdnConfig, GdnWeights, gated_deltanet
    from freetoken_py.layers.gdn_cpu import gated_deltanet_cpu
    from freetoken_py.layers.linear import KernelLinear

    cfg = GdnConfig(num_k_heads=2, num_v_heads=4, k_head_dim=16, v_head_dim=16, conv_kernel=4, eps=1e-6)
    D, S = 48, 5
    g = torch.Generator().manual_seed(11)
    in_w = torch.randn(cfg.proj_rows, D, generator=g) * 0.2
    w = GdnWeights(KernelLinear(in_w, None, "fp32"), torch.randn(cfg.conv_dim, 4, generator=g) * 0.5,
                   torch.randn(4, generator=g), torch.randn(4, generator=g), 1 + 0.3 * torch.randn(16, generator=g))
    conv0 = torch.randn(S, cfg.conv_dim, 3, generator=g)
    rec0 = torch.randn(S, 4, 16, 16, generator=g) * 0.1
    states = {"torch": (conv0.clone(), rec0.clone()), "cpu": (conv0.clone(), rec0.clone())}
    lens, slots = [1, 65, 1, 3], [4, 0, 2, 1]
    for _ in range(2):
        offs = np.cumsum([0] + lens)
        seqs = [SeqAttention(int(offs[i]), int(offs[i + 1]), torch.zeros(0, dtype=torch.long), None)
                for i in range(len(lens))]
        meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), seqs, slots)
        x = torch.randn(int(offs[-1]), D, generator=g)
        ref = gated_deltanet(cfg, w, x, meta, *states["torch"])
        got = gated_deltanet_cpu(cfg, w, x, meta, *states["cpu"])
        assert _rel(got, ref) <= 1e-4
        for a, b in zip(states["cpu"], states["torch"]):
            assert _rel(a, b) <= 1e-4
        lens = [1, 1, 1, 7]
    assert torch.equal(states["cpu"][0][3], conv0[3]) and torch.equal(states["cpu"][1][3], rec0[3])


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next_mixed"])
def test_cpu_backend_runs_hybrids_through_the_kernels(arch, tmp_path):
    """--backend cpu: prefill through gated_deltanet_cpu, decode through HybridDecoder (both numba), for a
    batch of two ragged prompts (one longer than GDN's 64-token chunk): every step's logits match
    transformers' (prefill + 8 cached decode steps, <= 1e-4 relative)."""
    import hybrid_util
    from freetoken_py.core import SamplingParams
    from freetoken_py.engine.fused_hybrid import HybridDecoder
    from freetoken_py.layers.gdn_cpu import gated_deltanet_cpu
    from freetoken_py.llm import LLM

    path = hybrid_util.build(arch, tmp_path / arch)
    ref = hybrid_util.reference(path)
    llm = LLM(path, dtype="float32", backend="cpu", show_progress=False, max_num_seqs=2, expert_cache="off",
              enable_prefix_cache=False)
    assert llm.model.gdn_mixer is gated_deltanet_cpu and type(llm.runner.fused) is HybridDecoder
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, hybrid_util.VOCAB, (n,), generator=g).tolist() for n in (70, 9)]
    reqs = [llm.add_request(p, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)) for p in prompts]
    logits = {id(r): [] for r in reqs}
    decode_steps = 0
    while any(len(r.output_token_ids) < 9 for r in reqs):
        chunks = llm.scheduler.schedule()
        decode_steps += all(ch.num_new == 1 for ch in chunks)
        sampling = [ch for ch in chunks if ch.samples]  # before the pass moves num_computed on
        for row, ch in zip(llm.runner.forward_batch(chunks), sampling):
            logits[id(ch.req)].append(row)
            ch.req.output_token_ids.append(int(row.argmax()))
    assert decode_steps >= 8
    for r, p in zip(reqs, prompts):
        seq = torch.tensor([p + r.output_token_ids[:8]])
        with torch.no_grad():
            want = ref(seq).logits[0, len(p) - 1:]
        assert _rel(torch.stack(logits[id(r)][:9]), want) <= 1e-4
