"""Attention masks as predicates on absolute positions (SPEC §2–§3).

A mask is a small frozen dataclass: ``mask(q_pos, kv_pos)`` broadcasts over integer tensors and
returns True where the query may see the key. It is the specification of an architecture's
attention: the dense reference kernel materialises it, the fast kernels must equal that, and
FlexAttention uses it as its ``mask_mod``. Print one, or ``materialize`` it for small sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class CausalMask:
    """``kv <= q``: the transformer, and every PerceiverAR layer (lower-right aligned)."""

    def __call__(self, q: Tensor, kv: Tensor) -> Tensor:
        return kv <= q


@dataclass(frozen=True)
class SegmentPairMask:
    """ECP: causal, and the key lies in the query's segment or the one before it.

    ``kv <= q and q // m - kv // m <= 1``; segments are aligned to position 0.
    """

    segment_len: int

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

    def __call__(self, q: Tensor, kv: Tensor) -> Tensor:
        h = self.history_len
        history = (q < h) & (kv < h)
        if self.segment_len is not None:
            history = history & (q // self.segment_len == kv // self.segment_len)
        return history | ((q >= h) & (kv <= q))


Mask = CausalMask | SegmentPairMask | DoubleMask


def materialize(mask: Mask, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
    """The boolean (len(q_pos), len(kv_pos)) grid of ``mask``; True = may attend."""
    return mask(q_pos[:, None], kv_pos[None, :])


def show(grid: Tensor) -> str:
    """Render a boolean grid as rows of ``#`` (attend) and ``.`` (masked), for eyes and tests."""
    return "\n".join("".join("#" if v else "." for v in row) for row in grid.tolist())


def positions(start: int, stop: int, device: torch.device | None = None) -> Tensor:
    return torch.arange(start, stop, device=device)
