"""Attention kernels: the dense reference, and exact fast kernels whose cost follows the pattern.

All take q (B, H, Rq, D) and k, v (B, H, Rk, D), where the Rq query rows are the last Rq of the
Rk key rows (rows are in position order), and return (B, H, Rq, D).

- ``reference_attention`` materialises the mask predicate densely: the specification.
- ``causal_attention``: lower-right aligned causal (query i sees keys 0 .. Rk - Rq + i). SDPA's
  ``is_causal`` is upper-left aligned, so it is only used when Rq == Rk.
- ``segment_pair_attention``: ECP. Each segment's m queries attend to [previous segment, own
  segment], batched over segments: O(T·2m), never T×T. Three exact kernels: ``native`` (CPU, with
  dropout; the band kernel of native.py, ~1.5·m² entries per segment), ``flash`` (on the CPU, no
  dropout: two flash calls merged by log-sum-exp, segment_lse.py; elsewhere one lower-right
  causal call per pair, ``segment_pairs_lower_right``, which CUDA runs with its FlashAttention
  kernel) and ``mask`` (any device: one SDPA call with a static (m, 2m) mask, batched over
  segments).
- ``paired_blocks_attention``: the ``mask`` kernel of any pattern where a block of c queries sees
  at most its previous block and itself (ECP with c = m, a sliding window with c = w).
- ``block_causal_attention``: causal attention within consecutive blocks, batched over blocks
  (block_local, and each half of the heads of s2).
- ``double_attention``: the Double Attention family. History rows attend (unmasked) within their
  history block; latent rows attend lower-right causally to every key.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ecp_lm.model.kernels import native
from ecp_lm.model.kernels.masks import Mask, materialize
from ecp_lm.model.kernels.segment_lse import segment_pairs_lse
from ecp_lm.model.rows import Rows


def reference_attention(q: Tensor, k: Tensor, v: Tensor, mask: Mask, q_pos: Tensor,
                        kv_pos: Tensor, dropout_p: float = 0.0) -> Tensor:
    """Dense softmax attention with the mask predicate materialised on absolute positions."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, H, Rq, Rk)
    allowed = materialize(mask, q_pos, kv_pos, q.size(1))  # (Rq, Rk), or (H, Rq, Rk) per head
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return probs @ v


def causal_attention(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0) -> Tensor:
    """Causal attention aligned lower-right: the queries are the last Rq of the Rk keys."""
    rq, rk = q.size(-2), k.size(-2)
    if rq == rk:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        # Neither torch.compile nor a dispatch mode (a FLOP or memory count) can construct the
        # CausalBias tensor subclass; the same mask as a dense boolean (Rq, Rk) tensor can (and
        # the compiler folds it).
        mask = torch.ones(rq, rk, dtype=torch.bool, device=q.device).tril(rk - rq)
    else:
        mask = causal_lower_right(rq, rk)  # lets CUDA use a kernel with the diagonal built in
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


@lru_cache(maxsize=32)
def segment_pair_mask(m: int, device: torch.device) -> Tensor:
    """(m, 2m) for ECP: every key of the previous segment, then causal within the own segment."""
    row = torch.arange(m, device=device)[:, None]
    col = torch.arange(2 * m, device=device)[None, :]
    return (col < m) | (col - m <= row)


def segment_pair_attention(q: Tensor, k: Tensor, v: Tensor, segment_len: int,
                           dropout_p: float = 0.0, kernel: str | None = None) -> Tensor:
    """ECP attention over T rows (any T >= 1) at consecutive positions whose first one starts a
    segment (0, or any multiple of m: the segment structure is the same). ``kernel``: "native",
    "flash" or "mask"; None picks the fastest that can run this call."""
    m = segment_len
    if kernel is None:
        if native.supports(q, dropout_p):
            kernel = "native"
        elif q.device.type == "cpu" and dropout_p == 0.0:
            kernel = "flash"
        else:
            kernel = "mask"
    if kernel == "native":  # ~1.5·m² per segment instead of 2·m²
        return native.band_attention(q, k, v, (m, 0, m), dropout_p=dropout_p)
    if kernel == "mask":
        return paired_blocks_attention(q, k, v, m, segment_pair_mask(m, q.device), dropout_p)
    b, n_heads, t, d = q.shape
    q, k, v = (_pad_rows(x, -t % m).reshape(b, n_heads, -1, m, d) for x in (q, k, v))
    if q.device.type == "cpu":
        out = segment_pairs_lse(q, k, v)
    else:
        out = segment_pairs_lower_right(q, k, v, dropout_p)
    return out.reshape(b, n_heads, -1, d)[:, :, :t]


