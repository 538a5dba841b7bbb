"""What distinguishes one architecture from another on the shared skeleton (SPEC §2).

An architecture is (a) a mask predicate on absolute positions, (b) a rule for which rows produce
queries in each layer, (c) which positions are predicted, and (d) an exact fast kernel for its
mask. Everything else (embedding, blocks, norm, head) is shared.
"""

from __future__ import annotations

from torch import Tensor

from ecp_lm.config import ModelConfig
from ecp_lm.models.attention.masks import Mask
from ecp_lm.models.block import Block
from ecp_lm.models.rope import RotaryEmbedding
from ecp_lm.models.rows import Rows


class Architecture:
    """Base: a causal model over positions 0 .. T-1 that predicts every position."""

    mask: Mask

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    @property
    def max_len(self) -> int | None:
        """Longest accepted input (None: unbounded)."""
        return self.cfg.seq_len

    @property
    def cache_capacity(self) -> int | None:
        """Slots of a per-layer KV cache that makes decoding exact (None: no cache; decoding
        recomputes the window)."""
        return None

    def check_length(self, t: int) -> None:
        limit = self.max_len
        if t < 1 or (limit is not None and t > limit):
            bound = "" if limit is None else f"..{limit}"
            raise ValueError(f"input length {t} is outside 1{bound} accepted by "
                             f"arch={self.cfg.arch!r} (seq_len={self.cfg.seq_len})")

    def check_start_pos(self, start_pos: int) -> None:
        """Refuses an absolute offset at which this architecture's function is not defined. Here
        positions belong to the window, which starts at 0; ECP accepts multiples of m."""
        if start_pos != 0:
            raise ValueError(f"start_pos={start_pos}: arch={self.cfg.arch!r} numbers positions "
                             "within its window, so a window starts at position 0")

    def input_rows(self, t: int, start_pos: int = 0) -> Rows:
        """The positions held by the rows of an input of length ``t`` whose first token is at
        ``start_pos`` (a cached decode step may continue at any position)."""
        return Rows.span(start_pos, start_pos + t)

    def context_start(self, length: int) -> int:
        """First index of a sequence of ``length`` tokens that the prediction after its last
        token needs: here the last window of N tokens."""
        return max(0, length - self.cfg.seq_len)

    def num_predicted(self, t: int) -> int:
        """How many trailing positions of an input of length ``t`` are predicted."""
        return t

    def num_queries(self, layer: int, rows: Rows, n_predicted: int) -> int:
        """Rows producing queries in ``layer``: all of them, except in the last layer, where only
        the predicted rows are read afterwards."""
        return n_predicted if layer == self.cfg.n_layers - 1 else len(rows)

    def make_block(self, layer: int, rope: RotaryEmbedding | None) -> Block:
        return Block(self.cfg, self, rope)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows, dropout_p: float) -> Tensor:
        """The exact fast kernel for ``mask`` (q: the last rows of ``rows``)."""
        raise NotImplementedError


class PerceiverFamily(Architecture):
    """Windows of N = h + l positions; an input of length T < N is right-aligned: its tokens take
    positions N - T .. N - 1 and the left padding is dropped (it is never a key, SPEC §4). The
    last min(l, T) positions are predicted."""

    def input_rows(self, t: int, start_pos: int = 0) -> Rows:
        n, h = self.cfg.seq_len, self.cfg.history_len
        start = n - t
        return Rows(range(min(start, h), h), range(max(start, h), n))

    def num_predicted(self, t: int) -> int:
        return min(self.cfg.latent_len, t)
