"""The shared skeleton: token embedding -> L pre-norm blocks -> final norm -> head (SPEC §2, §5).

One ``LanguageModel`` serves every architecture. The ``Architecture`` object (``archs/``, one
file per pattern) decides which positions each layer's rows hold and which rows query, which keys
each query sees (its mask predicate) and runs its exact fast kernels; everything else is here:
embedding, block, attention projections and RoPE, head, prefill and decode. A recurrent
architecture gives each block its own mixer in place of ``Attention`` (``Architecture.mixer``,
with the same interface and a state for a cache). Shapes: B batch,
T tokens, R rows a layer holds, Rq rows that query, H heads, D head size, d = H·D, V vocabulary.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ecp_lm.model.archs import architecture
from ecp_lm.model.archs.base import Architecture
from ecp_lm.model.cache import Cache, KVCache, decode_span
from ecp_lm.model.context_parallel import ContextGroup
from ecp_lm.model.kernels import check_kernel, choose_kernel
from ecp_lm.model.kernels.flex import flex_attention_from_mask
from ecp_lm.model.kernels.native import decode_linear, dropout
from ecp_lm.model.kernels.sdpa import cached_attention, reference_attention
from ecp_lm.model.loss import linear_cross_entropy
from ecp_lm.model.rope import RotaryEmbedding, Rotation, Rotations, rotate, rotation_tail
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


class Dropout(nn.Dropout):
    """``nn.Dropout`` whose training masks on CPU come from the native kernel's hash
    (``native.dropout``; elsewhere, or compiled, ``F.dropout``)."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p) if self.training and self.p > 0.0 else x


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.ff_mult * cfg.d_model)
        self.act = nn.GELU()
        self.down = nn.Linear(cfg.ff_mult * cfg.d_model, cfg.d_model)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: Tensor, linear=nn.Linear.__call__) -> Tensor:
        return self.dropout(linear(self.down, self.act(linear(self.up, x))))


class Block(nn.Module):
    """``x = x + Attn(Norm(x)); x = x + FF(Norm(x))``. Where only the last ``n_query`` rows
    query (PerceiverAR's layer 0, or the last layer, whose other rows nobody reads), the residual
    is those rows and the block returns only them. An architecture may map the rows to fewer
    between the two (``Architecture.compression``: compressed_double's history), or put a
    recurrent mixer in attention's place (``Architecture.mixer``)."""

    def __init__(self, cfg: ModelConfig, arch: Architecture, rope: RotaryEmbedding | None,
                 layer: int):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        mixer = arch.mixer(cfg, layer)
        self.attn = Attention(cfg, arch, rope) if mixer is None else mixer
        """The token mixer: attention, or the architecture's recurrent mixer."""
        self.ff_norm = nn.LayerNorm(cfg.d_model)
        self.ff = FeedForward(cfg)
        self.dropout = Dropout(cfg.dropout)
        self.compress = arch.compression(layer)

    def forward(self, x: Tensor, rows: Rows, n_query: int, cache: Cache | None = None,
                context: ContextGroup | None = None, rotation: Rotation | None = None
                ) -> tuple[Tensor, Rows]:
        update = self.attn(self.attn_norm(x), rows, n_query, cache, context, rotation)
        x, rows = x[:, x.size(1) - n_query:] + self.dropout(update), rows.tail(n_query)
        if self.compress is not None:
            x, rows = self.compress(x, rows)
        return x + self.dropout(self.ff(self.ff_norm(x))), rows

    def decode(self, x: Tensor, pos: Tensor, cache: Cache, span: int | None = None,
               rotation: Rotation | None = None) -> Tensor:
        """One token per batch row at positions ``pos`` (B,): (B, 1, d) -> (B, 1, d)."""
        x = x + self.dropout(self.attn.decode(self.attn_norm(x), pos, cache, span, rotation))
        return x + self.dropout(self.ff(self.ff_norm(x), decode_linear))


