"""Prefix-state reuse on hybrid models (Gated DeltaNet + full attention): a request resumed from a
cached snapshot of the recurrent state must compute exactly what a fresh engine computes from
scratch. The reference is the same engine with the prefix cache off (itself checked against
transformers in tests/test_hybrid_models.py); logits are read where the engine computes them
(ModelRunner.forward_batch, observed, not replaced)."""
from __future__ import annotations

import json
import math
import shutil

import httpx
import pytest
import torch

import hybrid_util
from freetoken_py.core import Request, SamplingParams
from freetoken_py.llm import LLM

PAGE = 8
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, hybrid_util.VOCAB, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    made = {}

    def make(name="qwen3_5_moe"):
        if name not in made:
            made[name] = hybrid_util.build(name, tmp_path_factory.mktemp(name))
        return made[name]

    return make


def _llm(path, backend="torch", **kw):
    return LLM(path, backend=backend, page_size=PAGE, show_progress=False, max_num_batched_tokens=32, **kw)


def _run(llm, prompt, params=GREEDY):
    """Generate alone; returns (output, the logits of each step, tokens the runner computed, passes)."""
    seen, computed, passes = [], [0], [0]
    forward = llm.runner.forward_batch

    def observe(chunks, *a, **k):
        samples = any(ch.samples for ch in chunks)      # (before the pass advances num_computed)
        out = forward(chunks, *a, **k)
        computed[0] += sum(ch.num_new for ch in chunks)
        passes[0] += 1
        if samples:
            seen.append(out[-1].clone())
        return out

    llm.runner.forward_batch = observe
    try:
        out = llm.generate([prompt], params)[0]
    finally:
        llm.runner.forward_batch = forward
    return out, torch.stack(seen), computed[0], passes[0]


def _same(a, b):
    (oa, la, *_), (ob, lb, *_) = a, b
    assert oa.token_ids == ob.token_ids
    assert (la - lb).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name,backend", [("qwen3_5_moe", "torch"), ("qwen3_5_moe", "cpu"), ("qwen3_next", "torch")])
def test_turn_two_from_cached_state_equals_fresh(hybrid, name, backend):
    path = hybrid(name)
    on, off = _llm(path, backend), _llm(path, backend, enable_prefix_cache=False)
    assert on.scheduler.states.in_layer                  # both backends' mixers capture inside a chunk
    turn1 = _prompt(45, 1)                               # > one prefill chunk (32), ends mid-page
    first = _run(on, turn1)
    _same(first, _run(off, turn1))
    # the next turn keeps the generated tokens: resumes from the decode-time snapshot at 48
    turn2 = turn1 + first[0].token_ids + _prompt(7, 2)
    again = _run(on, turn2)
    _same(again, _run(off, turn2))
    assert again[0].num_cached_tokens == 48
    assert again[2] == len(turn2) - 48 + GREEDY.max_tokens - 1  # cached_tokens is what was skipped
    # an agent re-serialises its call: diverges right after turn 1's prompt, whose end was snapshotted
    turn2b = turn1 + _prompt(9, 3)
    other = _run(on, turn2b)
    _same(other, _run(off, turn2b))
    assert other[0].num_cached_tokens == 40
    assert on.snapshots.num_mismatches == 0 and on.tracker.num_mismatches == 0


@pytest.mark.parametrize("in_layer", [True, False])
def test_partial_overlap_resumes_from_the_deepest_earlier_snapshot(hybrid, in_layer):
    path = hybrid()
    on, off = _llm(path, snapshot_every_pages=2), _llm(path, enable_prefix_cache=False)
    assert on.scheduler.states.in_layer                  # the torch mixer captures inside a chunk
    on.scheduler.states.in_layer = in_layer              # False: chunks are cut at the points instead
    base = _prompt(6 * PAGE + 3, 4)
    first = _run(on, base)                               # snapshots at 16, 32, 48 (every 2 pages + the end)
    # one pass per 32-token chunk when captured inside (32 + 19), else cut at 16, 32, 48 (16 + 16 + 16 + 3)
    assert first[3] == (2 if in_layer else 4) + GREEDY.max_tokens - 1
    for diverge, resume in ((3 * PAGE + 3, 2 * PAGE), (4 * PAGE, 4 * PAGE), (PAGE + 1, 0)):
        prompt = base[:diverge] + _prompt(10, diverge)
        out = _run(on, prompt)
        _same(out, _run(off, prompt))
        assert out[0].num_cached_tokens == resume, diverge


