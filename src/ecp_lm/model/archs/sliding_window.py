"""Sliding-window attention (Longformer, Mistral; SPEC §3b ``sliding_window``).

Each query sees itself and the previous w - 1 positions: ``q - w < kv <= q``, w = ``window``.
Like ECP it propagates context upward through depth, w - 1 positions per layer (receptive field
L·(w - 1)), accepts any input length, trains every position and decodes from a ring of w slots.

Default window: the w that gives the same number of unmasked score entries over a window of N
queries as ECP with S segments of m = N / S,

    N·w - w(w - 1)/2  =  S·m(m + 1)/2 + (S - 1)·m²,

solved for the nearest integer, w = round(N + 1/2 - sqrt((N + 1/2)² - 2·E_ecp)): about 3m/2 when
there are many segments (w = 385 at N = 16384, m = 256), more with few, where both patterns'
first-window ramps weigh in (w = 397 at N = 1024, S = 4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import torch
from torch import Tensor

from ecp_lm.model.archs.base import ArchConfig, BandRule, SizedBand, triangle
from ecp_lm.model.kernels.sdpa import paired_blocks_attention
from ecp_lm.model.rows import Rows


def window_entries(n: int, w: int) -> int:
    """Unmasked entries of a window of ``n`` queries: sum over q of min(q + 1, w)."""
    return triangle(n) if w >= n else triangle(w) + (n - w) * w


def equal_cost_window(seq_len: int, num_segments: int) -> int:
    """The window whose entries over N queries are closest to ECP's at the same N and S."""
    n, s = seq_len, num_segments
    m = n // s
    target = s * triangle(m) + (s - 1) * m * m
    guess = round(n + 0.5 - math.sqrt(max(0.0, (n + 0.5) ** 2 - 2 * target)))
    candidates = [w for w in (guess - 1, guess, guess + 1) if 1 <= w <= n]
    return min(candidates, key=lambda w: (abs(window_entries(n, w) - target), w))


@lru_cache(maxsize=32)
def _pair_mask(w: int, device: torch.device) -> Tensor:
    """(w, 2w): query i of a block of w sees keys i + 1 .. i + w of [previous block, own]."""
    row = torch.arange(w, device=device)[:, None]
    col = torch.arange(2 * w, device=device)[None, :]
    return (col > row) & (col <= row + w)



@dataclass(frozen=True)
class SlidingWindowMask:
    """``q - w < kv <= q``: each query sees itself and the previous w - 1 positions."""

    window: int
    per_head: ClassVar[bool] = False

    def __call__(self, q: Tensor, kv: Tensor) -> Tensor:
        return (kv <= q) & (kv > q - self.window)


class SlidingWindow(SizedBand):
    kernels = ("native", "mask")
    size_fields = ("window",)

    def __init__(self, cfg: ArchConfig):
        super().__init__(cfg)
        self.mask = SlidingWindowMask(self.cfg.window)

    @classmethod
    def default_size(cls, seq_len: int, num_segments: int) -> int:
        return equal_cost_window(seq_len, num_segments)  # ECP's cost

    @property
    def period(self) -> int:
        return 1

    def band_rules(self) -> list[tuple[slice, BandRule]]:
        return [(slice(None), (1, 0, self.cfg.window - 1))]

    def layer_cost(self, layer: int) -> tuple[int, int]:
        # Tiles: blocks of w queries, each against its previous block and itself.
        n, w = self.cfg.seq_len, self.cfg.window
        tiles = sum(r * (r + (w if start else 0))
                    for start, r in ((s, min(w, n - s)) for s in range(0, n, w)))
        return window_entries(n, w), tiles

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows, dropout_p: float,
               kernel: str) -> Tensor:
        if kernel == "native":
            return super().attend(q, k, v, rows, dropout_p, kernel)
        w = self.cfg.window
        return paired_blocks_attention(q, k, v, w, _pair_mask(w, q.device), dropout_p)