class LanguageModel(nn.Module):
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of keeping them
    (``torch.utils.checkpoint``; ``train.activation_checkpointing``): honoured when training with
    autograd on, and never with KV caches."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg = cfg.resolved()  # the sizes this model has, every one concrete
        self.arch = architecture(cfg.arch)(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.dropout = Dropout(cfg.dropout)
        # Layer i attends with arch.layer(i) (a hybrid's layers differ) and rotates with the
        # base arch.rope_base(i) (None: no RoPE); one RotaryEmbedding per base, shared.
        bases = [self.arch.rope_base(i) for i in range(cfg.n_layers)]
        ropes = {base: RotaryEmbedding(cfg.head_dim, base)
                 for base in dict.fromkeys(bases) if base is not None}
        self.blocks = nn.ModuleList(
            Block(cfg, self.arch.layer(i), ropes.get(base), i) for i, base in enumerate(bases))
        self.norm = nn.LayerNorm(cfg.d_model)
        out = cfg.vocab_size if cfg.num_classes is None else cfg.num_classes
        self.head = nn.Linear(cfg.d_model, out, bias=cfg.num_classes is not None)
        self._init_weights()
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    def _init_weights(self) -> None:
        """GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2L)."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and not name.endswith("compress"):
                is_residual = name.endswith(("out_proj", "ff.down"))
                nn.init.normal_(module.weight, 0.0, residual_std if is_residual else 0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, tokens: Tensor, start_pos: int = 0, context: ContextGroup | None = None,
                targets: Tensor | None = None, reduction: str = "mean") -> Tensor:
        """tokens (B, T) -> logits (B, P, V) of the last P positions, P = min(latent_len, T)
        for the perceiver family and T for every other architecture; or (B, num_classes) with a
        classification head (over the mean hidden state of the predicted positions).

        ``start_pos``: the absolute position of the first token, where the architecture allows
        one other than 0 (ecp: any multiple of m, computing the same function as at 0).
        ``context``: tokens are one shard of a window split across ranks (``hidden_states``).
        ``targets`` (B, T), the token after each input: instead of logits, the cross-entropy of
        the predicted positions (``head_loss``: ``reduction`` mean, sum, or none (B, P)),
        without the (B, P, V) logits. The loss goes through ``forward`` so that DDP's and FSDP's
        hooks see it."""
        hidden = self.hidden_states(tokens, start_pos=start_pos, context=context)  # (B, P, d)
        if self.cfg.num_classes is not None:
            if targets is not None:
                raise ValueError("targets: a classifier's loss is the cross-entropy of its "
                                 "(B, num_classes) output; call it without targets")
            return self.head(hidden.mean(dim=1))
        if targets is None:
            return self.head(hidden)
        if targets.shape != tokens.shape:
            raise ValueError(f"targets must have the shape of tokens {tuple(tokens.shape)}, "
                             f"got {tuple(targets.shape)}")
        return self.head_loss(hidden, targets[:, targets.size(1) - hidden.size(1):], reduction)

    def hidden_states(self, tokens: Tensor, caches: list[Cache] | None = None,
                      start_pos: int = 0, context: ContextGroup | None = None) -> Tensor:
        """tokens (B, T) int64 at positions ``start_pos`` .. -> final-normed hidden states of the
        predicted positions, (B, P, d). With ``caches``, their keys and values go into the
        caches (``prefill``); into filled caches, tokens continue them at their next position
        (a ValueError otherwise), in chunks of any length, exactly as one forward over the whole
        stream. With a ``context`` group, tokens are this rank's shard of a window
        (``ContextGroup.shard``; every rank of the group calls together)."""
        if tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(f"tokens must be a (B, T) int64 tensor, got shape "
                             f"{tuple(tokens.shape)} dtype {tokens.dtype}")
        t = tokens.size(1)
        if context is not None:
            self.check_context(t, context, start_pos, caches)
        if caches is not None and caches[0].filled:
            expected = caches[0].next_pos
            if any(p != start_pos for p in expected):
                raise ValueError(f"hidden_states at start_pos={start_pos}, but the caches "
                                 f"continue at position {_positions(expected)}")
        else:
            self.arch.check_start_pos(start_pos)
        self.arch.check_length(start_pos + t)
        self._check_token_ids(tokens)
        # The positions the rows hold (T rows from start_pos, or the perceiver family's
        # right-aligned window) and how many trailing positions are predicted (T, or l).
        rows, n_predicted = self.arch.input_rows(t, start_pos), self.arch.num_predicted(t)
        x = self.dropout(self.embed(tokens))  # (B, T, d)
        dtype, rotations = self.compute_dtype(tokens.device.type), Rotations(tokens.device)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            cache = None if caches is None else caches[i]
            # Looked up here, outside any recomputed block (a checkpointed region that
            # torch.compile traces may not write to the memo): once per row layout.
            rope = block.attn.rope
            rotation = None if rope is None else rotations(rope, rows, dtype)
            # Rows that query: all of them, but in the last layer only the predicted ones.
            args = (x, rows, self.arch.num_queries(i, rows, n_predicted), cache, context,
                    rotation)
            if recompute and cache is None:
                # Dropped and recomputed in backward under the forward's RNG state (the same
                # dropout masks); a context group's halo exchange is recomputed too, in the same
                # order on every rank, so the repeated messages pair up.
                x, rows = checkpoint(block, *args, use_reentrant=False, preserve_rng_state=True)
            else:
                x, rows = block(*args)  # (B, R, d) -> (B, R', d)
        return self.norm(x[:, x.size(1) - n_predicted:])  # (B, P, d)

    def head_loss(self, hidden: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
        """Cross-entropy of ``head(hidden)`` for hidden (B, P, d) against targets (B, P) (-100:
        not counted), in float32 over chunks of rows (loss.py): the loss and gradients of the
        logits' ``F.cross_entropy`` without holding them. ``reduction``: mean, sum, or none."""
        loss = linear_cross_entropy(hidden.reshape(-1, hidden.size(-1)), self.head.weight,
                                    self.head.bias, targets.reshape(-1), reduction)
        return loss.view(targets.shape) if reduction == "none" else loss

    def loss(self, tokens: Tensor, context: ContextGroup | None = None) -> Tensor:
        """Mean next-token cross-entropy of the predicted positions of ``tokens[:, :-1]``, for
        ``tokens`` (B, T + 1). With a ``context`` group, the mean over this rank's shard (the
        window's mean is the mean over the group's ranks: context_parallel.py)."""
        if context is None:
            return self(tokens[:, :-1], targets=tokens[:, 1:])
        shard, start_pos = context.shard(tokens)
        return self(shard[:, :-1], start_pos, context, targets=shard[:, 1:])

    # Incremental decoding (architectures with a cache_capacity) --------------------------------
    def make_caches(self, batch_size: int, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> list[Cache] | None:
        """One empty cache per layer (keys and values, or a recurrent mixer's state), or None if
        this architecture decodes by recomputing.
        By default on the model's device, in ``compute_dtype`` (call it under the same autocast
        as the decoding)."""
        if self.arch.cache_capacity is None or self.cfg.num_classes is not None:
            return None
        device = torch.device(device) if device is not None else self.embed.weight.device
        dtype = dtype or self.compute_dtype(device.type)
        # Each layer's own (a hybrid's local layers keep their rings, its global the N, its
        # recurrent layers their states)
        return [block.attn.make_cache(batch_size, dtype, device) for block in self.blocks]

    def prefill(self, tokens: Tensor, caches: list[Cache], start_pos: int = 0) -> Tensor:
        """Logits (B, T, V) of a prompt at positions ``start_pos`` .., filling empty caches."""
        if any(cache.filled for cache in caches):
            raise ValueError("prefill needs empty caches (make_caches)")
        for cache in caches:
            cache.start_at(start_pos)
        return self.head(self.hidden_states(tokens, caches, start_pos))

    def decode_one_token(self, token: Tensor, pos: int | Tensor, caches: list[Cache]
                         ) -> Tensor:
        """Logits (B, V) after ``token`` (B, 1) at absolute position ``pos``, the position after
        the last one in the caches: an int, or a (B,) tensor where rows stand at different
        positions (``stack_caches``). Checks the call, then runs ``decode_step``."""
        if token.dim() != 2 or token.size(1) != 1 or not caches[0].filled:
            raise ValueError("decode_one_token takes one (B, 1) token after a prefill")
        expected = caches[0].next_pos
        if isinstance(pos, int):
            if any(p != pos for p in expected):
                raise ValueError(f"decode_one_token at pos={pos}, but the caches continue at "
                                 f"position {_positions(expected)}")
            pos = torch.full((token.size(0),), pos, dtype=torch.long, device=token.device)
        elif pos.tolist() != expected:  # the eager API checks; decode_step does not
            raise ValueError(f"decode_one_token at pos={pos.tolist()}, but the caches "
                             f"continue at positions {expected}")
        logits = self.decode_step(token, pos, caches, decode_span(caches))
        for cache in caches:
            cache.advance()
        return logits

    def decode_step(self, token: Tensor, pos: Tensor, caches: list[Cache],
                    span: int | None = None) -> Tensor:
        """The decode step: token (B, 1) at positions ``pos`` (B,) int64 -> logits (B, V).
        Tensor operations of fixed shape only, no host sync and no branch on the caches' state,
        so ``torch.compile(model.decode_step, fullgraph=True)`` is one graph for every step
        (``generate(..., compile=True)``). Eager callers may pass ``span``, the leading cache
        slots in use after this step (``KVCache.slots_in_use``). It checks nothing: callers
        that take user input go through ``decode_one_token``."""
        x = self.embed(token)  # (B, 1, d)
        rotations: dict[float, Rotation] = {}  # one (cos, sin) at ``pos`` per RoPE base
        for block, cache in zip(self.blocks, caches, strict=True):
            rope, rotation = block.attn.rope, None
            if rope is not None:
                if rope.base not in rotations:
                    rotations[rope.base] = rope.rotation(pos[:, None], cache.k.dtype, x.device)
                rotation = rotations[rope.base]
            x = block.decode(x, pos, cache, span, rotation)
        return decode_linear(self.head, self.norm(x))[:, -1]  # (B, V)

    # Checks and bookkeeping ---------------------------------------------------------------------
    def compute_dtype(self, device_type: str) -> torch.dtype:
        """The dtype activations come out in: autocast's where it is on, else the parameters'
        (also on devices without autocast, such as ``meta``)."""
        if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return self.embed.weight.dtype

    def check_kernels(self, device: torch.device | str, training: bool) -> None:
        """Refuses (ValueError) an explicit ``attn_impl`` that cannot run this model's layers on
        ``device`` in ``compute_dtype`` (call it under the autocast the model will run in), with
        their dropout and a backward where ``training``: called before compiling a step, so that
        the reason comes first rather than inside torch.compile's error."""
        device = torch.device(device)
        dtype, dropout = self.compute_dtype(device.type), self.cfg.dropout if training else 0.0
        for block in self.blocks:
            check_kernel(block.attn.arch, self.cfg.attn_impl, device, dtype, dropout, training)

    def check_context(self, shard_len: int, context: ContextGroup, start_pos: int,
                      caches: list[Cache] | None = None) -> None:
        """Refuses a context-parallel call this architecture cannot compute exactly
        (ValueError): the window of K shards of ``shard_len`` must suit its halo."""
        if caches is not None:
            raise ValueError("context parallelism is for whole windows, not cached decoding")
        self.arch.check_context(shard_len * context.size, context.size)
        if start_pos != context.index * shard_len:
            raise ValueError(f"shard {context.index} of {context.size} starts at position "
                             f"{context.index * shard_len}, not start_pos={start_pos}")

    def _check_token_ids(self, tokens: Tensor) -> None:
        """Out-of-range ids as a ValueError, in eager mode on CPU only: reading the ids back is a
        host sync that would stall an accelerator and break a compiled graph, so elsewhere ids
        are validated where they enter (data layer, ``generate``, CLI)."""
        if tokens.device.type != "cpu" or torch.compiler.is_compiling():
            return
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ValueError(f"token ids must lie in 0..{self.cfg.vocab_size - 1}, "
                             f"got min {lo} max {hi}")

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Optimizer groups: weight decay on matrix weights (linear maps, embeddings) only."""
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        return [{"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]


def _positions(positions: list[int]) -> str:
    return str(positions[0]) if len(set(positions)) == 1 else str(positions)


def build_model(cfg: ModelConfig) -> LanguageModel:
    """The model for ``cfg`` (every architecture shares ``LanguageModel``)."""
    return LanguageModel(cfg)
