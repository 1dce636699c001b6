"""Linear layers behind one call signature, so the forward pass does not care where the weights
live: `TorchLinear` (the reference, any dtype) or `KernelLinear` (numba GEMV over bf16 / fp32 /
int8 weights, fp32 activations)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight  # [N, K]
        self.bias = bias

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class KernelLinear:
    """Numba dense kernel; x is cast to fp32, the result is fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, group_size: int = 32):
        from freetoken_py.kernels import DenseWeight, dense_linear

        self.dense = DenseWeight.from_tensor(weight, fmt=fmt, group_size=group_size)
        self._matmul = dense_linear  # bound once: this is called ~25x per decoded token
        self.bias = None if bias is None else bias.float()

    @classmethod
    def from_packed(cls, packed, bias: torch.Tensor | None) -> "KernelLinear":
        """A checkpoint's packed weight (formats.Packed: fp8 / int4 codes and scales) as it is."""
        from freetoken_py.kernels import DenseWeight, dense_linear

        self = cls.__new__(cls)
        self.dense = DenseWeight.from_arrays(packed.fmt, packed.group_size, *packed.arrays(), packed.shape[1])
        self._matmul = dense_linear
        self.bias = None if bias is None else bias.float()
        return self

    @property
    def out_features(self) -> int:
        return self.dense.out_features

    @property
    def nbytes(self) -> int:
        return self.dense.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(self.dense, x)  # casts to contiguous fp32 itself; torch in, torch out
        return out if self.bias is None else out + self.bias
