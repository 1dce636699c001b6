"""The bundled demo model (freetoken_py/data/demo_model/): files, formats, template, loadability.

Expectations are checked against independent references: the `tokenizers` library for the
tokenizer round trip, jinja2's sandbox for the chat template, transformers for the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DEMO_DIR = Path(__file__).resolve().parents[1] / "freetoken_py" / "data" / "demo_model"
REQUIRED = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"}
OPTIONAL = {"chat_template.jinja"}
MAX_BYTES = 30 * 1024 * 1024

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a text file and return its contents.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is in src/app.py?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "read_file", "arguments": {"path": "src/app.py"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "print('hi')"},
    {"role": "assistant", "content": "It prints `hi`."},
    {"role": "user", "content": "Now read setup.py."},
    # OpenAI clients send the arguments as a JSON string: rendered verbatim.
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_2", "type": "function",
         "function": {"name": "read_file", "arguments": "{\"path\": \"setup.py\"}"}}]},
    {"role": "tool", "tool_call_id": "call_2", "content": "from setuptools import setup"},
]

SNIPPET = (
    "import os\n\n\ndef walk(root: str) -> list[str]:\n"
    "    \"\"\"Return every file under *root* — sorted, “unicode” too: é ß 中文 🙂.\"\"\"\n"
    "    out = []\n\tfor d, _, names in os.walk(root):   \n"
    "        out += [os.path.join(d, n) for n in names if n != '']  # trailing  \r\n"
    "    return sorted(out)\n\n\n\n")


def _read_json(name):
    return json.loads((DEMO_DIR / name).read_text(encoding="utf-8"))


def _render(source, **kwargs):
    """Render like the runtime: an immutable sandbox with only `tojson` added."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(**kwargs)
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    return env.from_string(source).render(messages=CONVERSATION, tools=TOOLS,
                                          add_generation_prompt=True)


def test_files_exist_and_fit_the_size_budget():
    names = {p.name for p in DEMO_DIR.iterdir()}
    assert REQUIRED <= names
    assert names <= REQUIRED | OPTIONAL, f"leftover files: {names - REQUIRED - OPTIONAL}"
    total = sum((DEMO_DIR / n).stat().st_size for n in names)
    assert total <= MAX_BYTES, total


def test_config_is_a_real_qwen3_moe():
    cfg = _read_json("config.json")
    assert cfg["model_type"] == "qwen3_moe"
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    assert num_experts > cfg["num_experts_per_tok"] >= 2
    assert cfg["norm_topk_prob"] is True and cfg["tie_word_embeddings"] is False
    assert cfg["mlp_only_layers"] == [] and cfg["decoder_sparse_step"] == 1


def test_special_token_ids_agree_across_files():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    cfg, gen, tcfg = (_read_json(n) for n in
                      ("config.json", "generation_config.json", "tokenizer_config.json"))
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert tok.get_vocab_size() == cfg["vocab_size"]
    assert cfg["eos_token_id"] == im_end and cfg["bos_token_id"] == eot
    assert gen["eos_token_id"] == [im_end, eot] and gen["pad_token_id"] == eot
    assert tcfg["eos_token"] == "<|im_end|>" and tcfg["pad_token"] == "<|endoftext|>"
    assert tcfg["bos_token"] is None and tcfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    added = {t["content"]: t["special"] for t in _read_json("tokenizer.json")["added_tokens"]}
    assert added == {"<|endoftext|>": True, "<|im_start|>": True, "<|im_end|>": True,
                     "<tool_call>": False, "</tool_call>": False, "<tool_response>": False,
                     "</tool_response>": False, "<think>": False, "</think>": False}
    for marker in added:  # each marker is one token, never split
        assert tok.encode(f"x{marker}y").tokens[1] == marker


def test_tokenizer_is_qwen2_style_byte_level_and_round_trips_code():
    from tokenizers import Tokenizer

    spec = _read_json("tokenizer.json")
    pre = spec["pre_tokenizer"]["pretokenizers"]
    assert [p["type"] for p in pre] == ["Split", "ByteLevel"]
    assert spec["decoder"]["type"] == "ByteLevel" and spec["model"]["type"] == "BPE"
    tok = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    ids = tok.encode(SNIPPET).ids
    assert tok.decode(ids, skip_special_tokens=False) == SNIPPET
    assert len(ids) < len(SNIPPET.encode()) / 2  # it learned merges, not just bytes


