"""logprobs / top_logprobs / echo / n through a real `freetoken serve` (demo model, fp32) on
127.0.0.1, against the independent reference: transformers' log_softmax of the same checkpoint's
logits, teacher-forced (greedy continuations computed by transformers itself), 1e-4, top-k order
included; token strings compared through the checkpoint's own tokenizer."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from freetoken_py.cli import DEMO_MODEL
from freetoken_py.tokenizer import Tokenizer

TOL = 1e-4
MAX_NUM_SEQS = 6


@pytest.fixture(scope="module")
def srv():
    from server_util import ServerThread

    with ServerThread(max_num_seqs=MAX_NUM_SEQS, max_model_len=512) as s:
        yield s


@pytest.fixture(scope="module")
def hf():
    from conftest import reference_model

    return reference_model(DEMO_MODEL)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(DEMO_MODEL)


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.base_url + path, json={"model": "m", **body}, timeout=120)


def reference(hf, ids: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of `ids` (new tokens) and the log-softmax rows
    [len(ids) + new - 1, V]: row p scores token p + 1."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(new):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return ids, lp[:-1]


def text_of(tok, i: int) -> str:
    return tok.decode([i], skip_special_tokens=False)


def check_completion_lps(got: dict, ids: list[int], rows: torch.Tensor, k: int, tok, first_null: bool) -> None:
    """/v1/completions' parallel lists: tokens[i] is ids[i], scored by rows[i - 1] (or null)."""
    assert got["tokens"] == [text_of(tok, i) for i in ids]
    start = 1 if first_null else 0
    if first_null:
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    for j in range(start, len(ids)):
        row = rows[j - 1] if first_null else rows[j]
        assert abs(got["token_logprobs"][j] - float(row[ids[j]])) < TOL
        vals, best = torch.topk(row, k)
        top = list(got["top_logprobs"][j].items())
        assert [t for t, _ in top[:k]] == [text_of(tok, i) for i in best.tolist()]
        assert all(abs(v - float(x)) < TOL for (_, v), x in zip(top, vals))


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_completions_echo_logprobs_equal_transformers(srv, hf, tok, max_tokens):
    ids = tok.encode("The capital of France is Paris. The capital of Italy is")
    r = post(srv, "/completions", dict(prompt=ids, max_tokens=max_tokens, echo=True, logprobs=3, temperature=0,
                                       ignore_eos=True))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    full, rows = reference(hf, ids, max_tokens)
    check_completion_lps(choice["logprobs"], full, rows, 3, tok, first_null=True)
    assert choice["text"] == tok.decode(ids, skip_special_tokens=False) + tok.decode(full[len(ids):])
    offsets = choice["logprobs"]["text_offset"]
    assert offsets == [sum(len(text_of(tok, i)) for i in full[:j]) for j in range(len(full))]
    assert r.json()["usage"]["completion_tokens"] == max_tokens


def test_completions_logprobs_without_echo_streamed_and_not(srv, hf, tok):
    ids = tok.encode("def fibonacci(n):")
    body = dict(prompt=ids, max_tokens=4, logprobs=2, temperature=0, ignore_eos=True)
    plain = post(srv, "/completions", body).json()["choices"][0]["logprobs"]
    full, rows = reference(hf, ids, 4)
    check_completion_lps(plain, full[len(ids):], rows[len(ids) - 1:], 2, tok, first_null=False)
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in sse(srv, "/completions", body):
        lps = chunk["choices"][0]["logprobs"] if chunk["choices"] else None
        for key in streamed if lps else ():
            streamed[key] += lps[key]
    assert streamed == plain


