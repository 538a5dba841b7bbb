"""The Routing Transformer (Roy et al., 2021): online k-means routing attention beside local
attention (SPEC §3d ``routing``).

Per layer, heads 0 .. H/2 − 1 are local and heads H/2 .. H − 1 routed (with one head, it is
routed). A local head is a sliding window: q sees the last w = ``window`` positions, rotated by
RoPE at absolute positions. A routed head has one projection for queries and keys (§4: "we share
the query and key projections"): its key k_t is also its query. Each key is routed to the
nearest of k = ``num_clusters`` centroids μ (unit vectors, per layer and head) by the dot
product of k_t / |k_t| with them, and a query attends to keys of its own cluster.

The paper balances clusters by taking the top w keys of each centroid over the whole sequence:
whether a key is in a cluster then depends on the keys after it, which a causal model cannot
read. Here each key joins its nearest centroid, and a query attends to the last w keys of its
cluster up to itself: every query sees at most w keys (the paper's equal cluster size), and
the output at q depends on no later position. Routed heads carry no positions (content routes
them; the local heads carry order).

The centroids are a buffer, frozen in evaluation. In training, each forward records its keys'
per-cluster sums; ``LanguageModel.at_step`` applies them before the next step, μ ← normalise(λμ
+ (1 − λ)·mean of the unit keys assigned), λ = ``CENTROID_DECAY`` (the paper's exponential
moving average). The record is kept with the model, so a resumed run updates as an
uninterrupted one did; with gradient accumulation, the step's last micro-batch is the one
recorded.

``chunked`` runs a window at once: each routed head's rows sorted by (cluster, order), then a
sliding window of w in that order, masked to the same cluster, O(N·w); the local heads as
sliding_window's blocks. ``reference`` runs one position after another from the state.
Decoding keeps, per layer, a ring of the last w local keys and values and, per routed head and
cluster, the last w keys and values with a count: constant memory, exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ecp_lm.model.archs.base import ArchConfig, Architecture
from ecp_lm.model.archs.recurrent import PositionedMixer, Recurrent
from ecp_lm.model.archs.sliding_window import one_window, window_entries
from ecp_lm.model.cache import StateCache
from ecp_lm.model.rope import RotaryEmbedding, Rotation, rotate

CENTROID_DECAY = 0.999
"""λ of the centroids' moving average."""


