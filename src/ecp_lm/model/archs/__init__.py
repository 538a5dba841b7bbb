"""The architectures, by ``ModelConfig.arch`` name.

Each lives in one module of this package as one ``Architecture`` subclass (base.py says what it
owns); adding one is one new file and one line below. Importing this module loads none of them
(nor torch): ``architecture(name)`` imports the one asked for.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ecp_lm.model.archs.base import Architecture

REGISTRY: dict[str, str] = {  # name -> "module:Class" in this package
    "transformer": "transformer:Transformer",
    "perceiver_ar": "perceiver_ar:PerceiverAR",
    "double": "double:Double",
    "compressed_double": "compressed_double:CompressedDouble",
    "ssplit": "double:SSplit",
    "ecp": "ecp:ECP",
    "sliding_window": "sliding_window:SlidingWindow",
    "block_local": "block_local:BlockLocal",
    "s2": "s2:ShiftedSparse",
}

ARCHS: tuple[str, ...] = tuple(REGISTRY)


def architecture(name: str) -> type[Architecture]:
    """The class of architecture ``name`` (ValueError for an unknown name)."""
    if name not in REGISTRY:
        raise ValueError(f"arch={name!r} is not one of {', '.join(ARCHS)}")
    module, cls = REGISTRY[name].split(":")
    return getattr(import_module(f"{__name__}.{module}"), cls)


__all__ = ["ARCHS", "REGISTRY", "architecture"]
