"""The Compressive Transformer (Rae et al., 2020): attention over the segment, a memory of the
layer's previous inputs and a compressed memory of older ones (SPEC §3d ``compressive``).

Positions are cut into segments of m = N / S from position 0, processed in order. In layer ℓ,
with u the layer's (normed) inputs, a query at position q of the segment that starts at
a = q − q mod m attends, by softmax over all of them at once, to

- its own segment up to q: keys and values of u_a .. u_q;
- the memory (§3, TransformerXL's): the previous n_m = ``memory_len`` inputs, u_{a − n_m} ..
  u_{a − 1}, their gradient stopped (keys W_k·sg(u), so W_k learns from them, u does not);
- the compressed memory: n_cm = n_m slots just before the memory, slot g the compression of
  positions g·c .. g·c + c − 1 (c = ``compression_rate``), slots (a − n_m)/c − n_cm ..
  (a − n_m)/c − 1. The compression is the paper's mean pooling (§3.1 lists it beside the
  convolutions; the attention-reconstruction loss that trains a convolution is not used): a
  slot's key and value are the means of sg(u)'s over its c positions (the projections are
  linear), rotated at its last position.

The paper's FIFO gives exactly this: each new segment evicts the memory's oldest m inputs into
m / c compressed slots. So ``chunked`` runs a whole window at once, each segment's queries
against [its n_cm slots, its n_m memory rows, itself] in one SDPA call batched over segments
(O(N·(m + n_m + n_cm))); ``reference`` runs the same one position at a time from the state.
Decoding keeps the last n_m + m keys and values and the n_cm slots (unrotated): constant memory
however long the stream, and exact.

Deviations forced by the skeleton: RoPE at absolute positions (``rope``) instead of
TransformerXL's relative encodings, and mean pooling as the compression function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ecp_lm.model.archs.base import ArchConfig, Architecture
from ecp_lm.model.archs.recurrent import PositionedMixer, Recurrent
from ecp_lm.model.cache import StateCache
from ecp_lm.model.rope import RotaryEmbedding, Rotation, rotate


@dataclass(frozen=True)
class CompressiveMask:
    """What q reads, itself or through a slot: kv <= q from the first position of its segment's
    oldest compressed slot on."""

    segment_len: int
    memory_len: int
    compression_rate: int
    per_head: ClassVar[bool] = False

    def __call__(self, q: Tensor, kv: Tensor) -> Tensor:
        m, n_m, c = self.segment_len, self.memory_len, self.compression_rate
        top = (q - q % m - n_m).clamp(min=0) // c
        return (kv <= q) & (kv >= (top - n_m).clamp(min=0) * c)


class Compressive(Recurrent):
    """Attention with a state: the memories a segment sees (``CompressiveAttention``)."""

    kernels = ("chunked",)
    kind = "attention over memories carried in a state"
    has_keys = True  # its attention's keys and values (``tied_kv`` ties them)

    def __init__(self, cfg: ArchConfig):
        super().__init__(cfg)
        c = self.cfg
        self.mask = CompressiveMask(self.segment_len, c.memory_len, c.compression_rate)
    size_fields = ("num_segments", "memory_len", "compression_rate")

    @classmethod
    def defaults(cls, cfg: ArchConfig) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if cfg.memory_len is None:
            out["memory_len"] = cfg.seq_len // cfg.num_segments  # the paper's n_m = n_s
        if cfg.compression_rate is None:
            out["compression_rate"] = 4
        return out

    @classmethod
    def check(cls, cfg: ArchConfig) -> None:
        super().check(cfg)
        n, s, c = cfg.seq_len, cfg.num_segments, cfg.compression_rate
        if n % s:
            raise ValueError(f"seq_len={n} is not divisible by num_segments={s}")
        for name, value in (("segment_len", n // s), ("memory_len", cfg.memory_len)):
            if value % c:
                raise ValueError(f"{name}={value} is not divisible by compression_rate={c}: "
                                 "the memory is compressed c positions to a slot")

    def check_start_pos(self, start_pos: int) -> None:
        if start_pos != 0:
            raise ValueError(f"start_pos={start_pos}: arch={self.cfg.arch!r} cuts its segments "
                             "from position 0, so a stream starts there (a cache continues it "
                             "at any position)")

    def mixer(self, cfg: ArchConfig, layer: int) -> nn.Module:
        return CompressiveAttention(cfg, self, layer)

    def slots(self, a: int) -> range:
        """The compressed slots a query of the segment starting at ``a`` sees."""
        c = self.cfg
        top = max(0, (a - c.memory_len) // c.compression_rate)
        return range(max(0, top - c.memory_len), top)

    def layer_cost(self, layer: int) -> tuple[int, int]:
        # Per query q of the segment from a: q − a + 1 own keys, min(n_m, a) memory rows and its
        # slots. Tiles, of ``chunked``: each segment's rows against all of its keys.
        n, m = self.cfg.seq_len, self.segment_len
        entries = sum(q - q // m * m + 1 + min(self.cfg.memory_len, q // m * m)
                      + len(self.slots(q // m * m)) for q in range(n))
        tiles = sum(r * (r + min(self.cfg.memory_len, a) + len(self.slots(a)))
                    for a, r in ((a, min(m, n - a)) for a in range(0, n, m)))
        return entries, tiles

    def state_bytes(self, dtype_bytes: int = 4) -> int:
        c = self.cfg
        return dtype_bytes * 2 * c.d_model * (c.memory_len + self.segment_len + c.memory_len)

    def mixer_flops(self, seq_len: int) -> float:
        return float(2 * self.cfg.d_model)  # the means of keys and values; attention: entries


class CompressiveAttention(PositionedMixer):
    def __init__(self, cfg: ArchConfig, arch: Compressive, layer: int):
        super().__init__(cfg, arch)
        c = arch.cfg
        d, h = c.d_model, c.n_heads
        self.heads, self.head_dim, self.arch = h, d // h, arch
        self.seg, self.mem, self.rate = arch.segment_len, c.memory_len, c.compression_rate
        self.ring = self.mem + self.seg  # raw rows a query may see: its memory and segment
        self.q_proj, self.k_proj, self.out_proj = (nn.Linear(d, d, bias=False) for _ in range(3))
        # With tied_kv one projection is both keys (before RoPE) and values.
        self.v_proj = None if c.tied_kv else nn.Linear(d, d, bias=False)
        base = Architecture.rope_base(arch, layer)
        self.rotary = None if base is None else RotaryEmbedding(self.head_dim, base)

    @property
    def rope(self) -> RotaryEmbedding | None:
        """Rotates queries and keys at absolute positions; the model computes the rows' angles
        once per forward (``rotation``), the memory's and the slots' are read from them or
        computed here."""
        return self.rotary

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        h, k = self.heads, self.head_dim
        return {"k": (h, self.ring, k), "v": (h, self.ring, k), "ck": (h, self.mem, k),
                "cv": (h, self.mem, k)}

    def mix_at(self, x: Tensor, start: int, state: dict[str, Tensor] | None, kernel: str,
               rotation: Rotation | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Rows x (B, T, d) at positions start .. start + T − 1, after the positions ``state``
        holds: the outputs and the state after them. ``reference``: one segment after the
        other, each from the state the one before left (the paper's order)."""
        if kernel != "reference":
            return self._segments(x, start, state, rotation)
        outs, t = [], 0
        while t < x.size(1):
            stop = min(x.size(1), (start + t) // self.seg * self.seg + self.seg - start)
            part = None if rotation is None else tuple(r[t:stop] for r in rotation)
            y, state = self._segments(x[:, t:stop], start + t, state, part)
            outs.append(y)
            t = stop
        return torch.cat(outs, dim=1), state

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values (B, H, T, K), unrotated."""
        b, t, _ = x.shape

        def heads(y: Tensor) -> Tensor:
            return y.view(b, t, self.heads, self.head_dim).transpose(1, 2)

        k = heads(self.k_proj(x))
        return heads(self.q_proj(x)), k, k if self.v_proj is None else heads(self.v_proj(x))

    def _angles(self, positions: Tensor, dtype: torch.dtype) -> Rotation | None:
        if self.rope is None:
            return None
        return self.rope.rotation(positions.clamp(min=0), dtype, positions.device)

    def _merge(self, out: Tensor) -> Tensor:
        b, _, t, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1))

    def _segments(self, x: Tensor, start: int, state: dict[str, Tensor] | None,
                  rotation: Rotation | None) -> tuple[Tensor, dict[str, Tensor]]:
        b, t, _ = x.shape
        h, dim, m, mem, c, ring = self.heads, self.head_dim, self.seg, self.mem, self.rate, \
            self.ring
        dev, end = x.device, start + t
        q, k, v = self._project(x)
        _, k_sg, v_sg = self._project(x.detach())  # the memory: no gradient into the inputs
        if state is None:
            state = {name: x.new_zeros(b, *shape) for name, shape in self.state_shapes().items()}
        state = {name: s.to(k.dtype) for name, s in state.items()}

        # Raw rows at positions first .. end − 1: the state's, then these.
        first = max(0, start - ring)
        held = torch.arange(first, start, device=dev) % ring
        raw = {name: torch.cat([state[src][:, :, held], new], dim=2) for name, src, new in
               (("k", "k", k), ("v", "v", v), ("k_sg", "k", k_sg), ("v_sg", "v", v_sg))}
        if rotation is None:
            rotation = self._angles(torch.arange(start, end, device=dev), q.dtype)
        if rotation is not None and first < start:
            before = self._angles(torch.arange(first, start, device=dev), q.dtype)
            rotation = tuple(torch.cat(pair) for pair in zip(before, rotation, strict=True))

        def slots(index: Tensor) -> tuple[Tensor, Tensor]:
            """Compressed slots ``index`` (G,): the mean of their rows where these hold them,
            else the state's."""
            rows = (index[:, None] * c - first + torch.arange(c, device=dev))
            rows = rows.clamp(0, end - first - 1)
            fresh = (index * c >= first)[:, None]
            return tuple(torch.where(fresh, raw[raw_name][:, :, rows].mean(-2),
                                     state[kept][:, :, index % mem])
                         for raw_name, kept in (("k_sg", "ck"), ("v_sg", "cv")))

        # The segments these queries fall in, each against [its slots, its memory, itself].
        seg0, seg1 = start // m, (end - 1) // m
        j = seg1 - seg0 + 1
        heads = torch.arange(seg0, seg1 + 1, device=dev)[:, None] * m  # (J, 1): a
        own_pos = heads + torch.arange(m, device=dev)  # (J, m)
        mem_pos = heads - mem + torch.arange(mem, device=dev)  # (J, n_m)
        tops = [max(0, (a * m - mem) // c) for a in (seg0, seg1)]
        lo, hi = max(0, tops[0] - mem), max(0, tops[0] - mem, tops[1])
        top = (heads - mem).clamp(min=0) // c  # (J, 1): the first slot after its slots
        slot_idx = top - mem + torch.arange(mem, device=dev)  # (J, n_cm)
        table = torch.arange(lo, hi, device=dev)
        ck, cv = slots(table)
        keys_live, keys_kept = raw["k"], raw["k_sg"]
        if rotation is not None:
            keys_live, keys_kept = rotate(keys_live, rotation), rotate(keys_kept, rotation)
            fresh = table * c + c - 1 - first
            if first:  # slots older than the rows held: angles of their own
                slot_rot = self._angles(table * c + c - 1, q.dtype)
            else:
                slot_rot = tuple(r[fresh.clamp(0, end - first - 1)] for r in rotation)
            ck = rotate(ck, slot_rot)
            q = rotate(q, tuple(r[start - first:] for r in rotation))
        if hi == lo:  # no slot yet: one of zeros, which the mask hides
            ck, cv = k.new_zeros(b, h, 1, dim), v.new_zeros(b, h, 1, dim)

        def gather(x: Tensor, index: Tensor) -> Tensor:  # (B, H, J, n, K)
            return x[:, :, index.clamp(0, x.size(2) - 1)]

        keys = torch.cat([gather(ck, slot_idx - lo), gather(keys_kept, mem_pos - first),
                          gather(keys_live, own_pos - first)], dim=3)
        values = torch.cat([gather(cv, slot_idx - lo), gather(raw["v_sg"], mem_pos - first),
                            gather(raw["v"], own_pos - first)], dim=3)
        causal = torch.ones(m, m, dtype=torch.bool, device=dev).tril()
        mask = torch.cat([(slot_idx >= 0)[:, None, :].expand(j, m, mem),
                          (mem_pos >= 0)[:, None, :].expand(j, m, mem),
                          causal.expand(j, m, m)], dim=-1)  # (J, m, n_cm + n_m + m)
        queries = F.pad(q, (0, 0, start - seg0 * m, (seg1 + 1) * m - end))
        out = F.scaled_dot_product_attention(queries.view(b, h, j, m, dim), keys, values,
                                             attn_mask=mask)
        out = out.reshape(b, h, j * m, dim)[:, :, start - seg0 * m:][:, :, :t]

        # The state after position end − 1: the last ``ring`` raw rows, and the slots of every
        # segment boundary crossed (the last n_cm of them). The gradient stops at the inputs
        # (``k_sg``), not at the projections.
        new = {}
        latest = torch.arange(max(first, end - ring), end, device=dev)
        for name, src in (("k", "k_sg"), ("v", "v_sg")):
            new[name] = state[name].clone()
            new[name][:, :, latest % ring] = raw[src][:, :, latest - first]
        done = max(0, ((end - 1) // m * m - mem) // c)  # the slots of the last boundary
        index = torch.arange(max(0, done - mem), done, device=dev)
        for name, value in zip(("ck", "cv"), slots(index), strict=True):
            new[name] = state[name].clone()
            new[name][:, :, index % mem] = value
        return self._merge(out), new

    def decode(self, x: Tensor, pos: Tensor, cache: StateCache, span: int | None = None,
               rotation: Rotation | None = None) -> Tensor:
        """One row per batch row at positions ``pos`` (B,), from the cache's state and into it:
        at a segment's first position the memory's oldest segment is compressed first, then
        the row attends over every raw row and slot its segment sees. Tensor operations only
        (one compiled graph for every step)."""
        h, dim, m, mem, c, ring = self.heads, self.head_dim, self.seg, self.mem, self.rate, \
            self.ring
        state = {name: cache.read(name) for name in self.state_shapes()}
        q, k, v = self._project(x)  # (B, H, 1, K)
        dtype, dev, b = state["k"].dtype, x.device, x.size(0)
        rows = torch.arange(b, device=dev)[:, None]
        a = pos - pos % m  # (B,)
        # A boundary: the positions a − n_m − m .. a − n_m − 1 leave the memory as m / c slots.
        evicted = (a - mem - m)[:, None] + torch.arange(m, device=dev)  # (B, m)
        group = (a - mem - m)[:, None] // c + torch.arange(m // c, device=dev)  # (B, m / c)
        keep = (pos % m == 0)[:, None] & (group >= 0)
        at = group % mem
        for raw_name, name in (("k", "ck"), ("v", "cv")):
            rows_of = state[raw_name].transpose(1, 2)[rows, evicted % ring]  # (B, m, H, K)
            means = rows_of.view(b, m // c, c, h, dim).mean(2)  # (B, m / c, H, K)
            slots = state[name].transpose(1, 2)  # (B, n_cm, H, K), a view
            slots[rows, at] = torch.where(keep[..., None, None], means, slots[rows, at])
        for name, value in (("k", k), ("v", v)):
            state[name].transpose(1, 2)[rows[:, 0], pos % ring] = value[:, :, 0].to(dtype)
        # Every raw slot holds the latest position <= pos of its residue; the slots hold the
        # n_cm groups before the memory, each at the one of its residue mod n_cm.
        raw_pos = pos[:, None] - (pos[:, None] - torch.arange(ring, device=dev)) % ring
        top = (a - mem).clamp(min=0) // c
        low = top - mem
        slot_group = low[:, None] + (torch.arange(mem, device=dev) - low[:, None]) % mem
        keys, cmp = state["k"].to(q.dtype), state["ck"].to(q.dtype)
        if self.rope is not None:
            q = rotate(q, rotation if rotation is not None else self._angles(pos[:, None],
                                                                             q.dtype))
            keys = rotate(keys, self._angles(raw_pos, q.dtype))
            cmp = rotate(cmp, self._angles(slot_group * c + c - 1, q.dtype))
        allowed = torch.cat([slot_group >= 0, (raw_pos >= 0) & (raw_pos >= (a - mem)[:, None])],
                            dim=1)  # (B, n_cm + ring)
        out = F.scaled_dot_product_attention(
            q, torch.cat([cmp, keys], dim=2),
            torch.cat([state["cv"], state["v"]], dim=2).to(q.dtype),
            attn_mask=allowed[:, None, None, :])
        return self._merge(out)
