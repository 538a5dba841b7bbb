"""Double Attention and s-Split Double Attention (SPEC §3 ``double``, ``ssplit``).

Every layer keeps all N positions. History rows attend to the history bidirectionally (allowed:
they are never scored) — to all of it (``double``), or only to their own segment of h / S
positions (``ssplit``); latent rows attend causally to every earlier position. One softmax per
row, so each row's keys fall in exactly one of the two kernel calls.
"""

from __future__ import annotations

from torch import Tensor

from ecp_lm.config import ModelConfig
from ecp_lm.model.archs.base import PerceiverFamily, triangle, whole_segments
from ecp_lm.model.kernels.masks import DoubleMask
from ecp_lm.model.kernels.sdpa import double_attention
from ecp_lm.model.rows import Rows


class Double(PerceiverFamily):
    kernels = ("flash",)

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.mask = DoubleMask(cfg.history_len)

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
    ``ModelConfig.segment_len`` means here)."""

    size_fields = ("latent_len", "num_segments")

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.mask = DoubleMask(cfg.history_len, cfg.segment_len)

    @classmethod
    def check(cls, cfg: ModelConfig) -> None:
        super().check(cfg)
        if cfg.history_len % cfg.num_segments:
            raise ValueError(f"history length seq_len-latent_len={cfg.history_len} is not "
                             f"divisible by num_segments={cfg.num_segments}")

    @classmethod
    def segment_length(cls, cfg: ModelConfig) -> int:
        return cfg.history_len // cfg.num_segments

    @classmethod
    def bench_sizes(cls, seq_len: int, segment_len: int) -> dict[str, int]:
        # The history of the default latent length N/2.
        return {"num_segments": whole_segments(seq_len // 2, segment_len, "history length ")}

    def history_entries(self, c: int) -> int:
        return c * c // self.cfg.num_segments  # S blocks of (h/S)²
