"""lm-evaluation-harness (PyPI `lm-eval`, in the test extra) runs a
log-likelihood (multiple-choice) task from a local data file against a real `freetoken serve`
through its `local-completions` model (echo + logprobs, token-id prompts); its per-example
log-likelihoods equal transformers' on the same checkpoint, teacher-forced (1e-4 per token)."""
from __future__ import annotations

import json

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")  # the test extra installs it; a bare install skips

from freetoken_py.cli import DEMO_MODEL  # noqa: E402

DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " a small dog"], "answer": 0},
    {"question": "def add(a, b):\n    return", "choices": [" a + b", " None", " print(a)"], "answer": 0},
    {"question": "Water boils at 100 degrees", "choices": [" Celsius", " Fahrenheit"], "answer": 0},
]
TASK = """task: freetoken_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def srv():
    from server_util import ServerThread

    with ServerThread(max_model_len=256) as s:
        yield s


def reference_loglikelihood(hf, tok, context: str, continuation: str) -> float:
    """transformers: the continuation's summed log-softmax after the context, tokenized as
    lm-eval's _encode_pair does (whole string, the context's tokens split off)."""
    whole = tok.encode(context + continuation, add_special_tokens=False)
    n_ctx = len(tok.encode(context, add_special_tokens=False))
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([whole])).logits[0].float(), dim=-1)
    return sum(float(lp[i - 1, whole[i]]) for i in range(n_ctx, len(whole)))


def test_lm_eval_local_completions_loglikelihoods_equal_transformers(srv, tmp_path):
    from conftest import reference_model
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    args = (f"model=demo,base_url={srv.base_url}/completions,tokenizer_backend=huggingface,"
            f"tokenizer={DEMO_MODEL},num_concurrent=1,max_retries=1,tokenized_requests=True")
    out = simple_evaluate(model="local-completions", model_args=args, tasks=["freetoken_local_mc"],
                          task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
                          batch_size=1)
    samples = out["samples"]["freetoken_local_mc"]
    hf, tok = reference_model(DEMO_MODEL), AutoTokenizer.from_pretrained(DEMO_MODEL)
    checked = 0
    for s in samples:
        for (context, continuation), resp in zip(s["arguments"], s["resps"], strict=True):
            got = resp[0][0]
            want = reference_loglikelihood(hf, tok, context, continuation)
            n = len(tok.encode(context + continuation, add_special_tokens=False))
            assert abs(got - want) < 1e-4 * n, (context, continuation, got, want)
            checked += 1
    assert checked == sum(len(d["choices"]) for d in DOCS)
    assert 0 <= out["results"]["freetoken_local_mc"]["acc,none"] <= 1
