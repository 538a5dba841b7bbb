"""ecp-lm: efficient long-context autoregressive models (ECP and the PerceiverAR family).

``prepare``, ``train`` and ``load`` (a ``Run``: ``generate``, ``evaluate``) are the command
line's journey as Python functions (``ecp_lm.api``).

The names below are imported on first use, so that importing the package (as the ``ecp``
command does first) does not yet load torch.
"""

from __future__ import annotations

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {"ARCHS": "ecp_lm.config", "PRESETS": "ecp_lm.config", "ModelConfig": "ecp_lm.config",
            "generate": "ecp_lm.generation", "LanguageModel": "ecp_lm.model",
            "build_model": "ecp_lm.model", "prepare": "ecp_lm.api", "train": "ecp_lm.api",
            "load": "ecp_lm.api", "Run": "ecp_lm.api"}

__all__ = ["ARCHS", "PRESETS", "LanguageModel", "ModelConfig", "Run", "__version__",
           "build_model", "generate", "load", "prepare", "train"]


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ecp_lm' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
