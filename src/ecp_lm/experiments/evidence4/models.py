"""The models Evidence IV compares, sized alike, and what each comparison holds equal.

Every model shares the skeleton's sizes (vocabulary, d_model, layers, heads, N, m); what differs:

- ``ecp``: segments of m;
- ``sliding_window``: ECP's unmasked score entries (its default w); ``sliding_window_tiles``:
  w = m, ECP's cost in the research's tiles;
- ``s2``: groups of m (about half ECP's entries); ``transformer``: full causal attention;
- ``perceiver_ar``: PerceiverAR with the default l = N/2 latents, the research's headline
  comparison. It reads the same input tokens per step but predicts only the latents, so equal
  training tokens (the same steps, batch and N) and equal training time (by the step times
  measured side by side) are two comparisons;
- ``mamba2``, ``gated_deltanet``: their ``mixer_width`` chosen so that the parameter count is the
  nearest to ECP's (``model.match_parameters``); ``rwkv7``: matched by construction (its keys and
  values are d_model wide, as attention's), its low-rank maps on top.
"""

from __future__ import annotations

from typing import Any

from ecp_lm.config import ModelConfig

MODELS: dict[str, dict[str, Any]] = {
    "ecp": {"arch": "ecp"},
    "sliding_window": {"arch": "sliding_window"},
    "sliding_window_tiles": {"arch": "sliding_window", "window": "m"},
    "s2": {"arch": "s2"},
    "transformer": {"arch": "transformer"},
    "perceiver_ar": {"arch": "perceiver_ar"},
    "mamba2": {"arch": "mamba2", "mixer_width": "matched"},
    "gated_deltanet": {"arch": "gated_deltanet", "mixer_width": "matched"},
    "rwkv7": {"arch": "rwkv7"},
}
"""Each model's ``ModelConfig`` fields beside the shared size: ``"m"`` is the segment length,
``"matched"`` the width ``match_parameters`` gives against ECP."""

RECURRENT = ("mamba2", "gated_deltanet", "rwkv7")


def model_config(name: str, size: dict[str, Any], vocab_size: int = 256) -> ModelConfig:
    """Model ``name`` at ``size`` (d_model, n_layers, n_heads, seq_len, num_segments)."""
    from ecp_lm.model.matching import match_parameters

    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; models: {', '.join(MODELS)}")
    m = size["seq_len"] // size["num_segments"]
    fields = {k: (m if v == "m" else v) for k, v in MODELS[name].items()
              if v != "matched"}
    cfg = ModelConfig(vocab_size=vocab_size, **size, **fields)
    if MODELS[name].get("mixer_width") == "matched":
        cfg = match_parameters(cfg, "ecp")
    return cfg

