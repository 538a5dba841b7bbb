"""Analytic attention cost of each architecture (SPEC §3; the research's cost comparison).

For a full window (T = N) this counts, with each architecture's closed-form formulas
(``Architecture.layer_cost`` in model/archs/), the (query, key) pairs each layer's mask allows
over the rows that layer actually computes queries for — the last layer of the perceiver family
only queries its l predicted rows, PerceiverAR only ever queries its latents, and
compressed_double's later layers hold p compressed history rows instead of h. Two counts:

``entries``
    exact unmasked score entries: what a kernel that skips every masked pair computes.
``tile_entries``
    the research's convention: every query block is scored against its whole key block, causal
    triangles counted in full (ECP: (2S - 1)·m² per layer, i.e. (2S - 1)/S² of full attention;
    sliding_window: blocks of w queries against their previous block and themselves, and with
    k attention sinks every block after the first against the k sink columns too; block_local
    and s2: the square of each block of b, each group of G).

A hybrid (``arch="hybrid"``, SPEC §3c) costs the sum of its layers': each layer is counted as the
layer of the pure architecture its ``layer_pattern`` names, at the same sizes, and the cost
carries the pattern (``layer_pattern``, ``layer_archs``) and the sizes of every layer kind.

FLOPs are forward attention FLOPs, 4 · d_model · entries: QKᵀ and PV each cost one multiply-add
(2 FLOPs) per entry and per channel, summed over heads (n_heads · head_dim = d_model). Projections,
softmax and the feed-forward are not included. The tests check ``entries`` against a brute-force
count of the materialised masks.

A recurrent mixer's layer (mamba2, gated_deltanet, rwkv7, rwkv4, mamba, mlstm, slstm; SPEC §3d) has
no attention entries. Its cost is the recurrence's own forward FLOPs over the window in the chunked
form (``Recurrent.mixer_flops``, per token: the chunk's whole square counted, as tiles count
attention; projections excluded, as for attention), and its decoding memory the state's bytes per
batch row, the same at every position. For an attention layer the decoding memory is its key/value
cache, 2 · capacity · d_model numbers (none where decoding recomputes: the perceiver family). Both
in float32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ecp_lm.config import HYBRID, OWN_SIZES, ModelConfig, tile_pattern

FLOPS_PER_ENTRY_PER_CHANNEL = 4
"""QKᵀ and PV: one multiply-add (2 FLOPs) each per score entry and per channel of d_model."""

SIZE_NAMES = {"latent_len": "l", "num_segments": "S", "compressed_len": "p", "window": "w",
              "block_len": "b", "group_len": "G", "mixer_width": "W", "state_size": "d_state",
              "conv_size": "conv", "chunk_size": "chunk", "num_features": "M",
              "feature_redraw": "redraw", "stride": "ℓ", "summary_len": "c", "dilation": "d",
              "global_tokens": "g", "memory_len": "n_m", "compression_rate": "c_r",
              "num_clusters": "k"}
"""The size fields a cost reports (where the architecture's ``size_fields`` hold them; a
hybrid's: those of every kind of layer it has), and their symbols in the table."""


@dataclass(frozen=True)
class AttentionCost:
    """Attention cost of one architecture (or hybrid) over one full window of N positions
    (batch 1)."""

    arch: str
    seq_len: int
    """N."""
    n_layers: int
    """L."""
    d_model: int
    latent_len: int | None
    """l (perceiver family only, else None)."""
    num_segments: int | None
    """S (ecp and ssplit only, or a hybrid with ecp layers; else None)."""
    compressed_len: int | None
    """p (compressed_double only, else None)."""
    window: int | str | None
    """w (sliding_window and longformer, or a hybrid with their layers; else None); longformer's
    may be a comma list, one per layer."""
    block_len: int | None
    """b (block_local, or a hybrid with its layers; else None)."""
    group_len: int | None
    """G (s2, or a hybrid with its layers; else None)."""
    entries_per_layer: tuple[int | float, ...]
    """Exact (query, key) pairs the mask allows, over the rows each layer queries (per head; the
    mean over heads where the mask differs between heads, as for s2)."""
    tile_entries_per_layer: tuple[int | float, ...]
    """Block-tile convention: each query block against its whole key block."""
    layer_pattern: str | None = None
    """A hybrid's ``layer_pattern`` (None for a pure architecture)."""
    mixer_width: int | None = None
    """W (mamba2, mamba, gated_deltanet, or a hybrid with their layers; else None)."""
    state_size: int | None = None
    """mamba2's and mamba's state per channel (else None)."""
    conv_size: int | None = None
    """The short convolution's taps (the mixers that have one; else None)."""
    chunk_size: int | None = None
    """The chunked kernel's chunk (the recurrent mixers; else None)."""
    num_features: int | None = None
    """M, the performer's random features per head (else None)."""
    feature_redraw: int | None = None
    """The performer's training steps between draws of its features (else None)."""
    stride: int | None = None
    """ℓ, the sparse transformer's stride (else None)."""
    summary_len: int | None = None
    """c, its fixed pattern's summary positions per block (else None)."""
    dilation: int | str | None = None
    """d, longformer's dilation (one, or a comma list per layer; else None)."""
    global_tokens: int | None = None
    """g, longformer's global tokens (else None)."""
    memory_len: int | None = None
    """n_m, the compressive transformer's memory (else None)."""
    compression_rate: int | None = None
    """Its compression rate (else None)."""
    num_clusters: int | None = None
    """k, the routing transformer's centroids per routed head (else None)."""
    sink_tokens: int = 0
    """k, sliding_window's attention sinks (its layers' in a hybrid): counted in the entries,
    and in the tiles as one more key block of k columns for every block of w queries after the
    first."""
    mixer_flops_per_layer: tuple[float, ...] = ()
    """Forward FLOPs of each layer's recurrence over the window (0 for an attention layer)."""
    decode_bytes_per_layer: tuple[int | None, ...] = ()
    """Decoding memory of each layer per batch row, float32: a recurrent state's bytes, an
    attention layer's key/value cache (None where decoding recomputes)."""

    @property
    def mixer_flops(self) -> float:
        """Forward FLOPs of the recurrences over the window: 0 without recurrent layers."""
        return sum(self.mixer_flops_per_layer)

    @property
    def decode_bytes(self) -> int | None:
        """Decoding memory per batch row over every layer (None where a layer recomputes)."""
        per_layer = self.decode_bytes_per_layer
        return None if not per_layer or None in per_layer else sum(per_layer)

    @property
    def layer_archs(self) -> list[str]:
        """Each layer's architecture: the pattern tiled over the layers, or ``arch``."""
        if self.layer_pattern is None:
            return [self.arch] * self.n_layers
        return tile_pattern(self.layer_pattern, self.n_layers)

    @property
    def label(self) -> str:
        """The row's name: ``arch``, or ``hybrid(PATTERN)`` for a hybrid."""
        return self.arch if self.layer_pattern is None else hybrid_label(self.layer_pattern)

    @property
    def entries(self) -> int:
        return sum(self.entries_per_layer)

    @property
    def tile_entries(self) -> int:
        return sum(self.tile_entries_per_layer)

    @property
    def flops_per_layer(self) -> tuple[int, ...]:
        return tuple(self._flops(e) for e in self.entries_per_layer)

    @property
    def flops(self) -> int:
        """Forward attention FLOPs of the whole model: 4 · d_model · entries."""
        return self._flops(self.entries)

    @property
    def tile_flops(self) -> int:
        return self._flops(self.tile_entries)

    @property
    def causal_entries(self) -> int:
        """L · N(N+1)/2: full causal attention over every row in every layer."""
        n = self.seq_len
        return self.n_layers * n * (n + 1) // 2

    @property
    def full_entries(self) -> int:
        """L · N²: full unmasked attention."""
        return self.n_layers * self.seq_len ** 2

    @property
    def ratio_to_causal(self) -> float:
        return self.entries / self.causal_entries

    @property
    def ratio_to_full(self) -> float:
        return self.entries / self.full_entries

    @property
    def tile_ratio_to_full(self) -> float:
        """ECP: exactly (2S - 1)/S²."""
        return self.tile_entries / self.full_entries

    def _flops(self, entries: int | float) -> int | float:
        return FLOPS_PER_ENTRY_PER_CHANNEL * self.d_model * entries

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data: the sizes, per-layer lists, totals and ratios."""
        data = dataclasses.asdict(self)
        data["layer_archs"] = self.layer_archs
        data["entries_per_layer"] = list(self.entries_per_layer)
        data["tile_entries_per_layer"] = list(self.tile_entries_per_layer)
        data["flops_per_layer"] = list(self.flops_per_layer)
        data["tile_flops_per_layer"] = [self._flops(e) for e in self.tile_entries_per_layer]
        data["mixer_flops_per_layer"] = list(self.mixer_flops_per_layer)
        data["decode_bytes_per_layer"] = list(self.decode_bytes_per_layer)
        for name in ("entries", "tile_entries", "flops", "tile_flops", "causal_entries",
                     "full_entries", "ratio_to_causal", "ratio_to_full", "tile_ratio_to_full",
                     "mixer_flops", "decode_bytes"):
            data[name] = getattr(self, name)
        return data


def attention_cost(cfg: ModelConfig) -> AttentionCost:
    """The analytic attention cost of ``cfg``'s architecture over a full window (each
    architecture's ``layer_cost``)."""
    from ecp_lm.model.archs import architecture

    kind = architecture(cfg.arch)
    arch = kind(cfg)
    per_layer = [arch.layer_cost(i) for i in range(cfg.n_layers)]
    layers = [arch.layer(i) for i in range(cfg.n_layers)]
    own = kind.sizes(arch.cfg)  # a hybrid's: the sizes of every kind of layer it has
    sizes = {name: getattr(arch.cfg, name) if name in own else None for name in SIZE_NAMES}
    return AttentionCost(
        arch=cfg.arch, seq_len=cfg.seq_len, n_layers=cfg.n_layers, d_model=cfg.d_model,
        **sizes, entries_per_layer=tuple(e for e, _ in per_layer),
        tile_entries_per_layer=tuple(t for _, t in per_layer), layer_pattern=cfg.layer_pattern,
        sink_tokens=cfg.sink_tokens,
        mixer_flops_per_layer=tuple(cfg.seq_len * layer.mixer_flops(cfg.seq_len)
                                    if layer.recurrent else 0 for layer in layers),
        decode_bytes_per_layer=tuple(decode_bytes(layer, cfg.d_model) for layer in layers))


def decode_bytes(layer: Any, d_model: int, dtype_bytes: int = 4) -> int | None:
    """One layer's decoding memory per batch row: its state, or its keys and values."""
    if layer.recurrent:
        return layer.state_bytes(dtype_bytes)
    capacity = layer.cache_capacity
    return None if capacity is None else 2 * capacity * d_model * dtype_bytes


def hybrid_label(pattern: str) -> str:
    """A hybrid's row name: ``hybrid(sliding_window*5,transformer)``."""
    return f"{HYBRID}({pattern})"


GLOBAL_LAYER_FIELDS = ("layer_pattern", "global_rope", "rope_base_global")
"""A hybrid's own fields: each compared config sets its own pattern (the global layers' RoPE
does not change a cost)."""


def compare(base: ModelConfig | Mapping[str, Any], archs: Iterable[str],
            patterns: Iterable[str] = ()) -> list[AttentionCost]:
    """The cost of each of ``archs``, then of a hybrid of each of ``patterns``, at the sizes of
    ``base`` (a config, or its fields). Each row keeps only the own sizes (``OWN_SIZES``) its
    layers have.

    An architecture whose constraints the sizes break (e.g. ssplit needs h divisible by S), or
    a malformed pattern, raises the config's ValueError, prefixed with the row's name.
    """
    from ecp_lm.model.archs import architecture

    fields = base.to_dict() if isinstance(base, ModelConfig) else dict(base)
    for name in GLOBAL_LAYER_FIELDS:
        fields.pop(name, None)
    rows = [(arch, {"arch": arch}) for arch in archs]
    rows += [(hybrid_label(p), {"arch": HYBRID, "layer_pattern": p}) for p in patterns]
    costs = []
    for label, row in rows:
        own = {**fields, **row}
        layers = own.get("n_layers", ModelConfig.n_layers)
        layers = layers if isinstance(layers, int) and layers >= 1 else 1  # checked below
        try:
            names = (tile_pattern(row["layer_pattern"], layers)
                     if "layer_pattern" in row else [row["arch"]])
            used = {size for name in names for size in architecture(name).size_fields}
            for name in OWN_SIZES:  # each sizes one pattern only: dropped for the others
                if name not in used:
                    own.pop(name, None)
            if not any(architecture(name).takes_sink_tokens for name in names):
                own.pop("sink_tokens", None)  # sinks extend a window: none without one
            if "global_tokens" not in used:
                own.pop("global_tokens", None)
            cfg = ModelConfig.from_dict(own)
        except ValueError as err:
            raise ValueError(f"{label}: {err}") from err
        costs.append(attention_cost(cfg))
    return costs


def run_lengths(values: Iterable[int], separator: str = " + ") -> str:
    """``[5, 3, 3, 3, 1]`` -> ``"5 + 3×3 + 1"``, numbers with thousands separators."""
    runs: list[list[int]] = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return separator.join(f"{v:,}" + (f"×{k}" if k > 1 else "") for v, k in runs)


def _sizes(cost: AttentionCost) -> str:
    """The pattern's own sizes, each under its symbol: ``l=1024 S=16``, ``w=194``, ``b=256``."""
    parts = [(symbol, getattr(cost, name)) for name, symbol in SIZE_NAMES.items()]
    if cost.sink_tokens:
        parts.append(("sinks", cost.sink_tokens))
    return " ".join(f"{symbol}={value}" for symbol, value in parts if value is not None) or "-"


def format_table(costs: list[AttentionCost]) -> str:
    """A plain aligned text table of ``costs``, with a title line and a legend."""
    header = ("arch", "sizes", "entries per layer", "total entries", "fwd GFLOPs",
              "vs causal", "vs full", "tile vs full", "mixer GFLOPs", "decode KiB/row")
    body = [(c.label, _sizes(c), run_lengths(c.entries_per_layer), f"{c.entries:,}",
             f"{c.flops / 1e9:.2f}", f"{c.ratio_to_causal:.1%}", f"{c.ratio_to_full:.1%}",
             f"{c.tile_ratio_to_full:.1%}", f"{c.mixer_flops / 1e9:.2f}",
             "recomputes" if c.decode_bytes is None else f"{c.decode_bytes / 1024:,.1f}")
            for c in costs]
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]
    left = {0, 1, 2}  # text columns; numbers are right-aligned

    def line(row: tuple[str, ...]) -> str:
        cells = (cell.ljust(w) if i in left else cell.rjust(w)
                 for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
        return "  ".join(cells).rstrip()

    lines = []
    if costs:
        c = costs[0]
        lines.append(f"Attention cost per window: N={c.seq_len}, L={c.n_layers}, "
                     f"d_model={c.d_model}, batch 1, forward")
    lines += [line(header), line(tuple("-" * w for w in widths))]
    lines += [line(row) for row in body]
    lines += [
        "",
        "entries: (query, key) pairs the mask allows, over the rows each layer queries;",
        "GFLOPs: 4·d_model·entries (QKᵀ and PV); vs causal: / L·N(N+1)/2; vs full: / L·N²;",
        "tile: each query block scored against its whole key block (ECP: (2S-1)/S²).",
        "mixer GFLOPs: a recurrent layer's recurrence (chunked, projections excluded); decode:",
        "float32 keys and values (2·capacity·d_model) or recurrent state per row, all layers.",
    ]
    if any(c.sink_tokens for c in costs):
        lines.append("sinks=k: sliding_window's attention sinks, in the entries; in tiles, k "
                     "more key columns for every block of w queries after the first.")
    if any(c.layer_pattern is not None for c in costs):
        lines.append("hybrid(P): layers as pattern P, each costed as the pure architecture's "
                     "layer; sizes: every layer kind's.")
    return "\n".join(lines)
