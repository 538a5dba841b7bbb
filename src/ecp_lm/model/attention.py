"""Multi-head attention of the skeleton (SPEC §2): the projections, RoPE at absolute positions,
and the architecture's kernel for a full pass, a chunk into a filled cache, a ring of caches or
one decoded token. Shapes as in ``model.model``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ecp_lm.model.archs.base import Architecture
from ecp_lm.model.cache import KVCache
from ecp_lm.model.context_parallel import ContextGroup
from ecp_lm.model.kernels import choose_kernel
from ecp_lm.model.kernels.flex import flex_attention_from_mask
from ecp_lm.model.kernels.native import decode_linear
from ecp_lm.model.kernels.sdpa import cached_attention, reference_attention
from ecp_lm.model.rope import RotaryEmbedding, Rotation, rotate, rotation_tail
from ecp_lm.model.rows import Rows

if TYPE_CHECKING:
    from ecp_lm.config import ModelConfig


class Attention(nn.Module):
    """Multi-head attention: projections, RoPE at absolute positions, and the kernel the
    architecture's pattern runs with."""

    def __init__(self, cfg: ModelConfig, arch: Architecture, rope: RotaryEmbedding | None):
        super().__init__()
        d = cfg.d_model
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.arch, self.rope, self.impl, self.dropout = arch, rope, cfg.attn_impl, cfg.dropout
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        # With tied_kv one projection is both keys (before RoPE) and values.
        self.v_proj = None if cfg.tied_kv else nn.Linear(d, d, bias=False)
        self.out_proj = nn.Linear(d, d, bias=False)

    def _heads(self, x: Tensor) -> Tensor:
        b, r, _ = x.shape
        return x.view(b, r, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, R, D)

    def _project(self, x: Tensor, n_query: int, linear=nn.Linear.__call__
                 ) -> tuple[Tensor, Tensor, Tensor]:
        """Queries of the last ``n_query`` rows of x (B, R, d), keys and values of all rows, each
        (B, H, ·, D), before RoPE; ``linear(layer, x)`` applies a projection."""
        q = self._heads(linear(self.q_proj, x[:, x.size(1) - n_query:]))  # (B, H, Rq, D)
        k = self._heads(linear(self.k_proj, x))  # (B, H, R, D)
        v = k if self.v_proj is None else self._heads(linear(self.v_proj, x))
        return q, k, v

    def _merge(self, out: Tensor, linear=nn.Linear.__call__) -> Tensor:
        b, _, rq, _ = out.shape
        return linear(self.out_proj, out.transpose(1, 2).reshape(b, rq, -1))  # (B, Rq, d)

    def forward(self, x: Tensor, rows: Rows, n_query: int, cache: KVCache | None = None,
                context: ContextGroup | None = None, rotation: Rotation | None = None
                ) -> Tensor:
        """x (B, R, d) holds ``rows``; its last ``n_query`` rows query. -> (B, n_query, d).

        ``cache``: an empty one is filled (prefill); a filled one is continued by these rows,
        any number of them (``_attend_cached``). ``context``: x is one shard of a window, and the
        keys and values get the previous shard's halo (context_parallel.py). ``rotation``: RoPE's
        (cos, sin) at ``rows``, computed once per forward (``rope.Rotations``), or here if None."""
        kv_pos = rows.positions(x.device)  # (R,)
        q, k, v = self._project(x, n_query)
        if self.rope is not None:
            if rotation is None:
                rotation = self.rope.rotation(kv_pos, q.dtype, x.device)
            q, k = rotate(q, rotation_tail(rotation, n_query)), rotate(k, rotation)
        if cache is not None and cache.filled:
            return self._merge(self._attend_cached(q, k, v, rows, cache))
        if cache is not None:
            cache.update(kv_pos, k, v)
        if context is not None:  # the keys gain the previous shard's last rows, not queries
            k, v, rows = context.extend(k, v, rows, self.arch.halo_len)  # (B, H, halo + R, D)
        return self._merge(self._attend(q, k, v, rows))  # (B, H, Rq, D) -> (B, Rq, d)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows) -> Tensor:
        """q (B, H, Rq, D): the last Rq of the key rows ``rows`` of k, v (B, H, R, D). Where
        the architecture's own kernel takes a query at every row (``queries_at_every_row``), the
        rows before the queries get zero queries, whose outputs are dropped."""
        dropout_p = self.dropout if self.training else 0.0
        needs_backward = torch.is_grad_enabled() and q.requires_grad
        kernel = choose_kernel(self.arch, self.impl, q, dropout_p, needs_backward)
        if kernel == "reference":  # the predicate, materialised: the specification
            kv_pos = rows.positions(q.device)
            return reference_attention(q, k, v, self.arch.mask, kv_pos[len(rows) - q.size(2):],
                                       kv_pos, dropout_p)
        if kernel == "flex":
            return flex_attention_from_mask(q, k, v, self.arch.mask, rows,
                                            self.arch.flex_bands(self.n_heads))
        pad = k.size(2) - q.size(2) if self.arch.queries_at_every_row else 0
        if pad:
            q = nn.functional.pad(q, (0, 0, pad, 0))  # (B, H, R, D)
        return self.arch.attend(q, k, v, rows, dropout_p, kernel)[:, :, pad:]

    def _attend_cached(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows, cache: KVCache
                       ) -> Tensor:
        """New rows ``rows`` (R, from the position the cache continues at; q: the last Rq of
        them) continuing a filled cache, written into it after they attend: writing first would
        be wrong for R > 1, a later row's slot may hold a position an earlier row still sees.

        The keys their queries see before them, from ``arch.cached_keys_from`` on, are read from
        the ring and prepended to their own, as the context-parallel halo is, and the
        architecture's kernel runs them (``_attend``): O(R·span) time and O(capacity + R) memory,
        what a forward over R rows costs. Where the ring does not hold those keys so (stacked
        rows of different origins) or the architecture has no such form, the queries attend
        over the whole ring plus their own keys by the mask on absolute positions
        (``cached_attention``): exact too, in O(R·(capacity + R))."""
        out = None if _dense_chunks else self._attend_chunk(q, k, v, rows, cache)
        if out is None:
            out = self._attend_ring(q, k, v, rows, cache)
        cache.update(rows.positions(k.device), k, v)
        return out

    def _attend_chunk(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows, cache: KVCache
                      ) -> Tensor | None:
        """``_attend_cached`` on the architecture's kernel; None where it cannot run so."""
        pos = rows.main.start
        starts = {self.arch.cached_keys_from(pos, origin) for origin in cache.origin}
        start = starts.pop() if len(starts) == 1 else None
        held = None if start is None else cache.prepend(start, pos, k, v)
        if held is None:
            return None
        keys, values = (x.to(q.dtype) for x in held)  # (B, H, pos - start + R, D)
        sinks = self.arch.cached_sinks(start)  # before ``start``, from the sink slots
        if len(sinks):
            slots = cache.slot(torch.arange(sinks.start, sinks.stop, device=k.device))
            keys = torch.cat([cache.k[:, :, slots].to(q.dtype), keys], dim=2)
            values = torch.cat([cache.v[:, :, slots].to(q.dtype), values], dim=2)
        return self._attend(q, keys, values, Rows(sinks, range(start, rows.main.stop)))

    def _attend_ring(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows, cache: KVCache
                     ) -> Tensor:
        """``_attend_cached`` over every slot of the ring plus the rows' own keys, by the mask
        on the positions each slot holds: (B, H, Rq, capacity + R) scores."""
        kv_pos = rows.positions(k.device)  # (R,)
        keys = torch.cat([cache.k, k.to(cache.k.dtype)], dim=2)  # (B, H, S + R, D)
        values = torch.cat([cache.v, v.to(cache.v.dtype)], dim=2)
        slot_pos = torch.cat([cache.pos, kv_pos.expand(k.size(0), -1)], dim=1)  # (B, S + R)
        return cached_attention(q, keys, values, self.arch.mask, kv_pos[len(rows) - q.size(2):],
                                slot_pos)

    def make_cache(self, batch_size: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        """An empty cache of this layer's capacity (the pattern's ``cache_capacity``)."""
        return KVCache(batch_size, self.n_heads, self.arch.cache_capacity, self.head_dim, dtype,
                       device, self.arch.sink_len)

    def decode(self, x: Tensor, pos: Tensor, cache: KVCache, span: int | None = None,
               rotation: Rotation | None = None) -> Tensor:
        """One new row per batch row, x (B, 1, d) at positions ``pos`` (B,), written into
        ``cache`` and attended against its ring: all of it (fixed shapes: one compiled graph for
        every step), or its first ``span`` slots where the caller knows only those are in use."""
        q, k, v = self._project(x, 1, decode_linear)  # (B, H, 1, D) each
        if self.rope is not None:
            if rotation is None:
                rotation = self.rope.rotation(pos[:, None], q.dtype, q.device)
            q, k = rotate(q, rotation), rotate(k, rotation)
        cache.write(pos, k, v)
        keys, values, slot_pos = cache.k, cache.v, cache.pos  # (B, H, S, D), (B, S)
        if span is not None:
            keys, values, slot_pos = keys[:, :, :span], values[:, :, :span], slot_pos[:, :span]
        out = cached_attention(q, keys, values, self.arch.mask, pos[:, None], slot_pos)
        return self._merge(out, decode_linear)  # (B, 1, d)


_dense_chunks = False


@contextlib.contextmanager
def dense_cached_chunks() -> Iterator[None]:
    """Within the block, chunks into filled caches attend over the whole ring plus their own
    keys by the mask (``cached_attention``), as every chunk did before they ran on the
    architectures' kernels: what ``benchmarks/stream_chunks.py`` compares against."""
    global _dense_chunks
    before, _dense_chunks = _dense_chunks, True
    try:
        yield
    finally:
        _dense_chunks = before
