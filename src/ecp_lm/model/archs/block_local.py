"""Block-local attention (SPEC §3b ``block_local``): the control for ECP's overlap.

``kv <= q and q // b == kv // b``: causal attention within non-overlapping blocks of b =
``block_len`` positions (default 2m = 2·N/S, ECP's one-layer reach), aligned to position 0. No
information crosses a block boundary at any depth, so whatever ECP's overlapping pairs add shows
as the difference between the two. Any input length; every position trained; decoding keeps the
current block, a ring of b slots. Configs saved by earlier releases, which called b ``window``,
are read with that name (``renamed``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from ecp_lm.model.archs.base import ArchConfig, BandRule, SizedBand, block_costs
from ecp_lm.model.kernels.sdpa import block_causal_attention
from ecp_lm.model.rows import Rows


@dataclass(frozen=True)
class BlockLocalMask:
    """``kv <= q and q // b == kv // b``: causal within non-overlapping blocks of b positions,
    aligned to position 0; nothing crosses a block boundary."""

    block_len: int
    per_head: ClassVar[bool] = False

    def __call__(self, q: Tensor, kv: Tensor) -> Tensor:
        b = self.block_len
        return (kv <= q) & (q // b == kv // b)


class BlockLocal(SizedBand):
    kernels = ("native", "flash")
    size_fields = ("block_len",)
    renamed: ClassVar[dict[str, str]] = {"window": "block_len"}
    period_name = "block_len"

    def __init__(self, cfg: ArchConfig):
        super().__init__(cfg)
        self.mask = BlockLocalMask(self.cfg.block_len)

    @classmethod
    def default_size(cls, seq_len: int, num_segments: int) -> int:
        return 2 * (seq_len // num_segments)  # ECP's one-layer reach, 2m

    @property
    def period(self) -> int:
        return self.cfg.block_len

    def period_text(self) -> str:
        return f"block_len={self.period} (block_local's blocks are aligned to position 0)"

    def band_rules(self) -> list[tuple[slice, BandRule]]:
        return [(slice(None), (self.cfg.block_len, 0, 0))]

    def layer_cost(self, layer: int) -> tuple[int, int]:
        b = self.cfg.block_len
        return block_costs(self.cfg.seq_len, b, b)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows, dropout_p: float,
               kernel: str) -> Tensor:
        if kernel == "native":
            return super().attend(q, k, v, rows, dropout_p, kernel)
        return block_causal_attention(q, k, v, self.cfg.block_len, dropout_p=dropout_p)
