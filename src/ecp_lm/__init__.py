"""ecp-lm: efficient long-context autoregressive models (ECP and the PerceiverAR family)."""

from ecp_lm.config import ARCHS, PRESETS, ModelConfig
from ecp_lm.generate import generate
from ecp_lm.models import LanguageModel, build_model

__version__ = "0.1.0"

__all__ = ["ARCHS", "PRESETS", "LanguageModel", "ModelConfig", "__version__", "build_model",
           "generate"]
