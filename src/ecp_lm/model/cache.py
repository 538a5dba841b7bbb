"""Decoding caches: one small module per layer, a key/value ring for attention (``KVCache``)
and a fixed-size state for a recurrent mixer (``StateCache``).

A cache is a ring of ``capacity`` preallocated slots per batch row: position p lives in slot
``p % capacity`` (sink slots aside, below), and ``pos`` (B, capacity) records which absolute
position every slot holds (-1: empty). A decode step attends over all the slots with the
architecture's own mask predicate on those positions, and nothing else: exact by construction,
and of fixed shape, so that one compiled graph serves every step (no slice grows, no Python
branch reads the cache's state). Rows may stand at different positions (batched prompts of
different lengths, ``stack``).
Several new positions at once (a chunk, ``LanguageModel.hidden_states``) attend, before they
are written, over the keys and values of the ring as it stood before them plus their own: those
positions the architecture's kernel needs from the ring, in order (``prepend``), so that a chunk
of C costs what a forward over it does, O(C·span) time and O(capacity + C) memory, however full
the ring (``Attention._attend_cached``; the whole ring by the mask where rows differ).

The buffers take the dtype the model computes in (``LanguageModel.make_caches``): the
parameters' dtype, or the autocast dtype when generation runs under ``torch.autocast``.

- transformer: capacity N, a plain cache of the whole window;
- ecp: capacity 2m. The next position p (segment s = p // m) sees segment s - 1 and its own
  segment up to p, at most 2m positions, and those are exactly the last 2m written; older slots
  are overwritten. Memory and work per token stay O(L·2m·d) however long the generation runs.
- sliding_window, block_local, s2: rings of w, b and G slots, for the same reason (the
  architecture's ``cache_capacity``: the most positions any of its queries sees).
- sliding_window with ``sink_tokens`` = k: k sink slots before the ring of w. Positions 0 .. k - 1
  live in slots 0 .. k - 1 and are never overwritten; position p >= k lives in slot
  k + (p - k) mod w (``slot``). With k = 0 that is p mod capacity.
- the recurrent mixers (mamba2, gated_deltanet, rwkv7, rwkv4, mamba, mlstm, slstm): no
  key/value slots. A recurrent mixer's cache is its
  state after the last position and the last inputs of its short convolution or token shift
  (RWKV-4's channel mix's too: ``StateCache``): the same bytes at position 10 and at 10⁶.

Both kinds keep the same host-side bookkeeping (``Stream``): per row, the stream's first
position and the position the next write continues at.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


class Stream(nn.Module):
    """Host-side bookkeeping shared by every cache, never read by a decode step: per row, the
    first position written (``origin``) and the position the next write continues at
    (``next_pos``)."""

    def __init__(self, batch_size: int):
        super().__init__()
        self.origin: list[int] = [0] * batch_size
        self.next_pos: list[int] = [0] * batch_size

    @property
    def written(self) -> int:
        """The most positions any row has written."""
        return max(n - o for n, o in zip(self.next_pos, self.origin, strict=True))

    def start_at(self, origin: int) -> None:
        """Let an empty cache hold a stream whose first position is ``origin``."""
        if self.written:
            raise ValueError("start_at needs an empty cache")
        self.origin = [origin] * len(self.origin)
        self.next_pos = [origin] * len(self.next_pos)

    def advance(self, count: int = 1) -> None:
        """Record, host-side, that every row wrote ``count`` more positions (a decode step: 1)."""
        self.next_pos = [p + count for p in self.next_pos]

    def _keep_rows(self, rows: list[int]) -> None:
        self.origin = [self.origin[r] for r in rows]
        self.next_pos = [self.next_pos[r] for r in rows]

    def _rows_of(self, caches: Sequence[Stream]) -> None:
        self.origin = [p for c in caches for p in c.origin]
        self.next_pos = [p for c in caches for p in c.next_pos]


class KVCache(Stream):
    def __init__(self, batch_size: int, n_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 sinks: int = 0):
        super().__init__(batch_size)
        if not 0 <= sinks < capacity:
            raise ValueError(f"sinks={sinks} must lie in 0..capacity-1={capacity - 1}")
        shape = (batch_size, n_heads, capacity, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device),
                             persistent=False)
        # Absolute position held by each slot of each row; -1 = empty.
        self.register_buffer("pos", torch.full((batch_size, capacity), -1, dtype=torch.long,
                                               device=device), persistent=False)
        self.capacity = capacity
        self.sinks = sinks
        """Leading slots that hold positions 0 .. sinks - 1 for good (attention sinks)."""
        self.ring = capacity - sinks
        """Slots that hold the latest positions from ``sinks`` on, overwritten in turn."""

    @property
    def filled(self) -> int:
        """Slots in use: the most positions any row has written, up to the capacity."""
        return min(self.capacity, self.written)

    def slots_in_use(self, ahead: int = 0) -> int:
        """How many leading slots hold every position written, and ``ahead`` more per row: an
        eager decode step attends over only those (``decode_step(span=...)``); the whole ring
        once it has wrapped, or for a stream that did not start at position 0."""
        if any(self.origin):
            return self.capacity
        return min(self.capacity, max(self.next_pos) + ahead)

    def nbytes(self, used_only: bool = False) -> int:
        """Bytes of the key and value buffers (only the filled slots if ``used_only``)."""
        slots = self.filled if used_only else self.capacity
        return 2 * self.k[:, :, :slots].numel() * self.k.element_size()

    def slot(self, pos: Tensor) -> Tensor:
        """The slot of each absolute position in ``pos`` (tensor operations only)."""
        if not self.sinks:
            return pos % self.capacity
        return torch.where(pos < self.sinks, pos, self.sinks + (pos - self.sinks) % self.ring)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write keys/values (B, H, R, D) at positions ``input_pos`` (R,), the same in every row,
        continuing the positions written before; keeps the last ``capacity`` (with sink slots:
        the sinks and the last ``ring``). Returns the whole ring: keys, values and the positions
        (B, capacity) their slots hold. Queries of these positions attend before the write
        (``Attention._attend_cached``): a later position's slot may hold one an earlier
        position sees."""
        self.advance(input_pos.numel())
        if self.sinks and input_pos.numel() > self.ring:
            # the sinks and the last ``ring`` positions: each slot written once
            keep = (input_pos < self.sinks) | (input_pos > input_pos[-1] - self.ring)
            input_pos, k, v = input_pos[keep], k[:, :, keep], v[:, :, keep]
        elif input_pos.numel() > self.capacity:
            input_pos, k, v = (input_pos[-self.capacity:], k[:, :, -self.capacity:],
                               v[:, :, -self.capacity:])
        slots = self.slot(input_pos)
        self.k[:, :, slots] = k.to(self.k.dtype)
        self.v[:, :, slots] = v.to(self.v.dtype)
        self.pos[:, slots] = input_pos
        return self.k, self.v, self.pos

    def prepend(self, start: int, stop: int, k: Tensor, v: Tensor
                ) -> tuple[Tensor, Tensor] | None:
        """Keys and values (B, H, R, D) of R positions from ``stop`` on, with those of positions
        ``start`` .. ``stop`` - 1 in front, read from the ring in position order: (B, H,
        stop - start + R, D) in the cache's dtype. The ring holds the last ``ring`` before
        ``stop``; any older ones (which no query from ``stop`` on sees) are zeros. None where a
        row's slots do not hold exactly those positions (not written, or stacked rows that
        differ). Reads ``pos`` back to check: one host sync, for eager chunks only."""
        if not 0 <= start <= stop:
            return None
        first = max(start, stop - self.ring)
        if self.sinks:  # sink slots and the ring: read the slots of first .. stop - 1
            parts = [self.slot(torch.arange(first, stop, device=self.pos.device))]
        else:
            a = first % self.capacity
            b = a + stop - first
            # The positions first .. stop - 1 occupy consecutive slots, wrapping at most once.
            parts = [slice(a, min(b, self.capacity)), slice(0, max(0, b - self.capacity))]
        held = torch.cat([self.pos[:, part] for part in parts], dim=1)  # (B, stop - first)
        expected = torch.arange(first, stop, device=held.device)
        if not torch.equal(held, expected.expand_as(held)):
            return None
        older = k.new_zeros(*k.shape[:2], first - start, k.size(3), dtype=self.k.dtype)

        def joined(ring: Tensor, new: Tensor) -> Tensor:
            return torch.cat([older, *(ring[:, :, part] for part in parts),
                              new.to(ring.dtype)], dim=2)

        return joined(self.k, k), joined(self.v, v)

    def write(self, pos: Tensor, k: Tensor, v: Tensor) -> None:
        """One new position per row: ``pos`` (B,) int64, keys/values (B, H, 1, D). Tensor
        operations only (no host sync, fixed shapes): the decode step's write."""
        rows = torch.arange(pos.numel(), device=pos.device)
        slots = self.slot(pos)
        self.k[rows, :, slots] = k[:, :, 0].to(self.k.dtype)
        self.v[rows, :, slots] = v[:, :, 0].to(self.v.dtype)
        self.pos[rows, slots] = pos

    def select_rows(self, index: Tensor) -> None:
        """Keep the rows ``index`` (B',) int64, in that order (a row may repeat: beam search)."""
        rows = index.tolist()
        at = index.to(self.k.device)
        self.k, self.v, self.pos = self.k[at], self.v[at], self.pos[at]
        self._keep_rows(rows)

    @classmethod
    def stack(cls, caches: Sequence[KVCache]) -> KVCache:
        """One cache whose rows are the rows of ``caches`` (each filled on its own, for example
        prompts of different lengths prefilled one by one); rows keep their own positions."""
        first = caches[0]
        _, heads, capacity, head_dim = first.k.shape
        out = cls(sum(c.k.size(0) for c in caches), heads, capacity, head_dim, first.k.dtype,
                  first.k.device, first.sinks)
        out.k.copy_(torch.cat([c.k for c in caches]))
        out.v.copy_(torch.cat([c.v for c in caches]))
        out.pos.copy_(torch.cat([c.pos for c in caches]))
        out._rows_of(caches)
        return out


