"""Models: the shared skeleton and the attention patterns (loaded on first use, so that the
architecture registry in ``model.archs`` can be read without torch)."""

from __future__ import annotations

from importlib import import_module

__all__ = ["LanguageModel", "build_model"]


def __getattr__(name: str) -> object:
    if name not in __all__:
        raise AttributeError(f"module 'ecp_lm.model' has no attribute {name!r}")
    value = getattr(import_module("ecp_lm.model.model"), name)
    globals()[name] = value
    return value
