"""ECP, the Efficient Context Propagating Perceiver (SPEC §3 ``ecp``).

Segments of m = N / S positions, aligned to position 0; each query sees the whole previous
segment and its own segment causally. Each layer extends the look-back by one segment, so context
propagates upward through depth while every attention costs O(T·2m). The mask does not depend on
N, so any input length T >= 1 is exact, including T > N.
"""

from __future__ import annotations

from torch import Tensor

from ecp_lm.config import ModelConfig
from ecp_lm.models.archs.base import Architecture
from ecp_lm.models.attention.kernels import segment_pair_attention
from ecp_lm.models.attention.masks import SegmentPairMask
from ecp_lm.models.rows import Rows


class ECP(Architecture):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.mask = SegmentPairMask(cfg.segment_len)

    @property
    def max_len(self) -> int | None:
        return None

    @property
    def cache_capacity(self) -> int:
        return 2 * self.cfg.segment_len  # the previous segment and the current one

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows, dropout_p: float) -> Tensor:
        # Every ECP position is predicted, so queries and keys are the same rows 0 .. T-1.
        assert rows.main.start == 0 and q.size(-2) == k.size(-2) == len(rows)
        return segment_pair_attention(q, k, v, self.mask.segment_len, dropout_p)
