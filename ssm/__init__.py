"""ssm: Mamba-style selective state-space models on a tested scan core."""

from .scan import backends, linear_scan, selective_scan

__version__ = "0.1.0"

__all__ = ["selective_scan", "linear_scan", "backends"]
