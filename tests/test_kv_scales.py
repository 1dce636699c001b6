"""FP8 KV scales: calibrated at start-up on the shipped real text (per layer and head, checked
against the exact K/V an fp32 cache stores for the same prefill), cached in a --kv-scales file
(round trip, refused for another configuration), and values beyond the range counted."""
from __future__ import annotations

import json

import pytest
import torch

from freetoken_py.core import Request, SamplingParams
from freetoken_py.engine.runner import ScheduledChunk
from freetoken_py.errors import FreetokenError
from freetoken_py.kvcache import KVCache
from freetoken_py.kvcache.pool import FP8, FP8_MARGIN, FP8_MAX
from freetoken_py.llm import CORPUS_DIR, LLM
from test_eval_kld import _tiny

KW = dict(backend="torch", show_progress=False, kv_cache_bytes=1 << 22, max_num_seqs=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _tiny(tmp_path_factory.mktemp("kvs"), 3)


def test_values_beyond_the_range_are_clipped_and_counted():
    cache = KVCache(2, 4, 4, 2, 8, FP8)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g)
    cache.write(1, torch.arange(4), k, v)                 # calibrates layer 1: nothing can clip
    assert cache.clipped == 0
    big_k, big_v = k * 5, v * 1.5
    cache.write(1, torch.arange(4, 8), big_k, big_v)
    want = sum(int((x.abs() / s[None, :, None] > FP8_MAX).sum())
               for x, s in ((big_k, cache.k_scale[1]), (big_v, cache.v_scale[1])))
    assert want > 0 and cache.clipped == want and cache.clipped_per_layer.tolist() == [0, want]
    back, _ = cache.read(1, torch.arange(4, 8))
    assert back.abs().max() <= FP8_MAX * cache.k_scale[1].max() + 1e-6


def test_scales_come_from_the_shipped_text_per_layer_and_head(tiny):
    fp8 = LLM(tiny, kv_dtype="fp8", **KW)
    ids, source = fp8.calibration_ids()
    tok = fp8.tokenizer
    prose, code = (tok.encode((CORPUS_DIR / f"calib_{k}.txt").read_text(), add_special_tokens=False)
                   for k in ("prose", "code"))
    assert ids == prose[:255] + code[:256] and "corpus" in source    # 511: the model's context is 512
    assert fp8.kv_calibration == {"source": source, "tokens": 511}
    # the same prefill through an fp32 cache stores the exact K/V: absmax per (layer, head) x margin
    exact = LLM(tiny, kv_dtype="fp32", **KW)
    req = Request(ids, SamplingParams())
    req.page_table = exact.allocator.allocate(-(-len(ids) // exact.config.page_size))
    exact.runner.forward_batch([ScheduledChunk(req, len(ids))])
    slots = exact.runner.cache.slots(req.page_table, 0, len(ids))
    for layer in range(exact.args.num_layers):
        k, v = exact.runner.cache.read(layer, slots)       # [T, Hkv, hd]
        for got, x in ((fp8.runner.cache.k_scale[layer], k), (fp8.runner.cache.v_scale[layer], v)):
            torch.testing.assert_close(got, x.abs().amax(dim=(0, 2)) * FP8_MARGIN / FP8_MAX, rtol=1e-5, atol=0)


def test_without_a_tokenizer_the_scales_come_from_random_ids(checkpoint_factory):
    llm = LLM(checkpoint_factory("qwen3_moe"), kv_dtype="fp8", **KW)
    assert llm.runner.cache.calibrated and llm.kv_calibration["source"].startswith("random ids")


def test_kv_scales_file_round_trip_and_refusals(tiny, tmp_path):
    path = tmp_path / "scales.json"
    first = LLM(tiny, kv_dtype="fp8", kv_scales=str(path), **KW)
    data = json.loads(path.read_text())
    assert data["format"] == "freetoken-kv-scales" and data["calibration"]["tokens"] == 511
    second = LLM(tiny, kv_dtype="fp8", kv_scales=str(path), **KW)
    c1, c2 = first.runner.cache, second.runner.cache
    assert torch.equal(c1.k_scale, c2.k_scale) and torch.equal(c1.v_scale, c2.v_scale) and c2.calibrated
    assert c2.scales_fingerprint() == c1.scales_fingerprint()
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert first.generate([[5, 6, 7, 8]], greedy)[0].token_ids == second.generate([[5, 6, 7, 8]], greedy)[0].token_ids

    data["key"]["backend"] = "cpu"
    path.write_text(json.dumps(data))
    with pytest.raises(FreetokenError, match="key differs in backend"):
        LLM(tiny, kv_dtype="fp8", kv_scales=str(path), **KW)
    data["key"]["backend"] = "torch"
    data["k_scale"] = data["k_scale"][:1]
    path.write_text(json.dumps(data))
    with pytest.raises(FreetokenError, match=r"k_scale: shape \(1, 2\)"):
        LLM(tiny, kv_dtype="fp8", kv_scales=str(path), **KW)
    path.write_text("{not json")
    with pytest.raises(FreetokenError, match="not a readable JSON file"):
        LLM(tiny, kv_dtype="fp8", kv_scales=str(path), **KW)


def test_the_server_reports_the_clip_count():
    import httpx

    from server_util import ServerThread
    from test_server_metrics import BODY, scrape

    with ServerThread(kv_dtype="fp8") as srv:
        r = httpx.post(srv.base_url + "/chat/completions", json=BODY, timeout=120)
        assert r.status_code == 200, r.text
        stats, m = srv.stats(), scrape(srv)
    assert stats["kv_fp8_clipped"] == m[("freetoken_kv_fp8_clipped_total", frozenset())] == 0
