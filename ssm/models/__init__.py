"""The language model: configuration, MambaLM with generation, checkpoint loading."""

from .config import MambaConfig
from .lm import InferenceCache, MambaLM, sample

__all__ = ["MambaConfig", "MambaLM", "InferenceCache", "sample"]
