"""The decoder interface and the plain (unquantised) decoder."""
from __future__ import annotations

import dataclasses

import torch

from freetoken_py.errors import ModelLoadError

PLAIN_DTYPES = ("F32", "BF16", "F16")


class PlainDecoder:
    """Unquantised weights: logical tensors are the stored ones."""

    name = "plain"
    exec_format: str | None = None   # the packed execution format it yields, if any
    group_size = 0

    def __init__(self, stored: dict):
        self.stored = stored
        self.logical = dict(stored)

    def packed(self, reader, name: str):
        return None

    def is_packed(self, name: str) -> bool:
        """Whether the logical tensor `name` is stored packed (`packed` gives it in an execution format)."""
        return False

    def get(self, reader, name: str) -> torch.Tensor:
        return reader.get(name)

    def describe(self) -> str:
        return "unquantised"


class QuantDecoder(PlainDecoder):
    """Shared part of the packed formats. A subclass's `scan()` returns the logical tensors and
    the names among them stored packed; `_packed(reader, name)` builds one Packed weight."""

    tag = "Q"

    def __init__(self, stored: dict, field: str):
        super().__init__(stored)
        self.field = field
        self.logical, self._quantised = self.scan()

    def scan(self) -> tuple[dict, set]:
        raise NotImplementedError

    def need(self, name: str, what: str = "scale"):
        info = self.stored.get(name)
        if info is None:
            raise ModelLoadError(f"missing {what} tensor '{name}' ({self.describe()} checkpoint, {self.field})")
        return info

    def packed(self, reader, name: str):
        return self._packed(reader, name) if name in self._quantised else None

    def is_packed(self, name: str) -> bool:
        return name in self._quantised

    def get(self, reader, name: str) -> torch.Tensor:
        p = self.packed(reader, name)
        return reader.get(name) if p is None else p.dequantize()


def logical(info, name: str, shape: tuple[int, ...], tag: str):
    """The TensorInfo of a logical tensor: its own name and shape, `tag` as its dtype."""
    return dataclasses.replace(info, name=name, shape=tuple(shape), dtype=tag)