def test_chat_template_renders_tools_calls_and_results_in_the_sandbox():
    source = _read_json("tokenizer_config.json")["chat_template"]
    text = _render(source)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "read_file", "arguments": '
            '{"path": "src/app.py"}}\n</tool_call><|im_end|>\n') in text
    assert '{"name": "read_file", "arguments": {"path": "setup.py"}}' in text
    assert ("<|im_start|>user\n<tool_response>\nprint('hi')\n</tool_response><|im_end|>\n"
            in text)
    assert text.count("<tool_call>\n") == 3  # two calls + the instruction in the system turn
    assert text.count("<tool_response>") == 2
    assert text.endswith("<|im_start|>assistant\n")
    # transformers renders with trim_blocks/lstrip_blocks; the template must not care.
    assert _render(source, trim_blocks=True, lstrip_blocks=True) == text


def test_chat_template_without_tools_is_plain_chatml():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    source = _read_json("tokenizer_config.json")["chat_template"]
    env = ImmutableSandboxedEnvironment()
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    text = env.from_string(source).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"


def _safetensors_header(path):
    """The tensor table of a .safetensors file, read without torch (u64 length + JSON)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def test_checkpoint_uses_per_expert_bf16_tensors():
    cfg = _read_json("config.json")
    header = _safetensors_header(DEMO_DIR / "model.safetensors")
    assert {t["dtype"] for t in header.values()} == {"BF16"}
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    for layer in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp."
        assert header[prefix + "gate.weight"]["shape"] == [num_experts, hidden]
        for e in range(num_experts):
            assert header[f"{prefix}experts.{e}.gate_proj.weight"]["shape"] == [inter, hidden]
            assert header[f"{prefix}experts.{e}.up_proj.weight"]["shape"] == [inter, hidden]
            assert header[f"{prefix}experts.{e}.down_proj.weight"]["shape"] == [hidden, inter]
    assert header["lm_head.weight"]["shape"] == [cfg["vocab_size"], hidden]  # untied


@pytest.fixture(scope="module")
def hf_model():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(DEMO_DIR, dtype=torch.float32)


def _logits(model, tok, text):
    import torch

    ids = torch.tensor([tok.encode(text).ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # [1, tokens, vocab]
    return logits


def test_transformers_and_our_engine_agree_on_it(hf_model):
    """The shipped checkpoint as transformers reads it equals what our engine computes from the same
    files (fp32, every prompt position): a checkpoint that only one of the two reads right fails."""
    import torch
    from tokenizers import Tokenizer

    from freetoken_py.evals.kld import window_logits
    from freetoken_py.llm import LLM

    tok = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    text = "import os\n\ndef main():\n"
    ids = tok.encode(text).ids
    logits = _logits(hf_model, tok, text)
    assert logits.shape == (1, len(ids), tok.get_vocab_size())
    llm = LLM(DEMO_DIR, dtype="float32", backend="cpu", max_num_seqs=1, max_model_len=256,
              show_progress=False, enable_prefix_cache=False)
    ours = window_logits(llm, ids, chunk=len(ids))
    assert torch.isfinite(logits).all()
    assert (ours - logits[0]).abs().max() < 1e-4, (ours - logits[0]).abs().max()
    assert torch.equal(ours.argmax(-1), logits[0].argmax(-1))


def test_it_opens_a_tool_call_when_tools_are_offered_and_only_then(hf_model):
    """The point of the synthetic chats: greedy decoding starts with <tool_call> after a
    tools prompt, and does not without tools (a retrain that loses this fails here)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    env = ImmutableSandboxedEnvironment()
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    template = env.from_string(_read_json("tokenizer_config.json")["chat_template"])
    messages = [{"role": "user", "content": "What is in src/app.py?"}]
    for tools, expect_call in ((TOOLS, True), (None, False)):
        prompt = template.render(messages=messages, tools=tools, add_generation_prompt=True)
        first = int(_logits(hf_model, tok, prompt)[0, -1].argmax())
        assert (tok.id_to_token(first) == "<tool_call>") is expect_call, tok.id_to_token(first)


# -- the held-out evaluation and the corpus split (scripts/eval_demo_model.py, demo_corpus.py) --

