"""Mixers and blocks. Each mixer has forward(x, cache=None) and step(x_t, cache); they call the
scan core only through its public functions."""

from .block import Block, GatedMLP
from .cache import LayerCache
from .mamba import Mamba
from .mamba2 import Mamba2
from .norm import RMSNorm, RMSNormGated

__all__ = ["Mamba", "Mamba2", "Block", "GatedMLP", "RMSNorm", "RMSNormGated", "LayerCache"]
