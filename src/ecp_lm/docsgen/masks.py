"""``docs/img/masks/*.svg``: each architecture's attention pattern, drawn from its own predicate.

For every architecture in ``config.ARCHS`` and three hybrids, a small model config (N = 32
positions, S = 4 segments of m = 8, 3 layers, 2 heads) is built into its ``Architecture``, and
the rows each layer holds are followed as the model's forward follows them: ``input_rows``, the
queries of ``num_queries``, ``Rows.tail`` after the attention and the layer's ``compression``. In
each layer the architecture's mask predicate (``arch.layer(i).mask``) is materialised over those
query and key positions (``kernels.masks.materialize``), per head where it differs between
heads. Layers (and heads) with the same grid share one panel.

A panel is an N × N grid of absolute positions, queries down and keys across. Blue cells are the
pairs the predicate allows, merged into one ``rect class="on"`` per run along a row; grey rows
and columns are positions the layer holds no row for. Each panel's ``<g>`` carries
``data-layers`` and ``data-heads``, the layers and heads it stands for, so a test can read the
picture back and compare it with the predicate. Coordinates are integers, so the bytes are the
same wherever the pictures are drawn.

A recurrent mixer's predicate (mamba2, gated_deltanet, rwkv7, rwkv4, mamba, mlstm, slstm) is
causal: not keys it attends to, but the positions its output depends on, through the state.
"""

from __future__ import annotations

from dataclasses import dataclass
from xml.sax.saxutils import escape

from ecp_lm.config import ARCHS

SEQ_LEN, NUM_SEGMENTS, N_LAYERS, N_HEADS = 32, 4, 3, 2
CELL = 8
"""Pixels per position."""
GAP, LEFT, TOP = 28, 16, 40
"""Pixels between panels, before the first panel and above the panels (for their titles)."""

PICTURES: dict[str, dict[str, object]] = {
    **{arch: {"arch": arch} for arch in ARCHS},
    # a window per layer, half the heads of the top layer dilated, two global tokens
    "longformer": {"arch": "longformer", "window": "4,6,5", "dilation": "1,1,3",
                   "global_tokens": 2},
    "hybrid_ecp": {"arch": "hybrid", "layer_pattern": "ecp*2,transformer"},
    "hybrid_sliding_window": {"arch": "hybrid", "layer_pattern": "sliding_window*2,transformer"},
    "hybrid_mamba2": {"arch": "hybrid", "layer_pattern": "mamba2*2,sliding_window"},
}
"""Picture name -> the ModelConfig fields that differ from the shared small config."""


@dataclass(frozen=True)
class Panel:
    """One grid: the layers and heads whose queries at ``queries`` see ``allowed`` keys among
    ``keys`` (``allowed[i][j]``: query ``queries[i]`` sees key ``keys[j]``)."""

    layers: tuple[int, ...]
    heads: tuple[int, ...]
    queries: tuple[int, ...]
    keys: tuple[int, ...]
    allowed: tuple[tuple[bool, ...], ...]
    kinds: tuple[str, ...] = ()
    """A hybrid's layer architectures (empty otherwise)."""


def model_config(name: str):
    """The small ModelConfig picture ``name`` is drawn for."""
    from ecp_lm.config import ModelConfig

    return ModelConfig(vocab_size=256, d_model=16, n_layers=N_LAYERS, n_heads=N_HEADS,
                       seq_len=SEQ_LEN, num_segments=NUM_SEGMENTS, **PICTURES[name])


def build_architecture(name: str):
    """The ``Architecture`` of picture ``name``'s config."""
    from ecp_lm.model.archs import architecture

    cfg = model_config(name).resolved()
    return architecture(cfg.arch)(cfg)


def layer_grids(arch) -> list[tuple[int, list[int], list[int], list[list[list[bool]]]]]:
    """(layer, query positions, key positions, per-head grids) of each layer, following the rows
    through the layers as ``LanguageModel.hidden_states`` does on a full window."""
    import torch

    from ecp_lm.model.kernels.masks import materialize

    n_layers, n_heads = arch.cfg.n_layers, arch.cfg.n_heads
    rows, n_predicted = arch.input_rows(SEQ_LEN), arch.num_predicted(SEQ_LEN)
    out = []
    with torch.no_grad():
        for i in range(n_layers):
            layer = arch.layer(i)
            n_query = arch.num_queries(i, rows, n_predicted)
            keys = rows.positions()
            queries = keys[len(rows) - n_query:]
            grid = materialize(layer.mask, queries, keys, n_heads)
            grid = grid.expand(n_heads, len(queries), len(keys))  # (H, Rq, Rk)
            out.append((i, queries.tolist(), keys.tolist(), grid.tolist()))
            rows = rows.tail(n_query)
            compress = layer.compression(i)
            if compress is not None:  # the module maps rows as in the model (zero features)
                _, rows = compress(torch.zeros(1, len(rows), 1), rows)
    return out