@dataclass(frozen=True)
class RoutingMask:
    """What q may read: its window on a local head; on a routed head any earlier position (the
    keys of its cluster, which content decides)."""

    window: int
    n_heads: int
    per_head: ClassVar[bool] = True

    def __call__(self, q: Tensor, kv: Tensor, head: Tensor) -> Tensor:
        return (kv <= q) & ((q - kv < self.window) | (head >= self.n_heads // 2))


class Routing(Recurrent):
    """Routing attention with its rings carried in a state (``RoutingAttention``)."""

    kernels = ("chunked",)
    kind = "routing attention over rings carried in a state"
    has_keys = True
    size_fields = ("num_clusters", "window")

    @classmethod
    def defaults(cls, cfg: ArchConfig) -> dict[str, Any]:
        out: dict[str, Any] = {}
        clusters = cfg.num_clusters
        if clusters is None:
            clusters = out["num_clusters"] = math.isqrt(cfg.seq_len - 1) + 1  # the paper's √N
        if cfg.window is None:
            out["window"] = -(-cfg.seq_len // clusters)  # N / k: a balanced cluster
        return out

    @classmethod
    def check(cls, cfg: ArchConfig) -> None:
        one_window(cfg)
        super().check(cfg)

    def __init__(self, cfg: ArchConfig):
        super().__init__(cfg)
        self.mask = RoutingMask(self.cfg.window, self.cfg.n_heads)

    def check_start_pos(self, start_pos: int) -> None:
        if start_pos != 0:
            raise ValueError(f"start_pos={start_pos}: arch={self.cfg.arch!r} keeps its keys in "
                             "rings from a stream's first position, so a stream starts at 0 (a "
                             "cache continues it at any position)")

    def mixer(self, cfg: ArchConfig, layer: int) -> nn.Module:
        return RoutingAttention(cfg, self, layer)

    def layer_cost(self, layer: int) -> tuple[int | float, int | float]:
        # At most min(q + 1, w) keys per query on every head (a routed head's cluster may hold
        # fewer); tiles: blocks of w rows (in position or in cluster order) against their
        # previous block and themselves.
        n, w = self.cfg.seq_len, self.cfg.window
        tiles = sum(r * (r + (w if start else 0))
                    for start, r in ((s, min(w, n - s)) for s in range(0, n, w)))
        return window_entries(n, w), tiles

    def state_bytes(self, dtype_bytes: int = 4) -> int:
        c = self.cfg
        k, h = c.d_model // c.n_heads, c.n_heads
        routed = h - h // 2
        return dtype_bytes * (2 * (h // 2) * c.window * k
                              + routed * c.num_clusters * (2 * c.window * k + 1))

    def mixer_flops(self, seq_len: int) -> float:
        c = self.cfg
        routed = c.n_heads - c.n_heads // 2
        return 2.0 * routed * c.num_clusters * (c.d_model // c.n_heads)  # routing a key


def _wide(x: Tensor) -> Tensor:
    """x in float32 at least (routing compares unit vectors; bf16 would flip near ties)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _window_pairs(w: int, device: torch.device) -> Tensor:
    """(w, 2w): query i of a block of w sees keys i + 1 .. i + w of [previous block, own]."""
    row = torch.arange(w, device=device)[:, None]
    col = torch.arange(2 * w, device=device)[None, :]
    return (col > row) & (col <= row + w)


def blocks_of(x: Tensor, w: int) -> tuple[Tensor, Tensor]:
    """x (..., L, D) padded to whole blocks of w: the blocks (..., S, w, D) and, for each, its
    previous block and itself (..., S, 2w, D), block 0's previous one zeros."""
    pad = -x.size(-2) % w
    blocks = F.pad(x, (0, 0, 0, pad)).unflatten(-2, (-1, w))
    previous = F.pad(blocks[..., :-1, :, :], (0, 0, 0, 0, 1, 0))
    return blocks, torch.cat([previous, blocks], dim=-2)


class RoutingAttention(PositionedMixer):
    def __init__(self, cfg: ArchConfig, arch: Routing, layer: int):
        super().__init__(cfg, arch)
        c = arch.cfg
        d, h = c.d_model, c.n_heads
        self.head_dim, self.local, self.routed = d // h, h // 2, h - h // 2
        self.window, self.clusters = c.window, c.num_clusters
        k = self.head_dim
        self.q_proj = nn.Linear(d, self.local * k, bias=False) if self.local else None
        self.k_proj = nn.Linear(d, d, bias=False)  # the routed heads' queries too
        self.v_proj = None if c.tied_kv else nn.Linear(d, d, bias=False)
        self.out_proj = nn.Linear(d, d, bias=False)
        base = Architecture.rope_base(arch, layer)
        self.rotary = None if base is None or not self.local else RotaryEmbedding(k, base)
        mu = F.normalize(torch.randn(self.routed, self.clusters, k), dim=-1)
        self.register_buffer("centroids", mu, persistent=True)
        self.register_buffer("pending_sum", torch.zeros_like(mu), persistent=True)
        self.register_buffer("pending_count", torch.zeros(self.routed, self.clusters),
                             persistent=True)

    @property
    def rope(self) -> RotaryEmbedding | None:
        """The local heads' rotation (the model computes the rows' angles once per forward)."""
        return self.rotary

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        k, w, n = self.head_dim, self.window, self.clusters
        return {"k": (self.local, w, k), "v": (self.local, w, k),
                "rk": (self.routed, n, w, k), "rv": (self.routed, n, w, k),
                "rn": (self.routed, n)}

    @torch.no_grad()
    def at_step(self, step: int) -> None:
        """Before a training step: the centroids move towards the last step's keys."""
        seen = self.pending_count > 0
        if not seen.any():
            return
        mean = self.pending_sum / self.pending_count.clamp(min=1)[..., None]
        moved = F.normalize(CENTROID_DECAY * self.centroids + (1 - CENTROID_DECAY) * mean, dim=-1)
        self.centroids.copy_(torch.where(seen[..., None], moved, self.centroids))
        self.pending_sum.zero_()
        self.pending_count.zero_()

    # Projections ------------------------------------------------------------------------------
    def _project(self, x: Tensor, pos: Tensor, rotation: Rotation | None
                 ) -> tuple[Tensor | None, Tensor, Tensor, Tensor, Tensor]:
        """x (B, T, d) at positions ``pos``: the local heads' queries, keys and values (B, h, T,
        K), rotated, and the routed heads' keys and values (B, r, T, K)."""
        b, t, _ = x.shape

        def heads(y: Tensor) -> Tensor:
            return y.view(b, t, -1, self.head_dim).transpose(1, 2)

        k = heads(self.k_proj(x))
        v = k if self.v_proj is None else heads(self.v_proj(x))
        lq = None if self.q_proj is None else heads(self.q_proj(x))
        lk, lv = k[:, :self.local], v[:, :self.local]
        if self.rotary is not None:
            if rotation is None:
                rotation = self.rotary.rotation(pos, x.dtype, x.device)
            lq, lk = rotate(lq, rotation), rotate(lk, rotation)
        return lq, lk, lv, k[:, self.local:], v[:, self.local:]

    def route(self, keys: Tensor) -> Tensor:
        """The cluster of each routed key (B, r, T, K) -> (B, r, T): its nearest centroid."""
        unit = F.normalize(_wide(keys.detach()), dim=-1)
        return torch.einsum("brtk,rck->brtc", unit, self.centroids.to(unit.dtype)).argmax(-1)

    def _record(self, keys: Tensor, cluster: Tensor) -> None:
        """In training: this batch's unit keys summed per cluster, for ``at_step``."""
        with torch.no_grad():
            unit = F.normalize(_wide(keys.detach()), dim=-1)  # (B, r, T, K)
            onehot = F.one_hot(cluster, self.clusters).to(unit.dtype)  # (B, r, T, n)
            self.pending_sum.copy_(torch.einsum("brtc,brtk->rck", onehot, unit))
            self.pending_count.copy_(onehot.sum((0, 2)))

    # Forward -----------------------------------------------------------------------------------
    def mix_at(self, x: Tensor, start: int, state: dict[str, Tensor] | None, kernel: str,
               rotation: Rotation | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Rows x (B, T, d) at positions start .. start + T − 1 after the positions ``state``
        holds: the outputs and the state after them."""
        b, t, _ = x.shape
        if state is None:
            state = {name: x.new_zeros(b, *shape) for name, shape in self.state_shapes().items()}
        pos = torch.arange(start, start + t, device=x.device)
        lq, lk, lv, rk, rv = self._project(x, pos, rotation)
        cluster = self.route(rk)
        if self.training and torch.is_grad_enabled():
            self._record(rk, cluster)
        if kernel == "reference":
            outs = []
            for i in range(t):
                one = slice(i, i + 1)
                out, state = self._step(None if lq is None else lq[:, :, one], lk[:, :, one],
                                        lv[:, :, one], rk[:, :, one], rv[:, :, one],
                                        cluster[:, :, one], pos[one].expand(b), state)
                outs.append(out)
            out = torch.cat(outs, dim=2)
        else:
            out, state = self._chunk(lq, lk, lv, rk, rv, cluster, start, state)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1)), state

    def _chunk(self, lq: Tensor | None, lk: Tensor, lv: Tensor, rk: Tensor, rv: Tensor,
               cluster: Tensor, start: int, state: dict[str, Tensor]
               ) -> tuple[Tensor, dict[str, Tensor]]:
        t = rk.size(2)
        w, n, dev = self.window, self.clusters, rk.device
        dtype = rk.dtype
        new = {}
        outs = []
        # Local heads: the ring's last w − 1 positions before ``start``, then these rows; a
        # sliding window of w from the first of them.
        if self.local:
            first = max(0, start - (w - 1))
            held = torch.arange(first, start, device=dev) % w
            keys = torch.cat([state["k"][:, :, held].to(dtype), lk], dim=2)
            values = torch.cat([state["v"][:, :, held].to(dtype), lv], dim=2)
            queries = F.pad(lq, (0, 0, start - first, 0))
            q_blocks, _ = blocks_of(queries, w)
            _, k_pairs = blocks_of(keys, w)
            _, v_pairs = blocks_of(values, w)
            mask = _window_pairs(w, dev).expand(q_blocks.size(2), w, 2 * w).clone()
            mask[0, :, :w] = False
            out = F.scaled_dot_product_attention(q_blocks, k_pairs, v_pairs, attn_mask=mask)
            outs.append(out.flatten(2, 3)[:, :, start - first:start - first + t])
            latest = torch.arange(max(first, start + t - w), start + t, device=dev)
            for name, src in (("k", keys), ("v", values)):
                new[name] = state[name].to(dtype).clone()
                new[name][:, :, latest % w] = src[:, :, latest - first]
        # Routed heads: the rings' keys (oldest first) and these rows, sorted by (cluster,
        # order); each row against the w rows before it in that order, in its cluster.
        count = state["rn"].long()  # (B, r, n)
        slot = torch.arange(w, device=dev)
        age = (slot - count[..., None]) % w  # 0: the oldest of a full ring
        filled = slot < count[..., None].clamp(max=w)  # (B, r, n, w)
        order = torch.where(filled, age - w, torch.full_like(age, -2 * w))  # before any row
        ring_cluster = torch.where(filled, torch.arange(n, device=dev)[:, None], -1)
        all_cluster = torch.cat([ring_cluster.flatten(2), cluster], dim=2)  # (B, r, L)
        all_order = torch.cat([order.flatten(2), torch.arange(t, device=dev).expand_as(cluster)],
                              dim=2)
        sort_key = (all_cluster + 1) * (t + 3 * w) + all_order + 2 * w
        perm = sort_key.argsort(dim=-1)  # (B, r, L)
        keys = torch.cat([state["rk"].to(dtype).flatten(2, 3), rk], dim=2)
        values = torch.cat([state["rv"].to(dtype).flatten(2, 3), rv], dim=2)

        def sort(x: Tensor) -> Tensor:
            return x.gather(2, perm[..., None].expand_as(x)) if x.dim() == 4 else x.gather(2, perm)

        s_keys, s_values, s_cluster = sort(keys), sort(values), sort(all_cluster)
        q_blocks, k_pairs = blocks_of(s_keys, w)
        _, v_pairs = blocks_of(s_values, w)
        c_blocks, c_pairs = blocks_of(s_cluster[..., None].float(), w)
        same = c_blocks == c_pairs.transpose(-1, -2)  # (B, r, S, w, 2w)
        pair = _window_pairs(w, dev)
        diagonal = torch.zeros_like(pair)
        diagonal[:, w:] = torch.eye(w, dtype=torch.bool, device=dev)
        mask = (pair & same & (c_blocks >= 0)) | diagonal  # a padding row sees itself
        mask[..., 0, :, :w] = False
        out = F.scaled_dot_product_attention(q_blocks, k_pairs, v_pairs, attn_mask=mask)
        sorted_out = out.flatten(2, 3)[:, :, :perm.size(-1)]
        unsorted = torch.empty_like(sorted_out).scatter(
            2, perm[..., None].expand_as(sorted_out), sorted_out)
        outs.append(unsorted[:, :, n * w:])
        # The rings after these rows: each cluster's last w of them written in turn.
        onehot = F.one_hot(cluster, n)  # (B, r, T, n)
        rank = (onehot.cumsum(2) * onehot).sum(-1) - 1  # (B, r, T): its place in its cluster
        total = onehot.sum(2)  # (B, r, n)
        kept = rank >= total.gather(2, cluster) - w  # the last w of each cluster
        where = (count.gather(2, cluster) + rank) % w  # (B, r, T)
        new["rn"] = (count + total).to(state["rn"].dtype)
        target = torch.where(kept, cluster * w + where, n * w)  # the others: a spare slot
        for name, src in (("rk", rk), ("rv", rv)):
            ring = F.pad(state[name].to(dtype).flatten(2, 3), (0, 0, 0, 1))  # (B, r, n·w + 1, K)
            ring = ring.scatter(2, target[..., None].expand_as(src), src)
            new[name] = ring[:, :, :n * w].unflatten(2, (n, w))
        return torch.cat(outs, dim=1), new

    def _step(self, lq: Tensor | None, lk: Tensor, lv: Tensor, rk: Tensor, rv: Tensor,
              cluster: Tensor, pos: Tensor, state: dict[str, Tensor]
              ) -> tuple[Tensor, dict[str, Tensor]]:
        """One row per batch row at positions ``pos`` (B,): written into the rings, then
        attending over them (tensor operations only)."""
        b, dev, w = rk.size(0), rk.device, self.window
        dtype = rk.dtype
        rows = torch.arange(b, device=dev)
        outs, new = [], {}
        if self.local:
            slot = pos % w
            for name, value in (("k", lk), ("v", lv)):
                ring = state[name].to(dtype).clone()
                ring[rows, :, slot] = value[:, :, 0]
                new[name] = ring
            held = pos[:, None] - (pos[:, None] - torch.arange(w, device=dev)) % w  # (B, w)
            outs.append(F.scaled_dot_product_attention(
                lq, new["k"], new["v"], attn_mask=(held >= 0)[:, None, None, :]))
        c = cluster[:, :, 0]  # (B, r)
        heads = torch.arange(self.routed, device=dev)
        count = state["rn"].clone()
        n_c = count[rows[:, None], heads, c].long()  # (B, r)
        for name, value in (("rk", rk), ("rv", rv)):
            ring = state[name].to(dtype).clone()
            ring[rows[:, None], heads, c, n_c % w] = value[:, :, 0]
            new[name] = ring
        count[rows[:, None], heads, c] = count[rows[:, None], heads, c] + 1
        new["rn"] = count
        keys = new["rk"][rows[:, None], heads, c]  # (B, r, w, K)
        values = new["rv"][rows[:, None], heads, c]
        valid = torch.arange(w, device=dev) < (n_c + 1).clamp(max=w)[..., None]  # (B, r, w)
        outs.append(F.scaled_dot_product_attention(rk, keys, values,
                                                   attn_mask=valid[:, :, None, :]))
        return torch.cat(outs, dim=1), new

    def decode(self, x: Tensor, pos: Tensor, cache: StateCache, span: int | None = None,
               rotation: Rotation | None = None) -> Tensor:
        state = {name: cache.read(name) for name in self.state_shapes()}
        lq, lk, lv, rk, rv = self._project(x, pos[:, None], rotation)
        out, new = self._step(lq, lk, lv, rk, rv, self.route(rk), pos, state)
        for name, value in new.items():
            cache.write(name, value)
        b = x.size(0)
        return self.out_proj(out.transpose(1, 2).reshape(b, 1, -1))