def segment_pairs_lower_right(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0
                              ) -> Tensor:
    """q, k, v (B, H, S, m, D): ECP's pairs as causal attention aligned lower-right. Query i of
    segment s against the 2m keys of segments s - 1 and s sees keys 0 .. m + i, which is ECP's
    (m, 2m) mask exactly, so the segments after the first are one SDPA call over
    (B, H·(S-1), m, D) x (B, H·(S-1), 2m, D) with ``causal_lower_right`` (segment 0, causal on
    its own, a second): no mask tensor, which lets CUDA pick its FlashAttention kernel. (A
    sliding window's pair mask also has a lower edge, which no causal alignment expresses.)"""
    b, n_heads, s, m, d = q.shape
    first = F.scaled_dot_product_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0],
                                           dropout_p=dropout_p, is_causal=True)
    if s == 1:
        return first.unsqueeze(2)
    pair_k = torch.cat([k[:, :, :-1], k[:, :, 1:]], dim=-2)  # (B, H, S-1, 2m, D)
    pair_v = torch.cat([v[:, :, :-1], v[:, :, 1:]], dim=-2)
    rest = causal_attention(q[:, :, 1:].reshape(b, n_heads * (s - 1), m, d),
                            pair_k.reshape(b, n_heads * (s - 1), 2 * m, d),
                            pair_v.reshape(b, n_heads * (s - 1), 2 * m, d), dropout_p)
    return torch.cat([first.unsqueeze(2), rest.reshape(b, n_heads, s - 1, m, d)], dim=2)


def _pad_rows(x: Tensor, pad: int) -> Tensor:
    """Zero rows after the last one: later than every real query, so causality hides them."""
    return F.pad(x, (0, 0, 0, pad)) if pad else x


def paired_blocks_attention(q: Tensor, k: Tensor, v: Tensor, block_len: int, pair_mask: Tensor,
                            dropout_p: float = 0.0) -> Tensor:
    """Rows cut into blocks of c = ``block_len`` from the first; block 0 attends causally to
    itself, every later block to [previous block, own block] under ``pair_mask`` (c, 2c): one
    SDPA call batched over blocks, O(T·2c). Exact for any mask in which a query sees nothing
    before the previous block and, within the first block, every earlier key."""
    b, n_heads, t, d = q.shape
    q, k, v = (_pad_rows(x, -t % block_len).reshape(b, n_heads, -1, block_len, d)
               for x in (q, k, v))
    out = segment_pairs_masked(q, k, v, dropout_p, pair_mask)
    return out.reshape(b, n_heads, -1, d)[:, :, :t]


def segment_pairs_masked(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0,
                         pair_mask: Tensor | None = None) -> Tensor:
    """q, k, v (B, H, S, m, D): each segment against [previous, own] under one static (m, 2m)
    mask (by default ECP's), one SDPA call batched over segments."""
    b, n_heads, s, m, d = q.shape
    if pair_mask is None:
        pair_mask = segment_pair_mask(m, q.device)
    # Segment 0 has no previous segment: plain causal attention.
    first = F.scaled_dot_product_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0],
                                           dropout_p=dropout_p, is_causal=True)
    outs = [first.unsqueeze(2)]
    if s > 1:
        pair_k = torch.cat([k[:, :, :-1], k[:, :, 1:]], dim=-2)  # (B, H, S-1, 2m, D)
        pair_v = torch.cat([v[:, :, :-1], v[:, :, 1:]], dim=-2)
        rest = F.scaled_dot_product_attention(
            q[:, :, 1:].reshape(b, n_heads * (s - 1), m, d),
            pair_k.reshape(b, n_heads * (s - 1), 2 * m, d),
            pair_v.reshape(b, n_heads * (s - 1), 2 * m, d),
            attn_mask=pair_mask, dropout_p=dropout_p)
        outs.append(rest.reshape(b, n_heads, s - 1, m, d))
    return torch.cat(outs, dim=2)


