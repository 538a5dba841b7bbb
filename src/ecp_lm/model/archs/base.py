"""What distinguishes one architecture from another on the shared skeleton (SPEC §2).

An architecture is one class in one file of this package, registered by one line in
``__init__.py``. It owns everything specific to its pattern: (a) a mask predicate on absolute
positions (the specification), (b) which rows produce queries in each layer, (c) which positions
are predicted, (d) its exact fast kernels, (e) its decoding cache, (f) its analytic attention cost
(``ecp complexity``), (g) the receptive field uncached generation needs, and (h) the defaults
and checks of its own config fields. Everything else (embedding, blocks, projections, RoPE,
norm, head: ``model/model.py``) is shared, and no module here imports it.

The kernels themselves, and the choice of the one that runs a call, are in ``model/kernels/``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor, nn

from ecp_lm.model.kernels import block_masks, native
from ecp_lm.model.kernels.masks import Mask
from ecp_lm.model.rows import Rows


class ArchConfig(Protocol):
    """The fields of ``ecp_lm.config.ModelConfig`` an architecture reads: the pattern depends on
    this interface, not on the config module (which looks the architectures up)."""

    arch: str
    attn_impl: str
    seq_len: int
    n_layers: int
    n_heads: int
    num_segments: int
    latent_len: int | None
    compressed_len: int | None
    window: int | str | None
    dilation: int | str | None
    global_tokens: int
    memory_len: int | None
    num_clusters: int | None
    compression_rate: int | None
    block_len: int | None
    group_len: int | None
    sink_tokens: int
    mixer_width: int | None
    state_size: int | None
    conv_size: int | None
    chunk_size: int | None
    d_model: int
    tied_kv: bool
    rope: str
    rope_base: float
    layer_pattern: str | None
    global_rope: str | None
    rope_base_global: float | None

    @property
    def history_len(self) -> int: ...

    @property
    def segment_len(self) -> int: ...

    @property
    def layer_unit(self) -> list[str]: ...

    @property
    def layer_archs(self) -> list[str]: ...

    def resolved(self) -> ArchConfig: ...

    def layer_config(self, arch: str) -> ArchConfig: ...


# A band rule (period, shift, back): in one layer, query position t sees keys lo(t) .. t with
# lo(t) = max(0, floor((t + shift) / period) * period - shift - back) (native.py).
BandRule = tuple[int, int, int]


def triangle(n: int) -> int:
    """Entries of an n×n causal block, diagonal included."""
    return n * (n + 1) // 2


def block_costs(n: int, first: int, block: int) -> tuple[int, int]:
    """(entries, tile_entries) of causal attention within consecutive blocks of n positions: a
    first block of ``first`` positions, then blocks of ``block``, the last one possibly shorter.
    Entries count each block's causal triangle; tiles its whole square."""
    sizes = [min(first, n)] + [min(block, n - start) for start in range(first, n, block)]
    return sum(triangle(r) for r in sizes), sum(r * r for r in sizes)