def test_eviction_under_a_tiny_pool_stays_exact(hybrid):
    path = hybrid()
    # 9 pages and 3 snapshot slots for 2 interleaved conversations (each turn snapshots its prompt's
    # end and its decode): pages and snapshots are evicted, and the latest snapshots are reused
    on = _llm(path, prefix_snapshots=3, kv_cache_bytes=9 * PAGE * 512 + 3 * 16896)
    off = _llm(path, enable_prefix_cache=False)
    histories = [_prompt(3 * PAGE + 2, 10 + i) for i in range(2)]
    for turn in range(3):
        for i, h in enumerate(histories):
            out = _run(on, h, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
            ref = _run(off, h, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
            _same(out, ref)
            histories[i] = h + out[0].token_ids + _prompt(5, 100 * turn + i)
    assert on.prefix_cache.num_snapshots_evicted > 0 and on.prefix_cache.num_evicted > 0
    assert on.snapshots.num_restored > 0 and on.snapshots.num_mismatches == 0


def test_a_corrupted_snapshot_is_caught_and_not_used(hybrid):
    path = hybrid()
    on, off = _llm(path, snapshot_every_pages=2), _llm(path, enable_prefix_cache=False)
    turn1 = _prompt(5 * PAGE + 1, 5)
    _run(on, turn1)                                      # snapshots at 16, 32, 40
    ns = on._cache_namespace(Request([1], SamplingParams()))
    ref = on.prefix_cache.snapshot_at(ns, turn1[:5 * PAGE])
    on.runner.states.rec[0][ref.slot].mul_(1.001)        # bytes of the deepest snapshot change
    turn2 = turn1 + _prompt(6, 6)
    out = _run(on, turn2)
    _same(out, _run(off, turn2))
    assert on.snapshots.num_mismatches == 1
    assert out[0].num_cached_tokens == 4 * PAGE          # the next shallower snapshot, intact


def _build_chat_model(out):
    """The tiny qwen3_5_moe of hybrid_util with the demo model's tokenizer and chat template."""
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig

    from freetoken_py.cli import DEMO_MODEL

    vocab = json.loads((DEMO_MODEL / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    geometry = dict(hybrid_util._COMMON, vocab_size=vocab, max_position_embeddings=2048)
    model = AutoModelForCausalLM.from_config(Qwen3_5MoeTextConfig(head_dim=32, **geometry))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif n.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(math.log(0.5), math.log(8.0)))
            elif n.endswith("dt_bias"):
                p.normal_(0, 1.0)
    model.float().save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL / f, out / f)
    return out


def test_ten_turn_agent_conversation_over_http_reuses_its_prompt(tmp_path):
    from server_util import ServerThread

    path = _build_chat_model(tmp_path / "hybrid_chat")
    system = "You are a coding agent. Tools: read_file, write_file, run_tests, search. " * 20
    messages = [{"role": "system", "content": system}]
    with ServerThread(model_dir=path, page_size=PAGE, backend="torch") as srv:
        shares = []
        for turn in range(10):
            messages.append({"role": "user", "content": f"Step {turn}: run the tests and fix file_{turn}.py"})
            r = httpx.post(srv.base_url + "/chat/completions", timeout=120, json={
                "model": "m", "messages": messages, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            usage = body["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            shares.append(cached / usage["prompt_tokens"])
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"] or ""})
        stats = srv.stats()
    assert shares[0] == 0
    assert min(shares[1:]) >= 0.9, shares
    assert stats.get("state_bytes_per_request", 0) > 0
    snaps = stats["state_snapshots"]
    assert snaps["restored"] >= 9 and snaps["refused"] == 0 and snaps["held"] <= snaps["slots"]


def test_preempted_requests_resume_from_their_snapshots(hybrid):
    path = hybrid()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [_prompt(3 * PAGE + 3, 20 + i) for i in range(3)]
    off = _llm(path, enable_prefix_cache=False)
    expected = [o.token_ids for o in off.generate(prompts, params)]
    # 14 pages for 3 requests growing to 5 pages each: the newest is preempted and recomputed,
    # resuming from the snapshots it published on the way out
    on = _llm(path, kv_cache_bytes=14 * PAGE * 512 + 6 * 16896, prefix_snapshots=6)
    assert [o.token_ids for o in on.generate(prompts, params)] == expected
    assert on.scheduler.num_preemptions > 0 and on.snapshots.num_restored > 0
    assert on.snapshots.num_mismatches == 0 and on.tracker.num_mismatches == 0


def test_what_a_cached_turn_and_its_decode_cost_counted(hybrid):
    """Everything a cached turn does before its first token, counted (no clock): the runner
    computes exactly the uncached suffix in one pass, the state is never zeroed, and it moves two
    snapshots' bytes (the restore, the capture at the prompt's last page) and checksums two (the
    restore's check, the capture's seal). Decoding then copies the state once per page boundary it
    crosses with no checksum (the rolling snapshot), sealed once when the request publishes it;
    the next turn resumes from it exactly."""
    path = hybrid()
    on, off = _llm(path), _llm(path, enable_prefix_cache=False)
    pool, store = on.runner.states, on.snapshots
    slot = pool.bytes_per_slot
    turn1 = _prompt(45, 1)
    on.generate([turn1], GREEDY)                          # snapshot of its last page (40)
    turn2 = turn1 + _prompt(9, 3)                         # 54 tokens: resumes at 40, captures at 48
    computed, passes = [0], [0]
    forward = on.runner.forward_batch

    def observe(chunks, *a, **k):
        computed[0] += sum(ch.num_new for ch in chunks)
        passes[0] += 1
        return forward(chunks, *a, **k)

    on.runner.forward_batch = observe
    counts = lambda: (pool.bytes_zeroed, store.bytes_copied, store.bytes_checksummed)  # noqa: E731
    z0, c0, s0 = counts()
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    req = on.add_request(turn2, params)
    while not req.output_token_ids:
        on.step()
    z1, c1, s1 = counts()
    assert req.num_cached_tokens == 40
    assert (computed[0], passes[0]) == (len(turn2) - 40, 1)
    assert (z1 - z0, c1 - c0, s1 - s0) == (0, 2 * slot, 2 * slot)
    while not req.finished:                               # 54 -> 73 computed: crosses 56, 64 and 72
        on.step()
        if not req.finished:
            assert store.bytes_checksummed == s1          # no checksum while it decodes
    z2, c2, s2 = counts()
    assert (z2 - z1, c2 - c1, s2 - s1) == (0, 3 * slot, slot)   # three rolling copies, one seal
    on.runner.forward_batch = forward
    turn3 = turn2 + req.output_token_ids + _prompt(5, 7)
    out = _run(on, turn3)
    _same(out, _run(off, turn3))
    assert out[0].num_cached_tokens == 72 and store.num_mismatches == 0


def test_residency_tiers_run_a_hybrid_with_its_prefix_state(hybrid):
    """--emulate-gpu on a hybrid: the routed experts go through the residency tiers (telemetry
    counts them), the Gated DeltaNet layers and their snapshots stay as they are; a two-turn
    conversation gives the cpu backend's greedy tokens, turn 2 resumed from cached state."""
    path = hybrid()
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    emu = _llm(path, backend="auto", residency="emulate", residency_profile="rtx4060-laptop-8g")
    ref = _llm(path, backend="cpu", enable_prefix_cache=False)
    turn1 = _prompt(45, 11)
    a, b = emu.generate([turn1], params)[0], ref.generate([turn1], params)[0]
    assert a.token_ids == b.token_ids
    turn2 = turn1 + a.token_ids + _prompt(6, 12)
    a, b = emu.generate([turn2], params)[0], ref.generate([turn2], params)[0]
    assert a.token_ids == b.token_ids and a.num_cached_tokens == 48
    res = emu.stats()["residency"]
    assert res["steps"] > 0 and res["expert_slots"] > 0
    assert emu.snapshots.num_restored == 1 and emu.snapshots.num_mismatches == 0
