"""Recurrent token mixers in place of attention: what mamba2, gated_deltanet and rwkv7 share
(SPEC §3d).

A recurrent architecture keeps the skeleton (embedding, pre-norm blocks, feed-forward, head)
and replaces each block's attention by a mixer of its own (``Recurrent.mixer``): a module that
reads its rows in order and carries a fixed-size state from each position to the next. So:

- the output at position q depends on every position up to q (the "mask" is causal), through
  the state, and on no later one;
- there are no positions in the computation (no RoPE): a window may start anywhere, and any
  input length is accepted;
- decoding keeps the state (``cache.StateCache``), not keys and values: constant memory, exact
  for any length, and a chunk into a filled state is one call of the chunked kernel started
  from that state;
- the kernels are the mixer's own: ``chunked`` (the chunkwise-parallel form in PyTorch, any
  device, forward and backward), ``reference`` (the token-by-token recurrence, the definition)
  and, on CUDA where flash-linear-attention is installed, ``fla`` (its Triton kernels), which
  ``auto`` takes for a call in bf16 or fp16 and never inside torch.compile (fla's entry points
  disable the compiler);
- the chunked kernel runs a layer in groups of ``GROUP_TOKENS`` rows, one after the other, each
  from the state the one before left (``RecurrentMixer.mix_chunked``): its intermediates are
  one group's, whatever the length; with autograd on, each group is recomputed in backward
  from its input and its start state, so a layer keeps its input and output for backward,
  not the kernel's intermediates; a small call (one group, at most ``KEEP_ELEMENTS`` numbers
  in its rows) keeps them instead and saves backward a forward;
- context parallelism is refused: a shard would need the state of every shard before it.

A mixer module has Attention's interface (``forward(x, rows, n_query, cache, ...)`` and
``decode(x, pos, cache, ...)``), so a block and a hybrid treat both alike.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ecp_lm.model.archs.base import ArchConfig, Architecture
from ecp_lm.model.archs.transformer import CausalMask
from ecp_lm.model.cache import StateCache
from ecp_lm.model.kernels import LIBRARIES, choose_kernel
from ecp_lm.model.rows import Rows

KERNELS = ("fla", "chunked")
"""A recurrent mixer's kernels besides ``reference``, in ``auto``'s order."""
FLA_DEVICES = ("cuda",)
"""The device types flash-linear-attention's kernels run on."""
GROUP_TOKENS = 512
"""Rows the chunked kernel takes at once (rounded down to whole chunks, at least one): a
group's intermediates stay in the CPU's caches, and it is what backward recomputes at once."""
RECOMPUTE_GROUPS = True
"""Whether backward recomputes each group from its rows and start state (memory per token
independent of the kernel), or keeps every group's intermediates (one forward fewer);
benchmarks/mixer_groups.py measures both. A small call keeps them either way
(``KEEP_ELEMENTS``)."""
KEEP_ELEMENTS = 1 << 18
"""The most numbers a call's rows (batch × rows × d_model) may hold for a call of one group to
keep its intermediates rather than recompute them in backward: they are some tens of times its
rows (a few MiB here), and recomputing would cost a whole extra forward of the mixer. Recall
tasks of short windows and small widths train this way."""
FLA_MIN_VERSION = (0, 4, 0)
"""The oldest flash-linear-attention whose entry points take what the mixers pass (the ``fla``
extra's pin): 0.3.2's ``chunk_gated_delta_rule`` asserts against float32 q, k, v."""


def fla_installed() -> bool:
    """Whether flash-linear-attention (``fla``, the ``fla`` extra) can be imported."""
    return importlib.util.find_spec("fla") is not None


def fla_version() -> tuple[int, ...] | None:
    """The installed flash-linear-attention's release (``fla-core``, or the
    ``flash-linear-attention`` package that holds it), None where neither is recorded."""
    from importlib import metadata

    for name in ("fla-core", "flash-linear-attention"):
        try:
            text = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        parts = []
        for piece in text.split(".")[:3]:
            digits = "".join(itertools.takewhile(str.isdigit, piece))
            if not digits:
                break
            parts.append(int(digits))
        return tuple(parts)
    return None


