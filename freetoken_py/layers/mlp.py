"""The dense SwiGLU MLP: dense layers, and the shared experts of MoE layers."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from freetoken_py.layers.linear import TorchLinear


def swiglu(w13, w2, x: torch.Tensor) -> torch.Tensor:
    """w2(silu(gate) * up), w13 = gate|up rows."""
    gate, up = w13(x).chunk(2, dim=-1)
    return w2(F.silu(gate) * up)


def swiglu_shapes(prefix: str, width: int, hidden: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}gate_proj.weight": (width, hidden), f"{prefix}up_proj.weight": (width, hidden),
            f"{prefix}down_proj.weight": (hidden, width)}


def load_swiglu(get, prefix: str) -> tuple[TorchLinear, TorchLinear]:
    """(gate|up [2I, D], down [D, I]) from {gate,up,down}_proj: gate and up concatenated (a copy)."""
    w13 = torch.cat([get(prefix + "gate_proj.weight"), get(prefix + "up_proj.weight")])
    return TorchLinear(w13), TorchLinear(get(prefix + "down_proj.weight"))


def held_swiglu(held, prefix: str) -> int:
    return held(prefix + "gate_proj.weight", True) + held(prefix + "up_proj.weight", True) + held(
        prefix + "down_proj.weight", False)


@dataclass(frozen=True)
class DenseMlp:
    """A dense layer's feed-forward part (a model file's layer kind, layers/decoder.py)."""
    width: int
    hidden: int
    names: str = "mlp."
    router = None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return swiglu_shapes(self.names, self.width, self.hidden)

    def load(self, get, prefix: str, skip_experts: bool = False) -> dict:
        mlp13, mlp2 = load_swiglu(get, prefix + self.names)
        return dict(mlp13=mlp13, mlp2=mlp2)

    def held(self, held, prefix: str, skip_experts: bool = False) -> tuple[int, int]:
        return held_swiglu(held, prefix + self.names), 0

    def forward(self, lw, x: torch.Tensor, ctx, i: int) -> torch.Tensor:
        return swiglu(lw.mlp13, lw.mlp2, x)
