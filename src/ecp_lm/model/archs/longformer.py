"""Longformer (Beltagy et al., 2020): sliding windows of a width per layer, dilated on some heads,
and global tokens (SPEC §3b ``longformer``).

Layer i has a window w_i (``window``: one width, or a comma list with one per layer) and a
dilation d_i (``dilation``: likewise; default 1). Heads H/2 .. H − 1 of a layer with d_i > 1 are
dilated (the paper's "a small number of heads", here the second half, stated), the others are
not. With g = ``global_tokens``, head h of layer i lets query q see key kv when

    kv <= q  and  ( (q − kv) mod δ = 0  and  q − kv < w_i·δ   or   kv < g ),

δ = d_i on a dilated head and 1 otherwise: w_i positions δ apart, the last of them q itself
(§3: "the sliding window with gaps of size dilation d"), and the first g positions, which every
query sees. The paper's global tokens also see every position; in a causal model a global token
at q < g sees the keys <= q, all of which are global themselves, so the predicate above holds
that too. The pattern depends on q − kv alone (g = 0): a window may start at any position and
decoding keeps a ring of (w_i − 1)·δ + 1 slots per layer, plus g sink slots never evicted.

The ``mask`` kernel runs it in O(N·w): an undilated head as sliding_window's blocks of w against
their previous block; a dilated head likewise within each residue class mod d (the rows regrouped
so that a class is contiguous: there, the dilated window is a plain one); the global tokens as a
few extra key columns beside the blocks (kernels/sinks.py).

Deviations from the published model, forced by the shared skeleton: one set of projections for
the local and the global attention (the paper's global attention has projections of its own), and
RoPE (``rope``) in place of learned absolute positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ecp_lm.model.archs.base import ArchConfig, Architecture
from ecp_lm.model.archs.sliding_window import equal_cost_window, sink_entries, window_entries
from ecp_lm.model.kernels import sinks
from ecp_lm.model.kernels.sdpa import paired_blocks_attention
from ecp_lm.model.rows import Rows


def per_layer(value: int | str, n_layers: int, name: str) -> list[int]:
    """``value`` for each of ``n_layers`` layers: one positive integer for all, or a comma list
    of one per layer (ValueError otherwise)."""
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be a positive integer or a comma list of them")
    if isinstance(value, int):
        items = [value] * n_layers
    else:
        try:
            items = [int(part) for part in str(value).split(",")]
        except ValueError:
            raise ValueError(f"{name}={value!r} must be a positive integer or a comma list of "
                             f"them, one per layer") from None
        if len(items) != n_layers:
            raise ValueError(f"{name}={value!r} has {len(items)} values for n_layers="
                             f"{n_layers}: give one per layer, or one for all")
    if min(items) < 1:
        raise ValueError(f"{name}={value!r}: every value must be a positive integer")
    return items


@dataclass(frozen=True)
class LongformerMask:
    """Head h sees ``window`` positions ``dilation`` apart ending at q (1 apart below head
    ``first_dilated``), and the first ``global_tokens`` positions."""

    window: int
    dilation: int
    first_dilated: int
    global_tokens: int = 0
    per_head: ClassVar[bool] = True

    def __call__(self, q: Tensor, kv: Tensor, head: Tensor) -> Tensor:
        step = torch.where(head >= self.first_dilated, self.dilation, 1)
        near = ((q - kv) % step == 0) & (q - kv < self.window * step)
        return (kv <= q) & (near | (kv < self.global_tokens))


def _pair_mask(w: int, device: torch.device) -> Tensor:
    """(w, 2w): query i of a block of w sees keys i + 1 .. i + w of [previous block, own]."""
    row = torch.arange(w, device=device)[:, None]
    col = torch.arange(2 * w, device=device)[None, :]
    return (col > row) & (col <= row + w)


def _blocks(n: int, w: int, extra: int) -> int:
    """Tiles of n rows in blocks of w, each block after the first against its previous block
    and ``extra`` more columns as well as itself."""
    return sum(r * (r + (w + extra if start else 0))
               for start, r in ((s, min(w, n - s)) for s in range(0, n, w)))


class Longformer(Architecture):
    """The model: ``layer(i)`` is layer i's pattern (its window and dilation)."""

    kernels = ("mask",)
    size_fields = ("window", "dilation", "global_tokens")
    queries_at_every_row = True

    def __init__(self, cfg: ArchConfig, index: int | None = None):
        super().__init__(cfg)
        c = self.cfg
        self.windows = per_layer(c.window, c.n_layers, "window")
        self.dilations = per_layer(c.dilation, c.n_layers, "dilation")
        self.index = index
        if index is None:
            self.layers = [Longformer(cfg, i) for i in range(c.n_layers)]
            return
        self.window, self.dilation = self.windows[index], self.dilations[index]
        first = c.n_heads // 2 if self.dilation > 1 else c.n_heads
        self.mask = LongformerMask(self.window, self.dilation, first, c.global_tokens)

    # Configuration --------------------------------------------------------------------------
    @classmethod
    def defaults(cls, cfg: ArchConfig) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if cfg.dilation is None:
            out["dilation"] = 1
        if cfg.window is None:
            if cfg.seq_len % cfg.num_segments:
                raise ValueError(f"the default window of arch={cfg.arch!r} is set from ECP's "
                                 f"segments of seq_len/num_segments, but seq_len={cfg.seq_len} "
                                 f"is not divisible by num_segments={cfg.num_segments}; set "
                                 "window")
            out["window"] = equal_cost_window(cfg.seq_len, cfg.num_segments)  # ECP's cost
        return out

    @classmethod
    def check(cls, cfg: ArchConfig) -> None:
        super().check(cfg)
        per_layer(cfg.window, cfg.n_layers, "window")
        per_layer(cfg.dilation, cfg.n_layers, "dilation")

    # Per layer ------------------------------------------------------------------------------
    def layer(self, layer: int) -> Architecture:
        return self if self.index is not None else self.layers[layer]

    def reach_back(self, layer: int) -> int:
        """How far back layer ``layer``'s farthest non-global key lies: (w − 1)·δ."""
        return (self.windows[layer] - 1) * self.dilations[layer]

    @property
    def max_len(self) -> int | None:
        return None

    @property
    def sink_len(self) -> int:
        return self.cfg.global_tokens

    @property
    def cache_capacity(self) -> int:
        layers = range(self.cfg.n_layers) if self.index is None else (self.index,)
        return max(self.reach_back(i) for i in layers) + 1 + self.sink_len

    def cached_keys_from(self, pos: int, origin: int) -> int | None:
        # The chunk's first query reaches back (w − 1)·d at most (the global tokens aside,
        # which ``cached_sinks`` gives): all in the ring.
        return None if self.index is None else max(origin, pos - self.reach_back(self.index))

    def check_start_pos(self, start_pos: int) -> None:
        if start_pos < 0 or (self.sink_len and start_pos):
            why = (f"with global_tokens={self.sink_len} every query sees positions "
                   f"0..{self.sink_len - 1}, so a window starts at position 0"
                   if self.sink_len else "positions are non-negative")
            raise ValueError(f"start_pos={start_pos}: {why} (a cache continues it at any "
                             "position)")

    def check_context(self, t: int, k: int) -> None:
        if k > 1:
            raise ValueError(f"arch={self.cfg.arch!r} has no context-parallel form (its layers' "
                             "windows, dilations and global tokens differ); run it unsplit")

    def context_start(self, length: int) -> int:
        if self.sink_len:
            return 0  # every position sees the global tokens at 0 .. g - 1
        start = length - 1  # the position whose output predicts the next token
        for layer in reversed(range(self.cfg.n_layers)):  # from the top layer down
            start = max(0, start - self.reach_back(layer))
        return start

    # Cost -----------------------------------------------------------------------------------
    def layer_cost(self, layer: int) -> tuple[int | float, int | float]:
        # Entries per head: an undilated one sliding_window's with sinks; a dilated one, over
        # each query q, min(w, q // d + 1) in its window and the global tokens outside it.
        # Tiles, of the ``mask`` kernel: blocks of w against their previous block, the g global
        # columns and themselves, within the window (undilated) or each residue class mod d.
        n, g, h = self.cfg.seq_len, self.cfg.global_tokens, self.cfg.n_heads
        w, d = self.windows[layer], self.dilations[layer]
        plain = (window_entries(n, w) + sink_entries(n, w, g), _blocks(n, w, g))
        if d == 1:
            return plain
        dilated_entries = sum(min(w, q // d + 1) for q in range(n)) + sum(
            1 for q in range(n) for s in range(min(g, q + 1))
            if (q - s) % d or q - s >= w * d)
        dilated = (dilated_entries, sum(_blocks(len(range(r, n, d)), w, g) for r in range(d)))
        dilated_heads = h - h // 2
        return tuple(_mean((h - dilated_heads) * a + dilated_heads * b, h)
                     for a, b in zip(plain, dilated, strict=True))

    # Kernels ----------------------------------------------------------------------------------
    def attend(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows, dropout_p: float,
               kernel: str) -> Tensor:
        # Queries at every row. The rows are a main run, and before it, for a chunk continuing
        # a cache, the global tokens it no longer holds (a history run of keys only, whose
        # outputs are zeros, dropped by ``Attention._attend``).
        n_hist, main = len(rows.history), rows.main
        n_sinks = n_hist + max(0, min(self.sink_len, main.stop) - main.start)
        sink_pos = rows.positions(q.device)[:n_sinks]
        sink_k, sink_v = k[:, :, :n_sinks], v[:, :, :n_sinks]
        q, k, v = q[:, :, n_hist:], k[:, :, n_hist:], v[:, :, n_hist:]
        first = self.mask.first_dilated
        parts = [self._dilated(q[:, heads], k[:, heads], v[:, heads], step, main.start,
                               sink_pos, sink_k[:, heads], sink_v[:, heads], dropout_p)
                 for heads, step in ((slice(0, first), 1), (slice(first, None), self.dilation))
                 if len(range(q.size(1))[heads])]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return torch.nn.functional.pad(out, (0, 0, n_hist, 0))  # (B, H, R, D)

    def _dilated(self, q: Tensor, k: Tensor, v: Tensor, d: int, start: int, sink_pos: Tensor,
                 sink_k: Tensor, sink_v: Tensor, dropout_p: float) -> Tensor:
        """Heads with dilation ``d`` (1: none) over the main run of rows from position ``start``:
        the rows regrouped into the d residue classes of their index, each class a plain window
        of w (its rows d apart); the global tokens at ``sink_pos`` as extra columns where the
        window does not hold them."""
        b, h, t, dim = q.shape
        w, pad = self.window, -t % d
        classes = (t + pad) // d

        def grouped(x: Tensor) -> Tensor:  # (B, h, T, D) -> (B, h·d, T / d, D), class-major
            x = torch.nn.functional.pad(x, (0, 0, 0, pad))
            return x.view(b, h, classes, d, dim).transpose(2, 3).reshape(b, h * d, classes, dim)

        n = len(sink_pos)
        if n:
            q_pos = start + torch.arange(t + pad, device=q.device).view(classes, d).T
            dist = q_pos[..., None] - sink_pos  # (d, T / d, n)
            in_window = (sink_pos >= start) & (dist % d == 0) & (dist < w * d)
            allowed = (dist >= 0) & ~in_window
            allowed = allowed.expand(h, d, classes, n).reshape(h * d, classes, n)
            sink_k, sink_v = (x[:, :, None].expand(b, h, d, n, dim).reshape(b, h * d, n, dim)
                              for x in (sink_k, sink_v))
            out = sinks.paired_blocks_with_sinks(grouped(q), grouped(k), grouped(v), w,
                                                 _pair_mask(w, q.device), sink_k, sink_v,
                                                 allowed, dropout_p)
        else:
            out = paired_blocks_attention(grouped(q), grouped(k), grouped(v), w,
                                          _pair_mask(w, q.device), dropout_p)
        out = out.view(b, h, d, classes, dim).transpose(2, 3).reshape(b, h, t + pad, dim)
        return out[:, :, :t]


def _mean(total: int, count: int) -> int | float:
    """total / count, an int when exact."""
    return total // count if total % count == 0 else total / count

