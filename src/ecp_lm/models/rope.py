"""Rotary position embedding (RoPE), applied to queries and keys at absolute positions."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RotaryEmbedding(nn.Module):
    """Rotates feature pairs (i, i + D/2) by angle ``pos * base**(-2i/D)``."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (B, H, R, D), positions (R,) int -> (B, H, R, D)."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # (R, D/2)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
