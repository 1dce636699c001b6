"""Shared fixtures: tiny random checkpoints built locally with transformers' own classes
(`save_pretrained` -> real safetensors + config.json), so every model test has an independent
reference (transformers' logits)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

VOCAB = 160

# Tiny models: OpenMP barriers cost more than the math, and on a loaded 2-core box a second
# intra-op thread makes each step ~5x slower. One thread keeps the suite fast and deterministic.
torch.set_num_threads(1)


def _configs():
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, max_position_embeddings=512, rms_norm_eps=1e-6)
    return {
        # MoE on every other layer plus an mlp_only layer; renormalised top-k; attention biases
        "qwen3_moe": (Qwen3MoeConfig, dict(common, num_hidden_layers=4, intermediate_size=96,
                                           moe_intermediate_size=48, num_experts=8, decoder_sparse_step=1,
                                           mlp_only_layers=[2], norm_topk_prob=True, attention_bias=True,
                                           head_dim=16)),
        # sparse step 2 and no renormalisation
        "qwen3_moe_step2": (Qwen3MoeConfig, dict(common, num_hidden_layers=4, intermediate_size=96,
                                                 moe_intermediate_size=64, num_experts=8, decoder_sparse_step=2,
                                                 norm_topk_prob=False)),
        "mixtral": (MixtralConfig, dict(common, num_hidden_layers=2, intermediate_size=64, num_local_experts=6)),
        "mixtral_swa": (MixtralConfig, dict(common, num_hidden_layers=2, intermediate_size=64,
                                            num_local_experts=6, sliding_window=12)),
        "olmoe": (OlmoeConfig, dict(common, num_hidden_layers=2, intermediate_size=48, num_experts=8,
                                    clip_qkv=0.5, norm_topk_prob=False, eos_token_id=None, pad_token_id=None)),
    }


ARCHS = list(_configs())


def build_checkpoint(name: str, out: Path, dtype=torch.float32, seed: int = 0, **save_kwargs) -> Path:
    from transformers import AutoModelForCausalLM

    cls, kwargs = _configs()[name]
    torch.manual_seed(seed)
    config = cls(**kwargs)
    model = AutoModelForCausalLM.from_config(config)
    # random init is tiny; widen it so logits differ clearly and routing is not uniform
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    model.to(dtype).save_pretrained(out, **save_kwargs)
    return out


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    cache: dict[tuple, Path] = {}

    def make(name: str, dtype=torch.float32, **save_kwargs) -> Path:
        key = (name, str(dtype), tuple(sorted(save_kwargs.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(name)
            cache[key] = build_checkpoint(name, out, dtype, **save_kwargs)
        return cache[key]

    return make


def reference_model(path: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def random_prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=g).tolist()


# ---- the real server on 127.0.0.1 (tests/server_util.py), shared by the server test modules ----
@pytest.fixture(scope="module")
def srv():
    """A `freetoken serve` of the demo model (fp32) in a background thread, one per test module."""
    from server_util import ServerThread

    with ServerThread() as s:
        yield s


@pytest.fixture(scope="module")
def ref():
    """The reference: the same demo model through `LLM` directly, no server, no prefix cache."""
    from freetoken_py.cli import DEMO_MODEL
    from freetoken_py.llm import LLM

    return LLM(DEMO_MODEL, dtype="float32", show_progress=False, enable_prefix_cache=False)


class StandInCudart:
    """Stands in for the CUDA runtime (torch.cuda.cudart(): not in a CPU build), as a discrete
    GPU without cudaDevAttrHostRegisterReadOnlySupported answers: the read-only flag is refused
    (cudaErrorNotSupported, 801), a plain registration works, or every call fails (`broken`)."""

    def __init__(self, broken: bool = False):
        self.broken, self.calls, self.unregistered = broken, [], []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append((ptr, nbytes, flags))
        return 801 if self.broken or flags & 8 else 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0

    def cudaGetErrorString(self, err):
        return "operation not supported"
