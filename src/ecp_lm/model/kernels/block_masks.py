"""FlexAttention's block masks, built from an architecture's band rules or its mask predicate,
in O(T) memory (``flex.py`` runs the attention with them).

Conventions (``torch.nn.attention.flex_attention``): query and key rows are cut into blocks of
``BLOCK`` = 128 from the first row. A ``BlockMask`` lists, per (head, query block), the key blocks
computed with ``mask_mod`` applied ("partial") and those in which every entry is allowed
("full"), and the same transposed, per key block, for the backward. A block that the end of the
rows cuts short is never full (torch's convention: rows past the end count as masked).

Queries are the last Rq of the Rk key rows. The rows of a band architecture are contiguous
positions ``kv_start .. kv_start + Rk - 1``; those of the perceiver family at most two runs
(``Rows``: history, then main). The ``mask_mod`` is the predicate on the positions of
``q_idx`` and ``kv_idx``, computed from them by arithmetic (index + start, plus the gap between
the runs past the history); starts and gaps are 0-dim tensors, so that a new offset changes
data, not the compiled kernel.

Two builders, neither of which forms a (Q, KV) tensor:

- ``band_block_mask``: for a band architecture (``Bands``: a rule per head, query position t
  sees keys lo(t) .. t). A query block's visible keys are one contiguous range
  [lo(first query), last query], its full blocks one sub-range of it, both in closed form, and
  the same holds for the queries that see a key block; O(T / 128 · w) for a band w blocks wide.
  The pattern repeats every ``period`` positions, so a window is moved back by whole periods
  first and one table serves every start that agrees modulo the period.
- ``predicate_block_mask``: any predicate, evaluated a few block rows of queries at a time:
  O(128 · Rk) memory, O(Rq · Rk) time, for the patterns whose attention costs that anyway.

torch's kernels take (1, H, rows, columns) index tables, at least as many columns as blocks,
but read only the first ``num_blocks`` entries of a row. The band builder stores a row in w
entries of one buffer and hands the table over as an overlapping strided view of it (row stride
w, w times as many columns as blocks): the shape the kernels expect, in O(rows · w) memory.
Entries past ``num_blocks`` hold other rows' (valid) indices. Tables have at least two block
rows and columns, because torch.compile specialises a dimension of size 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from ecp_lm.model.kernels.masks import Mask, materialize
from ecp_lm.model.rows import Rows

BLOCK = 128
"""torch's default sparse block size, by which its CPU and CUDA kernels tile."""

# (period, shift, back): query position t sees keys lo(t) .. t with
# lo(t) = max(0, floor((t + shift) / period) * period - shift - back) (archs/base.py, native.py).
BandRule = tuple[int, int, int]


@dataclass(frozen=True)
class Bands:
    """A band architecture's block structure for FlexAttention: the rule of each head, and the
    period after which the whole pattern (and its predicate) repeats."""

    head_rules: tuple[BandRule, ...]
    period: int


def first_position(rows: Rows) -> int:
    """The position of the first row; ValueError unless the rows are contiguous positions."""
    if len(rows.history) and len(rows.main) and rows.history.stop != rows.main.start:
        raise ValueError(f"FlexAttention needs contiguous positions, got {rows}")
    return rows.history.start if len(rows.history) else rows.main.start


def band_block_mask(mask: Mask, bands: Bands, q_start: int, kv_start: int, q_len: int,
                    kv_len: int, device: torch.device):
    """The block mask of a band pattern, from its rules."""
    shift = kv_start // bands.period * bands.period  # the same pattern, nearer to position 0
    return _uncached_if_compiling(_band_block_mask)(mask, bands, q_start - shift,
                                                    kv_start - shift, q_len, kv_len, device)


def predicate_block_mask(mask: Mask, n_heads: int, q_rows: Rows, kv_rows: Rows,
                         device: torch.device):
    """The block mask of any predicate, evaluated block row by block row."""
    return _uncached_if_compiling(_predicate_block_mask)(mask, n_heads if mask.per_head else 1,
                                                         q_rows, kv_rows, device)


def _uncached_if_compiling(builder):
    """``builder`` itself inside a graph being compiled, where the mask is built by the graph
    (dynamo would trace past the cache anyway, and warn), else its cached form."""
    return builder.__wrapped__ if torch.compiler.is_compiling() else builder


