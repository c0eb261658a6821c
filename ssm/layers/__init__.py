"""Mixers and blocks. Each mixer has forward(x, cache=None, cu_seqlens=None) and step(x_t, cache);
they call the scan core and the ops only through their public functions. MHA is the attention
mixer of hybrid models."""

from .attention import MHA
from .block import Block, GatedMLP
from .cache import AttentionCache, LayerCache, Mamba3Cache
from .mamba import Mamba
from .mamba2 import Mamba2
from .mamba3 import Mamba3
from .norm import RMSNorm, RMSNormGated

__all__ = [
    "Mamba",
    "Mamba2",
    "Mamba3",
    "MHA",
    "Mamba3Cache",
    "AttentionCache",
    "Block",
    "GatedMLP",
    "RMSNorm",
    "RMSNormGated",
    "LayerCache",
]