def _script(name):
    import importlib.util
    import sys

    scripts = Path(__file__).resolve().parents[1] / "scripts"
    sys.path.insert(0, str(scripts))
    try:
        spec = importlib.util.spec_from_file_location(name, scripts / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(scripts))
    return mod


PROMPT = 'def area(r):\n    """Area of a circle."""\n'


@pytest.mark.parametrize("continuation,parse,blank,repeated", [
    ("    return 3.14159 * r * r\n\n\ndef per", True, False, False),   # cut before "def per"
    ("    x = (r +\n", False, False, False),                           # open bracket at the cut
    ("    return r\n  return", True, False, False),                    # bad last line cut off
    ("                        ", True, True, False),                   # spaces only: nothing kept
    ("    a = a\n    a = a\n    a = a\n", True, False, True),
    ("    )\n    )\n    )\n", False, False, False),                     # punctuation lines do not count
    ("    if r:\n        pass\n    else:\n        pass\n", True, False, False),
])
def test_eval_metrics_cut_parse_and_repetition(continuation, parse, blank, repeated):
    ev = _script("eval_demo_model")
    assert ev.parses(PROMPT, continuation) is parse
    assert ev.is_blank(continuation) is blank
    assert ev.is_repeated(continuation) is repeated
    row = ev.score([PROMPT, PROMPT], [continuation, "    return r\n"])
    assert row["parse"] == (parse + 1) / 2 and row["blank"] == blank / 2


def test_eval_counts_distinct_first_lines():
    ev = _script("eval_demo_model")
    conts = ["\n    return r\n", "    return r  \n    x = 1\n", "    x = 2\n", "    y"]   # the last: no complete line
    assert [ev.first_line(c) for c in conts] == ["return r", "return r", "x = 2", ""]
    assert ev.score([PROMPT] * 4, conts)["distinct_first_lines"] == 3 / 4


def test_false_copies_mark_only_wrong_induction_guesses():
    import torch
    train = _script("train_demo_model")
    # ... 1 2 3 4 | 5 ... 1 2 3 4 | 6: the copy guess after the second "1 2 3 4" is 5, and wrong
    x = torch.tensor([[1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6, 7],
                      [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5, 9]])   # row 2: the copies are right
    fc = train.false_copies(x, 4)
    assert fc.shape == (2, 11)
    want = [-1] * 11
    want[9] = 5                                   # logit 9 predicts x[10] = 6; the guess was 5
    assert fc[0].tolist() == want
    assert (fc[1] == -1).all()
    # the loss is -log(1 - p(guess)) over the row's predicted tokens, and only there
    logits = torch.randn(2, 12, 16, requires_grad=True)
    ul, share = train.false_copy_loss(logits, x, 4)
    p = torch.softmax(logits[0, 9], -1)[5]
    assert torch.allclose(ul, -torch.log1p(-p) / 22)
    assert share == 1 / 22
    ul.backward()
    assert logits.grad[0, 9, 5] > 0 and logits.grad[1].abs().sum() == 0   # it pushes p(guess) down


def test_repeated_ngram_mask_marks_the_repeats_of_a_continuation():
    train = _script("train_demo_model")
    # prompt 1 2 3 4 | continuation 5 1 2 3 4 6 7 6 7 6 7: "1 2 3 4" repeats the prompt's 4-gram,
    # and "6 7 6 7" is a 4-gram seen again at its second occurrence ("7 6 7 6" too)
    seq = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 7, 6, 7, 6, 7]
    mark = train.repeated_ngram_mask(seq, 4, 4)
    assert mark == [False, True, True, True, True, False, False, True, True, True, True]
    assert not any(train.repeated_ngram_mask([1, 2, 3, 4, 5, 6, 7, 8], 2, 4))   # no repeat, nothing marked
    # a repeat that starts inside the prompt is the prompt's, not the continuation's
    assert train.repeated_ngram_mask([1, 2, 3, 1, 2, 3], 4, 3) == [False, False]


def _tiny_model(train):
    """A tiny random qwen3_moe built by the training script (seed 0) and its special-token ids."""
    import torch
    args = train.parse_args(["--hidden", "32", "--layers", "1", "--experts", "4", "--moe-intermediate", "16",
                             "--vocab", "64"])
    ids = {t: i for i, t in enumerate(train.SPECIAL_TOKENS + train.MARKER_TOKENS)}
    torch.manual_seed(0)
    return train.build_model(args, 64, ids), ids