class Recurrent(Architecture):
    """Base of the recurrent architectures: one mixer per layer, built by ``mixer``."""

    mask = CausalMask()
    kernels = KERNELS
    recurrent: ClassVar[bool] = True
    has_keys: ClassVar[bool] = False
    kind: ClassVar[str] = "a recurrent mixer"
    """What the layer is, in messages."""
    default_chunk: ClassVar[int] = 64
    """``chunk_size`` when the config leaves it unset."""

    @classmethod
    def defaults(cls, cfg: ArchConfig) -> dict[str, Any]:
        # A window shorter than the default chunk is one chunk.
        return {} if cfg.chunk_size is not None else {
            "chunk_size": min(cls.default_chunk, cfg.seq_len)}

    @classmethod
    def check(cls, cfg: ArchConfig) -> None:
        choices = ("auto", "reference", *cls.kernels)
        if cfg.attn_impl not in choices:
            raise ValueError(f"arch={cfg.arch!r} is {cls.kind}, which has no "
                             f"attn_impl={cfg.attn_impl!r} kernel; its kernels: "
                             f"{', '.join(choices)} (reference: the token-by-token recurrence)")
        if cfg.chunk_size is not None and cfg.chunk_size > cfg.seq_len:  # (sLSTM has none)
            raise ValueError(f"chunk_size={cfg.chunk_size} is longer than the window "
                             f"seq_len={cfg.seq_len}: a training window would never fill one "
                             f"chunk; set at most {cfg.seq_len} (or leave it unset)")

    def mixer(self, cfg: ArchConfig, layer: int) -> nn.Module:
        """The token mixer of layer ``layer``, in place of attention."""
        raise NotImplementedError

    def rope_base(self, layer: int) -> float | None:
        return None  # a recurrence has no positions to rotate

    @property
    def max_len(self) -> int | None:
        return None

    @property
    def cache_capacity(self) -> int:
        return 0  # an exact cache of no key/value slots: the state (StateCache)

    def check_start_pos(self, start_pos: int) -> None:
        if start_pos < 0:
            raise ValueError(f"start_pos={start_pos} must be >= 0")

    def check_context(self, t: int, k: int) -> None:
        if k > 1:
            raise ValueError(f"arch={self.cfg.arch!r} has no context-parallel form: its state "
                             "carries every earlier position, so a shard would need the final "
                             "state of every shard before it (run it unsplit, "
                             "train.context_parallel=1)")

    def context_start(self, length: int) -> int:
        return 0  # the state depends on every position: uncached generation reads them all

    def layer_cost(self, layer: int) -> tuple[int, int]:
        return 0, 0  # no attention: no score entries in either convention

    def auto_kernels(self, dropout_p: float, q: Tensor) -> tuple[str, ...]:
        # fla is written for 16-bit inputs: in float32 it is slower than its bf16 form by far,
        # and RWKV-7's kernel warns that it is unsupported on some GPUs; there the chunked form
        # computes in float32 throughout.
        # The other libraries' kernels (mamba-ssm's, mlstm-kernels') follow the same rule.
        if compute_dtype(q) in (torch.bfloat16, torch.float16):
            return self.kernels
        return tuple(k for k in self.kernels if k not in LIBRARIES)

    def kernel_limit(self, kernel: str, q: Tensor, dropout_p: float) -> str | None:
        if kernel == "fla":
            if q.device.type not in FLA_DEVICES:
                return f"flash-linear-attention's kernels run on CUDA, not {q.device.type}"
            if not fla_installed():
                return ("flash-linear-attention is not installed (pip install "
                        "'ecp-lm[fla]')")
            found = fla_version()
            if found is not None and found < FLA_MIN_VERSION:
                least = ".".join(map(str, FLA_MIN_VERSION))
                return (f"flash-linear-attention {'.'.join(map(str, found))} is older than "
                        f"{least}, the first whose kernels take these calls (pip install "
                        f"'fla-core>={least}')")
        return None

    def state_bytes(self, dtype_bytes: int = 4) -> int:
        """Bytes of one layer's decoding state for one batch row."""
        raise NotImplementedError

    def mixer_flops(self, seq_len: int) -> float:
        """Forward FLOPs per token of the recurrence itself (projections excluded), in the
        chunked form at this length."""
        raise NotImplementedError


