"""Models: the shared skeleton and the six attention patterns."""

from ecp_lm.models.lm import LanguageModel, build_model

__all__ = ["LanguageModel", "build_model"]
