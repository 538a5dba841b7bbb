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

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from ecp_lm.model.archs.base import ArchConfig, BandRule, SegmentedBand, triangle
from ecp_lm.model.kernels import native
from ecp_lm.model.kernels.sdpa import segment_pair_attention
from ecp_lm.model.rows import Rows


@dataclass(frozen=True)
class SegmentPairMask:
    """ECP: causal, and the key lies in the query's segment or the one before it.

    ``kv <= q and q // m - kv // m <= 1``; segments are aligned to position 0.
    """

    segment_len: int
    per_head: ClassVar[bool] = False

    def __call__(self, q: Tensor, kv: Tensor) -> Tensor:
        m = self.segment_len
        return (kv <= q) & (q // m - kv // m <= 1)


class ECP(SegmentedBand):
    kernels = ("native", "flash", "mask")

    def __init__(self, cfg: ArchConfig):
        super().__init__(cfg)
        self.mask = SegmentPairMask(self.segment_len)

    def band_rules(self) -> list[tuple[slice, BandRule]]:
        # Query t sees keys from the start of the previous segment: lo(t) = (t // m - 1)·m.
        m = self.segment_len
        return [(slice(None), (m, 0, m))]

    def layer_cost(self, layer: int) -> tuple[int, int]:
        # Segment 0 sees only itself causally; each later one its whole predecessor plus itself.
        m, s = self.segment_len, self.cfg.num_segments
        return s * triangle(m) + (s - 1) * m * m, (2 * s - 1) * m * m

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows, dropout_p: float,
               kernel: str) -> Tensor:
        # q, k, v: (B, H, T, D), T rows from the start of a segment.
        if kernel == "native":
            return native.band_attention(q, k, v, self.band_rules()[0][1], dropout_p=dropout_p)
        return segment_pair_attention(q, k, v, self.segment_len, dropout_p, kernel)

    def auto_kernels(self, dropout_p: float, q: Tensor) -> tuple[str, ...]:
        # Off the CPU, ``auto`` prefers the mask kernel to the lower-right flash path until a
        # GPU's measurements (benchmarks/gpu_check.py, ``kernels``) say which is faster.
        return ("native", "mask", "flash") if q.device.type != "cpu" else self.kernels

    def kernel_limit(self, kernel: str, q: Tensor, dropout_p: float) -> str | None:
        if kernel == "flash" and q.device.type == "cpu" and dropout_p > 0.0:
            return ("ecp's flash kernel on the CPU merges two flash-attention calls by "
                    "log-sum-exp, without dropout")
        return None
