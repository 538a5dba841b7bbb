"""FlexAttention with the mask predicate as ``mask_mod``, compiled within a stated graph budget
(its block masks, in O(T) memory: block_masks.py).

The compiled call is one graph for every length: only the batch and row dimensions of q, k, v
and the tables' rows and columns are symbolic, the BlockMask is assembled inside the graph from
them, and heads, head size and the mask's own sizes stay constants. Compiled, the forward runs
on CPU too (torch's C++ template, x86 with AVX2); the backward only on CUDA.

Graph budget. torch.compile keeps a function's graphs on its code object and, past
``torch._dynamo.config.recompile_limit`` of them (8), would run it uncompiled: FlexAttention
eagerly, O(T²) in time and memory. So:

- every *kind* of call (``Kind``: the mask's value, whether the rows have a gap, whether every
  row queries) gets a compiled function with a code object of its own: kinds never share the
  limit, and a hybrid of four local patterns has four functions;
- what would add graphs is normalised before the call: one query row gets a second one after
  it (a length of 1 is a specialisation of its own; the row is a later position, which no
  causal query sees, and its output is dropped); grad mode is off unless an input needs a
  gradient; autocast is off inside (q, k, v arrive in the dtype they were computed in);
- what is left is one graph per (dtype, forward only or with backward, batch of one or of
  several): ``GRAPHS_PER_KIND`` = 8 for two dtypes on CUDA, dynamo's default limit; 4 on a CPU
  (no backward). Past the limit the call raises ``RuntimeError`` naming the kind and the cause
  (the function is compiled with ``fullgraph``), never an eager run.

Head size. On the CPU, torch 2.13's compiled kernel is wrong at head sizes below 24 for some
lengths (head size 16: T = 8, 24, 40, 56, 72, 120 differ from the reference, one NaN), and exact
at 32 and above; head sizes below ``MIN_CPU_HEAD_DIM`` are zero-padded to it, the scale kept at
1/sqrt(D): the scores, and so the output's first D columns, are unchanged.
"""

from __future__ import annotations

import itertools
import math
import types
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor

from ecp_lm.model.kernels.block_masks import (
    BLOCK,
    Bands,
    band_block_mask,
    first_position,
    predicate_block_mask,
)
from ecp_lm.model.kernels.masks import Mask
from ecp_lm.model.rows import Rows

MIN_CPU_HEAD_DIM = 32
"""The smallest head size torch's compiled CPU FlexAttention computes exactly (see above)."""

GRAPHS_PER_KIND = 8
"""The graph budget of one kind: 2 dtypes x (forward only, with backward) x (batch of one, of
several). Equal to dynamo's default ``recompile_limit``, which enforces it."""


@dataclass(frozen=True)
class Kind:
    """What one compiled FlexAttention function serves (the module docstring): a mask, on rows
    with or without a gap between history and main, queried by every row or by the last few, at
    one number of heads and head size, on one kind of device."""

    mask: Mask
    gapped: bool
    every_row_queries: bool
    heads: int
    head_dim: int
    device: str


def flex_attention_from_mask(q: Tensor, k: Tensor, v: Tensor, mask: Mask, rows: Rows,
                             bands: Bands | None = None) -> Tensor:
    """FlexAttention over ``rows`` (q: their last Rq rows) whose ``mask_mod`` is ``mask``; the
    block mask comes from ``bands`` where given, else from the predicate."""
    q_len = q.size(-2)
    if q_len == 1:  # one row more, after the last: a length of 1 would compile a graph of its own
        q, k, v = (F.pad(x, (0, 0, 0, 1)) for x in (q, k, v))
        return flex_attention_from_mask(q, k, v, mask, _one_row_more(rows), bands)[..., :1, :]
    if bands is None:
        block_mask = predicate_block_mask(mask, q.size(1), rows.tail(q_len), rows, q.device)
    else:
        kv_start = first_position(rows)
        block_mask = band_block_mask(mask, bands, kv_start + len(rows) - q_len, kv_start,
                                     q_len, len(rows), q.device)
    gapped = bool(len(rows.history) and len(rows.main)) and rows.history.stop != rows.main.start
    kind = Kind(mask, gapped, q_len == len(rows), q.size(1), q.size(-1), q.device.type)
    return flex_attention(q, k, v, block_mask, kind)