def band_start(rule: BandRule, t: int) -> int:
    """lo(t) of ``rule``: the first key position query position ``t`` sees."""
    period, shift, back = rule
    return max(0, (t + shift) // period * period - shift - back)


class Architecture:
    """Base: a causal model over positions 0 .. T-1 that predicts every position."""

    mask: Mask
    kernels: ClassVar[tuple[str, ...]] = ()
    """This architecture's own fast kernels, fastest first (besides ``reference`` and ``flex``);
    ``auto_kernels`` may order them otherwise for a call with dropout."""
    flex_on_cuda: ClassVar[bool] = False
    """Whether ``auto`` prefers FlexAttention (the predicate, compiled) on CUDA when there is no
    dropout, before the architecture's own kernels."""
    size_fields: ClassVar[tuple[str, ...]] = ()
    """The ArchConfig fields that size this pattern (shown by ``ecp complexity``)."""
    global_attention: ClassVar[bool] = False
    """Whether each query sees every earlier position of its window: a hybrid's global layer
    (``global_rope``, ``rope_base_global``)."""
    queries_at_every_row: ClassVar[bool] = False
    """Whether ``attend`` needs a query at every key row (Rq = R: band patterns, whose kernels
    start at a period); ``Attention._attend`` then gives the key rows before the queries (a
    context-parallel halo, the keys a cached chunk reads from the ring) zero queries and drops
    their outputs. Otherwise ``attend`` takes the queries of the last Rq <= R rows."""
    recurrent: ClassVar[bool] = False
    """Whether a recurrent mixer replaces attention in this pattern's layers (``mixer``;
    recurrent.py)."""
    has_keys: ClassVar[bool] = True
    """Whether the pattern's layers attend with keys and values (``tied_kv`` ties them): all
    but the recurrent mixers'."""
    takes_sink_tokens: ClassVar[bool] = False
    """Whether the pattern takes ``sink_tokens`` (sliding_window): refused for a model none of
    whose layers does, and set to 0 in the config of a hybrid's other layers."""
    renamed: ClassVar[dict[str, str]] = {}
    """Earlier names of this pattern's size fields, {old: new}: a config saved by an earlier
    release is read with the old name (``config.saved_fields``); a new config that sets the old
    one is refused with a pointer to the new."""

    def __init__(self, cfg: ArchConfig):
        self.cfg = cfg.resolved()  # every size concrete: the pattern reads them directly
        self.segment_len = self.cfg.segment_len  # read once: derived per architecture

    # Configuration --------------------------------------------------------------------------
    @classmethod
    def defaults(cls, cfg: ArchConfig) -> dict[str, Any]:
        """The values of this architecture's own size fields when the config leaves them unset
        (``ArchConfig.resolved``), derived from the others; ValueError when they cannot be."""
        return {}

    @classmethod
    def check(cls, cfg: ArchConfig) -> None:
        """Check this architecture's own fields on the resolved config (ValueError). Called by
        ``ArchConfig`` after the shared fields are checked."""
        choices = ("auto", "reference", "flex", *cls.kernels)
        if cfg.attn_impl not in choices:
            raise ValueError(f"arch={cfg.arch!r} has no attn_impl={cfg.attn_impl!r} kernel; "
                             f"its kernels: {', '.join(choices)}")

    @classmethod
    def sizes(cls, cfg: ArchConfig) -> tuple[str, ...]:
        """The size fields a model of ``cfg`` has: this pattern's ``size_fields``."""
        return cls.size_fields

    @classmethod
    def segment_length(cls, cfg: ArchConfig) -> int:
        """``ArchConfig.segment_len``: m = N / S, the segment of ecp (s2: its group G, s-Split:
        its history segment)."""
        return cfg.seq_len // cfg.num_segments

    # Shape of the computation -----------------------------------------------------------------
    def layer(self, layer: int) -> Architecture:
        """The pattern ``layer`` attends with: this one in every layer (a hybrid's differ)."""
        return self

    def rope_base(self, layer: int) -> float | None:
        """The RoPE base ``layer`` rotates its queries and keys with; None: no rotation
        (``rope``: every layer, only layer 0, or none)."""
        rope = self.cfg.rope
        return self.cfg.rope_base if rope == "all" or (rope == "first" and layer == 0) else None

    @property
    def max_len(self) -> int | None:
        """Longest accepted input (None: unbounded)."""
        return self.cfg.seq_len

    @property
    def cache_capacity(self) -> int | None:
        """Slots of a per-layer KV cache that makes decoding exact (None: no cache; decoding
        recomputes the window)."""
        return None

    @property
    def sink_len(self) -> int:
        """Positions 0 .. sink_len - 1 that every later query sees besides what its pattern
        gives it (sliding_window's ``sink_tokens``); a cache keeps them in slots of their own,
        never overwritten."""
        return 0

    def cached_keys_from(self, pos: int, origin: int) -> int | None:
        """A chunk continuing a filled cache at position ``pos``, in a stream whose first
        position is ``origin``: the first position whose keys ``attend`` must be given with the
        chunk's own for its queries to see exactly what the mask lets them (the cache's keys
        from there to ``pos`` - 1 prepended; ``Attention._attend_cached``). None: no such form,
        the chunk attends over the whole ring by the predicate."""
        return None

    def cached_sinks(self, start: int) -> range:
        """The sink positions (``sink_len``) before ``start``, the first position
        ``cached_keys_from`` gives, that a chunk continuing a filled cache also sees: read from
        the cache's sink slots and given before those keys (``Attention._attend_cached``)."""
        return range(min(self.sink_len, start))

    def check_length(self, t: int) -> None:
        limit = self.max_len
        if t < 1 or (limit is not None and t > limit):
            bound = "" if limit is None else f"..{limit}"
            raise ValueError(f"input length {t} is outside 1{bound} accepted by "
                             f"arch={self.cfg.arch!r} (seq_len={self.cfg.seq_len})")

    def check_start_pos(self, start_pos: int) -> None:
        """Refuses an absolute offset at which this architecture's function is not defined. Here
        positions belong to the window, which starts at 0."""
        if start_pos != 0:
            raise ValueError(f"start_pos={start_pos}: arch={self.cfg.arch!r} numbers positions "
                             "within its window, so a window starts at position 0")

    @property
    def halo_len(self) -> int | None:
        """Context parallelism: the rows of keys and values a shard needs from the shard before
        it in every layer (model/context_parallel.py); None where attention reaches back without
        bound, so there is no halo form."""
        return None

    def check_context(self, t: int, k: int) -> None:
        """Refuses to split a window of ``t`` positions into ``k`` context-parallel shards where
        the shards would not compute this architecture's function (ValueError)."""
        if k > 1 and self.halo_len is None:
            raise ValueError(f"arch={self.cfg.arch!r} has no context-parallel form: its "
                             "attention reaches back without bound, so a shard would need every "
                             "earlier shard's keys (context_parallel works for ecp, "
                             "sliding_window, block_local and s2)")

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

    def mixer(self, cfg: ArchConfig, layer: int) -> nn.Module | None:
        """The module that replaces attention in layer ``layer`` (a recurrent mixer, with
        Attention's interface), or None: the layer attends with this pattern."""
        return None

    options: ClassVar[tuple[str, ...]] = ()
    """The choices of ``config.OPTIONS`` this pattern takes (refused for a model none of whose
    layers does)."""
    has_feed_forward: ClassVar[bool] = True
    """Whether a block of this pattern has a feed-forward after its mixer (xLSTM's mLSTM block
    has none: its up-projection is inside the mixer)."""

    def feed_forward(self, cfg: ArchConfig, layer: int) -> nn.Module | None:
        """The module that replaces the skeleton's feed-forward in layer ``layer`` (RWKV-4's
        channel mix), or None: the skeleton's. One with ``cache_shapes`` keeps state in the
        layer's cache (``forward(x, cache, linear)``)."""
        return None

    def compression(self, layer: int) -> nn.Module | None:
        """A module that maps (x, rows) to fewer rows between the attention and the feed-forward
        of ``layer`` (compressed_double's history), or None."""
        return None

    # Cost -----------------------------------------------------------------------------------------
    def layer_cost(self, layer: int) -> tuple[int | float, int | float]:
        """(entries, tile_entries) of ``layer`` over a full window (T = N), per head (the mean
        over heads where the mask differs between them): the (query, key) pairs the mask allows
        over the rows the layer queries, and the research's block-tile convention, where each
        query block is scored against its whole key block (complexity.py)."""
        raise NotImplementedError

    # Kernels --------------------------------------------------------------------------------------
    def auto_kernels(self, dropout_p: float, q: Tensor) -> tuple[str, ...]:
        """The order in which ``attn_impl="auto"`` tries this architecture's kernels for a call
        with dropout ``dropout_p`` and queries ``q`` (its device, and its dtype under the
        autocast in force): ``kernels``."""
        return self.kernels

    def kernel_limit(self, kernel: str, q: Tensor, dropout_p: float) -> str | None:
        """Why this architecture's own ``kernel`` cannot run a call that the kernel itself could
        (None: it can); ``model.kernels.kernel_problem`` checks the kernel first."""
        return None

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows, dropout_p: float,
               kernel: str) -> Tensor:
        """Run ``kernel``, one of ``kernels``, exact for ``mask``: q (B, H, Rq, D) holds the
        last Rq of the rows ``rows`` of k and v (B, H, R, D); returns (B, H, Rq, D). Band
        architectures get queries at every row (Rq = R), starting a period."""
        raise NotImplementedError

    def flex_bands(self, n_heads: int) -> block_masks.Bands | None:
        """The block structure FlexAttention's block mask is built from; None: from the
        predicate, evaluated block row by block row (block_masks.py)."""
        return None


