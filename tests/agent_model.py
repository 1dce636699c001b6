"""A tiny scripted qwen3_moe checkpoint for the real-client tests that need the clients' default
prompts (Claude Code ~17K, OpenCode ~10K demo tokens): a prefill that long is minutes on the
demo model on a small CPU box, and the demo model, past its 512-token training window, never
ends its answer. This one is 1 layer x 1 head of width 16 (the prefill is ~60x cheaper than the
demo's), with the demo model's tokenizer and chat template and a large position limit, and it
answers ANSWER then ends the turn, whatever it was asked:

- attention and experts write nothing (o_proj and the experts' down projections are zero), so
  the hidden state at the last position is the embedding of the last token;
- every embedding has a 1 in dimension 0; the tokens of the chain `"\\n"` (the end of the
  template's generation prompt `<|im_start|>assistant\\n`), ANSWER's tokens... also a 1 in their
  own dimension; the LM head maps chain token i to chain token i+1 (logit 10 against 0) and
  anything else to the end-of-turn token (logit 1 against 0). Greedy decoding (the
  generation_config says temperature 0; clients send none) then writes ANSWER and stops.

Built with transformers' own classes and save_pretrained (real safetensors + config.json)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "freetoken_py" / "data" / "demo_model"
ANSWER = "Hello from freetoken."


def build_agent_model(out: Path, max_positions: int = 262144, answer: str = ANSWER) -> Path:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from freetoken_py.tokenizer import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / f, out / f)
    tok = Tokenizer(out)
    demo = json.loads((DEMO / "config.json").read_text())
    trigger = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))[-1]
    chain = [trigger, *tok.encode(answer)]
    assert len(set(chain)) == len(chain), "the answer's tokens must be distinct (a bigram chain)"
    eos = demo["eos_token_id"]
    d = 2 + len(chain)
    config = Qwen3MoeConfig(vocab_size=demo["vocab_size"], hidden_size=d, num_hidden_layers=1,
                            num_attention_heads=1, num_key_value_heads=1, head_dim=16, intermediate_size=16,
                            moe_intermediate_size=8, num_experts=2, num_experts_per_tok=1,
                            max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=False,
                            bos_token_id=demo["bos_token_id"], eos_token_id=eos, pad_token_id=demo["pad_token_id"])
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb[:, 0] = 1.0
        head[eos, 0] = 1.0
        for i, t in enumerate(chain):
            emb[t, 1 + i] = 1.0
            head[chain[i + 1] if i + 1 < len(chain) else eos, 1 + i] = 10.0
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "eos_token_id": eos,
                                                            "bos_token_id": demo["bos_token_id"]}))
    return out
