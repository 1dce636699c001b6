"""numpy <-> torch plumbing shared by the pack/dequant references."""
from __future__ import annotations

import numpy as np
import torch


def as_float32(w) -> tuple[torch.Tensor, bool]:
    """(w as a CPU float32 torch tensor, whether the caller passed numpy)."""
    if isinstance(w, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)), True
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"expected a torch tensor or numpy array, got {type(w).__name__}")
    return w.detach().to("cpu", torch.float32), False


def as_tensor(a) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a.detach().cpu()


def out(t: torch.Tensor, numpy: bool):
    return t.numpy() if numpy else t


def safe_scale(amax: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, divisor): scale = amax / qmax (0 for all-zero rows/groups, whose divisor is 1)."""
    scale = amax / qmax
    return scale, torch.where(scale > 0, scale, 1.0)
