"""Key/value caches for incremental decoding: one small module per layer.

A cache is a ring of ``capacity`` preallocated slots; ``update(input_pos, k, v)`` writes each
position into slot ``(pos - origin) % capacity`` (``origin``: the first position it holds, 0
unless a prefill starts elsewhere) and records which absolute position every slot holds, so the
decode step attends over the slots with the architecture's own mask predicate (on absolute
positions) and nothing else: exact by construction.

The buffers take the dtype the model computes in (``LanguageModel.make_caches``): the
parameters' dtype, or the autocast dtype when generation runs under ``torch.autocast``.

- transformer: capacity N, a plain cache of the whole window;
- ecp: capacity 2m. The next position p (segment s = p // m) sees segment s - 1 and its own
  segment up to p, at most 2m positions, and those are exactly the last 2m written; older slots
  are overwritten. Memory and work per token stay O(L·2m·d) however long the generation runs.
- sliding_window, block_local, s2: rings of w, b and G slots, for the same reason (the
  architecture's ``cache_capacity``: the most positions any of its queries sees).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class KVCache(nn.Module):
    def __init__(self, batch_size: int, n_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        shape = (batch_size, n_heads, capacity, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device),
                             persistent=False)
        # Absolute position held by each slot; -1 = empty.
        self.register_buffer("pos", torch.full((capacity,), -1, dtype=torch.long, device=device),
                             persistent=False)
        self.capacity = capacity
        self.origin = 0  # first position written (set before the first update)
        self.filled = 0  # positions are written in order from origin: slots 0 .. filled-1 in use
        self.next_pos = 0  # the position the next update must start at

    def start_at(self, origin: int) -> None:
        """Let an empty cache hold a stream whose first position is ``origin``."""
        if self.filled:
            raise ValueError("start_at needs an empty cache")
        self.origin = self.next_pos = origin

    def nbytes(self, used_only: bool = False) -> int:
        """Bytes of the key and value buffers (only the filled slots if ``used_only``)."""
        slots = self.filled if used_only else self.capacity
        return 2 * self.k[:, :, :slots].numel() * self.k.element_size()

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write keys/values (B, H, R, D) at positions ``input_pos`` (R,), which continue the
        positions written before; keeps the last ``capacity``. Returns the slots in use (keys,
        values, their positions): a plain cache grows with the sequence, a ring stops at its
        capacity."""
        self.next_pos += input_pos.numel()
        if input_pos.numel() > self.capacity:
            input_pos, k, v = (input_pos[-self.capacity:], k[:, :, -self.capacity:],
                               v[:, :, -self.capacity:])
        slots = (input_pos - self.origin) % self.capacity
        self.k[:, :, slots] = k.to(self.k.dtype)
        self.v[:, :, slots] = v.to(self.v.dtype)
        self.pos[slots] = input_pos
        self.filled = min(self.capacity, self.filled + input_pos.numel())
        n = self.filled
        return self.k[:, :, :n], self.v[:, :, :n], self.pos[:n]