class ShortConv(nn.Module):
    """A causal depthwise convolution over the time axis with kernel size K, its last K - 1
    inputs the tail a cache keeps: ``forward(x, tail)`` for x (B, T, C) returns the outputs
    (B, T, C) and the new tail (B, K - 1, C). A zero tail is a sequence's start."""

    def __init__(self, channels: int, size: int):
        super().__init__()
        self.size = size
        self.conv = nn.Conv1d(channels, channels, size, groups=channels, bias=True)

    def forward(self, x: Tensor, tail: Tensor | None = None) -> tuple[Tensor, Tensor]:
        b, _, c = x.shape
        if tail is None:
            tail = x.new_zeros(b, self.size - 1, c)
        full = torch.cat([tail.to(x.dtype), x], dim=1)  # (B, K - 1 + T, C)
        out = self.conv(full.transpose(1, 2)).transpose(1, 2)  # (B, T, C)
        # A copy, not a view: the tail outlives the call (the next group's start), and a view
        # would keep all of ``full`` alive with it.
        return out, full[:, full.size(1) - (self.size - 1):].clone()


class RecurrentMixer(nn.Module):
    """A mixer's plumbing: the kernel chosen per call, its state read from a cache and written
    back. A subclass gives ``state_shapes`` and ``mix(x, state, kernel) -> (y, state)`` for a
    run of rows x (B, R, d) from ``state`` (a dict of the cache's tensors, None at a sequence's
    start); ``decode`` runs ``mix`` on one row with the reference (token-by-token) kernel."""

    rope = None  # a block reads its mixer's RoPE: none here

    def __init__(self, cfg: ArchConfig, arch: Recurrent):
        super().__init__()
        self.arch, self.impl = arch, cfg.attn_impl
        self.chunk = arch.cfg.chunk_size

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each state tensor's shape for one batch row."""
        raise NotImplementedError

    def mix(self, x: Tensor, state: dict[str, Tensor] | None, kernel: str
            ) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError

    def make_cache(self, batch_size: int, dtype: torch.dtype, device: torch.device,
                   beside: dict[str, tuple[int, ...]] | None = None) -> StateCache:
        """The mixer's state and, ``beside`` it, other state of its layer (a feed-forward's)."""
        # The state accumulates every position: float32 at least, whatever the model runs in.
        return StateCache(batch_size, {**self.state_shapes(), **(beside or {})},
                          torch.promote_types(dtype, torch.float32), device)

    def kernel(self, x: Tensor) -> str:
        needs_backward = torch.is_grad_enabled() and x.requires_grad
        return choose_kernel(self.arch, self.impl, x, 0.0, needs_backward)

    def forward(self, x: Tensor, rows: Rows, n_query: int, cache: StateCache | None = None,
                context: object = None, rotation: object = None) -> Tensor:
        """x (B, R, d) -> (B, n_query, d), the last n_query rows' outputs; with a cache, from
        its state (a filled one) and into it."""
        state = self.read_state(cache) if cache is not None and cache.filled else None
        kernel = self.kernel(x)
        y, new = (self.mix_chunked(x, state) if kernel == "chunked"
                  else self.mix(x, state, kernel))
        if cache is not None:
            _write(cache, new)
            cache.advance(x.size(1))
        return y[:, y.size(1) - n_query:]

    def mix_chunked(self, x: Tensor, state: dict[str, Tensor] | None
                    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``mix`` on the chunked kernel, over groups of ``GROUP_TOKENS`` rows in turn, each
        from the state the group before it left. With autograd on, each group is recomputed in
        backward from its rows and its start state (``_Recompute``; where torch.compile traces,
        ``torch.utils.checkpoint``; a mixer draws no random numbers), so that what the layer
        keeps for backward is its rows and one state per group, whatever the length. A small
        call (one group, ``KEEP_ELEMENTS``) is run once and differentiated as it ran."""
        chunk = self.chunk or 1  # a cell without chunks (sLSTM's): groups of GROUP_TOKENS
        span = max(1, GROUP_TOKENS // chunk) * chunk
        small = x.size(1) <= span and x.numel() <= KEEP_ELEMENTS
        recompute = RECOMPUTE_GROUPS and torch.is_grad_enabled() and not small
        outputs = []
        # Split once: slicing a group out inside the loop would cost its backward a zero-filled
        # gradient of all the rows per group.
        for part in x.split(span, dim=1):
            if recompute and torch.compiler.is_compiling():
                # traced as one graph, whose partitioner places the recomputation
                y, state = checkpoint(self.mix, part, state, "chunked", use_reentrant=False,
                                      preserve_rng_state=False)
            elif recompute:
                y, state = _recomputed(self, part, state)
            else:
                y, state = self.mix(part, state, "chunked")
            outputs.append(y)
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), state

    def decode(self, x: Tensor, pos: Tensor, cache: StateCache, span: int | None = None,
               rotation: object = None) -> Tensor:
        """One row per batch row, x (B, 1, d), from the cache's state and into it (tensor
        operations only: one compiled graph for every step)."""
        y, new = self.mix(x, self.read_state(cache), "reference")
        _write(cache, new)
        return y

    def read_state(self, cache: StateCache) -> dict[str, Tensor]:
        """The mixer's own state tensors from the layer's cache."""
        return {name: cache.read(name) for name in self.state_shapes()}


class PositionedMixer(RecurrentMixer):
    """A mixer whose state stands at a position of the stream (the compressive transformer's
    segments, the routing transformer's rings, RoPE on its keys): ``mix_at(x, start, state,
    kernel, rotation)`` runs rows from position ``start``; a stream starts at position 0. Its
    chunked form is linear in the rows already, so it runs them at once, not in groups."""

    def mix_at(self, x: Tensor, start: int, state: dict[str, Tensor] | None, kernel: str,
               rotation: Any = None) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError

    def forward(self, x: Tensor, rows: Rows, n_query: int, cache: StateCache | None = None,
                context: object = None, rotation: Any = None) -> Tensor:
        state = self.read_state(cache) if cache is not None and cache.filled else None
        y, new = self.mix_at(x, rows.main.start, state, self.kernel(x), rotation)
        if cache is not None:
            _write(cache, new)
            cache.advance(x.size(1))
        return y[:, y.size(1) - n_query:]

    def mix(self, x: Tensor, state: dict[str, Tensor] | None, kernel: str
            ) -> tuple[Tensor, dict[str, Tensor]]:
        """``mix_at`` of a stream's first rows (from position 0, no state)."""
        if state is not None:
            raise ValueError(f"{type(self).__name__}'s state stands at a position: continue "
                             "it with forward or mix_at")
        return self.mix_at(x, 0, None, kernel)

    def mix_chunked(self, x: Tensor, state: dict[str, Tensor] | None
                    ) -> tuple[Tensor, dict[str, Tensor]]:
        return self.mix(x, state, "chunked")