# Band block masks --------------------------------------------------------------------------------

# A few layouts per model (one per distinct (rows, queries) in its layers); the bound keeps a
# stream of new lengths from holding masks on the device without end.
@lru_cache(maxsize=8)
def _band_block_mask(mask: Mask, bands: Bands, q_start: int, kv_start: int, q_len: int,
                     kv_len: int, device: torch.device):
    from torch.nn.attention.flex_attention import BlockMask

    rules = sorted(set(bands.head_rules))
    # heads -> their rule's tables; with a single rule, one table broadcast over the heads
    which = [rules.index(rule) for rule in bands.head_rules] if len(rules) > 1 else [0]
    n_q, n_kv = _rows(q_len), _rows(kv_len)
    width = max(_band_width(rule) for rule in rules)
    kv_tables = [_kv_side(rule, q_start, kv_start, q_len, kv_len, device) for rule in rules]
    q_tables = [_q_side(rule, q_start, kv_start, q_len, kv_len, device) for rule in rules]
    kv_num, kv_idx, full_kv_num, full_kv_idx = _stack(kv_tables, which, width, n_kv)
    q_num, q_idx, full_q_num, full_q_idx = _stack(q_tables, which, width, n_q)
    return BlockMask(seq_lengths=(q_len, kv_len), kv_num_blocks=kv_num, kv_indices=kv_idx,
                     full_kv_num_blocks=full_kv_num, full_kv_indices=full_kv_idx,
                     q_num_blocks=q_num, q_indices=q_idx, full_q_num_blocks=full_q_num,
                     full_q_indices=full_q_idx, BLOCK_SIZE=(BLOCK, BLOCK),
                     mask_mod=_mask_mod(mask, Rows.span(q_start, q_start + q_len),
                                        Rows.span(kv_start, kv_start + kv_len), device))


