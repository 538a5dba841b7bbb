"""LongLoRA's shifted sparse attention, S²-Attn (Chen et al. 2023; SPEC §3b ``s2``).

Groups of G = ``group_len`` positions (default ECP's segment m = N / S, which then needs N
divisible by S). Heads 0 .. H/2 - 1 attend causally within groups aligned to position 0; heads
H/2 .. H - 1 within groups shifted by G/2, with no wrap-around (their first group is G/2 long, so
nothing leaks from the future). The shifted half lets information cross a group boundary in each
layer. The pattern repeats every G positions, so ``ModelConfig.segment_len`` is G. Any input
length; every position trained; decoding keeps the last G positions (either half's group up to
the query).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from ecp_lm.model.archs.base import ArchConfig, BandRule, SizedBand, block_costs
from ecp_lm.model.kernels.sdpa import block_causal_attention
from ecp_lm.model.rows import Rows


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


class ShiftedSparse(SizedBand):
    kernels = ("native", "flash")
    size_fields = ("group_len",)
    period_name = "group_len"

    def __init__(self, cfg: ArchConfig):
        super().__init__(cfg)
        self.mask = ShiftedGroupMask(self.cfg.group_len, cfg.n_heads)

    @classmethod
    def default_size(cls, seq_len: int, num_segments: int) -> int:
        return seq_len // num_segments  # ECP's segment, m

    @classmethod
    def check(cls, cfg: ArchConfig) -> None:
        super().check(cfg)
        if cfg.group_len % 2:
            raise ValueError(f"s2 shifts its groups by half a group, but "
                             f"group_len={cfg.group_len} is odd (set an even group_len; its "
                             f"default is seq_len/num_segments)")
        if cfg.n_heads % 2:
            raise ValueError(f"s2 shifts the groups of half of the heads, but "
                             f"n_heads={cfg.n_heads} is odd")

    @classmethod
    def segment_length(cls, cfg: ArchConfig) -> int:
        # The pattern's period, G: the config as set (unset: the default, ECP's m).
        if cfg.group_len is not None:
            return cfg.group_len
        return cls.default_size(cfg.seq_len, cfg.num_segments)

    @property
    def period(self) -> int:
        return self.cfg.group_len

    def period_text(self) -> str:
        return f"group_len={self.period} (s2 aligns its groups to position 0)"

    def band_rules(self) -> list[tuple[slice, BandRule]]:
        g, half = self.cfg.group_len, self.cfg.n_heads // 2
        return [(slice(0, half), (g, 0, 0)), (slice(half, None), (g, g // 2, 0))]

    def layer_cost(self, layer: int) -> tuple[int | float, int | float]:
        # The mean over heads: half see groups from 0, half groups shifted by G/2.
        n, g = self.cfg.seq_len, self.cfg.group_len
        plain, shifted = block_costs(n, g, g), block_costs(n, g // 2, g)
        return tuple(_half(a + b) for a, b in zip(plain, shifted, strict=True))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows, dropout_p: float,
               kernel: str) -> Tensor:
        if kernel == "native":  # one call per half of the heads, each with its own rule
            return super().attend(q, k, v, rows, dropout_p, kernel)
        g = self.cfg.group_len

        def groups(q: Tensor, k: Tensor, v: Tensor, rule: BandRule) -> Tensor:
            return block_causal_attention(q, k, v, g, first_len=g - rule[1], dropout_p=dropout_p)

        return self.per_head_rule(groups, q, k, v)


def _half(total: int) -> int | float:
    """total / 2, an int when exact."""
    return total // 2 if total % 2 == 0 else total / 2