def _recomputed(mixer: RecurrentMixer, rows: Tensor, state: dict[str, Tensor] | None
                ) -> tuple[Tensor, dict[str, Tensor]]:
    """``mixer.mix(rows, state, "chunked")``, keeping for backward only ``rows`` and ``state``
    (``_Recompute``)."""
    names = sorted(mixer.state_shapes())
    starts = () if state is None else tuple(state[name] for name in names)
    params = tuple(mixer.parameters())
    y, *ends = _Recompute.apply(mixer, names, len(starts), rows, *starts, *params)
    return y, dict(zip(names, ends, strict=True))


class _Recompute(torch.autograd.Function):
    """A group of the chunked kernel run without keeping its intermediates, and run again in
    backward to differentiate it. Its inputs are the rows, the start state and the mixer's
    parameters, explicitly: each parameter's gradient leaves the node like any other, summed
    over the groups before it reaches the parameter (once per backward, as data parallelism's
    hooks expect). Faster than ``torch.utils.checkpoint``'s saved-tensor hooks on the many
    small operations of a mixer; torch.compile traces that one instead."""

    @staticmethod
    def forward(ctx, mixer, names, n_state, rows, *tensors):
        ctx.mixer, ctx.names, ctx.n_state = mixer, names, n_state
        kind = rows.device.type
        ctx.autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) \
            if torch.amp.is_autocast_available(kind) else None
        starts = tensors[:n_state]
        ctx.save_for_backward(rows, *starts)
        with torch.no_grad():
            y, ends = mixer.mix(rows, dict(zip(names, starts, strict=True)) if n_state else None,
                                "chunked")
        return (y, *(ends[name] for name in names))

    @staticmethod
    def backward(ctx, *grads):
        rows, *starts = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in (rows, *starts)]
        params = list(ctx.mixer.parameters())
        kind, enabled, dtype = ctx.autocast or ("cpu", False, None)
        with torch.enable_grad(), torch.autocast(kind, dtype=dtype, enabled=enabled):
            y, ends = ctx.mixer.mix(inputs[0], dict(zip(ctx.names, inputs[1:], strict=True))
                                    if ctx.n_state else None, "chunked")
        outputs = [y, *(ends[name] for name in ctx.names)]
        pairs = [(out, grad) for out, grad in zip(outputs, grads, strict=True)
                 if grad is not None and out.requires_grad]
        every = (*inputs, *params)
        wrt = [t for t in every if t.requires_grad]
        if not pairs or not wrt:
            return (None,) * (3 + len(every))
        found = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                         allow_unused=True))
        return (None, None, None, *(next(found) if t.requires_grad else None for t in every))