def sse(srv, path: str, body: dict) -> list[dict]:
    out = []
    with httpx.stream("POST", srv.base_url + path, json={"model": "m", "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def test_chat_logprobs_equal_transformers_streamed_and_not(srv, hf, tok):
    messages = [{"role": "user", "content": "Name three colours."}]
    prompt = tok.encode(tok.apply_chat_template(messages))
    body = dict(messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=4, ignore_eos=True)
    r = post(srv, "/chat/completions", body).json()
    assert r["usage"]["prompt_tokens"] == len(prompt)
    content = r["choices"][0]["logprobs"]["content"]
    full, rows = reference(hf, prompt, 5)
    for item, tid, row in zip(content, full[len(prompt):], rows[len(prompt) - 1:], strict=True):
        assert item["token"] == text_of(tok, tid) and item["bytes"] == list(item["token"].encode())
        assert abs(item["logprob"] - float(row[tid])) < TOL
        vals, best = torch.topk(row, 4)
        assert [t["token"] for t in item["top_logprobs"]] == [text_of(tok, i) for i in best.tolist()]
        assert all(abs(t["logprob"] - float(v)) < TOL for t, v in zip(item["top_logprobs"], vals))
    streamed = [c for ch in sse(srv, "/chat/completions", body) for choice in ch["choices"]
                if choice["logprobs"] for c in choice["logprobs"]["content"]]
    assert streamed == content


def test_n4_seeded_gives_four_completions_and_reads_the_prompt_once(srv):
    """33 prompt tokens (page size 16): the first choice computes them, the three others find 32
    of them in the prefix cache (stats count each request)."""
    ids = list(range(100, 133))
    before = srv.stats()
    body = dict(prompt=ids, max_tokens=8, temperature=1.0, seed=11, n=4, ignore_eos=True, cache_salt="n4")
    r = post(srv, "/completions", body).json()
    after = srv.stats()
    texts = [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3] and len(set(texts)) == 4
    assert r["usage"]["prompt_tokens"] == 33 and r["usage"]["completion_tokens"] == 32
    assert after["prompt_tokens"] - before["prompt_tokens"] == 4 * 33
    assert after["cached_prompt_tokens"] - before["cached_prompt_tokens"] == 3 * 32
    again = post(srv, "/completions", body).json()   # seeded: the same four again
    assert [c["text"] for c in sorted(again["choices"], key=lambda c: c["index"])] == texts


def test_n2_chat_streamed_carries_both_indices(srv):
    chunks = sse(srv, "/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=2,
                                                temperature=1.0, seed=5, stream_options={"include_usage": True}))
    finished = [c["index"] for ch in chunks for c in ch["choices"] if c["finish_reason"]]
    assert sorted(finished) == [0, 1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("path,body,param", [
    ("/chat/completions", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("/chat/completions", dict(top_logprobs=2), "top_logprobs"),
    ("/chat/completions", dict(n=MAX_NUM_SEQS + 1), "n"),
    ("/completions", dict(logprobs=21), "logprobs"),
    ("/completions", dict(n=MAX_NUM_SEQS + 1), "n"),
    ("/completions", dict(n=2, best_of=3), "best_of"),
    ("/completions", dict(suffix="x"), "suffix"),
    ("/completions", dict(max_tokens=0), "max_tokens"),
    ("/responses", dict(top_logprobs=21, include=["message.output_text.logprobs"]), "top_logprobs"),
    ("/chat/completions", dict(modalities=["text", "audio"]), "modalities"),
    ("/chat/completions", dict(audio={"voice": "alloy", "format": "wav"}), "audio"),
    ("/chat/completions", dict(web_search_options={}), "web_search_options"),
    ("/responses", dict(background=True), "background"),
])
def test_bad_fields_are_openai_400s(srv, path, body, param):
    base = {"/chat/completions": dict(messages=[{"role": "user", "content": "hi"}], max_tokens=2),
            "/completions": dict(prompt="hi", max_tokens=2), "/responses": dict(input="hi", max_output_tokens=2)}[path]
    r = post(srv, path, {**base, **body})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert param in err["message"] or param in ("audio", "modalities") and "audio" in err["message"]


def test_echo_with_a_prompt_over_the_context_is_a_400(srv):
    r = post(srv, "/completions", dict(prompt=[5] * 600, max_tokens=0, echo=True, logprobs=1))
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]


def test_responses_include_output_text_logprobs_streamed_and_not(srv, hf, tok):
    body = dict(input="Name three colours.", max_output_tokens=4, temperature=0, top_logprobs=2,
                include=["message.output_text.logprobs", "reasoning.encrypted_content"])
    r = post(srv, "/responses", body).json()
    (part,) = [p for item in r["output"] if item["type"] == "message" for p in item["content"]]
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three colours."}]))
    full, rows = reference(hf, prompt, 4)
    for item, tid, row in zip(part["logprobs"], full[len(prompt):], rows[len(prompt) - 1:], strict=True):
        assert item["token"] == text_of(tok, tid) and abs(item["logprob"] - float(row[tid])) < TOL
        assert [t["token"] for t in item["top_logprobs"]] == [text_of(tok, i) for i in torch.topk(row, 2)[1].tolist()]
    events = []
    with httpx.stream("POST", srv.base_url + "/responses", json={"model": "m", "stream": True, **body},
                      timeout=120) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    deltas = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    done = [e for e in events if e["type"] == "response.output_text.done"]
    assert deltas == part["logprobs"] and done[0]["logprobs"] == part["logprobs"]
    plain = post(srv, "/responses", dict(body, include=[])).json()
    assert all(p["logprobs"] == [] for item in plain["output"] if item["type"] == "message" for p in item["content"])


def test_logit_bias_changes_the_greedy_token_and_not_the_logprobs(srv, hf, tok):
    """+100 on a token makes greedy pick it; its logprob stays the model's (raw distribution)."""
    ids = tok.encode("def fibonacci(n):")
    _, rows = reference(hf, ids, 1)
    row = rows[len(ids) - 1]   # the next token's distribution
    target = int(torch.argsort(row)[len(row) // 2])   # a middling token, never the argmax
    r = post(srv, "/completions", dict(prompt=ids, max_tokens=1, temperature=0, logprobs=0,
                                       logit_bias={str(target): 100})).json()["choices"][0]["logprobs"]
    assert r["tokens"] == [text_of(tok, target)]
    assert abs(r["token_logprobs"][0] - float(row[target])) < TOL


@pytest.mark.parametrize("bias", [{"x": 1}, {"5": 101}, {"99999999": 1}, {"5": "1"}])
def test_bad_logit_bias_is_a_400(srv, bias):
    r = post(srv, "/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                            logit_bias=bias))
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
