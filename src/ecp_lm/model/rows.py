"""Which absolute positions the rows of a layer's hidden state hold.

Every architecture keeps its rows in position order: first a run of history rows (positions < h,
used by the perceiver family; empty for every other architecture), then a contiguous main run.
The layout is plain Python data, so kernels can slice by it without reading tensors back from
the device, and it is hashable, so FlexAttention block masks can be cached by it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Rows:
    history: range
    main: range

    @classmethod
    def span(cls, start: int, stop: int) -> Rows:
        """Rows for the contiguous positions start .. stop - 1 with no history block."""
        return cls(range(0), range(start, stop))

    def __len__(self) -> int:
        return len(self.history) + len(self.main)

    def tail(self, n: int) -> Rows:
        """The last ``n`` rows."""
        if n >= len(self):
            return self
        if n <= len(self.main):
            return Rows(range(0), self.main[len(self.main) - n:])
        return Rows(self.history[len(self) - n:], self.main)

    def positions(self, device: torch.device | str | None = None) -> Tensor:
        parts = [torch.arange(len(r), device=device) + r.start for r in (self.history, self.main)]
        return torch.cat(parts)