def _write(cache: StateCache, state: dict[str, Tensor]) -> None:
    for name, value in state.items():
        cache.write(name, value)


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dimension (groups of ``group`` channels each normalised on their
    own), times silu(gate): ``norm(x) * silu(z)`` (Gated DeltaNet's output norm) or, with
    ``gate_first``, ``norm(x * silu(z))`` (Mamba-2's)."""

    def __init__(self, width: int, group: int, gate_first: bool, eps: float = 1e-6):
        super().__init__()
        self.group, self.gate_first, self.eps = group, gate_first, eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        dtype = x.dtype
        x, z = wide(x), wide(z)
        if self.gate_first:
            x = x * F.silu(z)
        shape = x.shape
        g = x.reshape(*shape[:-1], shape[-1] // self.group, self.group)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        out = g.reshape(shape) * self.weight.to(g.dtype)
        if not self.gate_first:
            out = out * F.silu(z)
        return out.to(dtype)


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a call on ``x`` computes in: autocast's where it is on for x's device, else
    x's own."""
    kind = x.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def fla_layout(x: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, H, T, ...) as flash-linear-attention takes it, (B, T, H, ...), contiguous, in
    ``dtype``."""
    return x.transpose(1, 2).to(dtype).contiguous()


def fla_state(state: Tensor | None) -> Tensor | None:
    """A state (B, H, V, K) as flash-linear-attention holds it, (B, H, K, V), in float32 (or
    wider); None stays None. Its final state comes back through the same transpose."""
    return None if state is None else wide(state.transpose(-1, -2)).contiguous()


def wide(x: Tensor) -> Tensor:
    """x in float32, or as it is if wider (float64): what the recurrences compute in."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def heads_of(x: Tensor, n_heads: int) -> Tensor:
    """(B, T, H·D) -> (B, H, T, D)."""
    b, t, _ = x.shape
    return x.view(b, t, n_heads, -1).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, T, D) -> (B, T, H·D)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def log_spaced(n: int, low: float, high: float) -> Tensor:
    """n values evenly spaced in log scale from ``low`` to ``high``."""
    return torch.exp(torch.linspace(math.log(low), math.log(high), n))