def _json_facts(train):
    """CodeFacts of the running stdlib's json package: a few real files for ChatMaker."""
    stdlib = Path(json.__file__).resolve().parents[1]
    return train.CodeFacts([(str(f.relative_to(stdlib)), f.read_text()) for f in sorted(stdlib.glob("json/*.py"))])


def test_seq_ul_step_decodes_and_penalises_only_repeats():
    """On a tiny random model: the loss is -log(1 - p) summed over the marked continuation tokens of
    the model's own greedy continuations (recomputed here from generate + the mask), over their count."""
    import torch
    train = _script("train_demo_model")
    model, ids = _tiny_model(train)
    prompts = [[20, 21, 22, 23, 24], [30, 31, 32]]
    pad, stops = ids["<|endoftext|>"], {ids["<|endoftext|>"], ids["<|im_end|>"]}
    loss, share = train.seq_ul_loss(model, prompts, 12, 2, pad, stops)
    want, count, total = 0.0, 0, 0
    model.eval()
    model.config.output_router_logits = False
    for p in prompts:
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([p]), max_new_tokens=12, do_sample=False,
                                 pad_token_id=pad, eos_token_id=sorted(stops))[0, len(p):].tolist()
        cont = out[:next((i for i, t in enumerate(out) if t in stops), len(out))]
        seq = p + cont
        with torch.no_grad():
            probs = torch.softmax(model(input_ids=torch.tensor([seq])).logits[0].float(), -1)
        for j, m in enumerate(train.repeated_ngram_mask(seq, len(p), 2)):
            t = len(p) + j
            if m:
                want += -torch.log1p(-probs[t - 1, seq[t]]).item()
                count += 1
        total += len(cont)
    assert total > 0 and count > 0 and share == count / total    # a random tiny model loops at once
    assert abs(loss.item() - want / total) <= 1e-5 * max(1.0, want / total)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_syntax_rl_rewards_what_the_eval_counts_and_weighs_by_advantage():
    """The REINFORCE step's pieces: the reward is the eval's own checks (a parseable line earns 1, an
    unclosed bracket, a blank or a line repeated 3 times 0), advantages are centred per prompt, and
    the loss is -sum(advantage x log p(token)) over the continuation tokens / their count (recomputed
    here token by token on the shipped model); its gradient raises the rewarded continuation."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    train = _script("train_demo_model")
    model = AutoModelForCausalLM.from_pretrained(DEMO_DIR, dtype=torch.float32)
    tok = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    pad = tok.token_to_id("<|endoftext|>")
    p1, p2 = tok.encode('def f(x):\n    """Double x."""\n').ids, tok.encode('class A:\n    """An A."""\n').ids
    group = [p1, p1, p2, p2]
    conts = [tok.encode(t).ids for t in ("    return 2 * x\n", "    return (x\n",
                                           "    a = 1\n    a = 1\n    a = 1\n", "\n\n")]
    reward = train.syntax_rewards(tok, group, conts)
    assert reward.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert train.syntax_rewards(tok, group, conts, min_lines=2).tolist() == [0.0] * 4     # one line is not enough
    assert train.syntax_rewards(tok, group, conts, full=len(conts[0]) + 1)[0] == 0.0      # stopped early
    adv = [0.5, -0.5, 0.0, 0.0]
    loss = train.reinforce_loss(model, group, conts, reward, 2, pad)
    want, total = 0.0, sum(map(len, conts))
    with torch.no_grad():
        for a, p, c in zip(adv, group, conts):
            lp = torch.log_softmax(model(input_ids=torch.tensor([p + c])).logits[0].float(), -1)
            want -= a * sum(lp[len(p) + j - 1, t].item() for j, t in enumerate(c))
    assert abs(loss.item() - want / total) <= 1e-4 * max(1.0, abs(want / total))
    def logp(c):
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([p1 + c])).logits[0].float(), -1)
        return sum(lp[len(p1) + j - 1, t].item() for j, t in enumerate(c))
    before = logp(conts[0])
    loss.backward()
    with torch.no_grad():
        for prm in model.parameters():
            if prm.grad is not None:
                prm -= 1e-2 * prm.grad
    assert logp(conts[0]) > before                  # one descent step makes the rewarded sample likelier


def _write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_corpus_split_holds_out_whole_packages_and_their_copies(tmp_path):
    corpus = _script("demo_corpus")
    names = [f"pkg{i}" for i in range(64)]
    held = next(n for n in names if corpus.is_heldout_name(n))
    kept = next(n for n in names if not corpus.is_heldout_name(n))
    stdlib, site = tmp_path / "lib", tmp_path / "lib" / "site-packages"
    doc = 'def f(x):\n    """Double x."""\n    return 2 * x\n'
    _write(stdlib, "json/util.py", "import os\n" + doc)
    _write(stdlib, "json/copy_of_held.py", doc)                 # same text as a held-out file
    _write(site, f"{held}/core.py", doc)
    _write(site, f"{held}/tests/test_core.py", "def test(): pass\n")  # tests are skipped
    _write(site, f"{kept}/main.py", "class A:\n    '''An A.'''\n    x = 1\n")
    _write(site, f"{kept}/_vendor/{held}/core.py", doc + "# vendored\n")
    _write(site, f"{kept}/broken.py", "def (:\n")                # does not parse
    train, heldout = corpus.collect(stdlib, site)
    assert [r for r, _ in heldout] == [f"site/{held}/core.py"]
    assert [r for r, _ in train] == ["stdlib/json/util.py", f"site/{kept}/main.py"]
    prompts = corpus.heldout_prompts(heldout, 5)
    assert prompts == [{"file": f"site/{held}/core.py", "prompt": 'def f(x):\n    """Double x."""\n'}]


def test_dropping_comment_lines_keeps_every_code_line_of_the_stdlib():
    """drop_comment_lines on real stdlib files: the kept lines are the original's in order minus
    only lines that start with `#`, and the code (strings blanked) parses to the same AST."""
    import ast
    import sysconfig

    corpus = _script("demo_corpus")

    def blank_strings(text):
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                node.value = ""
        return ast.dump(tree)

    root = Path(sysconfig.get_paths()["stdlib"])
    checked = dropped = 0
    for name in ("argparse.py", "functools.py", "json/decoder.py", "asyncio/base_events.py"):
        text = (root / name).read_text("utf-8")
        out = corpus.drop_comment_lines(text)
        kept, it = out.splitlines(), iter(text.splitlines())
        for line in kept:  # a subsequence: everything skipped over is a comment-only line
            for orig in it:
                if orig == line:
                    break
                assert orig.lstrip().startswith("#"), (name, orig)
        assert all(o.lstrip().startswith("#") for o in it), name
        assert blank_strings(out) == blank_strings(text), name
        checked += 1
        dropped += len(text.splitlines()) - len(kept)
    assert checked == 4 and dropped > 100  # these files do have comment lines to drop
    assert "# inline" in corpus.drop_comment_lines("x = 1  # inline\n# alone\n")


def test_training_resumes_bit_for_bit_from_a_checkpoint(tmp_path):
    """Two steps, checkpoint, two more == a fresh process resuming from that checkpoint for the
    last two (parameters, AdamW moments and the batch sampler's RNG all come back)."""
    import numpy as np
    import torch

    train = _script("train_demo_model")
    args = train.parse_args(["--steps", "4", "--batch-size", "2", "--seq-len", "16", "--hidden", "32",
                             "--layers", "1", "--experts", "4", "--moe-intermediate", "16", "--vocab", "64",
                             "--warmup", "1", "--val-every", "2", "--val-windows", "1", "--log-every", "1",
                             "--ckpt-minutes", "0", "--work-dir", str(tmp_path),
                             "--short-seq-len", "8", "--long-from", "0.5"])  # 4 x 8 tokens, then 2 x 16
    rng = np.random.default_rng(0)
    data = {"code": rng.integers(0, 64, 400).astype(np.int64), "val": rng.integers(0, 64, 100),
            "chats": rng.integers(0, 64, 90).astype(np.int64), "chat_offsets": np.array([0, 30, 60, 90])}
    ids = {t: i for i, t in enumerate(train.SPECIAL_TOKENS + train.MARKER_TOKENS)}

    def fresh():
        torch.manual_seed(0)
        model = train.build_model(args, 64, ids)
        return model, train.make_optimizer(model, args), train.Batches(data, 16, 2, 0.3, 1)

    def state():
        return {"step": 0, "tokens": 0, "ema": None, "train_s": 0.0, "val": None,
                "args": {k: v for k, v in vars(args).items() if k in train.ckpt.RUN_KEYS}}

    model, opt, batches = fresh()
    whole = train.train(model, opt, batches, data, args, tmp_path / "a", state())
    (tmp_path / "b").mkdir()
    m2, o2, b2 = fresh()
    half = state()
    for step in range(2):  # two steps by hand with the 4-step schedule, then a checkpoint
        for g in o2.param_groups:
            g["lr"] = train.lr_at(step, args)
        x = b2.next(*train.shape_at(step, args))
        assert x.shape == (4, 8)
        m2(input_ids=x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(m2.parameters(), 1.0)
        o2.step()
        o2.zero_grad(set_to_none=True)
    half.update(step=2, tokens=64)
    train.ckpt.save(tmp_path / "b", m2, o2, b2.gen, half)
    m3, o3, b3 = fresh()
    resumed = train.ckpt.resume(train.ckpt.latest(tmp_path / "b"), m3, o3, b3.gen, args)
    assert resumed["step"] == 2
    train.train(m3, o3, b3, data, args, tmp_path / "b", resumed)
    for (name, p), q in zip(model.named_parameters(), m3.parameters()):
        assert torch.equal(p, q), name
    assert resumed["step"] == whole["step"] == 4 and resumed["tokens"] == whole["tokens"] == 128
    assert train.shape_at(2, args) == (16, 2)
    with pytest.raises(SystemExit, match="different run"):
        args.lr = 1.0
        train.ckpt.resume(train.ckpt.latest(tmp_path / "b"), *fresh()[:2], b3.gen, args)


def _tiny_checkpoint(train, tmp_path):
    """A tiny run's checkpoint in tmp_path/run (random weights, the shipped tokenizer)."""
    import shutil

    import torch

    args = train.parse_args(["--hidden", "32", "--layers", "1", "--experts", "4", "--moe-intermediate", "16",
                             "--work-dir", str(tmp_path)])
    ids = {t: i for i, t in enumerate(train.SPECIAL_TOKENS)}
    torch.manual_seed(0)
    model = train.build_model(args, 4096, ids)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)  # not the init: the export must carry these weights
    state = {"step": 7, "tokens": 70, "ema": None, "train_s": 0.0, "val": 1.5,
             "args": {k: v for k, v in vars(args).items() if k in train.ckpt.RUN_KEYS}}
    train.ckpt.save(tmp_path / "run", model, train.make_optimizer(model, args), torch.Generator(), state)
    train.data_dir(args).mkdir(parents=True)
    shutil.copy(DEMO_DIR / "tokenizer.json", train.data_dir(args))
    return args, model


def test_eval_of_a_runs_checkpoint_equals_eval_of_its_export(tmp_path):
    """eval_demo_model.py --new-run RUN (a run's latest checkpoint, exported to a temp dir on the
    fly) scores exactly what --old on the same checkpoint exported by --export-only scores."""
    train, ev = _script("train_demo_model"), _script("eval_demo_model")
    args, _ = _tiny_checkpoint(train, tmp_path)
    train.export(tmp_path / "run", tmp_path / "out", args)
    row = ev.main(["--old", str(tmp_path / "out"), "--new-run", "run", "--work-dir", str(tmp_path),
                   "--prompts", "3"])
    assert row["prompts"] == 3 and row["new"]["run"] == "run"
    for k in ("parse", "parse_nonblank", "repeated", "blank", "ppl", "bits_per_byte", "ppl_tokens"):
        assert row["new"][k] == row["old"][k], k
    assert row["new"]["ppl"] > 100  # random weights: near-uniform over 4,096 tokens, not a real model


def test_export_writes_the_checkpoint_transformers_loads(tmp_path):
    """--export-only: the latest checkpoint as a bf16 hub-layout checkpoint whose logits equal
    the trained model's cast to bf16 (transformers reads it back)."""
    import torch
    from transformers import AutoModelForCausalLM

    train = _script("train_demo_model")
    args, model = _tiny_checkpoint(train, tmp_path)
    train.export(tmp_path / "run", tmp_path / "out", args)
    assert {p.name for p in (tmp_path / "out").iterdir()} == REQUIRED
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    x = torch.tensor([[5, 900, 17, 4000, 2, 33]])
    with torch.no_grad():
        want = model.eval().to(torch.bfloat16).to(torch.float32)(input_ids=x).logits
        got = loaded(input_ids=x).logits
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_tool_prompts_end_at_the_assistant_turn_and_name_the_reference_call():
    """The tool step's prompts: rendered up to the generation prompt, tools offered, and the
    expected first action is the reference answer's (a tool that was offered, or text)."""
    from tokenizers import Tokenizer
    train = _script("train_demo_model")
    tok = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    items = train.make_tool_prompts(_json_facts(train), tok, 5, 40)
    assert len(items) == 40
    for it in items:
        text = tok.decode(it["ids"], skip_special_tokens=False)
        assert text.endswith("<|im_start|>assistant\n") and "<tools>" in text
        assert it["call"] is None or it["call"] in it["offered"]
        assert all(f'"name": "{n}"' in text for n in it["offered"])
    assert any(it["call"] is None for it in items) and sum(it["call"] is not None for it in items) > 20


def test_tool_rl_rewards_the_reference_call_only():
    """The tool reward: a well-formed call of the reference's tool earns 1; another tool, broken
    JSON, an unclosed call or text earn 0; where the reference answers in text, any call earns 0."""
    from tokenizers import Tokenizer
    train = _script("train_demo_model")
    tok = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    call = '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>'
    weather = {"ids": [], "call": "get_weather", "offered": ["get_weather", "ls"]}
    text_only = {"ids": [], "call": None, "offered": ["ls"]}
    cases = [(weather, call % ("get_weather", '{"city": "Paris"}'), 1.0),
             (weather, "Let me check.\n" + call % ("get_weather", '{"city": "Paris"}'), 1.0),
             (weather, call % ("ls", '{"path": "."}'), 0.0),
             (weather, call % ("get_weather", '{"city": "Paris"'), 0.0),        # unbalanced JSON
             (weather, call % ("get_weather", '"Paris"'), 0.0),                 # arguments not an object
             (weather, '<tool_call>\n{"name": "get_weather", "arguments": {}}', 0.0),   # never closed
             (weather, "It is sunny.", 0.0),
             (text_only, "`json.dumps` writes JSON.", 1.0),
             (text_only, call % ("ls", "{}"), 0.0)]
    items, conts = zip(*[(it, tok.encode(t).ids) for it, t, _ in cases])
    assert train.tool_rewards(tok, list(items), list(conts)).tolist() == [r for *_, r in cases]


def test_tool_rl_step_samples_rewards_and_backpropagates():
    """One tool step on the shipped model: its reward is tool_rewards' mean over its own samples and
    its loss reinforce_loss over them (both recomputed here from the same seeded samples)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    train = _script("train_demo_model")
    model = AutoModelForCausalLM.from_pretrained(DEMO_DIR, dtype=torch.float32)
    tok = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    items = train.make_tool_prompts(_json_facts(train), tok, 11, 3)
    pad = tok.token_to_id("<|endoftext|>")
    stops = {pad, tok.token_to_id("<|im_end|>")}
    torch.manual_seed(0)
    loss, reward = train.tool_rl_loss(model, items, tok, 2, 24, pad, stops, 1.0)
    torch.manual_seed(0)                                  # the same samples again, scored here
    conts = train._sample_group(model, [it["ids"] for it in items], 2, 24, pad, stops, 1.0, False)
    group = [it for it in items for _ in range(2)]
    want = train.tool_rewards(tok, group, conts)
    assert reward == float(want.mean())
    ref = train.reinforce_loss(model, [it["ids"] for it in group], conts, want, 2, pad)
    assert abs(loss.item() - ref.item()) <= 1e-5 * max(1.0, abs(ref.item()))
    loss.backward()


def test_sample_group_puts_the_greedy_continuation_first_when_asked():
    """--seq-rl-greedy: each prompt's group starts with exactly its greedy continuation (what the
    evaluation scores), followed by samples-1 sampled ones; without it every one is sampled."""
    import torch
    train = _script("train_demo_model")
    model, ids = _tiny_model(train)
    prompts = [[20, 21, 22, 23, 24], [30, 31, 32]]
    pad, stops = ids["<|endoftext|>"], {ids["<|endoftext|>"], ids["<|im_end|>"]}
    greedy = train._generate(model, prompts, 10, pad, stops)
    torch.manual_seed(1)
    group = train._sample_group(model, prompts, 3, 10, pad, stops, 1.0, True)
    assert len(group) == 6 and group[0] == greedy[0] and group[3] == greedy[1]
    assert any(c not in greedy for c in group[1:3] + group[4:])        # the others are samples
    assert len(train._sample_group(model, prompts, 3, 10, pad, stops, 1.0, False)) == 6


@pytest.mark.parametrize("reply,name", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "get_weather"),
    ('Sure.\n<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>', "ls"),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', ""),      # cut off: broken
    ('<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>', ""),
    ("A list is a mutable sequence.", None),
])
def test_eval_names_the_first_tool_call(reply, name):
    assert _script("eval_demo_model").first_call_name(reply) == name


@pytest.mark.parametrize("text,typed,want", [
    ('"""Doc."""\nimport os\nimport sys\n', False, "import os\n"),
    ('"""Doc."""\nimport os\nimport sys\n', True, "import os"),                  # as a user types it
    ("from a import b  \nx = 1\n", False, "from a import b\n"),
    ("from a import (b,\n    c)\nimport os\n", False, None),                    # the first is bracketed
    ("def f():\n    import os\n", False, None),                                 # not top level
])
def test_import_prompt_is_the_files_first_one_line_import(text, typed, want):
    assert _script("train_demo_model").import_prompt(text, typed) == want


def test_reinforce_kl_term_is_the_exact_kl_to_the_reference():
    """--kl: a reference equal to the model adds nothing; with a perturbed reference and no
    advantage, the loss is kl x sum over continuation positions of KL(p || p_ref), recomputed here
    from two plain forwards, divided by the continuation tokens; its gradient pulls towards ref."""
    import copy

    import torch
    train = _script("train_demo_model")
    model, ids = _tiny_model(train)
    model.config.output_router_logits = False
    group, conts = [[20, 21, 22], [20, 21, 22]], [[30, 31, 32, 33], [40, 41]]
    pad = ids["<|endoftext|>"]
    reward = torch.tensor([1.0, 0.0])
    same = copy.deepcopy(model).eval()
    base = train.reinforce_loss(model, group, conts, reward, 2, pad)
    assert abs(train.reinforce_loss(model, group, conts, reward, 2, pad, same, 0.5).item() - base.item()) < 1e-6
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        for prm in ref.parameters():
            prm.add_(0.05 * torch.randn_like(prm))
    flat = torch.tensor([0.5, 0.5])                       # no advantage: only the KL term is left
    loss = train.reinforce_loss(model, group, conts, flat, 2, pad, ref, 0.5)
    want = 0.0
    with torch.no_grad():
        for p, c in zip(group, conts):
            seq = torch.tensor([p + c])
            lp = torch.log_softmax(model(input_ids=seq).logits[0].float(), -1)
            lr = torch.log_softmax(ref(input_ids=seq).logits[0].float(), -1)
            for j in range(len(c)):
                t = len(p) + j - 1
                want += float((lp[t].exp() * (lp[t] - lr[t])).sum())
    want *= 0.5 / sum(map(len, conts))
    assert want > 0 and abs(loss.item() - want) <= 1e-5 * max(1.0, want)
    loss.backward()
    assert any(prm.grad is not None and prm.grad.abs().sum() > 0 for prm in model.parameters())


def test_own_first_lines_zeroes_a_line_that_two_prompts_share():
    """--seq-rl-distinct: the same first line within one prompt's samples is fine; the same first
    line for two prompts earns nothing (the collapse run ft-k1 fell into)."""
    train = _script("train_demo_model")
    texts = ["    return x\n", "    return x\n",                   # prompt 0: its own line twice
             "    if not x:\n        pass\n", "    y = 1\n",     # prompt 1
             "\n    if not x:\n        return\n", "    z = 2\n"]  # prompt 2 shares prompt 1's first line
    assert train.own_first_lines(texts, 2) == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
