"""Double Attention and s-Split Double Attention (SPEC §3 ``double``, ``ssplit``).

Every layer keeps all N positions. History rows attend to the history bidirectionally (allowed:
they are never scored) — to all of it (``double``), or only to their own segment of h / S
positions (``ssplit``); latent rows attend causally to every earlier position. One softmax per
row, so each row's keys fall in exactly one of the two kernel calls.
"""

from __future__ import annotations

from torch import Tensor

from ecp_lm.config import ModelConfig
from ecp_lm.models.archs.base import PerceiverFamily
from ecp_lm.models.attention.kernels import double_attention
from ecp_lm.models.attention.masks import DoubleMask
from ecp_lm.models.rows import Rows


class Double(PerceiverFamily):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.mask = DoubleMask(cfg.history_len)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows, dropout_p: float) -> Tensor:
        return double_attention(q, k, v, rows, self.mask.segment_len, dropout_p)


class SSplit(Double):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.mask = DoubleMask(cfg.history_len, cfg.segment_len)