class PerceiverFamily(Architecture):
    """Windows of N = h + l positions; an input of length T < N is right-aligned: its tokens take
    positions N - T .. N - 1 and the left padding is dropped (it is never a key, SPEC §4). The
    last min(l, T) positions are predicted."""

    size_fields = ("latent_len",)

    @classmethod
    def check(cls, cfg: ArchConfig) -> None:
        super().check(cfg)
        n = cfg.seq_len
        if not 1 <= cfg.latent_len <= n - 1:
            raise ValueError(f"latent_len={cfg.latent_len} is not in 1..seq_len-1={n - 1}")

    def input_rows(self, t: int, start_pos: int = 0) -> Rows:
        n, h = self.cfg.seq_len, self.cfg.history_len
        start = n - t
        return Rows(range(min(start, h), h), range(max(start, h), n))

    def num_predicted(self, t: int) -> int:
        return min(self.cfg.latent_len, t)


class BandArchitecture(Architecture):
    """Patterns in which each query sees a band of keys ending at itself, ``lo(q) .. q``, given
    per head by band rules, and the pattern repeats every ``period`` positions (ecp and the
    local baselines). They accept any input length T >= 1 (the mask does not depend on N),
    every position is trained, and:

    - a window may start at any multiple of the period (``start_pos``);
    - a decoding cache of max(q - lo(q) + 1) slots, a ring, is exact in constant memory;
    - through L layers the prediction after position p needs the tokens from lo^L(p) on, so
      uncached generation reads only those (rounded down to the period, to keep the pattern
      aligned);
    - on CPU the native band kernel runs them.
    """

    flex_on_cuda = True
    queries_at_every_row = True
    period_name: ClassVar[str] = "period"
    """The config's name for ``period``, in messages."""

    def band_rules(self) -> list[tuple[slice, BandRule]]:
        """(heads, rule) pairs covering every head."""
        raise NotImplementedError

    @property
    def period(self) -> int:
        """The pattern is unchanged when every position moves by a multiple of this."""
        raise NotImplementedError

    @property
    def max_len(self) -> int | None:
        return None

    @property
    def cache_capacity(self) -> int:
        # For a rule, q - lo(q) + 1 is largest just before lo(q) moves on: period + back; and
        # the sinks, if any, in slots of their own.
        return max(rule[0] + rule[2] for _, rule in self.band_rules()) + self.sink_len

    def flex_bands(self, n_heads: int) -> block_masks.Bands:
        rules = [None] * n_heads
        for heads, rule in self.band_rules():
            for head in range(n_heads)[heads]:
                rules[head] = rule
        return block_masks.Bands(tuple(rules), self.period)

    def reach(self, t: int) -> int:
        """The first position any head of query position ``t`` sees, in one layer."""
        return min(band_start(rule, t) for _, rule in self.band_rules())

    def cached_keys_from(self, pos: int, origin: int) -> int:
        # lo(t) only grows with t, so the chunk's first query reaches back furthest; rounded
        # down to the period so that the keys start where the pattern starts, but not before
        # the stream's first position (a multiple of the period), where the kernel's band is cut
        # as the mask cuts it. A query at t sees no key before t - capacity + 1: all in the ring.
        start = self.reach(pos)
        return max(origin, start - start % self.period)

    @property
    def halo_len(self) -> int:
        # lo(t) only grows with t, so a shard's first query reaches back furthest; rounded up to
        # the period so that the keys, halo included, start where the pattern starts.
        start = self.period * (2 + self.cache_capacity // self.period)
        reach = start - self.reach(start)
        return -(-reach // self.period) * self.period

    def check_context(self, t: int, k: int) -> None:
        if k == 1:
            return
        period, halo = self.period, self.halo_len
        if t % (k * period):
            raise ValueError(f"T={t} is not a multiple of K*{self.period_name}={k * period} "
                             f"(K={k} context-parallel shards of whole periods of "
                             f"{self.period_text()})")
        if t // k < halo:
            raise ValueError(f"T={t} in K={k} shards of {t // k} positions: arch="
                             f"{self.cfg.arch!r} needs the last {halo} positions before a shard, "
                             "more than the shard before it holds")

    def check_start_pos(self, start_pos: int) -> None:
        if start_pos < 0 or start_pos % self.period:
            raise ValueError(f"start_pos={start_pos} is not a non-negative multiple of "
                             f"{self.period_text()}")

    def period_text(self) -> str:
        return f"{self.period} (arch={self.cfg.arch!r} repeats its pattern every {self.period} " \
               "positions from position 0)"

    def first_seen(self, t: int) -> int:
        """The first position query position ``t``'s output depends on, through every layer:
        its receptive field starts there."""
        for _ in range(self.cfg.n_layers):
            t = self.reach(t)
        return t

    def context_start(self, length: int) -> int:
        start = self.first_seen(length - 1)  # from the position that predicts the next token
        return start - start % self.period

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows, dropout_p: float,
               kernel: str) -> Tensor:
        # The native band kernel runs any band: one call per group of heads sharing a rule.
        # Patterns with portable kernels (flash, mask) run those in their own ``attend``.
        if kernel == "native":
            return self.per_head_rule(partial(native.band_attention, dropout_p=dropout_p), q, k,
                                      v)
        raise NotImplementedError(f"arch={self.cfg.arch!r} has no {kernel!r} kernel")

    def per_head_rule(self, fn: Callable[[Tensor, Tensor, Tensor, BandRule], Tensor], q: Tensor,
                      k: Tensor, v: Tensor) -> Tensor:
        """``fn(q, k, v, rule)`` on each group of heads that shares a band rule, concatenated."""
        parts = self.band_rules()
        if len(parts) == 1:
            return fn(q, k, v, parts[0][1])
        return torch.cat([fn(q[:, heads], k[:, heads], v[:, heads], rule)
                          for heads, rule in parts], dim=1)


class SegmentedBand(BandArchitecture):
    """A band pattern built on segments of m = N / S aligned to position 0, which repeats every
    m positions: N must be a multiple of S (ecp)."""

    size_fields = ("num_segments",)

    @classmethod
    def check(cls, cfg: ArchConfig) -> None:
        super().check(cfg)
        if cfg.seq_len % cfg.num_segments:
            raise ValueError(
                f"seq_len={cfg.seq_len} is not divisible by num_segments={cfg.num_segments}")

    period_name = "segment_len"

    @property
    def period(self) -> int:
        return self.segment_len

    def period_text(self) -> str:
        return (f"segment_len={self.period} (arch={self.cfg.arch!r} aligns its segments to "
                "position 0)")


class SizedBand(BandArchitecture):
    """A band pattern sized by one field of its own, ``size_fields[0]`` (sliding_window's
    ``window``, block_local's ``block_len``, s2's ``group_len``), whose default is set from
    ECP's segments of m = N / S (``default_size``), so that the baselines match ECP's cost or
    reach at the same N and S."""

    @classmethod
    def defaults(cls, cfg: ArchConfig) -> dict[str, Any]:
        name = cls.size_fields[0]
        if getattr(cfg, name) is not None:
            return {}
        if cfg.seq_len % cfg.num_segments:
            raise ValueError(f"the default {name} of arch={cfg.arch!r} is set from ECP's "
                             f"segments of seq_len/num_segments, but seq_len={cfg.seq_len} is "
                             f"not divisible by num_segments={cfg.num_segments}; set {name}")
        return {name: cls.default_size(cfg.seq_len, cfg.num_segments)}

    @classmethod
    def default_size(cls, seq_len: int, num_segments: int) -> int:
        """The size when the config sets none (N divisible by S)."""
        raise NotImplementedError
