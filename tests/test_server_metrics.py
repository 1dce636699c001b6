"""GET /metrics: the engine's counters in the Prometheus text format, read with Prometheus' own
Python parser (prometheus_client), checked against the API's usage fields and against the JSON
of /v1/freetoken/stats, over real HTTP on loopback."""
from __future__ import annotations

import math

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from freetoken_py.server.metrics import Histogram, render
from server_util import ServerThread

BODY = {"model": "demo", "messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 6,
        "temperature": 0}


def scrape(srv, headers=None) -> dict:
    """{(sample name, frozenset(labels)): value} of one scrape, parsed by prometheus_client."""
    r = httpx.get(srv.url + "/metrics", timeout=30, headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def test_metrics_agree_with_the_usage_fields_and_the_stats_json():
    with ServerThread(residency="emulate", residency_profile="rtx4090") as srv:
        usages = []
        for _ in range(2):      # the same prompt twice: the second one's prefix comes from the cache
            r = httpx.post(srv.base_url + "/chat/completions", json=BODY, timeout=120)
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
        m = scrape(srv)
        stats = srv.stats()

    def one(name, **labels):
        return m[(name, frozenset(labels.items()))]

    assert one("freetoken_requests_received_total") == one("freetoken_requests_finished_total") == 2
    assert one("freetoken_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert one("freetoken_generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert one("freetoken_prompt_tokens_cached_total") == cached > 0
    assert one("freetoken_kv_pages") == stats["num_pages"] and one("freetoken_engine_failed") == 0
    assert one("freetoken_requests_active") == 0 and one("freetoken_accepting") == 1
    # histograms: cumulative buckets, +Inf = count = the finished requests, TTFT within the latency
    for name in ("freetoken_time_to_first_token_seconds", "freetoken_request_duration_seconds"):
        buckets = sorted(((float(dict(k[1])["le"]), v) for k, v in m.items() if k[0] == name + "_bucket"))
        assert buckets[-1] == (math.inf, 2) and one(name + "_count") == 2
        assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:]))
    assert 0 < one("freetoken_time_to_first_token_seconds_sum") <= one("freetoken_request_duration_seconds_sum")
    # residency: every per-layer counter is the JSON's, under the emulation's label
    res = stats["residency"]
    tier = "emulated:rtx4090"
    assert one("freetoken_expert_slots", accelerator=tier) == res["expert_slots"] > 0
    for layer, c in res["layers"].items():
        assert one("freetoken_expert_routed_pairs_total", accelerator=tier, layer=layer) == c["routed_pairs"] > 0
        assert one("freetoken_expert_hit_pairs_total", accelerator=tier, layer=layer) == c["hit_pairs"]
        assert one("freetoken_expert_pcie_bytes_total", accelerator=tier, layer=layer) == c["pcie_bytes"]
        assert one("freetoken_expert_stall_seconds_total", accelerator=tier, layer=layer) == pytest.approx(c["stall_s"])
    # the stats JSON carries the same histograms
    assert stats["ttft_seconds"]["count"] == 2 and stats["ttft_seconds"]["buckets"][-1] == ["+Inf", 2]


def test_metrics_need_the_key_when_one_is_set():
    with ServerThread(api_key="k") as srv:
        r = httpx.get(srv.url + "/metrics", timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        m = scrape(srv, headers={"Authorization": "Bearer k"})
        assert m[("freetoken_requests_received_total", frozenset())] == 0
        assert not any(name.startswith("freetoken_expert_") for name, _ in m)    # tiers off: none


def test_histogram_buckets_are_inclusive_upper_bounds():
    h = Histogram((0.1, 1.0))
    for v in (0.1, 0.05, 0.5, 1.0, 7.0):
        h.observe(v)
    # le=0.1 holds 0.05 and 0.1 itself; le=1 adds 0.5 and 1.0; +Inf everything
    assert h.as_dict() == {"buckets": [[0.1, 2], [1.0, 4], ["+Inf", 5]], "sum": pytest.approx(8.65), "count": 5}
    with pytest.raises(ValueError):
        Histogram((1.0, 0.5))


def test_render_escapes_labels_and_leaves_out_what_a_snapshot_lacks():
    # a stale snapshot (a long step held the engine thread: no page counts) and an odd label
    snap = {"stale": True, "active": 1, "num_requests": 3, "failed": None, "accepting": True,
            "residency": {"label": 'emu"la\\ted\nx', "expert_slots": 4, "steps": 2,
                          "layers": {"1": {k: 1 for k in (
                              "routed_pairs", "hit_pairs", "stream_pairs", "cpu_pairs", "split_pairs",
                              "split_cpu_share", "pcie_bytes", "stall_s", "predicted_s", "measured_s", "cpu_tier_s",
                              "cpu_tier_bytes", "prefetch_predicted", "prefetch_correct", "prefetch_copies")}}}}
    fams = {f.name: f for f in text_string_to_metric_families(render(snap))}
    assert "freetoken_kv_pages" not in fams and "freetoken_time_to_first_token_seconds" not in fams
    assert fams["freetoken_requests_received"].samples[0].value == 3
    sample = fams["freetoken_expert_slots"].samples[0]
    assert sample.labels == {"accelerator": 'emu"la\\ted\nx'} and sample.value == 4


def test_llm_stats_snapshot_follows_a_request_through_the_engine():
    """LLM.stats(), what the stats route and /metrics read: counts checked against what the
    request must hold at each point (its pages from its token count), not against the pools."""
    from freetoken_py.cli import DEMO_MODEL
    from freetoken_py.core import SamplingParams
    from freetoken_py.llm import LLM

    llm = LLM(DEMO_MODEL, dtype="float32", show_progress=False, max_model_len=512)
    idle = llm.stats()
    assert idle["free_pages"] == idle["num_pages"] and idle["num_pages"] * idle["page_size"] == llm.kv_capacity_tokens
    assert (idle["cached_pages"], idle["running"], idle["waiting"], idle["kv_fp8_clipped"]) == (0, 0, 0, 0)
    assert "residency" not in idle  # tiers off
    prompt = list(range(5, 5 + 3 * idle["page_size"] + 1))  # 3 whole pages and one token
    req = llm.add_request(prompt, SamplingParams(max_tokens=4, temperature=0))
    assert llm.stats()["waiting"] == 1
    llm.step()  # the prefill: 4 pages for the prompt
    mid = llm.stats()
    assert (mid["running"], mid["waiting"]) == (1, 0) and mid["free_pages"] == idle["num_pages"] - 4
    while not req.finished:
        llm.step()
    done = llm.stats()
    assert done["running"] == 0 and done["free_pages"] + done["cached_pages"] == done["num_pages"]
    assert done["cached_pages"] >= 3  # the prompt's whole pages stay cached