def _one_row_more(rows: Rows) -> Rows:
    """``rows`` and the position after the last one (which ends the main run)."""
    if len(rows.main):
        return Rows(rows.history, range(rows.main.start, rows.main.stop + 1))
    return Rows(range(0), range(rows.history.start, rows.history.stop + 1))


def flex_attention(q: Tensor, k: Tensor, v: Tensor, block_mask, kind: Kind) -> Tensor:
    """torch's FlexAttention under ``block_mask``: compiled for ``kind`` once for every length
    (inside a graph that is being compiled, the outer compilation lowers it)."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    head_dim = q.size(-1)
    scale = 1.0 / math.sqrt(head_dim)
    pad = MIN_CPU_HEAD_DIM - head_dim if q.device.type == "cpu" else 0
    if pad > 0:  # zero columns: the same scores (the module docstring)
        q, k, v = (F.pad(x, (0, pad)) for x in (q, k, v))
    if torch.compiler.is_compiling():
        out = flex(q, k, v, block_mask=block_mask, scale=scale)
    else:
        out = _compiled_call(q, k, v, block_mask, kind, scale)
    return out[..., :head_dim] if pad > 0 else out


_TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
           "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _compiled_call(q: Tensor, k: Tensor, v: Tensor, block_mask, kind: Kind, scale: float
                   ) -> Tensor:
    tables = tuple(getattr(block_mask, name) for name in _TABLES)
    # Only the batch and the lengths vary: the batch and row dimensions of q, k, v and the rows
    # and columns of the tables. Everything else (heads, head size, the mask's own sizes) stays a
    # constant.
    for x in (q, k, v):
        torch._dynamo.maybe_mark_dynamic(x, [0, 2])
    for table in tables:
        torch._dynamo.maybe_mark_dynamic(table, list(range(2, table.dim())))
    backward = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    with torch.set_grad_enabled(backward), torch.autocast(q.device.type, enabled=False):
        try:
            return _compiled(kind)(q, k, v, tables, block_mask.mask_mod, scale)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            limit = torch._dynamo.config.recompile_limit
            raise RuntimeError(
                f"FlexAttention for {kind.mask} needs more compiled graphs than "
                f"torch._dynamo.config.recompile_limit={limit}: a kind compiles one graph per "
                f"dtype, forward or backward and batch of one or several (this call: "
                f"{q.dtype}, {'backward' if backward else 'forward only'}, batch {q.size(0)}); "
                "use fewer dtypes per process, raise the limit, or another attn_impl") from None


def _flex_of_tables(q: Tensor, k: Tensor, v: Tensor, tables: tuple[Tensor, ...], mask_mod,
                    scale: float) -> Tensor:
    # The BlockMask is put together inside the graph, so that its lengths are q's and k's
    # (symbolic) sizes rather than Python ints that would be compiled in.
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    block_mask = BlockMask((q.size(-2), k.size(-2)), *tables, BLOCK_SIZE=(BLOCK, BLOCK),
                           mask_mod=mask_mod)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale)


_numbers = itertools.count()


@lru_cache(maxsize=64)
def _compiled(kind: Kind):
    """``_flex_of_tables`` compiled for one kind, from a code object of its own: dynamo keeps
    graphs, and counts its recompile limit, per code object."""
    code = _flex_of_tables.__code__
    own = types.FunctionType(code.replace(co_name=f"{code.co_name}_{next(_numbers)}"),
                             _flex_of_tables.__globals__)
    return torch.compile(own, fullgraph=True)


_supported_on_cpu: bool | None = None


@torch.compiler.assume_constant_result  # called, not traced, inside a compiled region
def compiles_on_cpu() -> bool:
    """Whether torch compiles FlexAttention for this CPU (its C++ template needs AVX2)."""
    global _supported_on_cpu
    if _supported_on_cpu is None:
        try:
            from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported
        except ImportError:  # a torch that keeps it elsewhere: let the compiler decide
            _supported_on_cpu = True
        else:
            _supported_on_cpu = bool(check_cpu_supported())
    return _supported_on_cpu
