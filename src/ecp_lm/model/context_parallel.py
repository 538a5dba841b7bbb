"""Context parallelism: one long sequence split across ranks, with a one-neighbour halo exchange.

Ring attention rotates every rank's keys and values around all ranks. A band pattern needs far
less: a query at position t sees keys from lo(t) on, never further back than a fixed reach, so a
rank that holds consecutive positions needs only the last few keys and values of its left
neighbour, per layer: its *halo* (``Architecture.halo_len``; ECP: one segment of m positions,
whatever the sequence length).

A window of T tokens is cut into K contiguous shards of T / K positions, shard r at absolute
positions r·T/K .. (r + 1)·T/K - 1 on rank r of the context group. In every layer each rank sends
the last ``halo_len`` rows of its keys (after RoPE, at their absolute positions) and values to the
next rank and receives the previous rank's, which it prepends to its own; the backward pass
returns the halo's gradients to the rank they came from. Rank 0 receives nothing, exactly as
position 0 has no previous segment in one process. Every other part of the model is per-position,
so each rank's logits equal the matching slice of the one-process logits.

Loss and gradients: each rank takes the mean next-token loss over its shard's targets (T / K per
row, the last one being the next shard's first token: ``ContextGroup.shard`` gives each rank
T / K + 1 tokens); the window's mean is the mean of the K shard means, and the gradient of it is
the mean of the ranks' gradients, which is what DDP computes over the ranks (``average_gradients``
does the same by hand).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ecp_lm.model.rows import Rows


@dataclass(frozen=True)
class ContextGroup:
    """This rank's place in a context-parallel group of K ranks that share one window."""

    ranks: tuple[int, ...]
    """Global ranks of the group, in sequence order (shard r on ``ranks[r]``)."""
    index: int
    """This rank's shard, 0 .. K - 1."""
    group: dist.ProcessGroup | None = None
    """The process group of ``ranks`` (None: the default group, when it is exactly ``ranks``)."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    @classmethod
    def of(cls, group: dist.ProcessGroup | None = None) -> ContextGroup:
        """The context group ``group`` (default: every rank), from this rank's point of view."""
        ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        return cls(ranks, ranks.index(dist.get_rank()), group)

    def shard(self, tokens: Tensor) -> tuple[Tensor, int]:
        """tokens (B, T + 1), a window and its last target -> (this rank's T / K + 1 tokens, the
        absolute position of its first one). T must split into K equal shards (the model checks
        the rest: ``LanguageModel.check_context``)."""
        t = tokens.size(1) - 1
        if t % self.size:
            raise ValueError(f"T={t} does not split into K={self.size} equal shards")
        length = t // self.size
        start = self.index * length
        return tokens[:, start:start + length + 1], start

    def extend(self, k: Tensor, v: Tensor, rows: Rows, halo_len: int
               ) -> tuple[Tensor, Tensor, Rows]:
        """Keys and values (B, H, R, D) of this shard's ``rows`` -> the same with the previous
        rank's last ``halo_len`` rows prepended (none on rank 0), and the rows they hold."""
        if halo_len == 0 or self.size == 1:
            return k, v, rows
        k, v = HaloExchange.apply(k, v, halo_len, self)
        if self.index == 0:
            return k, v, rows
        return k, v, Rows.span(rows.main.start - halo_len, rows.main.stop)

    # Point-to-point with the neighbours -------------------------------------------------------
    def _neighbour(self, step: int) -> int | None:
        i = self.index + step
        return self.ranks[i] if 0 <= i < self.size else None

    def pass_along(self, outgoing: Tensor, like: Tensor, forward: bool) -> Tensor | None:
        """Send ``outgoing`` to the next rank (``forward``) or the previous one (backward) and
        receive a tensor shaped as ``like`` from the other side (None at the group's end)."""
        send_to, recv_from = (1, -1) if forward else (-1, 1)
        peer_out, peer_in = self._neighbour(send_to), self._neighbour(recv_from)
        ops, incoming = [], None
        if peer_out is not None:
            ops.append(dist.P2POp(dist.isend, outgoing.contiguous(), peer_out, self.group))
        if peer_in is not None:
            incoming = torch.empty_like(like)
            ops.append(dist.P2POp(dist.irecv, incoming, peer_in, self.group))
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        return incoming


class HaloExchange(torch.autograd.Function):
    """(k, v) (B, H, R, D) -> (k, v) with the previous rank's last ``halo_len`` rows of each
    prepended (rank 0: unchanged). Keys and values travel as one (2, B, H, halo_len, D) message.

    Backward: the gradient of the prepended rows goes back to the previous rank, and the gradient
    the next rank returns is added to this rank's last ``halo_len`` rows. Every rank returns its
    outputs (rank 0 too), so every rank runs the backward and the messages pair up layer by layer.
    """

    @staticmethod
    def forward(ctx, k: Tensor, v: Tensor, halo_len: int, group: ContextGroup
                ) -> tuple[Tensor, Tensor]:
        ctx.halo_len, ctx.group = halo_len, group
        last = torch.stack([k[:, :, -halo_len:], v[:, :, -halo_len:]])  # (2, B, H, halo, D)
        halo = group.pass_along(last, last, forward=True)
        if halo is None:
            return k.clone(), v.clone()  # new tensors: autograd outputs may not alias inputs
        return torch.cat([halo[0], k], dim=-2), torch.cat([halo[1], v], dim=-2)

    @staticmethod
    def backward(ctx, grad_k: Tensor, grad_v: Tensor):
        h, group = ctx.halo_len, ctx.group
        grads = torch.stack([grad_k, grad_v])  # (2, B, H, [halo +] R, D)
        if group.index > 0:
            back, grads = grads[..., :h, :], grads[..., h:, :]
        else:
            back = grads[..., :h, :]  # rank 0 sends nothing; the shape is all that matters
        returned = group.pass_along(back, back, forward=False)
        if returned is not None:
            grads = grads.clone()
            grads[..., -h:, :] += returned
        return grads[0], grads[1], None, None


def average_gradients(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Average every parameter's gradient over ``group`` (default: every rank), as DDP would."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)  # a sum: gloo has no average
            p.grad /= dist.get_world_size(group)
