"""Attention kernels: the dense reference, and exact fast kernels whose cost follows the pattern.

All take q (B, H, Rq, D) and k, v (B, H, Rk, D), where the Rq query rows are the last Rq of the
Rk key rows (rows are in position order), and return (B, H, Rq, D).

- ``reference_attention`` materialises the mask predicate densely: the specification.
- ``causal_attention``: lower-right aligned causal (query i sees keys 0 .. Rk - Rq + i). SDPA's
  ``is_causal`` is upper-left aligned, so it is only used when Rq == Rk.
- ``segment_pair_attention``: ECP. Each segment's m queries attend to [previous segment, own
  segment], batched over segments: O(T·2m), never T×T. On CPU (no dropout) the native kernel
  (native.py, ~1.5·m² entries per segment), or where it cannot be built two flash calls merged
  by log-sum-exp (segment_lse.py); elsewhere one call with a static (m, 2m) mask.
- ``double_attention``: the Double Attention family. History rows attend (unmasked) within their
  history block; latent rows attend lower-right causally to every key.
- ``flex_attention_from_mask``: FlexAttention with the predicate as ``mask_mod``.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from ecp_lm.models.attention import native
from ecp_lm.models.attention.masks import Mask, materialize
from ecp_lm.models.attention.segment_lse import segment_pairs_lse
from ecp_lm.models.rows import Rows


def reference_attention(q: Tensor, k: Tensor, v: Tensor, mask: Mask, q_pos: Tensor,
                        kv_pos: Tensor, dropout_p: float = 0.0) -> Tensor:
    """Dense softmax attention with the mask predicate materialised on absolute positions."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, H, Rq, Rk)
    allowed = materialize(mask, q_pos, kv_pos)  # (Rq, Rk)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return probs @ v


def causal_attention(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0) -> Tensor:
    """Causal attention aligned lower-right: the queries are the last Rq of the Rk keys."""
    rq, rk = q.size(-2), k.size(-2)
    if rq == rk:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if torch.compiler.is_compiling():
        # torch.compile cannot construct the CausalBias tensor subclass (a graph break); the same
        # mask as a dense boolean (Rq, Rk) tensor traces, and the compiler folds it.
        mask = torch.ones(rq, rk, dtype=torch.bool, device=q.device).tril(rk - rq)
    else:
        mask = causal_lower_right(rq, rk)  # lets CUDA use a kernel with the diagonal built in
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


@lru_cache(maxsize=32)
def _segment_pair_mask(m: int, device: torch.device) -> Tensor:
    """(m, 2m): every key of the previous segment, then causal within the own segment."""
    row = torch.arange(m, device=device)[:, None]
    col = torch.arange(2 * m, device=device)[None, :]
    return (col < m) | (col - m <= row)


def segment_pair_attention(q: Tensor, k: Tensor, v: Tensor, segment_len: int,
                           dropout_p: float = 0.0) -> Tensor:
    """ECP attention over T rows (any T >= 1) at consecutive positions whose first one starts a
    segment (0, or any multiple of m: the segment structure is the same)."""
    b, n_heads, t, d = q.shape
    m = segment_len
    pad = -t % m
    if pad:  # padded rows come after every real query, so causality hides them as keys
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    s = (t + pad) // m
    q, k, v = (x.reshape(b, n_heads, s, m, d) for x in (q, k, v))  # (B, H, S, m, D)
    if native.supports(q, dropout_p):  # ~1.5·m² per segment instead of 2·m²
        out = native.segment_attention(q, k, v)
    elif q.device.type == "cpu" and dropout_p == 0.0:
        out = segment_pairs_lse(q, k, v)
    else:
        out = segment_pairs_masked(q, k, v, dropout_p)
    return out.reshape(b, n_heads, s * m, d)[:, :, :t]


def segment_pairs_masked(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0) -> Tensor:
    """q, k, v (B, H, S, m, D): each segment against [previous, own] under one static (m, 2m)
    mask, one SDPA call batched over segments."""
    b, n_heads, s, m, d = q.shape
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
            attn_mask=_segment_pair_mask(m, q.device), dropout_p=dropout_p)
        outs.append(rest.reshape(b, n_heads, s - 1, m, d))
    return torch.cat(outs, dim=2)


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
    """New queries against a cache's slots (slot position -1 = empty), masked by the predicate on
    absolute positions: (B, H, Rq, D) x (B, H, S, D) -> (B, H, Rq, D)."""
    allowed = (slot_pos[None, :] >= 0) & mask(q_pos[:, None], slot_pos[None, :])  # (Rq, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


# FlexAttention --------------------------------------------------------------------------------

@lru_cache(maxsize=64)
def _block_mask(mask: Mask, q_rows: Rows, kv_rows: Rows, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    q_pos, kv_pos = q_rows.positions(device), kv_rows.positions(device)

    def mask_mod(b, h, q_idx, kv_idx):
        return mask(q_pos[q_idx], kv_pos[kv_idx])

    return create_block_mask(mask_mod, None, None, len(q_rows), len(kv_rows), device=device)


@lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attention_from_mask(q: Tensor, k: Tensor, v: Tensor, mask: Mask, rows: Rows) -> Tensor:
    """FlexAttention whose ``mask_mod`` is the predicate; the block mask is built once per
    (mask, layout, device) and reused. Compiled on CUDA; eager (forward only) elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = _block_mask(mask, rows.tail(q.size(-2)), rows, q.device)
    kernel = _compiled_flex() if q.is_cuda else flex_attention
    return kernel(q, k, v, block_mask=block_mask)
