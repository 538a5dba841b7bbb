"""Block-local attention (SPEC §3b ``block_local``): the control for ECP's overlap.

``kv <= q and q // b == kv // b``: causal attention within non-overlapping blocks of b =
``window`` positions (default 2m, ECP's one-layer reach), aligned to position 0. No information
crosses a block boundary at any depth, so whatever ECP's overlapping pairs add shows as the
difference between the two. Any input length; every position trained; decoding keeps the current
block, a ring of b slots.
"""

from __future__ import annotations

from torch import Tensor

from ecp_lm.config import ModelConfig
from ecp_lm.model.archs.base import BandRule, WindowedBand, block_costs
from ecp_lm.model.kernels.masks import BlockLocalMask
from ecp_lm.model.kernels.sdpa import block_causal_attention


class BlockLocal(WindowedBand):
    kernels = ("native", "flash")

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.mask = BlockLocalMask(cfg.window)

    @classmethod
    def default_window(cls, seq_len: int, num_segments: int) -> int:
        return 2 * (seq_len // num_segments)  # ECP's one-layer reach, 2m

    @classmethod
    def bench_sizes(cls, seq_len: int, segment_len: int) -> dict[str, int]:
        return {"window": 2 * segment_len}

    @property
    def period(self) -> int:
        return self.cfg.window

    period_name = "window"

    def period_text(self) -> str:
        return f"window={self.period} (block_local's blocks are aligned to position 0)"

    def band_rules(self) -> list[tuple[slice, BandRule]]:
        return [(slice(None), (self.cfg.window, 0, 0))]

    def layer_cost(self, layer: int) -> tuple[int, int]:
        b = self.cfg.window
        return block_costs(self.cfg.seq_len, b, b)

    def attend_portable(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float,
                        kernel: str) -> Tensor:
        return block_causal_attention(q, k, v, self.cfg.window, dropout_p=dropout_p)
