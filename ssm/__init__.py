"""ssm: Mamba-style selective state-space models on a tested scan core."""

from .layers import Mamba, Mamba2, Mamba3
from .models import MambaConfig, MambaLM
from .scan import backends, linear_scan, selective_scan, ssd

__version__ = "0.1.0"

__all__ = ["Mamba", "Mamba2", "Mamba3", "MambaLM", "MambaConfig", "selective_scan", "linear_scan", "ssd", "backends"]
