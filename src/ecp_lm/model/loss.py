"""Cross-entropy over the output head, a chunk of rows at a time (the training and scoring loss).

The plain loss, ``F.cross_entropy(head(hidden).float(), targets)``, holds the logits of every
row in the compute dtype, a float32 copy of them and, in backward, their gradient: at the
``paper`` preset (V = 50,257, 16 windows of 2048) one float32 copy is 6.6 GB. Here the head runs
on ``chunk_rows`` rows at a time. A chunk's logits are computed in the compute dtype (autocast's,
else the weight's, as ``nn.Linear`` under autocast would), widened to float32 for the
log-sum-exp, and freed before the next chunk. No tensor of all the rows by V is ever made.

The gradient needs no second pass: the loss is a sum over rows, so while a chunk's softmax is at
hand its rows' gradient with respect to the logits, softmax − one-hot (times 1/count for the
mean), is complete but for the scalar that backward brings. It is pushed through the head at
once, into the gradient of the hidden states (rows, d) and float32 gradients of the head's
weight and bias; backward only scales those. The matrix products are the plain loss's three
(forward, input and weight gradient), in the same dtypes, and a tied head (the embedding's
weight) gets its share like any other input of an autograd function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

LOSS_CHUNK_BYTES = 128 * 2**20
"""The size of one chunk's float32 logits: 128 MiB, 667 rows at V = 50,257. A chunk's work
lives in about three times this (its logits in the compute dtype, in float32, and their
gradient)."""

REDUCTIONS = ("mean", "sum", "none")


def chunk_rows(vocab_size: int) -> int:
    """Rows per chunk: as many as keep their float32 logits within ``LOSS_CHUNK_BYTES``, at
    least one."""
    return max(1, LOSS_CHUNK_BYTES // (4 * vocab_size))


def linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                         reduction: str = "mean", ignore_index: int = -100,
                         rows: int | None = None) -> Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, ...)`` for hidden
    (N, d), weight (V, d) and targets (N,) int64, ``rows`` rows at a time (default
    ``chunk_rows(V)``). Targets equal to ``ignore_index`` count for nothing, as there.
    ``reduction``: mean over the counted rows, sum, or none: (N,) float32 (0 where ignored;
    without a gradient, for scoring)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not one of {', '.join(REDUCTIONS)}")
    rows = chunk_rows(weight.size(0)) if rows is None else rows
    dtype = (torch.get_autocast_dtype(hidden.device.type)
             if torch.is_autocast_enabled(hidden.device.type) else weight.dtype)
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        if reduction == "none":
            raise ValueError("reduction='none' is for scoring: it has no gradient; use 'sum' "
                             "or 'mean' to train")
        return _LinearCrossEntropy.apply(hidden, weight, bias, targets, reduction,
                                         ignore_index, rows, dtype)
    nll, _ = _chunked(hidden, weight, bias, targets, ignore_index, rows, dtype, None)
    return _reduce(nll, targets != ignore_index, reduction)


def _reduce(nll: Tensor, counted: Tensor, reduction: str) -> Tensor:
    if reduction == "sum":
        return nll.sum()
    if reduction == "mean":
        return nll.sum() / counted.sum()
    return nll


def _chunked(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
             ignore_index: int, rows: int, dtype: torch.dtype, row_scale: Tensor | None
             ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor | None] | None]:
    """Per-row nll (N,) float32 and, with ``row_scale`` (N,) (each row's weight in the loss),
    the gradients of sum(row_scale · nll) with respect to hidden, weight and bias."""
    device_type = hidden.device.type
    counted = targets != ignore_index
    safe = torch.where(counted, targets, 0)  # ignored rows gather a real column, then count 0
    w = weight.to(dtype)
    b = None if bias is None else bias.to(dtype)
    nll = torch.empty(hidden.size(0), dtype=torch.float32, device=hidden.device)
    grads = None
    if row_scale is not None:
        grads = (torch.empty_like(hidden), torch.zeros_like(weight, dtype=torch.float32),
                 None if bias is None else torch.zeros_like(bias, dtype=torch.float32))
    with torch.autocast(device_type, enabled=False):  # the dtypes are chosen here
        for start in range(0, hidden.size(0), rows):
            stop = min(start + rows, hidden.size(0))
            h, t = hidden[start:stop].to(dtype), safe[start:stop, None]  # (r, d), (r, 1)
            logits = F.linear(h, w, b).float()  # (r, V): the only tensor of V columns
            lse = torch.logsumexp(logits, dim=-1)  # (r,)
            nll[start:stop] = torch.where(counted[start:stop],
                                          lse - logits.gather(1, t)[:, 0], 0.0)
            if grads is None:
                continue
            probs = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            probs.scatter_add_(1, t, torch.full_like(probs[:, :1], -1.0))  # - one-hot
            g = probs.mul_(row_scale[start:stop, None]).to(dtype)  # d loss / d logits (r, V)
            grads[0][start:stop] = g @ w
            grads[1].add_(g.t() @ h)
            if grads[2] is not None:
                grads[2].add_(g.sum(0))
    return nll, grads


class _LinearCrossEntropy(torch.autograd.Function):
    """The chunked loss with its gradients computed in forward (``_chunked``); backward scales
    them by the incoming gradient."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                reduction: str, ignore_index: int, rows: int, dtype: torch.dtype) -> Tensor:
        counted = targets != ignore_index
        row_scale = counted.float()
        if reduction == "mean":
            row_scale = row_scale / counted.sum()
        nll, grads = _chunked(hidden, weight, bias, targets, ignore_index, rows, dtype,
                              row_scale)
        ctx.save_for_backward(*grads[:2], grads[2])
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return _reduce(nll, counted, reduction)

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        weight_dtype, bias_dtype = ctx.dtypes
        return (grad_hidden * grad_loss.to(grad_hidden.dtype),
                (grad_weight * grad_loss).to(weight_dtype),
                None if grad_bias is None else (grad_bias * grad_loss).to(bias_dtype),
                None, None, None, None, None)


def next_token_loss(logits: Tensor, tokens: Tensor, reduction: str = "mean") -> Tensor:
    """Cross-entropy of logits (B, P, V) for the last P inputs of ``tokens`` (B, T + 1), whose
    targets are the last P tokens; computed in float32. For logits already at hand: training
    and scoring reach the loss through ``LanguageModel.forward(..., targets=...)``, which never
    holds them."""
    targets = tokens[:, tokens.size(1) - logits.size(1):]  # (B, P)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                           reduction=reduction)
