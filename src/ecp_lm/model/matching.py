"""Parameter counts matched across architectures: a recurrent mixer's ``mixer_width`` chosen so
that its model has as many parameters as another architecture's at the same d_model.

Attention costs 4·d² per layer (the q, k, v and output projections); a mixer's projections
depend on its width W: Mamba-2's about 3·d·W + 2·d·N, Gated DeltaNet's 2·d² + 3·d·W. Everything
else (embedding, feed-forward, norms, head) is the skeleton's and the same. RWKV-7 has no width
to choose (its keys and values are d_model wide, as attention's): it is matched by construction,
its low-rank maps and per-channel vectors on top.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ecp_lm.config import ModelConfig
from ecp_lm.model.model import build_model


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of the model ``cfg`` builds (counted on the meta device: nothing allocated)."""
    with torch.device("meta"):
        return build_model(cfg).num_params()


def match_parameters(cfg: ModelConfig, like: str | ModelConfig = "ecp",
                     field: str = "mixer_width") -> ModelConfig:
    """``cfg`` with the ``mixer_width`` (a multiple of n_heads) whose model's parameter count is
    nearest to that of ``like``: an architecture's name (built with ``cfg``'s shared sizes, as
    ``arch`` overrides it) or a config. A config whose layers have no width to choose comes back
    unchanged. ``field="ff_hidden"`` chooses the feed-forward's hidden width instead (any
    architecture with the skeleton's feed-forward, e.g. a Llama-style transformer)."""
    if isinstance(like, str):
        like = dataclasses.replace(cfg, arch=like, layer_pattern=None, mixer_width=None,
                                   state_size=None, conv_size=None, chunk_size=None,
                                   sink_tokens=0, tied_kv=False)
    if field not in ("mixer_width", "ff_hidden"):
        raise ValueError(f"field={field!r}: match_parameters chooses mixer_width or ff_hidden")
    if field == "mixer_width" and "mixer_width" not in _sizes(cfg):
        return cfg
    target, step = parameter_count(like), cfg.n_heads if field == "mixer_width" else 1

    @functools.cache  # the first count of the search is also the one that checks the width
    def count(width: int) -> int:
        return parameter_count(dataclasses.replace(cfg, **{field: width}))

    # The count grows with the width: search the multiples of n_heads for the nearest.
    low, high = 1, max(2, 4 * cfg.d_model // step)
    if count(step) == count(high * step):
        raise ValueError(f"arch={cfg.arch!r}: {field} does not change its parameter count, so "
                         f"it cannot match {like.arch!r}'s")
    while count(high * step) < target:
        high *= 2
    while high - low > 1:
        mid = (low + high) // 2
        if count(mid * step) < target:
            low = mid
        else:
            high = mid
    best = min((low, high), key=lambda n: abs(count(n * step) - target))
    return dataclasses.replace(cfg, **{field: best * step})


def _sizes(cfg: ModelConfig) -> tuple[str, ...]:
    from ecp_lm.model.archs import architecture

    return architecture(cfg.arch).sizes(cfg)
