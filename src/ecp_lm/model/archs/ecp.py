"""ECP, the Efficient Context Propagating Perceiver (SPEC §3 ``ecp``).

Segments of m = N / S positions, aligned to position 0; each query sees the whole previous
segment and its own segment causally. Each layer extends the look-back by one segment, so context
propagates upward through depth while every attention costs O(T·2m). The mask does not depend on
N, so any input length T >= 1 is exact, including T > N; nor does it change when every position
moves by a multiple of m, so a window may start at any such offset (``start_pos``): it computes
the same function there as at 0, and a stream can run on at any absolute position. Decoding keeps
the last 2m positions per layer (the previous segment and the current one).
"""

from __future__ import annotations

from torch import Tensor

from ecp_lm.config import ModelConfig
from ecp_lm.model.archs.base import BandRule, SegmentedBand, triangle
from ecp_lm.model.kernels.masks import SegmentPairMask
from ecp_lm.model.kernels.sdpa import segment_pair_attention


class ECP(SegmentedBand):
    kernels = ("native", "flash", "mask")

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.mask = SegmentPairMask(cfg.segment_len)

    def band_rules(self) -> list[tuple[slice, BandRule]]:
        m = self.segment_len
        return [(slice(None), (m, 0, m))]

    def layer_cost(self, layer: int) -> tuple[int, int]:
        # Segment 0 sees only itself causally; each later one its whole predecessor plus itself.
        m, s = self.segment_len, self.cfg.num_segments
        return s * triangle(m) + (s - 1) * m * m, (2 * s - 1) * m * m

    def attend_portable(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float,
                        kernel: str) -> Tensor:
        return segment_pair_attention(q, k, v, self.segment_len, dropout_p, kernel)

    def kernel_problem(self, kernel: str, q: Tensor, dropout_p: float,
                       needs_backward: bool) -> str | None:
        if kernel == "flash" and (q.device.type != "cpu" or dropout_p > 0.0):
            return ("ecp's flash kernel merges two CPU flash-attention calls by log-sum-exp: "
                    "CPU only, without dropout")
        return super().kernel_problem(kernel, q, dropout_p, needs_backward)
