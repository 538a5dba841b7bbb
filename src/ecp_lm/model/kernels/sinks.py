"""Attention sinks beside a band (sliding_window's ``sink_tokens``, SPEC §3b): exact kernels.

A query at position q sees its band, the keys lo(q) .. q of the main run of rows, and the sinks,
positions 0 .. k - 1 (those <= q). The sinks outside the band are a few extra columns: keys
``sink_k`` (B, H, n, D) at positions ``sink_pos`` (n <= k), either rows of a history run before
the main run (a chunk continuing a cache, which holds the sinks in slots of their own) or the
first rows of the main run itself (a forward from position 0). ``outside_band`` gives which of
those columns each query sees that its band does not already hold, so that no key is counted
twice, and two kernels add them to the band:

- ``band_with_sinks`` (``native``): the native band kernel's output and log-sum-exp merged with
  a small dense attention over the n sink columns, by log-sum-exp. The backward runs the band
  kernel's backward with the *merged* output and log-sum-exp, which gives exactly the band
  keys' share of the gradients (the probabilities it recomputes are the merged softmax's), and
  the sink columns' share densely. O(T·(w + k)) time and memory, no T×T tensor.
- ``paired_blocks_with_sinks`` (``mask``): every block of c queries against [the n sink columns,
  its previous block, itself] under a (c, n + 2c) mask per block, one SDPA call batched over
  blocks: O(T·(n + 2c)), with SDPA's dropout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ecp_lm.model.kernels import native


def outside_band(q_pos: Tensor, sink_pos: Tensor, band_start: int, window: int) -> Tensor:
    """(Rq, n) bool: query position q_pos[i] sees sink sink_pos[j] (<= q) and its band does not
    hold it: the band is the main run's keys from ``band_start`` on within ``window`` of q."""
    q, s = q_pos[:, None], sink_pos[None, :]
    in_band = (s >= band_start) & (s > q - window)
    return (s <= q) & ~in_band


class _BandWithSinks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sink_k: Tensor, sink_v: Tensor,
                allowed: Tensor, rule: tuple[int, int, int], dropout_p: float) -> Tensor:
        b, h, t, d = q.shape
        ops = getattr(torch.ops, native._OPS)
        block = native.default_block(rule)
        seed = native._seed() if dropout_p > 0.0 else 0
        flat = [x.reshape(b * h, t, d).contiguous() for x in (q, k, v)]
        band_out, band_lse = ops.band_attention_forward(*flat, *rule, block, float(dropout_p),
                                                        seed)
        band_out, band_lse = band_out.view(b, h, t, d), band_lse.view(b, h, t)
        scale = 1.0 / math.sqrt(d)
        scores = (q @ sink_k.transpose(-2, -1)) * scale  # (B, H, T, n)
        sink_lse = scores.masked_fill(~allowed, float("-inf")).logsumexp(-1)
        lse = torch.logaddexp(band_lse, sink_lse)  # finite: a band holds its own query
        probs = torch.where(allowed, (scores - lse[..., None]).exp(), 0.0)
        keep = None
        if dropout_p > 0.0:
            keep = torch.rand_like(probs) >= dropout_p
            probs = probs * keep / (1.0 - dropout_p)
        out = band_out * (band_lse - lse).exp()[..., None] + probs @ sink_v
        ctx.rule, ctx.block, ctx.dropout_p, ctx.seed = rule, block, dropout_p, seed
        ctx.save_for_backward(q, k, v, sink_k, sink_v, allowed, out, lse, keep)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, sink_k, sink_v, allowed, out, lse, keep = ctx.saved_tensors
        b, h, t, d = q.shape
        grad = grad.contiguous()
        ops = getattr(torch.ops, native._OPS)
        flat = [x.reshape(b * h, t, d).contiguous() for x in (grad, q, k, v, out)]
        dq, dk, dv = ops.band_attention_backward(*flat, lse.reshape(b * h, t).contiguous(),
                                                 *ctx.rule, ctx.block, float(ctx.dropout_p),
                                                 ctx.seed)
        dq, dk, dv = (x.view(b, h, t, d) for x in (dq, dk, dv))
        scale = 1.0 / math.sqrt(d)
        probs = torch.where(allowed, ((q @ sink_k.transpose(-2, -1)) * scale
                                      - lse[..., None]).exp(), 0.0)  # (B, H, T, n)
        d_probs = grad @ sink_v.transpose(-2, -1)
        kept = probs
        if keep is not None:
            d_probs = d_probs * keep / (1.0 - ctx.dropout_p)
            kept = probs * keep / (1.0 - ctx.dropout_p)
        delta = (grad * out).sum(-1, keepdim=True)  # rowsum(dO·O) of the merged softmax
        d_scores = probs * (d_probs - delta)
        dq = dq + (d_scores @ sink_k) * scale
        d_sink_k = (d_scores.transpose(-2, -1) @ q) * scale
        d_sink_v = kept.transpose(-2, -1) @ grad
        return dq, dk, dv, d_sink_k, d_sink_v, None, None, None


