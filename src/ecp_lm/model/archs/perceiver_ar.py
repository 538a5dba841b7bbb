"""PerceiverAR (Hawthorne et al. 2022; SPEC §3 ``perceiver_ar``).

Layer 0: only the l latent positions produce queries, against keys at every position, lower-right
aligned causally; its residual is the latent rows. Layers >= 1: causal self-attention among the
latents. The history is compressed into the latents once and never refined, nor trained on.
"""

from __future__ import annotations

from torch import Tensor

from ecp_lm.model.archs.base import PerceiverFamily, triangle
from ecp_lm.model.archs.transformer import CausalMask
from ecp_lm.model.kernels.sdpa import causal_attention
from ecp_lm.model.rows import Rows


class PerceiverAR(PerceiverFamily):
    mask = CausalMask()
    kernels = ("flash",)

    def num_queries(self, layer: int, rows: Rows, n_predicted: int) -> int:
        return n_predicted

    def layer_cost(self, layer: int) -> tuple[int, int]:
        l, h = self.cfg.latent_len, self.cfg.history_len  # noqa: E741 (the paper's l)
        if layer == 0:  # latents against all N keys, lower-right causal
            return l * h + triangle(l), l * self.cfg.seq_len
        return triangle(l), l * l

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows, dropout_p: float,
               kernel: str) -> Tensor:
        return causal_attention(q, k, v, dropout_p)
