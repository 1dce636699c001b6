"""Shared fixtures: tiny random checkpoints built locally with transformers' own classes
(`save_pretrained` -> real safetensors + config.json), so every model test has an independent
reference (transformers' logits)."""
from __future__ import annotations

import os
from pathlib import Path

# MKL (torch's fp32 GEMMs on x86) takes alignment-dependent code paths unless told otherwise, so the
# same product of the same values can differ in the last bits between two loads of a model whose
# tensors lie at other offsets: on an AMD EPYC Zen 4 the DSA checkpoint with a full context and the
# same checkpoint as plain MLA differed by 2e-7 (tests/test_dsa_models.py compares them bit for bit).
# Strict conditional numerical reproducibility, read when MKL first runs (set before torch loads it);
# subprocesses inherit it.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import pytest  # noqa: E402
import torch  # noqa: E402

# bf16 weights multiply exact fp32 activations in the suite (the parity tests compare with fp32
# references at 1e-4..1e-5), also on CPUs with AVX512-BF16, where the default rounds activations to
# bf16 (docs/kernels.md); tests/test_kernels_bf16act.py runs that path explicitly. Set before any
# freetoken kernel is imported, and inherited by the CLI subprocesses tests start.
os.environ.setdefault("FREETOKEN_BF16_ACT", "fp32")
# Subprocesses (the CLI, kernel checks) import this checkout, whatever copy of the package pip installed
# and whatever directory they run in.
_ROOT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)

VOCAB = 160

# Tiny models: OpenMP barriers cost more than the math, and on a loaded 2-core box a second
# intra-op thread makes each step ~5x slower. One thread keeps the suite fast and deterministic.
torch.set_num_threads(1)


def _configs():
    from transformers import Glm4MoeConfig, MiniMaxM2Config, MixtralConfig, OlmoeConfig, Qwen3MoeConfig

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
        # GLM-4.5: layer 0 dense, q/k/v biases (no o bias), per-head qk-norm, RoPE on half the head,
        # sigmoid router with 2 groups of 4 experts (1 kept), a shared expert, x2.5
        "glm4_moe": (Glm4MoeConfig, dict(common, num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32,
                                         head_dim=16, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
                                         n_group=2, topk_group=1, use_qk_norm=True, attention_bias=True,
                                         partial_rotary_factor=0.5, routed_scaling_factor=2.5,
                                         eos_token_id=None, pad_token_id=None)),
        # GLM-4.5-Air-like: no qk-norm, no groups, no renormalisation, 2 shared-expert widths
        "glm4_moe_air": (Glm4MoeConfig, dict(common, num_hidden_layers=2, intermediate_size=96,
                                             moe_intermediate_size=32, head_dim=16, n_routed_experts=8,
                                             n_shared_experts=2, first_k_dense_replace=1, n_group=1, topk_group=1,
                                             use_qk_norm=False, attention_bias=True, partial_rotary_factor=0.5,
                                             norm_topk_prob=False, routed_scaling_factor=1.8,
                                             eos_token_id=None, pad_token_id=None)),
        # MiniMax-M2: full-width qk-norm, rotary_dim 8 of 16, sigmoid router with the bias on the block
        "minimax_m2": (MiniMaxM2Config, dict(common, num_hidden_layers=2, intermediate_size=32, head_dim=16,
                                             num_local_experts=8, rotary_dim=8, eos_token_id=None,
                                             pad_token_id=None, bos_token_id=None)),
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
        randomise_constants(model)
    model.to(dtype).save_pretrained(out, **save_kwargs)
    return out


def randomise_constants(model) -> None:
    """transformers initialises the sigmoid routers' e_score_correction_bias to 0 and RMSNorm
    weights to 1, which would leave the bias path and a norm-weight mix-up untested: randomise both
    (only on models that have such a bias, so the older families' checkpoints stay as they were)."""
    biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    if not biases:
        return
    for b in biases:
        b.normal_(0, 0.05)
    for name, p in model.named_parameters():
        if p.dim() == 1 and "norm" in name:
            p.uniform_(0.5, 1.5)


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
    """Stands in for the CUDA runtime (torch.cuda.cudart(): not in a CPU build): a registration
    works, or every call fails (`broken`: cudaErrorNotSupported, 801)."""

    def __init__(self, broken: bool = False):
        self.broken, self.calls, self.unregistered = broken, [], []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append((ptr, nbytes, flags))
        return 801 if self.broken else 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0

    def cudaGetErrorString(self, err):
        return "operation not supported"
