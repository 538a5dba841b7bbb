"""The six architectures, by ``ModelConfig.arch`` name."""

from ecp_lm.models.archs.base import Architecture
from ecp_lm.models.archs.compressed_double import CompressedDouble
from ecp_lm.models.archs.double import Double, SSplit
from ecp_lm.models.archs.ecp import ECP
from ecp_lm.models.archs.perceiver_ar import PerceiverAR
from ecp_lm.models.archs.transformer import Transformer

ARCHITECTURES: dict[str, type[Architecture]] = {
    "transformer": Transformer,
    "perceiver_ar": PerceiverAR,
    "double": Double,
    "compressed_double": CompressedDouble,
    "ssplit": SSplit,
    "ecp": ECP,
}

__all__ = ["ARCHITECTURES", "Architecture"]
