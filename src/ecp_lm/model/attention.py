"""Multi-head attention: projections, rotary embedding and kernel dispatch (SPEC §2).

This module owns the parameters; which keys a query may see is the architecture's business
(its mask predicate and its exact fast kernel), so the same module serves every pattern.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ecp_lm.config import ModelConfig
from ecp_lm.model.cache import KVCache
from ecp_lm.model.kernels.native import decode_linear
from ecp_lm.model.kernels.sdpa import (
    cached_attention,
    flex_attention_from_mask,
    reference_attention,
)
from ecp_lm.model.rope import RotaryEmbedding, rotate, rotation_tail
from ecp_lm.model.rows import Rows

if TYPE_CHECKING:
    from ecp_lm.model.archs.base import Architecture
    from ecp_lm.model.context_parallel import ContextGroup


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, arch: Architecture, rope: RotaryEmbedding | None):
        super().__init__()
        d = cfg.d_model
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.arch, self.rope, self.impl = arch, rope, cfg.attn_impl
        self.dropout = cfg.dropout
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        # With tied_kv one projection is both keys (before RoPE) and values.
        self.v_proj = None if cfg.tied_kv else nn.Linear(d, d, bias=False)
        self.out_proj = nn.Linear(d, d, bias=False)

    def _heads(self, x: Tensor) -> Tensor:
        b, r, _ = x.shape
        return x.view(b, r, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, R, D)

    def _project(self, x: Tensor, n_query: int, linear: Callable[[nn.Linear, Tensor], Tensor]
                 = nn.Linear.__call__) -> tuple[Tensor, Tensor, Tensor]:
        """Queries of the last ``n_query`` rows of x (B, R, d), keys and values of all of them,
        in heads (B, H, ·, D), before the rotary embedding; ``linear(layer, x)`` applies each
        projection."""
        q = self._heads(linear(self.q_proj, x[:, x.size(1) - n_query:]))  # (B, H, Rq, D)
        k = self._heads(linear(self.k_proj, x))  # (B, H, R, D)
        v = k if self.v_proj is None else self._heads(linear(self.v_proj, x))
        return q, k, v

    def forward(self, x: Tensor, rows: Rows, n_query: int, cache: KVCache | None = None,
                context: ContextGroup | None = None, rotation: tuple[Tensor, Tensor] | None = None
                ) -> Tensor:
        """x (B, R, d) holds ``rows``; the last ``n_query`` rows produce queries.
        Returns (B, n_query, d). With a ``cache``: an empty one is filled (prefill); a filled
        one is continued by the new rows, any number of them (``_attend_cached``). With a
        ``context`` group, x is one shard of a window and the keys and values get the previous
        shard's halo (context_parallel.py). ``rotation``: the rotary embedding's (cos, sin) at
        the positions of ``rows``, computed once per forward for every layer with these rows
        (``rope.Rotations``); computed here if None."""
        kv_pos = rows.positions(x.device)
        q_pos = kv_pos[len(rows) - n_query:]
        q, k, v = self._project(x, n_query)
        if self.rope is not None:
            if rotation is None:
                rotation = self.rope.rotation(kv_pos, q.dtype, x.device)
            q, k = rotate(q, rotation_tail(rotation, n_query)), rotate(k, rotation)
        if cache is not None and cache.filled:
            out = self._attend_cached(q, k, v, q_pos, kv_pos, cache)
        else:
            if cache is not None:
                cache.update(kv_pos, k, v)
            if context is not None:
                k, v, rows = context.extend(k, v, rows, self.arch.halo_len)
            out = self._attend(q, k, v, rows)  # (B, H, Rq, D)
        b, _, rq, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, rq, -1))

    def _attend_cached(self, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, kv_pos: Tensor,
                       cache: KVCache) -> Tensor:
        """New rows at positions ``kv_pos`` (R,) that continue a filled cache: their queries
        attend over the ring as it stands before them plus their own keys and values, (B, H,
        capacity + R, D), the mask predicate on absolute positions deciding what each sees; then
        the rows go into the ring. Writing first would be wrong for R > 1: a later row's slot
        may hold a position an earlier row still sees."""
        keys = torch.cat([cache.k, k.to(cache.k.dtype)], dim=2)  # (B, H, S + R, D)
        values = torch.cat([cache.v, v.to(cache.v.dtype)], dim=2)
        slot_pos = torch.cat([cache.pos, kv_pos.expand(k.size(0), -1)], dim=1)  # (B, S + R)
        out = cached_attention(q, keys, values, self.arch.mask, q_pos, slot_pos)
        cache.update(kv_pos, k, v)
        return out

    def decode(self, x: Tensor, pos: Tensor, cache: KVCache, span: int | None = None,
               rotation: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """One new row per batch row: x (B, 1, d) at absolute positions ``pos`` (B,) int64,
        written into ``cache`` and attended against its ring: all of it (fixed shapes, tensor
        operations only: the step ``torch.compile`` turns into one graph), or the first ``span``
        slots where the caller knows only those are in use (``KVCache.slots_in_use``).
        ``rotation``: the rotary embedding's (cos, sin) at ``pos``, computed once per step for
        every layer (``RotaryEmbedding.rotation``); computed here if None."""
        q, k, v = self._project(x, 1, decode_linear)  # (B, H, 1, D) each
        if self.rope is not None:
            if rotation is None:
                rotation = self.rope.rotation(pos[:, None], q.dtype, q.device)
            q, k = rotate(q, rotation), rotate(k, rotation)
        cache.write(pos, k, v)
        keys, values, slot_pos = cache.k, cache.v, cache.pos
        if span is not None:
            keys, values, slot_pos = keys[:, :, :span], values[:, :, :span], slot_pos[:, :span]
        out = cached_attention(q, keys, values, self.arch.mask, pos[:, None], slot_pos)
        return decode_linear(self.out_proj, out.transpose(1, 2).reshape(x.size(0), 1, -1))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows) -> Tensor:
        """q: the last Rq of the key rows ``rows``."""
        dropout_p = self.dropout if self.training else 0.0
        needs_backward = torch.is_grad_enabled() and q.requires_grad
        kernel = self.arch.kernel_for(self.impl, q, dropout_p, needs_backward)
        if kernel == "reference":
            kv_pos = rows.positions(q.device)
            return reference_attention(q, k, v, self.arch.mask, kv_pos[len(rows) - q.size(-2):],
                                       kv_pos, dropout_p)
        if kernel == "flex":
            return flex_attention_from_mask(q, k, v, self.arch.mask, rows,
                                            self.arch.flex_bands(self.n_heads))
        return self.arch.attend(q, k, v, rows, dropout_p, kernel)
