"""ECP, the Efficient Context Propagating Perceiver (SPEC §3 ``ecp``).

Segments of m = N / S positions, aligned to position 0; each query sees the whole previous
segment and its own segment causally. Each layer extends the look-back by one segment, so context
propagates upward through depth while every attention costs O(T·2m). The mask does not depend on
N, so any input length T >= 1 is exact, including T > N; nor does it change when every position
moves by a multiple of m, so a window may start at any such offset (``start_pos``): it computes
the same function there as at 0, and a stream can run on at any absolute position.
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

    def check_start_pos(self, start_pos: int) -> None:
        m = self.cfg.segment_len
        if start_pos < 0 or start_pos % m:
            raise ValueError(f"start_pos={start_pos} is not a non-negative multiple of "
                             f"segment_len={m} (ecp segments are aligned to position 0)")

    def context_start(self, length: int) -> int:
        # The prediction is the output at position length - 1, in segment s; through L layers
        # it reaches back to the start of segment max(0, s - L) and no further (SPEC §3).
        m = self.cfg.segment_len
        return max(0, (length - 1) // m - self.cfg.n_layers) * m

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows, dropout_p: float) -> Tensor:
        # Every ECP position is predicted, so queries and keys are the same rows. The kernel cuts
        # them into segments from the first row: exact when that row starts a segment.
        m = self.mask.segment_len
        assert rows.main.start % m == 0 and q.size(-2) == k.size(-2) == len(rows)
        return segment_pair_attention(q, k, v, m, dropout_p)
