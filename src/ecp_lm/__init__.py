"""ecp-lm: efficient long-context autoregressive models (ECP and the PerceiverAR family).

The names below are imported on first use, so that importing the package (as the ``ecp``
command does first) does not yet load torch.
"""

from __future__ import annotations

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {"ARCHS": "ecp_lm.config", "PRESETS": "ecp_lm.config", "ModelConfig": "ecp_lm.config",
            "generate": "ecp_lm.generation", "LanguageModel": "ecp_lm.model",
            "build_model": "ecp_lm.model"}

__all__ = ["ARCHS", "PRESETS", "LanguageModel", "ModelConfig", "__version__", "build_model",
           "generate"]


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ecp_lm' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