class StateCache(Stream):
    """A recurrent mixer's decoding cache: named state tensors of fixed shapes, each (B, ...),
    holding what the mixer needs of every position written so far (its recurrent state, the
    last inputs of its short convolutions or token shift). Its size does not depend on the
    position. The mixer reads and replaces them (``read``, ``write``: in place, so a compiled
    decode step is one graph)."""

    capacity = 0
    """No key/value slots."""

    def __init__(self, batch_size: int, shapes: dict[str, tuple[int, ...]],
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__(batch_size)
        self.names = tuple(shapes)
        for name, shape in shapes.items():
            self.register_buffer(name, torch.zeros((batch_size, *shape), dtype=dtype,
                                                   device=device), persistent=False)

    @property
    def filled(self) -> int:
        """Positions written: the most of any row (the state holds all of them)."""
        return self.written

    def read(self, name: str) -> Tensor:
        return getattr(self, name)

    def write(self, name: str, value: Tensor) -> None:
        """Replace state ``name`` by ``value`` (cast to the cache's dtype), in place."""
        getattr(self, name).copy_(value)

    def slots_in_use(self, ahead: int = 0) -> int:
        return 0

    def nbytes(self, used_only: bool = False) -> int:
        """Bytes of the state tensors: the same whatever the position."""
        return sum(self.read(n).numel() * self.read(n).element_size() for n in self.names)

    def select_rows(self, index: Tensor) -> None:
        """Keep the rows ``index`` (B',) int64, in that order (a row may repeat: beam search)."""
        for name in self.names:
            setattr(self, name, self.read(name)[index.to(self.read(name).device)])
        self._keep_rows(index.tolist())

    @classmethod
    def stack(cls, caches: Sequence[StateCache]) -> StateCache:
        """One cache whose rows are the rows of ``caches``, each row at its own position."""
        first = caches[0]
        shapes = {n: tuple(first.read(n).shape[1:]) for n in first.names}
        out = cls(sum(len(c.origin) for c in caches), shapes, first.read(first.names[0]).dtype,
                  first.read(first.names[0]).device)
        for name in first.names:
            out.write(name, torch.cat([c.read(name) for c in caches]))
        out._rows_of(caches)
        return out


Cache = KVCache | StateCache
"""A layer's decoding cache."""


def stack_caches(caches: Sequence[Cache]) -> Cache:
    """One layer's caches of several batches, stacked into one (their rows in order)."""
    return type(caches[0]).stack(caches)


def decode_span(caches: Sequence[Cache]) -> int:
    """The ``span`` of an eager decode step over one model's caches: the leading slots in use
    after it in the largest of them (``slots_in_use(ahead=1)``). Each layer reads the first
    ``span`` slots of its own ring, all of them where its ring is smaller (a hybrid's layers
    have rings of different capacities)."""
    return max(cache.slots_in_use(ahead=1) for cache in caches)
