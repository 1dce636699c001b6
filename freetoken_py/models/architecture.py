"""What a model file composes: its decoder layers (layers/decoder.py kinds), its RoPE and its RMSNorm kind.

Each model file (models/<model_type>.py) has `architecture(args) -> Architecture`: reading that
function tells you the family — which mixer each layer runs, which feed-forward part, which
router, which names. `MoeTransformer` runs the list; `weights.py` validates and loads each
layer's tensors through its kinds. The helpers below are the geometry every GQA family shares,
taken from the parsed config, so a model file writes only what its family chooses.
"""
from __future__ import annotations

from dataclasses import dataclass

from freetoken_py.layers.decoder import DecoderLayer, RmsNorm
from freetoken_py.layers.gqa import GqaAttention
from freetoken_py.layers.mlp import DenseMlp
from freetoken_py.layers.moe import MoeBlock
from freetoken_py.layers.rotary import RotaryEmbedding
from freetoken_py.models.args import ModelArgs


@dataclass(frozen=True, eq=False)
class Architecture:
    layers: tuple[DecoderLayer, ...]
    rope: RotaryEmbedding              # the cos / sin rows every attention layer of a step reads
    norm: RmsNorm = RmsNorm()

    def mixer(self, i: int):
        return self.layers[i].mixer

    @property
    def paged_layers(self) -> list[int]:
        """The layers keeping pages in the KV pool, in order (not the recurrent ones)."""
        return [i for i, layer in enumerate(self.layers) if layer.mixer.paged]


def gqa(a: ModelArgs, **options) -> GqaAttention:
    """GQA at the config's geometry and biases; `options` are the family's (GqaAttention's fields)."""
    base = dict(hidden=a.hidden_size, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                bias=a.attention_bias, o_bias=a.has_o_bias)
    return GqaAttention(**{**base, **options})


def feed_forward(a: ModelArgs, i: int, router, names, **options) -> MoeBlock | DenseMlp:
    """Layer i's feed-forward part: the MoE block where the config makes the layer sparse, else a
    dense SwiGLU MLP of `intermediate_size`. options: MoeBlock's (shared expert, gate, biases)."""
    if not a.sparse_layers[i]:
        return DenseMlp(a.intermediate_size, a.hidden_size, names.dense_mlp)
    return MoeBlock(router, a.num_experts, a.moe_intermediate_size, a.hidden_size, names, **options)


def plain_rope(a: ModelArgs) -> RotaryEmbedding:
    """Rotate-half RoPE over the first rope_dim dims of each head, linear position scaling."""
    return RotaryEmbedding(a.rope_dim, a.rope_theta, a.rope_scaling_factor)
