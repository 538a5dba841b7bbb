"""Exact ECP attention from two flash-attention calls (CPU): the fallback where the native kernel
(native.py) cannot be built.

Each segment's queries see the whole previous segment (m² entries, no mask) and their own segment
causally (m²/2). The (m, 2m)-mask kernel computes all 2m² of each tile; here the two parts are
two batched flash-attention calls, merged through their log-sum-exps. The causal call skips its
upper triangle only where the flash kernel splits the segment's queries into several blocks
(m >= 1024 with torch 2.13 on CPU); at m = 256 it costs as much as the unmasked call.

    lse = logaddexp(lse_prev, lse_own);  out = out_prev·e^(lse_prev−lse) + out_own·e^(lse_own−lse)

The log-sum-exp of the CPU flash kernel carries no gradient, so the backward is written out as
FlashAttention does across key blocks: each part's flash backward, given the *merged* output and
log-sum-exp, returns that part's exact contribution to dq, dk and dv.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _blocks(x: Tensor, first: int, last: int | None) -> Tensor:
    """Segments first..last-1 of x (B, H, S, m, D) as a batch: (B, H·S', m, D)."""
    b, _, _, m, d = x.shape
    return x[:, :, first:last].reshape(b, -1, m, d)


class _SegmentPairs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # (B, H, S, m, D) each
        b, h, s, m, d = q.shape
        out_own, lse_own = _flash(_blocks(q, 0, None), _blocks(k, 0, None),
                                  _blocks(v, 0, None), 0.0, True)
        out = out_own.reshape(b, h, s, m, d)
        lse = lse_own.reshape(b, h, s, m)
        if s > 1:
            out_prev, lse_prev = _flash(_blocks(q, 1, None), _blocks(k, 0, -1),
                                        _blocks(v, 0, -1), 0.0, False)
            out_prev, lse_prev = out_prev.reshape(b, h, s - 1, m, d), lse_prev.reshape(
                b, h, s - 1, m)
            merged = torch.logaddexp(lse_prev, lse[:, :, 1:])
            rest = (out_prev * (lse_prev - merged).exp().unsqueeze(-1)
                    + out[:, :, 1:] * (lse[:, :, 1:] - merged).exp().unsqueeze(-1))
            out = torch.cat([out[:, :, :1], rest.to(out.dtype)], dim=2)
            lse = torch.cat([lse[:, :, :1], merged], dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, out, lse = ctx.saved_tensors
        shape = q.shape
        b, h, s, m, d = shape
        grad = grad.contiguous()

        def part(first_q: int, last_k: int | None, first_k: int, causal: bool):
            return _flash_backward(
                _blocks(grad, first_q, None), _blocks(q, first_q, None),
                _blocks(k, first_k, last_k), _blocks(v, first_k, last_k),
                _blocks(out, first_q, None), lse[:, :, first_q:].reshape(b, -1, m), 0.0, causal)

        dq, dk, dv = (g.reshape(shape) for g in part(0, None, 0, True))
        if s > 1:
            dq_p, dk_p, dv_p = (g.reshape(b, h, s - 1, m, d) for g in part(1, -1, 0, False))
            dq = dq + F.pad(dq_p, (0, 0, 0, 0, 1, 0))  # queries of segments 1 .. S-1
            dk = dk + F.pad(dk_p, (0, 0, 0, 0, 0, 1))  # keys of segments 0 .. S-2
            dv = dv + F.pad(dv_p, (0, 0, 0, 0, 0, 1))
        return dq, dk, dv


def segment_pairs_lse(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """q, k, v (B, H, S, m, D) on CPU, no dropout -> (B, H, S, m, D)."""
    return _SegmentPairs.apply(q, k, v)
