"""Hybrid layer patterns: local layers interleaved with global ones (SPEC §3c ``hybrid``).

``layer_pattern`` tiles a unit of architecture names over the layers: Gemma 3's
``sliding_window*5,transformer``, Llama 4's ``block_local*3,transformer``, or ECP as the local
layer, ``ecp*3,transformer``. Each layer is exactly the layer of the pure architecture it names,
built from the same config (``ModelConfig.layer_config``: its own sizes and defaults, checked as
there), and it runs that architecture's mask, kernels and cache: a local layer caches its ring
(2m slots for ecp, w for sliding_window, b for block_local, G for s2), a global layer the window
of N. A layer may be any architecture whose every layer keeps all rows and predicts every
position (``LAYERS``); the perceiver family's layers drop rows, so they cannot be interleaved.

What the model as a whole accepts follows from its layers:

- with a global layer, inputs of at most N tokens from position 0, as the transformer's (and
  generation past N slides the window, recomputing, as the transformer's does);
- with local layers only, any length, from any position where every layer's pattern starts
  (a multiple of each period); decoding runs without end on the rings, and uncached generation
  reads the receptive field the layers compose, from the top layer down;
- with recurrent layers (mamba2, gated_deltanet, rwkv7, rwkv4, mamba, mlstm, slstm, performer, or
  compressive, whose state is its memories) and no global
  one, any length from any position the other layers allow; decoding keeps each recurrent layer's
  state beside the other layers' rings, and uncached generation reads the whole sequence (the state
  depends on every position); RoPE rotates the attention layers only;
- context parallelism where every layer has a halo (local layers only).
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from ecp_lm.model.archs.base import ArchConfig, Architecture, BandArchitecture
from ecp_lm.model.archs.block_local import BlockLocal
from ecp_lm.model.archs.compressive import Compressive
from ecp_lm.model.archs.ecp import ECP
from ecp_lm.model.archs.gated_deltanet import GatedDeltaNet
from ecp_lm.model.archs.longformer import Longformer
from ecp_lm.model.archs.mamba import Mamba
from ecp_lm.model.archs.mamba2 import Mamba2
from ecp_lm.model.archs.performer import Performer
from ecp_lm.model.archs.routing import Routing
from ecp_lm.model.archs.rwkv4 import RWKV4
from ecp_lm.model.archs.rwkv7 import RWKV7
from ecp_lm.model.archs.s2 import ShiftedSparse
from ecp_lm.model.archs.sliding_window import SlidingWindow
from ecp_lm.model.archs.sparse_transformer import SparseTransformer
from ecp_lm.model.archs.transformer import Transformer
from ecp_lm.model.archs.xlstm import MLSTM, SLSTM

LAYERS: dict[str, type[Architecture]] = {
    "transformer": Transformer,
    "ecp": ECP,
    "sliding_window": SlidingWindow,
    "block_local": BlockLocal,
    "s2": ShiftedSparse,
    "mamba2": Mamba2,
    "gated_deltanet": GatedDeltaNet,
    "rwkv7": RWKV7,
    "rwkv4": RWKV4,
    "mamba": Mamba,
    "mlstm": MLSTM,
    "slstm": SLSTM,
    "performer": Performer,
    "sparse_transformer": SparseTransformer,
    "longformer": Longformer,
    "compressive": Compressive,
    "routing": Routing,
}
"""The architectures a hybrid's layer may be: every one of their layers keeps all rows and
predicts every position, so any of them can follow any other (a recurrent mixer's layer too:
Nemotron-H's ``mamba2*3,transformer``, Qwen3-Next's ``gated_deltanet*3,transformer``, Samba's
``mamba2,sliding_window``)."""


def _kinds(cfg: ArchConfig) -> dict[str, type[Architecture]]:
    """The distinct architectures of ``cfg``'s layers, in the order they first appear (every
    name of the pattern checked, also one the last repetition cuts off)."""
    for name in cfg.layer_unit:
        if name not in LAYERS:
            raise ValueError(
                f"layer_pattern={cfg.layer_pattern!r}: {name!r} cannot be a layer of a hybrid; a "
                f"hybrid's layers keep every row and predict every position, as "
                f"{', '.join(LAYERS)} do (the perceiver family's layers drop rows)")
    return {name: LAYERS[name] for name in cfg.layer_archs}


def _layer_config(cfg: ArchConfig, name: str) -> ArchConfig:
    """``cfg.layer_config(name)``, its errors naming the layers they are about."""
    try:
        return cfg.layer_config(name)
    except ValueError as err:
        where = f"arch={cfg.arch!r}" if cfg.layer_pattern is None else \
            f"layer_pattern={cfg.layer_pattern!r}"
        raise ValueError(f"{where}, its {name} layers: {err}") from None


class Hybrid(Architecture):
    """Each layer one of ``LAYERS``, as ``layer_pattern`` says; ``layer(i)`` is layer i's."""

    def __init__(self, cfg: ArchConfig):
        super().__init__(cfg)
        kinds = {name: kind(_layer_config(self.cfg, name))
                 for name, kind in _kinds(self.cfg).items()}
        self.kinds: list[Architecture] = list(kinds.values())
        """One instance per distinct architecture, shared by its layers."""
        self.layers: list[Architecture] = [kinds[name].layer(i)
                                           for i, name in enumerate(self.cfg.layer_archs)]
        """Layer i's pattern: its kind's ``layer(i)`` (longformer's windows differ by layer)."""

    # Configuration --------------------------------------------------------------------------
    @classmethod
    def sizes(cls, cfg: ArchConfig) -> tuple[str, ...]:
        return tuple(dict.fromkeys(name for kind in _kinds(cfg).values()
                                   for name in kind.size_fields))

    @classmethod
    def defaults(cls, cfg: ArchConfig) -> dict[str, Any]:
        """The defaults the layers' kinds agree on. A size whose default differs between kinds
        (the recurrent mixers' ``chunk_size``: 64, rwkv7 32) stays unset here, so that each
        kind's layers take their own, whatever the pattern's order; one the config sets is
        every kind's."""
        merged: dict[str, Any] = {}
        differ: set[str] = set()
        for name, kind in _kinds(cfg).items():
            for key, value in kind.defaults(_layer_config(cfg, name)).items():
                if merged.setdefault(key, value) != value:
                    differ.add(key)
        return {key: value for key, value in merged.items() if key not in differ}

    @classmethod
    def check(cls, cfg: ArchConfig) -> None:
        kinds = _kinds(cfg)
        for name in kinds:
            _layer_config(cfg, name)  # each kind's checks, on its own config
        if not any(kind.global_attention for kind in kinds.values()):
            for name in ("global_rope", "rope_base_global"):
                if getattr(cfg, name) is not None:
                    raise ValueError(f"{name}={getattr(cfg, name)!r} is set, but "
                                     f"layer_pattern={cfg.layer_pattern!r} has no global "
                                     "(transformer) layer")

    # Per layer --------------------------------------------------------------------------------
    def layer(self, layer: int) -> Architecture:
        return self.layers[layer]

    def rope_base(self, layer: int) -> float | None:
        # ``rope``'s rule, which holds for every local layer (none for a recurrent one)
        own = self.layers[layer].rope_base(layer)
        if not self.layers[layer].global_attention:
            return own
        mode = self.cfg.global_rope  # a global layer: rotated by ``rope``'s rule, if unset
        if mode == "none" or (mode is None and own is None):
            return None
        base = self.cfg.rope_base_global
        return self.cfg.rope_base if base is None else base

    def compression(self, layer: int) -> nn.Module | None:
        return self.layers[layer].compression(layer)

    def layer_cost(self, layer: int) -> tuple[int | float, int | float]:
        return self.layers[layer].layer_cost(layer)

    # The model as a whole -------------------------------------------------------------------------
    @property
    def local(self) -> bool:
        """Whether every layer is local (a band pattern): no layer reaches back without bound."""
        return all(isinstance(kind, BandArchitecture) for kind in self.kinds)

    @property
    def max_len(self) -> int | None:
        limits = [kind.max_len for kind in self.kinds if kind.max_len is not None]
        return min(limits) if limits else None

    @property
    def cache_capacity(self) -> int | None:
        """The largest layer's cache (each layer's cache has its own, ``layer(i)``'s)."""
        capacities = [kind.cache_capacity for kind in self.kinds]
        return None if None in capacities else max(capacities)

    @property
    def period(self) -> int:
        """Every layer's pattern is unchanged when positions move by a multiple of this (all
        local layers)."""
        return math.lcm(*(kind.period for kind in self.kinds))

    @property
    def halo_len(self) -> int | None:
        halos = [kind.halo_len for kind in self.kinds]
        return None if None in halos else max(halos)

    def _each_kind(self, check: str, *args: int) -> None:
        for kind in self.kinds:
            try:
                getattr(kind, check)(*args)
            except ValueError as err:
                raise ValueError(f"layer_pattern={self.cfg.layer_pattern!r}, its "
                                 f"{kind.cfg.arch} layers: {err}") from None

    def check_start_pos(self, start_pos: int) -> None:
        self._each_kind("check_start_pos", start_pos)

    def check_context(self, t: int, k: int) -> None:
        self._each_kind("check_context", t, k)

    def context_start(self, length: int) -> int:
        if self.max_len is not None:
            return super().context_start(length)  # a global layer: the last window of N
        if not self.local:
            return 0  # a recurrent layer's state depends on every position
        if any(kind.sink_len for kind in self.kinds):
            return 0  # every position sees the sinks at 0 .. k - 1 through its window layers
        start = length - 1  # the position whose output predicts the next token
        for layer in reversed(self.layers):  # from the top layer down
            start = layer.reach(start)
        return start - start % self.period


class XLSTM(Hybrid):
    """xLSTM's stack: mLSTM and sLSTM blocks as ``layer_pattern`` places them (unset:
    ``config.STACKS``' xLSTM[7:1]), each layer the pure architecture's."""

    kernels = ("chunked",)  # every layer's: mlstm's chunks, slstm's groups
    recurrent = True  # every layer is: no attention anywhere, a state per layer

    @classmethod
    def check(cls, cfg: ArchConfig) -> None:
        others = sorted(set(cfg.layer_unit) - {"mlstm", "slstm"})
        if others:
            raise ValueError(f"arch=xlstm stacks mlstm and slstm layers; "
                             f"layer_pattern={cfg.layer_pattern!r} names {', '.join(others)} "
                             f"(arch=hybrid mixes any kinds)")
        super().check(cfg)
