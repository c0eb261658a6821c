"""Mixers and blocks. Each mixer has forward(x, cache=None) and step(x_t, cache); they call the
scan core only through its public functions."""

from .block import Block, GatedMLP
from .cache import LayerCache, Mamba3Cache
from .mamba import Mamba
from .mamba2 import Mamba2
from .mamba3 import Mamba3
from .norm import RMSNorm, RMSNormGated

__all__ = ["Mamba", "Mamba2", "Mamba3", "Mamba3Cache", "Block", "GatedMLP", "RMSNorm", "RMSNormGated", "LayerCache"]
