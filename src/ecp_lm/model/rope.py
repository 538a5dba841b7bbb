"""Rotary position embedding (RoPE), applied to queries and keys at absolute positions.

A query at position p and a key at position p' score ``q·R(θ(p') − θ(p))·k``: only the offset
p − p' matters, which is what lets ECP stream without end (its mask depends only on offsets and
segment indices). That holds numerically only if the angles θ_i(p) = p·ω_i are exact at every p:
computed in float32 from p, as is usual, their error grows with p (near 10⁷ the same offset
scores visibly differently than near 0, and streaming generation drifts after about 10⁶ tokens).

Here every angle is reduced modulo 2π exactly enough for float32 at any int64 position, without
rebasing positions (so a KV cache can keep keys rotated at their absolute positions):

- the position is split into 21-bit chunks, p = c₀ + c₁·2²¹ + c₂·2⁴², each chunk < 2²¹;
- ``(2^(21j)·ω_i) mod 2π`` is computed once, exactly, in rational arithmetic from the float64
  frequency ω_i and 2π to 60 digits;
- θ_i(p) mod 2π = (Σ_j c_j·table[j, i]) mod 2π in float64: three terms below 2²¹·2π, so the
  error is about 10⁻⁸ rad at every position, far below float32's rounding of an angle (~10⁻⁷);
- cos and sin are taken in float64 and only then rounded to the activations' dtype.

The table is kept as an int64 buffer holding the float64 bits, so that ``model.to(bfloat16)``,
which casts floating-point buffers, cannot round it. MPS has no float64: there the angles are
computed on the CPU and the cos/sin moved to the device.

The float64 work runs once per forward, not per layer: ``Rotations`` keeps the (cos, sin) of each
row layout a forward meets (``Rows``; most architectures have one, PerceiverAR and
compressed_double two) and base (a hybrid's global layers may have their own), and every layer
with those rows and that base reuses it, its queries (the last rows)
taking the tail. A decode step likewise computes its rotation once for every layer.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch
from torch import Tensor, nn

from ecp_lm.model.rows import Rows

Rotation = tuple[Tensor, Tensor]
"""RoPE's (cos, sin) at some positions (``RotaryEmbedding.rotation``)."""

TWO_PI = 2 * Fraction("3.14159265358979323846264338327950288419716939937510582097494459")
CHUNK_BITS = 21
N_CHUNKS = 3  # 3 x 21 bits cover every non-negative int64 position


def frequencies(head_dim: int, base: float = 10000.0) -> list[float]:
    """ω_i = base^(-2i/D) for the D/2 feature pairs (float64)."""
    return [base ** (-i / head_dim) for i in range(0, head_dim, 2)]


def angle_table(freqs: list[float]) -> Tensor:
    """(N_CHUNKS, D/2) float64: ``(2^(21j)·ω_i) mod 2π``, reduced exactly."""
    rows = [[float(Fraction(w) * 2 ** (CHUNK_BITS * j) % TWO_PI) for w in freqs]
            for j in range(N_CHUNKS)]
    return torch.tensor(rows, dtype=torch.float64)


class RotaryEmbedding(nn.Module):
    """Rotates feature pairs (i, i + D/2) by angle ``pos * base**(-2i/D)``."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        self.head_dim, self.base = head_dim, base
        self.register_buffer("table_bits", torch.empty(N_CHUNKS, head_dim // 2, dtype=torch.int64),
                             persistent=False)
        self.reset_table()

    @torch.no_grad()
    def reset_table(self) -> None:
        """(Re)compute the angle table, a buffer that checkpoints do not hold: at construction,
        and wherever a loader left it uninitialised."""
        table = angle_table(frequencies(self.head_dim, self.base))
        self.table_bits.copy_(table.view(torch.int64))

    def angles(self, positions: Tensor) -> Tensor:
        """positions (R,) int64, >= 0 -> angles (R, D/2) float64 in [0, 2π)."""
        table = self.table_bits.to(positions.device).view(torch.float64)  # (N_CHUNKS, D/2)
        low_bits = (1 << CHUNK_BITS) - 1
        chunks = torch.stack([(positions >> (CHUNK_BITS * j)) & low_bits
                              for j in range(N_CHUNKS)], dim=-1)  # (R, N_CHUNKS)
        return torch.remainder(chunks.to(torch.float64) @ table, math.tau)

    def rotation(self, positions: Tensor, dtype: torch.dtype, device: torch.device
                 ) -> tuple[Tensor, Tensor]:
        """cos and sin of the angles at ``positions`` (R,) or (B, R), as (R, D/2) or
        (B, 1, R, D/2) (the same angles in every head), in ``dtype`` on ``device``: computed once
        per step, they rotate queries and keys in every layer (``rotate``)."""
        if positions.device.type == "mps":  # no float64 on MPS
            positions = positions.cpu()
        angles = self.angles(positions.long())  # ([B,] R, D/2)
        if angles.dim() == 3:
            angles = angles[:, None]
        return (angles.cos().to(device=device, dtype=dtype),
                angles.sin().to(device=device, dtype=dtype))

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (B, H, R, D), positions (R,) int, or (B, R) where rows stand at different
        positions -> (B, H, R, D)."""
        return rotate(x, self.rotation(positions, x.dtype, x.device))


def rotate(x: Tensor, rotation: tuple[Tensor, Tensor]) -> Tensor:
    """x (B, H, R, D) rotated by ``RotaryEmbedding.rotation``'s (cos, sin)."""
    cos, sin = rotation
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def rotation_tail(rotation: tuple[Tensor, Tensor], n: int) -> tuple[Tensor, Tensor]:
    """The (cos, sin) (R, D/2) of the last ``n`` rows: the query rows of a layer whose keys are
    all R rows."""
    cos, sin = rotation
    return cos[cos.size(0) - n:], sin[sin.size(0) - n:]


class Rotations:
    """The rotary (cos, sin) of one forward by base and row layout: computed the first time a
    layer rotates with ``rope`` at ``rows`` and reused by every later layer that does the same
    (a hybrid's global layers may have a base of their own). Made afresh for each forward, it
    holds a handful of entries (one per base, layout and dtype)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._memo: dict[tuple[float, int, int, int, int, torch.dtype], Rotation] = {}

    def __call__(self, rope: RotaryEmbedding, rows: Rows, dtype: torch.dtype) -> Rotation:
        """(cos, sin), each (R, D/2), at the positions of ``rows``."""
        # Plain numbers as the key: a graph torch.compile traces holds them as constants.
        key = (rope.base, rows.history.start, rows.history.stop, rows.main.start,
               rows.main.stop, dtype)
        if key not in self._memo:
            self._memo[key] = rope.rotation(rows.positions(self.device), dtype, self.device)
        return self._memo[key]
