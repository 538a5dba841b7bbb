"""The Sparse Transformer (Child et al., 2019): factorised attention within the window N (SPEC
§3b ``sparse_transformer``).

Two patterns, each a mask predicate on absolute positions, with ``stride`` ℓ (default ⌈√N⌉):

- ``strided`` (the default): heads 0 .. H/2 − 1 see the last ℓ positions, q − ℓ < kv ≤ q;
  heads H/2 .. H − 1 every position ℓ apart, kv ≤ q with (q − kv) mod ℓ = 0;
- ``fixed`` (``sparse_pattern: fixed``): every head sees its own block of ℓ positions up to q,
  q // ℓ = kv // ℓ, and the last ``summary_len`` c positions of every earlier block,
  kv mod ℓ ≥ ℓ − c (default c = max(1, ℓ // 16)).

At ℓ = √N a query sees about √N positions of each kind: O(N·√N) entries over the window (the
cost ``ecp complexity`` counts). Kernels: ``flash`` runs either pattern in O(N·√N): the strided
one's local heads as a sliding window (blocks of ℓ against their previous block), its strided
heads as causal attention within each residue class mod ℓ (the rows regrouped so that a class is
contiguous); the fixed one as each block of ℓ against itself and the summary positions of the
blocks before the last (c per block: O(N·c·N/ℓ)). ``mask`` runs the predicate densely for either
(one scaled-dot-product call with the boolean mask, O(N²)), as the reference does; FlexAttention
runs it blockwise. Like the transformer, the model reads windows of at most N and decodes from a
cache of the window, the predicate applied to the positions it holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ecp_lm.model.archs.base import ArchConfig
from ecp_lm.model.archs.transformer import Transformer
from ecp_lm.model.kernels.masks import materialize
from ecp_lm.model.kernels.sdpa import paired_blocks_attention
from ecp_lm.model.rows import Rows


@dataclass(frozen=True)
class StridedMask:
    """Heads below H/2: the last ``stride`` positions; the others: every ``stride``-th."""

    stride: int
    n_heads: int
    per_head: ClassVar[bool] = True

    def __call__(self, q: Tensor, kv: Tensor, head: Tensor) -> Tensor:
        local = q - kv < self.stride
        strided = (q - kv) % self.stride == 0
        return (kv <= q) & torch.where(head < self.n_heads // 2, local, strided)


@dataclass(frozen=True)
class FixedMask:
    """The query's own block of ``stride`` positions, and the last ``summary_len`` positions
    of every block."""

    stride: int
    summary_len: int
    per_head: ClassVar[bool] = False

    def __call__(self, q: Tensor, kv: Tensor) -> Tensor:
        own = q // self.stride == kv // self.stride
        summary = kv % self.stride >= self.stride - self.summary_len
        return (kv <= q) & (own | summary)


class SparseTransformer(Transformer):
    kernels = ("flash", "mask")
    size_fields = ("stride", "summary_len")
    options = ("sparse_pattern",)
    global_attention = False

    @classmethod
    def sizes(cls, cfg: ArchConfig) -> tuple[str, ...]:
        return ("stride", "summary_len") if cfg.sparse_pattern == "fixed" else ("stride",)

    @classmethod
    def defaults(cls, cfg: ArchConfig) -> dict[str, Any]:
        out: dict[str, Any] = {}
        stride = cfg.stride if cfg.stride is not None else math.isqrt(cfg.seq_len - 1) + 1
        if cfg.stride is None:
            out["stride"] = stride
        if cfg.sparse_pattern == "fixed" and cfg.summary_len is None:
            out["summary_len"] = max(1, stride // 16)
        return out

    @classmethod
    def check(cls, cfg: ArchConfig) -> None:
        super().check(cfg)
        if cfg.stride > cfg.seq_len:
            raise ValueError(f"stride={cfg.stride} is longer than the window "
                             f"seq_len={cfg.seq_len}")
        if cfg.sparse_pattern == "fixed" and cfg.summary_len > cfg.stride:
            raise ValueError(f"summary_len={cfg.summary_len} is more than a block: "
                             f"stride={cfg.stride}")

    def __init__(self, cfg: ArchConfig):
        super().__init__(cfg)
        c = self.cfg
        self.mask = (FixedMask(c.stride, c.summary_len) if c.sparse_pattern == "fixed"
                     else StridedMask(c.stride, c.n_heads))

    def layer_cost(self, layer: int) -> tuple[int | float, int | float]:
        # Entries per query q (0-based): strided, min(q + 1, ℓ) for the local heads and
        # q // ℓ + 1 for the others (the mean over heads); fixed, q mod ℓ + 1 in its block and
        # c in each of the q // ℓ blocks before. Tiles, of the ``flash`` kernel: the local heads'
        # blocks of ℓ against their previous block and themselves, the strided heads' ℓ
        # residue classes of ⌈N/ℓ⌉ rows, each a whole square; the fixed pattern's blocks of ℓ,
        # each against itself and the c summary positions of every block before the last.
        n, c = self.cfg.seq_len, self.cfg
        stride = c.stride
        if c.sparse_pattern == "fixed":
            entries = sum(q % stride + 1 + (q // stride) * c.summary_len for q in range(n))
            summaries = (-(-n // stride) - 1) * c.summary_len
            return entries, sum(r * (r + summaries)
                                for r in (min(stride, n - s) for s in range(0, n, stride)))
        half = c.n_heads // 2
        local = (sum(min(q + 1, stride) for q in range(n)),
                 sum(r * (r + (stride if start else 0))
                     for start, r in ((s, min(stride, n - s)) for s in range(0, n, stride))))
        strided = (sum(q // stride + 1 for q in range(n)), stride * (-(-n // stride)) ** 2)
        return tuple(_mean(half * a + (c.n_heads - half) * b, c.n_heads)
                     for a, b in zip(local, strided, strict=True))

    def auto_kernels(self, dropout_p: float, q: Tensor) -> tuple[str, ...]:
        return self.kernels

    def attend(self, q: Tensor, k: Tensor, v: Tensor, rows: Rows, dropout_p: float,
               kernel: str) -> Tensor:
        if kernel == "flash" and not len(rows.history):
            t, rq = k.size(2), q.size(2)
            q = F.pad(q, (0, 0, t - rq, 0))  # queries at every row; the first t - rq unread
            stride = self.cfg.stride
            if isinstance(self.mask, FixedMask):
                out = summary_attention(q, k, v, stride, self.cfg.summary_len, dropout_p)
                return out[:, :, t - rq:]
            half = q.size(1) // 2
            local = paired_blocks_attention(q[:, :half], k[:, :half], v[:, :half], stride,
                                            _window_pairs(stride, q.device), dropout_p)
            strided = residue_attention(q[:, half:], k[:, half:], v[:, half:], stride,
                                        dropout_p)
            return torch.cat([local, strided], dim=1)[:, :, t - rq:]
        kv_pos = rows.positions(q.device)
        allowed = materialize(self.mask, kv_pos[len(rows) - q.size(2):], kv_pos, q.size(1))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p)


def _mean(total: int, count: int) -> int | float:
    """total / count, an int when exact."""
    return total // count if total % count == 0 else total / count


def _window_pairs(w: int, device: torch.device) -> Tensor:
    """(w, 2w): query i of a block of w sees keys i + 1 .. i + w of [previous block, own]."""
    row = torch.arange(w, device=device)[:, None]
    col = torch.arange(2 * w, device=device)[None, :]
    return (col > row) & (col <= row + w)


def residue_attention(q: Tensor, k: Tensor, v: Tensor, stride: int, dropout_p: float = 0.0
                      ) -> Tensor:
    """Causal attention of each row to the rows ``stride`` apart before it: rows (B, H, T, D)
    padded to whole strides and regrouped so that each residue class mod ``stride`` is one
    sequence of T / stride rows, then causal attention within each, O(T·T/stride)."""
    b, h, t, d = q.shape
    pad = -t % stride

    def grouped(x: Tensor) -> Tensor:  # (B, H, T', D) -> (B, H, stride, T'/stride, D)
        x = F.pad(x, (0, 0, 0, pad))
        return x.view(b, h, -1, stride, d).transpose(2, 3)

    out = F.scaled_dot_product_attention(grouped(q), grouped(k), grouped(v),
                                         dropout_p=dropout_p, is_causal=True)
    return out.transpose(2, 3).reshape(b, h, t + pad, d)[:, :, :t]


def summary_attention(q: Tensor, k: Tensor, v: Tensor, stride: int, summary_len: int,
                      dropout_p: float = 0.0) -> Tensor:
    """The fixed pattern over rows (B, H, T, D) from position 0: each block of ``stride`` rows
    causally within itself and, beside it, the last ``summary_len`` rows of every earlier block
    (the summaries of every block but the last, masked per block): one SDPA call batched over
    blocks, O(T·(stride + summaries))."""
    b, h, t, d = q.shape
    pad = -t % stride
    q, k, v = (F.pad(x, (0, 0, 0, pad)).view(b, h, -1, stride, d) for x in (q, k, v))
    blocks = q.size(2)
    pos = torch.arange((blocks - 1) * stride, device=q.device)
    cols = pos[pos % stride >= stride - summary_len]  # (n,) summary positions
    n = len(cols)

    def keys(x: Tensor) -> Tensor:  # (B, H, S, n + stride, D): the summaries, then the block
        summary = x.view(b, h, -1, d)[:, :, cols]
        return torch.cat([summary[:, :, None].expand(b, h, blocks, n, d), x], dim=3)

    earlier = (cols // stride)[None, :] < torch.arange(blocks, device=q.device)[:, None]
    own = torch.ones(stride, stride, dtype=torch.bool, device=q.device).tril()
    mask = torch.cat([earlier[:, None, :].expand(blocks, stride, n),
                      own.expand(blocks, stride, stride)], dim=-1)  # (S, stride, n + stride)
    out = F.scaled_dot_product_attention(q, keys(k), keys(v), attn_mask=mask,
                                         dropout_p=dropout_p)
    return out.reshape(b, h, -1, d)[:, :, :t]
