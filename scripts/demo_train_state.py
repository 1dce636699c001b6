"""Checkpoint and resume for scripts/train_demo_model.py, in safetensors + JSON (no pickle).

A checkpoint is a directory `ckpt/` in the run's work dir (outside the git tree):
`state.safetensors` holds the model's parameters ("model.<name>"), AdamW's moments
("exp_avg.<name>", "exp_avg_sq.<name>") and the batch sampler's RNG state ("sampler.rng");
`state.json` holds the step, the loss EMA, the token count, AdamW's per-parameter step counts and
the run's arguments. It is written to `ckpt.tmp/` and renamed into place, the previous one kept as
`ckpt.old/` until the rename is done, so an interruption at any moment leaves a whole checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# keys added after runs were checkpointed: a checkpoint without one ran with this value
LATER_KEYS = {"false_copy_ul": 0.0, "false_copy_n": 4, "finetune_from": "", "seq_ul": 0.0, "seq_ul_prompts": 8,
              "seq_ul_tokens": 64, "seq_ul_n": 4, "seq_rl": 0.0, "seq_rl_samples": 4,
              "seq_rl_temperature": 0.7, "seq_rl_full": False, "seq_rl_min_lines": 1,
              "seq_prompts": "docstring", "tool_rl": 0.0, "tool_rl_tokens": 48,
              "seq_rl_greedy": False, "kl": 0.0,
              "seq_rl_distinct": False, "time_schedule": False, "tokenizer": "", "stdlib": "", "site": ""}
# Arguments that must match for a resume to continue the same run.
RUN_KEYS = ("seed", "vocab", "hidden", "layers", "experts", "top_k", "moe_intermediate", "heads",
            "kv_heads", "seq_len", "short_seq_len", "long_from", "batch_size", "lr", "min_lr_frac", "warmup", "steps",
            "chat_frac", "num_chats", "aux_coef", "weight_decay", "code_comments", *LATER_KEYS)


def save(work: Path, model, opt, gen, state: dict) -> Path:
    """Write model + optimizer + sampler state atomically; returns the checkpoint dir."""
    from safetensors.torch import save_file

    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"model.{n}": p.detach().contiguous() for n, p in model.named_parameters()}
    steps = {}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if st:
                n = names[id(p)]
                tensors[f"exp_avg.{n}"] = st["exp_avg"].contiguous()
                tensors[f"exp_avg_sq.{n}"] = st["exp_avg_sq"].contiguous()
                steps[n] = float(st["step"])
    tensors["sampler.rng"] = gen.get_state()
    tmp, final, old = work / "ckpt.tmp", work / "ckpt", work / "ckpt.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "state.safetensors"))
    (tmp / "state.json").write_text(json.dumps({**state, "adam_steps": steps}, indent=1) + "\n")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def latest(work: Path) -> Path | None:
    """The newest whole checkpoint dir (ckpt/, else ckpt.old/ after an interrupted rename)."""
    for name in ("ckpt", "ckpt.old"):
        d = work / name
        if (d / "state.json").exists() and (d / "state.safetensors").exists():
            return d
    return None


def load_model(ckpt: Path, model) -> dict:
    """Parameters into `model`; returns state.json's dict."""
    from safetensors.torch import load_file

    tensors = load_file(str(ckpt / "state.safetensors"))
    params = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    missing, unexpected = model.load_state_dict(params, strict=False)
    own = {n for n, _ in model.named_parameters()}
    if set(params) != own:
        raise SystemExit(f"checkpoint {ckpt}: parameters differ from the model "
                         f"(missing {sorted(own - set(params))[:3]}, extra {sorted(set(params) - own)[:3]})")
    return json.loads((ckpt / "state.json").read_text())


def resume(ckpt: Path, model, opt, gen, args) -> dict:
    """Model, AdamW moments and the sampler's RNG from `ckpt`; refuses a different run."""
    import torch
    from safetensors.torch import load_file

    state = load_model(ckpt, model)
    saved = {**LATER_KEYS, **state["args"]}
    differ = {k: (saved.get(k), getattr(args, k)) for k in RUN_KEYS
              if saved.get(k) != getattr(args, k)}
    if differ:
        raise SystemExit(f"checkpoint {ckpt} is from a different run: {differ} (use another --run)")
    tensors = load_file(str(ckpt / "state.safetensors"))
    for n, p in model.named_parameters():
        if n in state["adam_steps"]:
            opt.state[p] = {"step": torch.tensor(state["adam_steps"][n]),
                            "exp_avg": tensors[f"exp_avg.{n}"].to(p.device, copy=True),
                            "exp_avg_sq": tensors[f"exp_avg_sq.{n}"].to(p.device, copy=True)}
    gen.set_state(tensors["sampler.rng"])
    return state
