"""LongLoRA's shifted sparse attention, S²-Attn (Chen et al. 2023; SPEC §3b ``s2``).

Groups of G = m = N / S positions (``num_segments`` sets m as for ECP). Heads 0 .. H/2 - 1 attend
causally within groups aligned to position 0; heads H/2 .. H - 1 within groups shifted by G/2,
with no wrap-around (their first group is G/2 long, so nothing leaks from the future). The
shifted half lets information cross a group boundary in each layer. Any input length; every
position trained; decoding keeps the last G positions (either half's group up to the query).
"""

from __future__ import annotations

from torch import Tensor

from ecp_lm.config import ModelConfig
from ecp_lm.model.archs.base import BandRule, SegmentedBand, block_costs
from ecp_lm.model.kernels.masks import ShiftedGroupMask
from ecp_lm.model.kernels.sdpa import block_causal_attention


class ShiftedSparse(SegmentedBand):
    kernels = ("native", "flash")

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.mask = ShiftedGroupMask(cfg.segment_len, cfg.n_heads)

    @classmethod
    def check(cls, cfg: ModelConfig) -> None:
        super().check(cfg)
        if cfg.segment_len % 2:
            raise ValueError(f"s2 shifts its groups by half a group, but the group "
                             f"seq_len/num_segments={cfg.segment_len} is odd")
        if cfg.n_heads % 2:
            raise ValueError(f"s2 shifts the groups of half of the heads, but "
                             f"n_heads={cfg.n_heads} is odd")

    def band_rules(self) -> list[tuple[slice, BandRule]]:
        g, half = self.segment_len, self.cfg.n_heads // 2
        return [(slice(0, half), (g, 0, 0)), (slice(half, None), (g, g // 2, 0))]

    def layer_cost(self, layer: int) -> tuple[int | float, int | float]:
        # The mean over heads: half see groups from 0, half groups shifted by G/2.
        n, g = self.cfg.seq_len, self.segment_len
        plain, shifted = block_costs(n, g, g), block_costs(n, g // 2, g)
        return tuple(_half(a + b) for a, b in zip(plain, shifted, strict=True))

    def attend_portable(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float,
                        kernel: str) -> Tensor:
        g = self.segment_len

        def groups(q: Tensor, k: Tensor, v: Tensor, rule: BandRule) -> Tensor:
            return block_causal_attention(q, k, v, g, first_len=g - rule[1], dropout_p=dropout_p)

        return self.per_head_rule(groups, q, k, v)


def _half(total: int) -> int | float:
    """total / 2, an int when exact."""
    return total // 2 if total % 2 == 0 else total / 2
