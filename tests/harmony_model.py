"""A tiny scripted gpt_oss checkpoint that speaks harmony, for the end-to-end server tests
(tests/test_harmony_server.py). Built with transformers' GptOssForCausalLM and save_pretrained, on
the demo vocabulary with harmony's tags as special tokens and gpt-oss's published chat template
(harmony_util.template_dir). Greedy decoding after the template's `<|start|>assistant` writes

    <|channel|>analysis<|message|>REASONING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

and, under the grammar of tool_choice required (where `final` is not allowed), the call
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` after the
same analysis message. How, in one layer:

- a bigram chain: every embedding has a constant dimension 0 and a chain token its own dimension;
  the LM head maps chain token t to its successor (logit +10);
- a memory of the reasoning: attention whose query is on `<|channel|>` and `<|message|>` only and
  whose key is on REASONING's last token only (both in the lowest-frequency rotary pair, so the position barely rotates them) puts all
  its weight there once that token is in the context (else spread over values that are all zero),
  and writes a "flip" dimension, which makes `<|channel|>` go on with `final` (or, where final is
  not allowed, `commentary`) and `<|message|>` with ANSWER instead of REASONING;
- experts write nothing (zero weights and biases: the clamped SwiGLU of 0 is 0).
"""
from __future__ import annotations

import json
from pathlib import Path

import harmony_util

REASONING = "ǂ"   # (two byte tokens) its last token must not occur in the prompts: it is the key
ANSWER = "Hello"
HIDDEN, HEAD_DIM = 32, 16


def _chain(tok) -> tuple[dict[int, int], dict]:
    """successor map (unflipped) and the special tokens' ids."""
    ids = {s: tok.token_to_id(s) for s in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>",
                                           "<|call|>")}
    seq = (tok.encode("assistant") + [ids["<|channel|>"]] + tok.encode("analysis") + [ids["<|message|>"]]
           + tok.encode(REASONING) + [ids["<|end|>"], ids["<|start|>"]] + tok.encode("assistant"))
    nxt: dict[int, int] = {}
    for a, b in zip(seq, seq[1:]):
        assert nxt.get(a, b) == b, f"token {a} has two successors in the script"
        nxt[a] = b
    final = tok.encode("final") + [ids["<|message|>"]]
    for a, b in zip(final, final[1:]):
        assert nxt.get(a, b) == b
        nxt[a] = b
    answer = tok.encode(ANSWER) + [ids["<|return|>"]]
    for a, b in zip(answer, answer[1:]):
        assert a not in nxt
        nxt[a] = b
    return nxt, ids


def build(out: Path) -> Path:
    import torch
    import transformers as tf

    from freetoken_py.tokenizer import Tokenizer

    harmony_util.template_dir(out)
    tok = Tokenizer(out)
    nxt, ids = _chain(tok)
    key = tok.encode(REASONING)[-1]
    sources = sorted(set(nxt) | {key})
    dim = {t: 1 + i for i, t in enumerate(sources)}
    flip = 1 + len(sources)
    assert flip < HIDDEN
    n = tok.vocab_size
    config = tf.GptOssConfig(vocab_size=n, hidden_size=HIDDEN, intermediate_size=8, num_hidden_layers=1,
                             num_attention_heads=1, num_key_value_heads=1, head_dim=HEAD_DIM, num_local_experts=2,
                             num_experts_per_tok=1, layer_types=["full_attention"], max_position_embeddings=131072,
                             tie_word_embeddings=False, eos_token_id=[ids["<|return|>"], ids["<|call|>"]],
                             bos_token_id=ids["<|start|>"], pad_token_id=0)
    model = tf.GptOssForCausalLM(config)
    low = HEAD_DIM // 2 - 1   # the lowest-frequency rotary pair is (low, HEAD_DIM - 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.zero_()
            if name.endswith("norm.weight"):
                p.fill_(1.0)
        layer = model.model.layers[0]
        layer.self_attn.sinks.fill_(-30.0)   # no weight on the sink
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb[:, 0] = 1.0
        for t, d in dim.items():
            emb[t, d] = 1.0
        attn = layer.self_attn
        # only <|channel|> and <|message|> ask (elsewhere the query is 0: uniform weights, and the
        # key's value spread over the whole context is too small to matter)
        attn.q_proj.weight[low, dim[ids["<|channel|>"]]] = 2.0
        attn.q_proj.weight[low, dim[ids["<|message|>"]]] = 2.0
        attn.k_proj.weight[low, dim[key]] = 2.0
        attn.v_proj.weight[0, dim[key]] = 1.0
        attn.o_proj.weight[flip, 0] = 1.0
        for a, b in nxt.items():
            head[b, dim[a]] = 10.0
        head[ids["<|message|>"], 0] = -2.0             # after "commentary": the call's " to=" before a preamble
        first_final, first_analysis = tok.encode("final")[0], tok.encode("analysis")[0]
        first_answer, first_reasoning = tok.encode(ANSWER)[0], tok.encode(REASONING)[0]
        for t, w in ((first_final, 30.0), (first_analysis, -30.0), (tok.encode("commentary")[0], 10.0),
                     (first_answer, 30.0), (first_reasoning, -30.0)):
            head[t, flip] = w
        # the flip boosts final and ANSWER alike: which one follows is the current token's second choice
        head[first_final, dim[ids["<|channel|>"]]] = 5.0
        head[first_answer, dim[ids["<|message|>"]]] = 5.0
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [ids["<|return|>"], ids["<|call|>"]], "temperature": 0.0}))
    return out