def _rows(length: int) -> int:
    """Block rows of a table for ``length`` rows: at least two (see the module docstring)."""
    return max(2, (length + BLOCK - 1) // BLOCK)


def _band_width(rule: BandRule) -> int:
    """The most blocks one block of queries (or of keys) can touch under ``rule``: a query sees
    at most period + back keys, so a block's range spans at most BLOCK + period + back - 1."""
    period, _, back = rule
    return (BLOCK + period + back - 2) // BLOCK + 2


def _lo(rule: BandRule, t: Tensor) -> Tensor:
    """lo(t): the first key position query position t sees."""
    period, shift, back = rule
    return _at_least((t + shift) // period * period - shift - back, 0)


def _hi(rule: BandRule, c: Tensor) -> Tensor:
    """The last query position that sees key position c: the largest t with lo(t) <= c."""
    period, shift, back = rule
    return ((c + shift + back) // period + 1) * period - shift - 1


# torch.where rather than clamp: traced into a graph, inductor's index simplification fails on
# clamped floor divisions of an arange (torch 2.13), and the builders must trace (a compiled
# training step builds its block mask inside the graph).
def _at_least(x: Tensor, bound: int) -> Tensor:
    return torch.where(x > bound, x, bound)


def _at_most(x: Tensor, bound: int) -> Tensor:
    return torch.where(x < bound, x, bound)


def _kv_side(rule: BandRule, q_start: int, kv_start: int, q_len: int, kv_len: int,
             device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per query block: the range of key blocks it sees and the range of full ones."""
    i = torch.arange(_rows(q_len), device=device)
    first = q_start + i * BLOCK  # the block's first and last query positions
    last = q_start + _at_most(i * BLOCK + BLOCK, q_len) - 1
    lo = _at_least(_lo(rule, first) - kv_start, 0) // BLOCK
    hi = _at_most(last - kv_start, kv_len - 1) // BLOCK
    full_lo = (_at_least(_lo(rule, last) - kv_start, 0) + BLOCK - 1) // BLOCK  # rounded up
    full_hi = _at_most((first - kv_start + 1) // BLOCK - 1, kv_len // BLOCK - 1)
    whole = i * BLOCK + BLOCK <= q_len
    exists = i * BLOCK < q_len
    return lo, torch.where(exists, hi, lo - 1), full_lo, torch.where(whole, full_hi, full_lo - 1)


def _q_side(rule: BandRule, q_start: int, kv_start: int, q_len: int, kv_len: int,
            device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per key block: the range of query blocks that see it and the range of full ones."""
    j = torch.arange(_rows(kv_len), device=device)
    first = kv_start + j * BLOCK  # the block's first and last key positions
    last = kv_start + _at_most(j * BLOCK + BLOCK, kv_len) - 1
    below = _at_least(first - q_start, 0)
    above = _at_most(_hi(rule, last) - q_start, q_len - 1)
    lo = below // BLOCK
    hi = torch.where((above >= below) & (j * BLOCK < kv_len), _at_least(above, 0) // BLOCK,
                     lo - 1)
    full_lo = (_at_least(last - q_start, 0) + BLOCK - 1) // BLOCK
    full_hi = _at_most((_hi(rule, first) - q_start + 1) // BLOCK - 1, q_len // BLOCK - 1)
    whole = j * BLOCK + BLOCK <= kv_len
    return lo, hi, full_lo, torch.where(whole, full_hi, full_lo - 1)


def _lists(ranges: tuple[Tensor, Tensor, Tensor, Tensor], width: int, n_cols: int
           ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """From per-row ranges of visible blocks [lo, hi] and of full ones [full_lo, full_hi]
    (empty when hi < lo; the full range lies within the visible one): the partial blocks, the
    visible ones outside the full range, and the full ones, each as (count, (rows, width)
    indices in increasing order). Entries past a count are clamped to valid block indices."""
    lo, hi, full_lo, full_hi = ranges
    n_full = _at_least(full_hi - full_lo + 1, 0)
    n_visible = _at_least(hi - lo + 1, 0)
    n_before = torch.where(n_full > 0, full_lo - lo, n_visible)  # partial blocks before the full
    n_after = torch.where(n_full > 0, hi - full_hi, 0)
    e = torch.arange(width, device=lo.device)
    partial = torch.where(e < n_before[:, None], lo[:, None] + e,
                          full_hi[:, None] + 1 + e - n_before[:, None])
    full = full_lo[:, None] + e
    return (n_before + n_after, _at_least(_at_most(partial, n_cols - 1), 0), n_full,
            _at_most(full, n_cols - 1))


def _stack(tables: list[tuple[Tensor, ...]], which: list[int], width: int, n_other: int
           ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(num, indices, full num, full indices) with a leading (1, heads) from each head's rule;
    the indices as overlapping strided views (``_overlapped``) over ``n_other`` blocks."""
    lists = [_lists(ranges, width, n_other) for ranges in tables]
    out = []
    for part in range(4):
        per_head = torch.stack([lists[r][part] for r in which]).to(torch.int32)
        out.append(per_head[None] if part % 2 == 0 else _overlapped(per_head, n_other))
    return tuple(out)


def _overlapped(rows: Tensor, n_other: int) -> Tensor:
    """(H, R, w) rows of indices as a (1, H, R, C) view whose row i starts at entry i·w of its
    head's buffer: entries 0 .. w - 1 of a row are its own, the rest belong to later rows (and
    to a tail of valid entries after the last row). C = w·n_other >= n_other columns, and a
    buffer of R·w + C + 1 entries: sizes between which no length makes a row stride equal to C,
    nor a head stride equal to R·C, so that torch.compile's guards on those never flip."""
    heads, n_rows, width = rows.shape
    n_cols = width * n_other
    per_head = n_rows * width + n_cols + 1
    buffer = rows.new_zeros(heads, per_head)
    buffer[:, :n_rows * width] = rows.reshape(heads, -1)
    return buffer.as_strided((1, heads, n_rows, n_cols), (heads * per_head, per_head, width, 1))


# Predicate block masks ---------------------------------------------------------------------------

@lru_cache(maxsize=8)
def _predicate_block_mask(mask: Mask, n_heads: int, q_rows: Rows, kv_rows: Rows,
                          device: torch.device):
    from torch.nn.attention.flex_attention import BlockMask

    partial, full = block_states(mask, n_heads, q_rows, kv_rows, device)
    kv_num, kv_idx = _ordered(partial)
    full_kv_num, full_kv_idx = _ordered(full)
    q_num, q_idx = _ordered(partial.transpose(-2, -1))
    full_q_num, full_q_idx = _ordered(full.transpose(-2, -1))
    return BlockMask(seq_lengths=(len(q_rows), len(kv_rows)), kv_num_blocks=kv_num,
                     kv_indices=kv_idx, full_kv_num_blocks=full_kv_num,
                     full_kv_indices=full_kv_idx, q_num_blocks=q_num, q_indices=q_idx,
                     full_q_num_blocks=full_q_num, full_q_indices=full_q_idx,
                     BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=_mask_mod(mask, q_rows, kv_rows, device))


def block_states(mask: Mask, n_heads: int, q_rows: Rows, kv_rows: Rows,
                 device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """(partial, full): boolean (H, query blocks, key blocks) grids of ``mask`` (H = 1 unless it
    differs between heads), evaluated a few block rows of queries at a time; at least two rows
    and columns of blocks, the ones past the ends empty."""
    q_len, kv_len = len(q_rows), len(kv_rows)
    n_q, n_kv = _rows(q_len), _rows(kv_len)
    heads = n_heads if mask.per_head else None
    q_all, kv_pos = q_rows.positions(device), kv_rows.positions(device)
    step = max(1, (1 << 22) // (BLOCK * n_kv * BLOCK * (heads or 1)))  # block rows at a time
    # The grids exist before the chunks: small tensors kept between the chunks' large
    # temporaries would pin the allocator's heap, which then grows by a chunk per step.
    partial = torch.zeros(heads or 1, n_q, n_kv, dtype=torch.bool, device=device)
    full = torch.zeros_like(partial)
    for i in range(0, n_q, step):
        rows = min(step, n_q - i) * BLOCK
        q_pos = q_all[i * BLOCK:i * BLOCK + rows]
        allowed = materialize(mask, q_pos, kv_pos, heads).view(heads or 1, len(q_pos), kv_len)
        allowed = torch.nn.functional.pad(allowed, (0, n_kv * BLOCK - kv_len,
                                                    0, rows - len(q_pos)))
        # any / all rather than a count: no int64 copy of the chunk
        tiles = allowed.view(-1, rows // BLOCK, BLOCK, n_kv, BLOCK)
        every = tiles.all(4).all(2)
        full[:, i:i + rows // BLOCK] = every
        partial[:, i:i + rows // BLOCK] = tiles.any(4).any(2) & ~every
    return partial, full


def _ordered(grid: Tensor) -> tuple[Tensor, Tensor]:
    """A boolean (H, R, C) grid as (1, H, R) counts and (1, H, R, C) indices, the True columns
    first, in increasing order."""
    counts = grid.sum(-1, dtype=torch.int32)
    order = torch.argsort(grid.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts[None], order.to(torch.int32)[None]


def _mask_mod(mask: Mask, q_rows: Rows, kv_rows: Rows, device: torch.device):
    """The predicate on the positions of the row indices (see the module docstring)."""
    q_pos, kv_pos = _position_of(q_rows, device), _position_of(kv_rows, device)
    if mask.per_head:
        def mask_mod(b, h, q_idx, kv_idx):
            return mask(q_pos(q_idx), kv_pos(kv_idx), h)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return mask(q_pos(q_idx), kv_pos(kv_idx))
    return mask_mod


def _position_of(rows: Rows, device: torch.device):
    """index -> position for ``rows``: index + start, plus the gap between the history and the
    main run for the indices past the history."""
    def scalar(value: int) -> Tensor | int:
        # Eagerly a 0-dim tensor filled on the device (no copy from the host), so that a new
        # offset is new data for the compiled kernel; inside a graph being compiled a constant,
        # since torch's CPU kernel cannot take a tensor made within the graph.
        if torch.compiler.is_compiling():
            return value
        return torch.full((), value, dtype=torch.int64, device=device)

    start = scalar(rows.history.start if len(rows.history) else rows.main.start)
    if not (len(rows.history) and len(rows.main)) or rows.history.stop == rows.main.start:
        return lambda idx: idx + start
    split, gap = scalar(len(rows.history)), scalar(rows.main.start - rows.history.stop)
    return lambda idx: idx + start + (idx >= split) * gap