def band_with_sinks(q: Tensor, k: Tensor, v: Tensor, rule: tuple[int, int, int],
                    sink_k: Tensor, sink_v: Tensor, allowed: Tensor, dropout_p: float = 0.0
                    ) -> Tensor:
    """The native band kernel over q, k, v (B, H, T, D) under ``rule`` (native.py) plus the
    sink columns ``sink_k``, ``sink_v`` (B, H, n, D) where ``allowed`` (T, n) says: exact,
    forward and backward. bfloat16 runs in float32, as the band kernel does."""
    dtype = q.dtype
    if dtype in native.WIDENED:
        q, k, v, sink_k, sink_v = (x.float() for x in (q, k, v, sink_k, sink_v))
    rule = tuple(int(x) for x in rule)
    out = _BandWithSinks.apply(q, k, v, sink_k, sink_v, allowed, rule, float(dropout_p))
    return out.to(dtype)


def paired_blocks_with_sinks(q: Tensor, k: Tensor, v: Tensor, block_len: int, pair_mask: Tensor,
                             sink_k: Tensor, sink_v: Tensor, allowed: Tensor,
                             dropout_p: float = 0.0) -> Tensor:
    """Rows cut into blocks of c = ``block_len`` from the first, each block against [the sink
    columns where ``allowed`` (T, n), or (H, T, n) per head, says, its previous block and
    itself under ``pair_mask`` (c, 2c); block 0 has no previous block]: one SDPA call batched
    over blocks."""
    b, n_heads, t, d = q.shape
    c, n = block_len, sink_k.size(2)
    pad = -t % c
    q, k, v = (F.pad(x, (0, 0, 0, pad)).reshape(b, n_heads, -1, c, d) for x in (q, k, v))
    s = q.size(2)

    def keys(blocks: Tensor, sinks: Tensor) -> Tensor:  # (B, H, S, n + 2c, D)
        previous = F.pad(blocks[:, :, :-1], (0, 0, 0, 0, 1, 0))  # block 0's: zeros, masked
        return torch.cat([sinks[:, :, None].expand(b, n_heads, s, n, d), previous, blocks], 3)

    sink_cols = F.pad(allowed, (0, 0, 0, pad)).unflatten(-2, (s, c))  # (..., S, c, n)
    pair = pair_mask.expand(s, c, 2 * c).clone()
    pair[0, :, :c] = False
    mask = torch.cat([sink_cols, pair.expand(*sink_cols.shape[:-1], 2 * c)], dim=-1)
    out = F.scaled_dot_product_attention(q, keys(k, sink_k), keys(v, sink_v), attn_mask=mask,
                                         dropout_p=dropout_p)
    return out.reshape(b, n_heads, -1, d)[:, :, :t]
