"""The model: the shared skeleton (model.py), the attention patterns and recurrent mixers
(archs/), their kernels (kernels/), the decoding caches, the loss, context parallelism and
parameter matching."""

from __future__ import annotations

from ecp_lm.model.matching import match_parameters, parameter_count
from ecp_lm.model.model import LanguageModel, build_model

__all__ = ["LanguageModel", "build_model", "match_parameters", "parameter_count"]
