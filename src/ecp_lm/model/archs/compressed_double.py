"""Compressed Double Attention (SPEC §3 ``compressed_double``).

Layer 0 is a Double Attention layer over N positions. After its attention and residual, the h
history rows are mapped to p rows by a learned linear map along the position axis, Linear(h -> p);
the latent rows keep their own residual. The feed-forward of layer 0 and every later layer run on
p + l rows. The compressed rows take RoPE positions h - p .. h - 1, so the later layers' mask,
``(q < p and kv < p) or (q >= p and kv <= q)`` on rows, is ``DoubleMask(h)`` on positions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ecp_lm.model.archs.base import ArchConfig
from ecp_lm.model.archs.double import Double
from ecp_lm.model.rows import Rows


class HistoryCompression(nn.Linear):
    """The learned map of the h history rows to p rows along the position axis, Linear(h -> p)
    (``weight`` (p, h), ``bias`` (p,)); the main rows pass through."""

    def __init__(self, history_len: int, compressed_len: int):
        super().__init__(history_len, compressed_len)
        self.history_len, self.compressed_len = history_len, compressed_len
        # Each compressed row starts as a random mix of the history rows of about unit gain.
        nn.init.normal_(self.weight, 0.0, history_len ** -0.5)
        nn.init.zeros_(self.bias)

    def forward(self, x: Tensor, rows: Rows) -> tuple[Tensor, Rows]:
        """(B, n_hist + n_main, d) -> (B, p + n_main, d). A right-aligned short input has fewer
        than h history rows; the missing (padding) rows are zero, so their weights drop out."""
        h, p, n_hist = self.history_len, self.compressed_len, len(rows.history)
        weight = self.weight[:, h - n_hist:]  # (p, n_hist)
        compressed = torch.einsum("ph,bhd->bpd", weight, x[:, :n_hist])
        compressed = compressed + self.bias[None, :, None]  # (B, p, d)
        return torch.cat([compressed, x[:, n_hist:]], dim=1), Rows(range(h - p, h), rows.main)


class CompressedDouble(Double):
    size_fields = ("latent_len", "compressed_len")

    @classmethod
    def defaults(cls, cfg: ArchConfig) -> dict[str, Any]:
        return {"compressed_len": max(1, cfg.history_len // 2)}

    @classmethod
    def check(cls, cfg: ArchConfig) -> None:
        super().check(cfg)
        h = cfg.history_len
        if not 1 <= cfg.compressed_len <= h - 1:
            raise ValueError(f"compressed_len={cfg.compressed_len} is not in "
                             f"1..history_len-1={h - 1}")
        if cfg.n_layers < 2:
            raise ValueError(f"compressed_double needs n_layers >= 2 (the history is "
                             f"compressed after layer 0), got n_layers={cfg.n_layers}")

    def history_rows(self, layer: int) -> int:
        return self.cfg.history_len if layer == 0 else self.cfg.compressed_len

    def compression(self, layer: int) -> nn.Module | None:
        return HistoryCompression(self.cfg.history_len, self.cfg.compressed_len) if layer == 0 \
            else None
