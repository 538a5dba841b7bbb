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

Attention sinks (``sink_tokens`` = k, StreamingLLM): every query also sees positions 0 .. k - 1
(those <= q), ``kv <= q ∧ (q − w < kv ∨ kv < k)``, with 0 <= k < w. The fast kernels add the
sink columns outside the band to it exactly (kernels/sinks.py), the cache keeps the sinks in k
slots of their own beside the ring of w, and since every position sees them, a window with sinks
starts at position 0 (no other offset, no context-parallel shards) and uncached generation reads
the whole sequence. k = 0 is the plain window, unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import torch
from torch import Tensor

from ecp_lm.model.archs.base import ArchConfig, BandRule, SizedBand, triangle
from ecp_lm.model.kernels import block_masks, sinks
from ecp_lm.model.kernels.sdpa import paired_blocks_attention
from ecp_lm.model.rows import Rows


def window_entries(n: int, w: int) -> int:
    """Unmasked entries of a window of ``n`` queries: sum over q of min(q + 1, w)."""
    return triangle(n) if w >= n else triangle(w) + (n - w) * w


def one_window(cfg: ArchConfig) -> None:
    """ValueError where ``window`` is a list per layer (longformer's alone)."""
    if isinstance(cfg.window, str):
        raise ValueError(f"window={cfg.window!r}: a width per layer is longformer's; "
                         f"arch={cfg.arch!r} takes one window")


def sink_entries(n: int, w: int, k: int) -> int:
    """Entries the sinks add over ``n`` queries: query q >= w sees min(k, q - w + 1) sinks
    outside its window (the others lie within it)."""
    rest = max(0, n - w)  # queries w .. n - 1, which see 1, 2, ... sinks outside, up to k
    return triangle(rest) if rest <= k else triangle(k) + (rest - k) * k


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
    """``q - w < kv <= q``: each query sees itself and the previous w - 1 positions; with
    ``sink_tokens`` = k, also the positions ``kv < k`` (those <= q)."""

    window: int
    sink_tokens: int = 0
    per_head: ClassVar[bool] = False

    def __call__(self, q: Tensor, kv: Tensor) -> Tensor:
        if self.sink_tokens:
            return (kv <= q) & ((kv > q - self.window) | (kv < self.sink_tokens))
        return (kv <= q) & (kv > q - self.window)


class SlidingWindow(SizedBand):
    kernels = ("native", "mask")
    size_fields = ("window",)
    takes_sink_tokens = True

    def __init__(self, cfg: ArchConfig):
        super().__init__(cfg)
        self.mask = SlidingWindowMask(self.cfg.window, self.cfg.sink_tokens)

    @classmethod
    def check(cls, cfg: ArchConfig) -> None:
        one_window(cfg)
        super().check(cfg)
        if cfg.sink_tokens >= cfg.window:
            raise ValueError(f"sink_tokens={cfg.sink_tokens} is not below window={cfg.window}: "
                             "sinks are a few positions seen besides the window; with "
                             "k >= w they would be more than the window itself (make window "
                             "larger or sink_tokens smaller)")

    @property
    def sink_len(self) -> int:
        return self.cfg.sink_tokens

    def check_start_pos(self, start_pos: int) -> None:
        super().check_start_pos(start_pos)
        if self.sink_len and start_pos:
            raise ValueError(f"start_pos={start_pos}: with sink_tokens={self.sink_len} every "
                             f"query sees positions 0..{self.sink_len - 1}, so a window starts "
                             "at position 0 (a cache continues it at any position)")

    def check_context(self, t: int, k: int) -> None:
        if self.sink_len and k > 1:
            raise ValueError(f"sink_tokens={self.sink_len}: every query sees positions "
                             f"0..{self.sink_len - 1}, which only the first of K={k} "
                             "context-parallel shards holds; run it unsplit")
        super().check_context(t, k)

    def first_seen(self, t: int) -> int:
        return 0 if self.sink_len else super().first_seen(t)

    def flex_bands(self, n_heads: int) -> block_masks.Bands | None:
        # With sinks, the block mask comes from the predicate (the sink columns are no band).
        return None if self.sink_len else super().flex_bands(n_heads)

    @classmethod
    def default_size(cls, seq_len: int, num_segments: int) -> int:
        return equal_cost_window(seq_len, num_segments)  # ECP's cost

    @property
    def period(self) -> int:
        return 1

    def band_rules(self) -> list[tuple[slice, BandRule]]:
        return [(slice(None), (1, 0, self.cfg.window - 1))]

    def layer_cost(self, layer: int) -> tuple[int, int]:
        # Tiles: blocks of w queries, each against its previous block and itself, and every
        # block after the first (whose queries see the sinks within their band) against the k
        # sink columns, one more key block.
        n, w, k = self.cfg.seq_len, self.cfg.window, self.cfg.sink_tokens
        tiles = sum(r * (r + (w + k if start else 0))
                    for start, r in ((s, min(w, n - s)) for s in range(0, n, w)))
        return window_entries(n, w) + sink_entries(n, w, k), tiles

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows, dropout_p: float,
               kernel: str) -> Tensor:
        if self.sink_len:
            return self._attend_with_sinks(q, k, v, rows, dropout_p, kernel)
        if kernel == "native":
            return super().attend(q, k, v, rows, dropout_p, kernel)
        w = self.cfg.window
        return paired_blocks_attention(q, k, v, w, _pair_mask(w, q.device), dropout_p)

    def _attend_with_sinks(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows, dropout_p: float,
                           kernel: str) -> Tensor:
        """``attend`` with sinks: the band over the main run, and the sink rows (the history run,
        then the main run's rows before k) as extra columns (kernels/sinks.py). The history
        rows' outputs are zeros (they are keys only, which ``Attention._attend`` drops)."""
        w, main, n_hist = self.cfg.window, rows.main, len(rows.history)
        n_sinks = n_hist + max(0, min(self.sink_len, main.stop) - main.start)
        positions = rows.positions(q.device)
        allowed = sinks.outside_band(positions[n_hist:], positions[:n_sinks], main.start, w)
        q, sink_k, sink_v = q[:, :, n_hist:], k[:, :, :n_sinks], v[:, :, :n_sinks]
        k, v = k[:, :, n_hist:], v[:, :, n_hist:]
        if kernel == "native":
            out = sinks.band_with_sinks(q, k, v, self.band_rules()[0][1], sink_k, sink_v,
                                        allowed, dropout_p)
        else:
            out = sinks.paired_blocks_with_sinks(q, k, v, w, _pair_mask(w, q.device), sink_k,
                                                 sink_v, allowed, dropout_p)
        return torch.nn.functional.pad(out, (0, 0, n_hist, 0))  # (B, H, R, D)
