import torch


class RotaryEmbedding:
    """Non-interleaved ("rotate half") RoPE with a cos/sin table that grows on demand."""

    def __init__(self, head_dim: int, theta: float, scaling_factor: float = 1.0):
        self.head_dim = head_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.scaling_factor = scaling_factor
        self._cos = torch.empty(0, head_dim)
        self._sin = torch.empty(0, head_dim)

    def _grow(self, num_positions: int) -> None:
        size = max(num_positions, 2 * self._cos.shape[0], 256)
        pos = torch.arange(size, dtype=torch.float) / self.scaling_factor
        freqs = pos[:, None] * self.inv_freq[None, :]  # [P, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, hd]
        self._cos, self._sin = emb.cos(), emb.sin()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self._cos.shape[0]:
            self._grow(need)
        return self._cos[positions].to(dtype), self._sin[positions].to(dtype)  # [T, hd]

    def cos_sin_numpy(self, positions: list[int]):
        """float32 numpy cos / sin rows [T, hd] for a few positions (the fused decode step: ~3 us
        where the torch indexing above costs ~30 us)."""
        need = max(positions) + 1 if positions else 0
        if need > self._cos.shape[0]:
            self._grow(need)
        return self._cos.numpy()[positions], self._sin.numpy()[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, hd]; cos/sin: [T, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first cos.shape[-1] dims of each head, the rest passed through
    (GLM-4.5: half the head, MiniMax-M2: rotary_dim). x: [T, H, hd]; cos/sin: [T, rd], rd <= hd."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat((apply_rotary(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)
