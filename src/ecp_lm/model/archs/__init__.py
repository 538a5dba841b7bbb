"""The architectures, by ``ModelConfig.arch`` name.

Each lives in one module of this package as one ``Architecture`` subclass (base.py says what it
owns); adding one is one new file, its name in ``config.ARCHS`` and one line below (and, if its
every layer keeps all rows and predicts every position, one in ``hybrid.LAYERS``).
"""

from __future__ import annotations

from ecp_lm.model.archs.base import Architecture
from ecp_lm.model.archs.block_local import BlockLocal
from ecp_lm.model.archs.compressed_double import CompressedDouble
from ecp_lm.model.archs.compressive import Compressive
from ecp_lm.model.archs.double import Double, SSplit
from ecp_lm.model.archs.ecp import ECP
from ecp_lm.model.archs.gated_deltanet import GatedDeltaNet
from ecp_lm.model.archs.hybrid import XLSTM, Hybrid
from ecp_lm.model.archs.longformer import Longformer
from ecp_lm.model.archs.mamba import Mamba
from ecp_lm.model.archs.mamba2 import Mamba2
from ecp_lm.model.archs.perceiver_ar import PerceiverAR
from ecp_lm.model.archs.performer import Performer
from ecp_lm.model.archs.routing import Routing
from ecp_lm.model.archs.rwkv4 import RWKV4
from ecp_lm.model.archs.rwkv7 import RWKV7
from ecp_lm.model.archs.s2 import ShiftedSparse
from ecp_lm.model.archs.sliding_window import SlidingWindow
from ecp_lm.model.archs.sparse_transformer import SparseTransformer
from ecp_lm.model.archs.transformer import Transformer
from ecp_lm.model.archs.xlstm import MLSTM, SLSTM

REGISTRY: dict[str, type[Architecture]] = {
    "transformer": Transformer,
    "perceiver_ar": PerceiverAR,
    "double": Double,
    "compressed_double": CompressedDouble,
    "ssplit": SSplit,
    "ecp": ECP,
    "sliding_window": SlidingWindow,
    "block_local": BlockLocal,
    "s2": ShiftedSparse,
    "mamba2": Mamba2,
    "gated_deltanet": GatedDeltaNet,
    "rwkv7": RWKV7,
    "rwkv4": RWKV4,
    "mamba": Mamba,
    "mlstm": MLSTM,
    "slstm": SLSTM,
    "performer": Performer,
    "xlstm": XLSTM,  # a stack of mlstm and slstm layers
    "sparse_transformer": SparseTransformer,
    "longformer": Longformer,
    "compressive": Compressive,
    "routing": Routing,
    "hybrid": Hybrid,  # layers of the others, as ``layer_pattern`` says
}


def architecture(name: str) -> type[Architecture]:
    """The class of architecture ``name`` (ValueError for an unknown name)."""
    if name not in REGISTRY:
        raise ValueError(f"arch={name!r} is not one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


__all__ = ["REGISTRY", "Architecture", "architecture"]
