"""SiLU's derivative, for the backward passes written out by hand (the gated norm and the causal
conv here, Mamba-3's output gate in ssm.scan)."""

from __future__ import annotations

import torch


def dsilu(z: torch.Tensor) -> torch.Tensor:
    """d silu(z) / dz = σ(z)·(1 + z·(1 − σ(z)))."""
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))
