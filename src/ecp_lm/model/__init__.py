"""The model: the shared skeleton (model.py), the attention patterns (archs/), their kernels
(kernels/), the decoding cache, the loss and context parallelism."""

from __future__ import annotations

from ecp_lm.model.model import LanguageModel, build_model

__all__ = ["LanguageModel", "build_model"]
