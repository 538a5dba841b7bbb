"""Attention masks as predicates on absolute positions (SPEC §2–§3).

A mask is a small frozen dataclass: ``mask(q_pos, kv_pos)`` broadcasts over integer tensors and
returns True where the query may see the key. A mask that differs between heads (``per_head``,
LongLoRA's shifted groups) takes the head index too: ``mask(q_pos, kv_pos, head)``. It is the
specification of an architecture's attention: the dense reference kernel materialises it, the fast
kernels must equal that, and FlexAttention uses it as its ``mask_mod``. Print one, or
``materialize`` it for small sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor


@dataclass(frozen=True)
class CausalMask:
    """``kv <= q``: the transformer, and every PerceiverAR layer (lower-right aligned)."""

    per_head: ClassVar[bool] = False

    def __call__(self, q: Tensor, kv: Tensor) -> Tensor:
        return kv <= q


@dataclass(frozen=True)
class SegmentPairMask:
    """ECP: causal, and the key lies in the query's segment or the one before it.

    ``kv <= q and q // m - kv // m <= 1``; segments are aligned to position 0.
    """

    segment_len: int
    per_head: ClassVar[bool] = False

    def __call__(self, q: Tensor, kv: Tensor) -> Tensor:
        m = self.segment_len
        return (kv <= q) & (q // m - kv // m <= 1)


@dataclass(frozen=True)
class DoubleMask:
    """Double Attention: history rows (q < h) see every history key, bidirectionally; latent rows
    see ``kv <= q``. With ``segment_len`` set (s-Split), history rows see only their own history
    segment of that length.

    The compressed_double layers after compression use ``DoubleMask(h)`` too: their p compressed
    rows carry positions h - p .. h - 1, so ``q < h`` is exactly the compressed block.
    """

    history_len: int
    segment_len: int | None = None
    per_head: ClassVar[bool] = False

    def __call__(self, q: Tensor, kv: Tensor) -> Tensor:
        h = self.history_len
        history = (q < h) & (kv < h)
        if self.segment_len is not None:
            history = history & (q // self.segment_len == kv // self.segment_len)
        return history | ((q >= h) & (kv <= q))


@dataclass(frozen=True)
class SlidingWindowMask:
    """``q - w < kv <= q``: each query sees itself and the previous w - 1 positions."""

    window: int
    per_head: ClassVar[bool] = False

    def __call__(self, q: Tensor, kv: Tensor) -> Tensor:
        return (kv <= q) & (kv > q - self.window)


@dataclass(frozen=True)
class BlockLocalMask:
    """``kv <= q and q // b == kv // b``: causal within non-overlapping blocks of b positions,
    aligned to position 0; nothing crosses a block boundary."""

    block_len: int
    per_head: ClassVar[bool] = False

    def __call__(self, q: Tensor, kv: Tensor) -> Tensor:
        b = self.block_len
        return (kv <= q) & (q // b == kv // b)


@dataclass(frozen=True)
class ShiftedGroupMask:
    """LongLoRA's shifted sparse attention (S²-Attn): causal within groups of G positions. Heads
    0 .. H/2 - 1 use groups aligned to position 0, ``q // G == kv // G``; heads H/2 .. H - 1
    groups shifted by G/2, ``(q + G/2) // G == (kv + G/2) // G``, without wrap-around (their
    first group, 0 .. G/2 - 1, is G/2 long)."""

    group_len: int
    n_heads: int
    per_head: ClassVar[bool] = True

    def __call__(self, q: Tensor, kv: Tensor, head: Tensor) -> Tensor:
        g = self.group_len
        shift = (head >= self.n_heads // 2) * (g // 2)
        return (kv <= q) & ((q + shift) // g == (kv + shift) // g)


Mask = (CausalMask | SegmentPairMask | DoubleMask | SlidingWindowMask | BlockLocalMask
        | ShiftedGroupMask)


def materialize(mask: Mask, q_pos: Tensor, kv_pos: Tensor, n_heads: int | None = None
                ) -> Tensor:
    """The boolean (len(q_pos), len(kv_pos)) grid of ``mask``; True = may attend. A per-head
    mask gives (n_heads, len(q_pos), len(kv_pos)); either broadcasts over (B, H, Rq, Rk)."""
    if not mask.per_head:
        return mask(q_pos[:, None], kv_pos[None, :])
    if n_heads is None:
        raise ValueError(f"{mask} differs between heads: materialize it with n_heads")
    heads = torch.arange(n_heads, device=q_pos.device)[:, None, None]
    return mask(q_pos[None, :, None], kv_pos[None, None, :], heads)


def show(grid: Tensor) -> str:
    """Render a boolean grid as rows of ``#`` (attend) and ``.`` (masked), for eyes and tests."""
    return "\n".join("".join("#" if v else "." for v in row) for row in grid.tolist())


def positions(start: int, stop: int, device: torch.device | None = None) -> Tensor:
    return torch.arange(start, stop, device=device)
