"""Full causal attention: the quality and speed baseline (SPEC §3 ``transformer``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch.nn.functional as F
from torch import Tensor

from ecp_lm.model.archs.base import Architecture, triangle
from ecp_lm.model.kernels import native
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
    kernels = ("flash", "native")
    global_attention = True

    @property
    def cache_capacity(self) -> int:
        return self.cfg.seq_len

    def cached_keys_from(self, pos: int, origin: int) -> int:
        # Every earlier position of the window: the chunk's queries are the last of its keys.
        return origin

    def layer_cost(self, layer: int) -> tuple[int, int]:
        n = self.cfg.seq_len
        return triangle(n), n * n

    def auto_kernels(self, dropout_p: float, q: Tensor) -> tuple[str, ...]:
        # With dropout, CPU SDPA leaves its fused kernels for its math path and draws a bernoulli
        # mask over every score; the band kernel over the whole causal band is faster there.
        return ("native", "flash") if dropout_p > 0.0 else self.kernels

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows, dropout_p: float,
               kernel: str) -> Tensor:
        if kernel == "native":  # the band rule (1, 0, T - 1): every key up to the query's own
            t, rq = k.size(2), q.size(2)
            q = F.pad(q, (0, 0, t - rq, 0))  # the first T - Rq rows query nothing anybody reads
            out = native.band_attention(q, k, v, (1, 0, t - 1), dropout_p=dropout_p)
            return out[:, :, t - rq:]
        return causal_attention(q, k, v, dropout_p)