def panels(arch) -> list[Panel]:
    """The distinct grids of ``arch``'s layers and heads, in layer order."""
    mixed = arch.cfg.layer_pattern is not None  # a hybrid: each panel names its layers' kind
    found: dict[tuple, list[tuple[int, int]]] = {}
    for i, queries, keys, grids in layer_grids(arch):
        kind = arch.cfg.layer_archs[i] if mixed else ""
        for head, grid in enumerate(grids):
            key = (kind, tuple(queries), tuple(keys), tuple(tuple(r) for r in grid))
            found.setdefault(key, []).append((i, head))
    result = []
    for (kind, queries, keys, allowed), members in found.items():
        layers = tuple(sorted({i for i, _ in members}))
        heads = tuple(sorted({h for _, h in members}))
        result.append(Panel(layers, heads, queries, keys, allowed, (kind,) if kind else ()))
    return result


def spans(values: tuple[int, ...]) -> str:
    """``0–1`` for (0, 1), ``2`` for (2,), ``0, 2`` for (0, 2)."""
    if len(values) > 1 and values == tuple(range(values[0], values[-1] + 1)):
        return f"{values[0]}–{values[-1]}"
    return ", ".join(map(str, values))


def title(panel: Panel, n_layers: int, n_heads: int) -> str:
    if len(panel.layers) == n_layers:
        text = "every layer"
    else:
        text = ("layers " if len(panel.layers) > 1 else "layer ") + spans(panel.layers)
    if len(panel.heads) < n_heads:
        text += (", heads " if len(panel.heads) > 1 else ", head ") + spans(panel.heads)
    if panel.kinds:
        text += f" ({', '.join(panel.kinds)})"
    return text


def panel_svg(panel: Panel, x: int, label: str) -> list[str]:
    size = SEQ_LEN * CELL
    m = SEQ_LEN // NUM_SEGMENTS
    out = [f'<g class="panel" transform="translate({x},{TOP})" '
           f'data-layers="{" ".join(map(str, panel.layers))}" '
           f'data-heads="{" ".join(map(str, panel.heads))}">',
           f'<text x="0" y="-8">{escape(label)}</text>',
           f'<rect class="grid" x="0" y="0" width="{size}" height="{size}"/>']
    for q in range(SEQ_LEN):
        if q not in panel.queries:
            out.append(f'<rect class="absent" x="0" y="{q * CELL}" width="{size}" '
                       f'height="{CELL}"/>')
    for k in range(SEQ_LEN):
        if k not in panel.keys:
            out.append(f'<rect class="absent" x="{k * CELL}" y="0" width="{CELL}" '
                       f'height="{size}"/>')
    for q, row in zip(panel.queries, panel.allowed, strict=True):
        cells = sorted(k for k, seen in zip(panel.keys, row, strict=True) if seen)
        start = 0
        while start < len(cells):  # one rect per run of consecutive key positions
            end = start
            while end + 1 < len(cells) and cells[end + 1] == cells[end] + 1:
                end += 1
            out.append(f'<rect class="on" x="{cells[start] * CELL}" y="{q * CELL}" '
                       f'width="{(end - start + 1) * CELL}" height="{CELL}"/>')
            start = end + 1
    guides = "".join(f"M{p * CELL} 0V{size}M0 {p * CELL}H{size}" for p in range(m, SEQ_LEN, m))
    out += [f'<path class="guide" d="{guides}"/>', "</g>"]
    return out


def caption(name: str, arch) -> list[str]:
    cfg = arch.cfg
    sizes = [f"N = {cfg.seq_len}"]
    if cfg.layer_pattern:
        sizes.append(f"layer_pattern = {cfg.layer_pattern}")
    for field in type(arch).sizes(cfg):
        sizes.append(f"{field} = {getattr(cfg, field)}")
        if field == "num_segments":
            sizes[-1] += f" (segments of {arch.segment_len})"
    first = f"{name}: {', '.join(sizes)}; {cfg.n_layers} layers, {cfg.n_heads} heads"
    recurrent = any(arch.layer(i).recurrent for i in range(cfg.n_layers))
    seen = ("attended, or for a recurrent layer depended on through its state" if recurrent
            else "attended")
    second = (f"rows: query positions, columns: key positions; blue: {seen}; grey: no row "
              f"in that layer; lines every {cfg.seq_len // NUM_SEGMENTS} positions")
    return [first, second]


def render(name: str) -> str:
    """Picture ``name`` as SVG text."""
    arch = build_architecture(name)
    found = panels(arch)
    size = SEQ_LEN * CELL
    lines = caption(name, arch)
    # About 7 pixels a character at 12 px sans-serif: room for the caption lines.
    width = max(LEFT + len(found) * (size + GAP), LEFT + 7 * max(map(len, lines)))
    height = TOP + size + 16 + 16 * len(lines)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
           "<style>.grid{fill:#fff;stroke:#999}.absent{fill:#e4e4e4}.on{fill:#2f6fd6}"
           ".guide{fill:none;stroke:#bbb;stroke-width:0.5}text{fill:#222}</style>",
           f'<rect width="{width}" height="{height}" fill="#fff"/>']
    for j, panel in enumerate(found):
        out += panel_svg(panel, LEFT + j * (size + GAP),
                         title(panel, arch.cfg.n_layers, arch.cfg.n_heads))
    for j, line in enumerate(lines):
        out.append(f'<text class="caption" x="{LEFT}" y="{TOP + size + 20 + 16 * j}">'
                   f"{escape(line)}</text>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def render_all() -> dict[str, str]:
    """``docs/img/masks/NAME.svg`` (relative to the repository) -> its SVG text."""
    return {f"docs/img/masks/{name}.svg": render(name) for name in PICTURES}
