"""Full causal attention: the quality and speed baseline (SPEC §3 ``transformer``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from ecp_lm.model.archs.base import Architecture, triangle
from ecp_lm.model.kernels.sdpa import causal_attention
from ecp_lm.model.rows import Rows


@dataclass(frozen=True)
class CausalMask:
    """``kv <= q``: the transformer, and every PerceiverAR layer (lower-right aligned)."""

    per_head: ClassVar[bool] = False

    def __call__(self, q: Tensor, kv: Tensor) -> Tensor:
        return kv <= q


class Transformer(Architecture):
    mask = CausalMask()
    kernels = ("flash",)
    global_attention = True

    @property
    def cache_capacity(self) -> int:
        return self.cfg.seq_len

    def layer_cost(self, layer: int) -> tuple[int, int]:
        n = self.cfg.seq_len
        return triangle(n), n * n

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows, dropout_p: float,
               kernel: str) -> Tensor:
        return causal_attention(q, k, v, dropout_p)
