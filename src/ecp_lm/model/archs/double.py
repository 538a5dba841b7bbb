"""Double Attention and s-Split Double Attention (SPEC §3 ``double``, ``ssplit``).

Every layer keeps all N positions. History rows attend to the history bidirectionally (allowed:
they are never scored) — to all of it (``double``), or only to their own segment of h / S
positions (``ssplit``); latent rows attend causally to every earlier position. One softmax per
row, so each row's keys fall in exactly one of the two kernel calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from ecp_lm.model.archs.base import ArchConfig, PerceiverFamily, triangle
from ecp_lm.model.kernels.sdpa import double_attention
from ecp_lm.model.rows import Rows


@dataclass(frozen=True)
class DoubleMask:
    """Double Attention: history rows (q < h) see every history key, bidirectionally; latent rows
    see ``kv <= q``. With ``segment_len`` set (s-Split), history rows see only their own history
    segment of that length.

    The compressed_double layers after compression use ``DoubleMask(h)`` too: their p compressed
    rows carry positions h - p .. h - 1, so ``q < h`` is exactly the compressed block.
    """

    history_len: int
    segment_len: int | None = None
    per_head: ClassVar[bool] = False

    def __call__(self, q: Tensor, kv: Tensor) -> Tensor:
        h = self.history_len
        history = (q < h) & (kv < h)
        if self.segment_len is not None:
            history = history & (q // self.segment_len == kv // self.segment_len)
        return history | ((q >= h) & (kv <= q))


class Double(PerceiverFamily):
    kernels = ("flash",)

    def __init__(self, cfg: ArchConfig):
        super().__init__(cfg)
        self.mask = DoubleMask(self.cfg.history_len)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows, dropout_p: float,
               kernel: str) -> Tensor:
        return double_attention(q, k, v, rows, self.mask.segment_len, dropout_p)

    def history_rows(self, layer: int) -> int:
        """Rows of the bidirectional history block in ``layer`` over a full window."""
        return self.cfg.history_len

    def history_entries(self, c: int) -> int:
        """Entries of a history block of ``c`` rows: all c² pairs."""
        return c * c

    def layer_cost(self, layer: int) -> tuple[int, int]:
        # A bidirectional history block of c rows plus l latent rows that see the whole history
        # and themselves causally; the last layer only queries the predicted (latent) rows.
        l, c = self.cfg.latent_len, self.history_rows(layer)  # noqa: E741 (the paper's l)
        history = 0 if layer == self.cfg.n_layers - 1 else self.history_entries(c)
        return history + l * c + triangle(l), history + l * (c + l)


class SSplit(Double):
    """``num_segments`` splits the history h = N - l into S segments of h / S (which is what
    ``ArchConfig.segment_len`` means here)."""

    size_fields = ("latent_len", "num_segments")

    def __init__(self, cfg: ArchConfig):
        super().__init__(cfg)
        self.mask = DoubleMask(self.cfg.history_len, cfg.segment_len)

    @classmethod
    def check(cls, cfg: ArchConfig) -> None:
        super().check(cfg)
        if cfg.history_len % cfg.num_segments:
            raise ValueError(f"history length seq_len-latent_len={cfg.history_len} is not "
                             f"divisible by num_segments={cfg.num_segments}")

    @classmethod
    def segment_length(cls, cfg: ArchConfig) -> int:
        return cfg.history_len // cfg.num_segments

    def history_entries(self, c: int) -> int:
        return c * c // self.cfg.num_segments  # S blocks of (h/S)²
