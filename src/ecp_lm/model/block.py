"""The pre-norm decoder block shared by every architecture (SPEC §2).

``x = x + Attn(Norm(x)); x = x + FF(Norm(x))``. When only the last ``n_query`` rows produce
queries (PerceiverAR's layer 0, or the last layer, whose other rows nobody reads), the residual is
those rows, ``x[:, -n_query:]``, and the block returns only them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

from ecp_lm.config import ModelConfig
from ecp_lm.model.attention import Attention
from ecp_lm.model.cache import KVCache
from ecp_lm.model.kernels.native import decode_linear
from ecp_lm.model.rope import RotaryEmbedding
from ecp_lm.model.rows import Rows

if TYPE_CHECKING:
    from ecp_lm.model.archs.base import Architecture
    from ecp_lm.model.context_parallel import ContextGroup


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = cfg.ff_mult * cfg.d_model
        self.up = nn.Linear(cfg.d_model, hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.down(self.act(self.up(x))))

    def decode(self, x: Tensor) -> Tensor:
        """``forward`` for the one row per batch row of a decode step (``decode_linear``)."""
        return self.dropout(decode_linear(self.down, self.act(decode_linear(self.up, x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, arch: Architecture, rope: RotaryEmbedding | None):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg, arch, rope)
        self.ff_norm = nn.LayerNorm(cfg.d_model)
        self.ff = FeedForward(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def attend(self, x: Tensor, rows: Rows, n_query: int, cache: KVCache | None = None,
               context: ContextGroup | None = None, rotation: tuple[Tensor, Tensor] | None = None
               ) -> tuple[Tensor, Rows]:
        """The attention sub-layer with its residual: (B, R, d) -> (B, n_query, d);
        ``rotation``: the rotary (cos, sin) at ``rows`` (``Attention.forward``)."""
        update = self.attn(self.attn_norm(x), rows, n_query, cache, context, rotation)
        return x[:, x.size(1) - n_query:] + self.dropout(update), rows.tail(n_query)

    def feed_forward(self, x: Tensor) -> Tensor:
        return x + self.dropout(self.ff(self.ff_norm(x)))

    def decode(self, x: Tensor, pos: Tensor, cache: KVCache, span: int | None = None,
               rotation: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """One token per batch row at positions ``pos`` (B,) against ``cache`` (see
        ``Attention.decode``): (B, 1, d) -> (B, 1, d)."""
        x = x + self.dropout(self.attn.decode(self.attn_norm(x), pos, cache, span, rotation))
        return x + self.dropout(self.ff.decode(self.ff_norm(x)))

    def forward(self, x: Tensor, rows: Rows, n_query: int, cache: KVCache | None = None,
                context: ContextGroup | None = None,
                rotation: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Rows]:
        x, rows = self.attend(x, rows, n_query, cache, context, rotation)
        return self.feed_forward(x), rows
