"""The models Evidence III compares, and each one's attention cost under both conventions.

A model is an architecture with its size overrides. The sliding window appears twice, matched to
ECP (segments of m) two ways:

- ``sliding_window``: its default w, whose unmasked score entries equal ECP's (w = 389 at
  N = 2048, m = 256: each query sees itself and w - 1 = 388 keys back);
- ``sliding_window_tiles``: w = m, whose cost in tiles equals ECP's (each block of m queries
  against its own block and the one before, the research's convention and what a block-sparse
  kernel pays); its reach per layer is m - 1, ECP's is m to 2m - 1.

Costs (``costs``): the exact unmasked score entries, the research's tiles (``tile_entries``),
and the tiles a block-sparse kernel visits at its block size (``kernel_tiles``: the query-key
block pairs with any unmasked entry, FlexAttention's default 128), each over full attention's.
"""

from __future__ import annotations

from typing import Any

import torch

from ecp_lm.bench.complexity import attention_cost
from ecp_lm.config import ModelConfig
from ecp_lm.model.archs import architecture
from ecp_lm.model.kernels.masks import materialize, positions

KERNEL_BLOCK = 128
"""FlexAttention's default block size: the tile a block-sparse kernel visits or skips."""

MODELS: dict[str, dict[str, Any]] = {
    "transformer": {"arch": "transformer"},
    "ecp": {"arch": "ecp"},
    "sliding_window": {"arch": "sliding_window"},
    "sliding_window_tiles": {"arch": "sliding_window", "window": "m"},
    "block_local": {"arch": "block_local"},
    "s2": {"arch": "s2"},
    # Hybrids: three local layers and one global (the transformer's), tiled over the depth.
    "hybrid_ecp": {"arch": "hybrid", "layer_pattern": "ecp*3,transformer"},
    "hybrid_sliding_window": {"arch": "hybrid", "layer_pattern": "sliding_window*3,transformer"},
    "hybrid_sliding_window_tiles": {"arch": "hybrid",
                                    "layer_pattern": "sliding_window*3,transformer",
                                    "window": "m"},
    "hybrid_block_local": {"arch": "hybrid", "layer_pattern": "block_local*3,transformer"},
}
HYBRIDS = tuple(name for name in MODELS if name.startswith("hybrid_"))
"""Each model's ``ModelConfig`` fields beside the shared size; ``"m"`` is the segment length."""


def variant(name: str, segment_len: int) -> dict[str, Any]:
    """The ``ModelConfig`` fields of model ``name`` (its arch and overrides) for segments of
    ``segment_len``."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; models: {', '.join(MODELS)}")
    return {k: (segment_len if v == "m" else v) for k, v in MODELS[name].items()}


def model_config(name: str, size: dict[str, Any]) -> dict[str, Any]:
    """The ``model:`` section of ``name`` at ``size`` (vocab, width, depth, N, S)."""
    m = size["seq_len"] // size["num_segments"]
    return {"vocab_size": 256, **size, **variant(name, m)}


def kernel_tiles(cfg: ModelConfig, block: int = KERNEL_BLOCK) -> float | None:
    """Tiles a block-sparse kernel visits, as a fraction of full attention's: the (query block,
    key block) pairs of ``block`` x ``block`` with any unmasked entry, per layer and head,
    averaged. None for an architecture whose rows are not one query per position (the perceiver
    family) or whose N is not a multiple of ``block``."""
    arch = architecture(cfg.arch)(cfg)
    n = cfg.seq_len
    if n % block or arch.num_predicted(n) != n:
        return None
    layers = [arch.layer(i) for i in range(cfg.n_layers)] if hasattr(arch, "layer") else \
        [arch] * cfg.n_layers  # a hybrid's layers each have their own mask
    if any(getattr(layer, "mask", None) is None for layer in layers):
        return None
    q = positions(0, n)
    shares = []
    for layer in layers:
        grid = materialize(layer.mask, q, q, cfg.n_heads)  # (N, N) or (H, N, N)
        grid = grid.reshape(*grid.shape[:-2], n // block, block, n // block, block)
        visited = grid.any(dim=-1).any(dim=-2)  # (..., N/b, N/b)
        shares.append(float(visited.to(torch.float64).mean()))
    return sum(shares) / len(shares)


def costs(cfg: ModelConfig) -> dict[str, float | None]:
    """Attention cost over full attention's, three ways (see the module)."""
    cost = attention_cost(cfg)
    return {"entries": cost.ratio_to_full, "research_tiles": cost.tile_ratio_to_full,
            "kernel_tiles": kernel_tiles(cfg), "window": cost.window}


def coverage(sizes: list[int], scored_bytes: int | None) -> dict[str, Any]:
    """How much of a split the first ``scored_bytes`` bytes cover (None: all of it): the
    documents (of the given byte ``sizes``, in stream order) with at least one byte inside, and
    the share of the split's bytes."""
    total = sum(sizes)
    scored = total if scored_bytes is None else min(scored_bytes, total)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return {"documents": sum(start < scored for start in starts), "of": len(sizes),
            "bytes": scored, "share": scored / total if total else 0.0}