def block_causal_attention(q: Tensor, k: Tensor, v: Tensor, block_len: int,
                           first_len: int | None = None, dropout_p: float = 0.0) -> Tensor:
    """Causal attention within consecutive blocks of rows: a first block of ``first_len`` rows
    (default ``block_len``), then blocks of ``block_len``, the last one possibly shorter; one
    SDPA call batched over the blocks after the first. Queries and keys are the same rows."""
    t = q.size(-2)
    first = min(first_len or block_len, t)
    out = [F.scaled_dot_product_attention(q[..., :first, :], k[..., :first, :],
                                          v[..., :first, :], dropout_p=dropout_p, is_causal=True)]
    rest = t - first
    if rest:
        b, n_heads, _, d = q.shape
        pad = -rest % block_len
        q, k, v = (_pad_rows(x[..., first:, :], pad).reshape(b, -1, block_len, d)
                   for x in (q, k, v))
        blocks = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        out.append(blocks.reshape(b, n_heads, -1, d)[:, :, :rest])
    return torch.cat(out, dim=-2)


def blockwise_attention(q: Tensor, k: Tensor, v: Tensor, first_len: int, block_len: int,
                        dropout_p: float = 0.0) -> Tensor:
    """Unmasked attention within consecutive blocks of rows: a first block of ``first_len`` rows
    (0 < first_len <= block_len), then blocks of ``block_len``. Queries and keys are the same rows.
    """
    out = [F.scaled_dot_product_attention(q[..., :first_len, :], k[..., :first_len, :],
                                          v[..., :first_len, :], dropout_p=dropout_p)]
    rest = q.size(-2) - first_len
    if rest:
        b, n_heads, _, d = q.shape
        n = rest // block_len
        q, k, v = (x[..., first_len:, :].reshape(b, n_heads * n, block_len, d) for x in (q, k, v))
        blocks = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        out.append(blocks.reshape(b, n_heads, rest, d))
    return torch.cat(out, dim=-2)


def double_attention(q: Tensor, k: Tensor, v: Tensor, rows: Rows,
                     history_segment: int | None = None, dropout_p: float = 0.0) -> Tensor:
    """Double Attention over ``rows``: history rows attend to the history keys of their block
    (the whole history, or their s-Split segment of length ``history_segment``, aligned to
    absolute positions); the remaining query rows attend lower-right causally to every key.

    The queries are either all rows or only the main rows.
    """
    n_hist, n_query = len(rows.history), q.size(-2)
    n_hist_query = n_query - len(rows.main)
    if n_hist_query not in (0, n_hist):
        raise ValueError(f"queries must be all {len(rows)} rows or the {len(rows.main)} main "
                         f"rows, got {n_query}")
    out = []
    if n_hist_query:
        hq, hk, hv = q[..., :n_hist, :], k[..., :n_hist, :], v[..., :n_hist, :]
        if history_segment is None:
            out.append(F.scaled_dot_product_attention(hq, hk, hv, dropout_p=dropout_p))
        else:
            start = rows.history.start
            first = min(n_hist, history_segment - start % history_segment)
            out.append(blockwise_attention(hq, hk, hv, first, history_segment, dropout_p))
    if len(rows.main):
        out.append(causal_attention(q[..., n_hist_query:, :], k, v, dropout_p))
    return torch.cat(out, dim=-2)


def cached_attention(q: Tensor, k: Tensor, v: Tensor, mask: Mask, q_pos: Tensor,
                     slot_pos: Tensor) -> Tensor:
    """New queries against a cache's slots, masked by the predicate on absolute positions:
    (B, H, Rq, D) x (B, H, S, D) -> (B, H, Rq, D). ``q_pos``: (Rq,), or (B, Rq) where rows stand
    at different positions; ``slot_pos`` (B, S), -1 = empty slot. Fixed shapes, no host sync."""
    q_pos = q_pos.expand(q.size(0), -1)[:, None, :, None]  # (B, 1, Rq, 1)
    kv_pos = slot_pos[:, None, None, :]  # (B, 1, 1, S)
    if mask.per_head:
        heads = torch.arange(q.size(1), device=q.device)[None, :, None, None]
        allowed = mask(q_pos, kv_pos, heads)
    else:
        allowed = mask(q_pos, kv_pos)
    allowed = allowed & (kv_pos >= 0)
    out = native.decode_attention(q, k, v, allowed)
    if out is not None:
        return out
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
