"""Attention masks as predicates on absolute positions (SPEC §2–§3).

A mask is a small frozen dataclass, defined with the architecture it belongs to (``archs/``):
``mask(q_pos, kv_pos)`` broadcasts over integer tensors and returns True where the query may see
the key. A mask that differs between heads (``per_head``, LongLoRA's shifted groups) takes the
head index too: ``mask(q_pos, kv_pos, head)``. It is the specification of an architecture's
attention: the dense reference kernel materialises it, the fast kernels must equal that, and
FlexAttention uses it as its ``mask_mod``. Print one, or ``materialize`` it for small sizes.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch
from torch import Tensor


class Mask(Protocol):
    """What every mask predicate provides."""

    per_head: ClassVar[bool]
    """Whether the predicate takes the head index as a third argument."""

    def __call__(self, q: Tensor, kv: Tensor, *head: Tensor) -> Tensor: ...


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
