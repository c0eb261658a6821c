"""RMSNorm and the gated, grouped RMSNorm of Mamba-2, computed in float32."""

from __future__ import annotations

import torch
from torch import nn

from ..ops import rms_norm
from ..ops.norm import upcast

__all__ = ["RMSNorm", "RMSNormGated", "upcast"]


class RMSNorm(nn.Module):
    """x / sqrt(mean(x², last dim) + eps) · weight. Parameter: ``weight`` (d,)."""

    def __init__(self, d: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # on the CPU one C pass forward and one backward; elsewhere torch's own rms_norm, or for
        # 16-bit inputs the formulas with a backward that keeps x as it came (ssm.ops.norm)
        return rms_norm(x, self.weight, self.eps)


class RMSNormGated(nn.Module):
    """Mamba-2's output norm: RMSNorm over groups of ``group_size`` channels, gated by silu(z).

    ``norm_before_gate=False`` (Mamba-2's default): norm(x · silu(z)); otherwise norm(x) · silu(z).
    Parameter: ``weight`` (d,). x, z: (..., d).
    """

    def __init__(
        self,
        d: int,
        eps: float = 1e-5,
        norm_before_gate: bool = False,
        group_size: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        group_size = d if group_size is None else group_size
        if d % group_size:
            raise ValueError(f"group_size must divide d = {d}, got {group_size}")
        self.eps, self.norm_before_gate, self.group_size = eps, norm_before_gate, group_size
        self.weight = nn.Parameter(torch.ones(d, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        # on the CPU one C pass forward and one backward; elsewhere the formulas written out, with
        # a backward that keeps x and z as they came and one 1/rms per group (ssm.ops.norm)
        return rms_norm(x, self.weight, self.eps, z, self.group_size, self.norm_before_gate)
