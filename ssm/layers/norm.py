"""RMSNorm and the gated, grouped RMSNorm of Mamba-2, computed in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..scan.cpu import rms_norm_cpu


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, or as it is when wider (float64 models compute in float64)."""
    return x if x.dtype == torch.float64 else x.float()


class RMSNorm(nn.Module):
    """x / sqrt(mean(x², last dim) + eps) · weight. Parameter: ``weight`` (d,)."""

    def __init__(self, d: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32, w32 = upcast(x), upcast(self.weight)
        # on the CPU one C pass forward and one backward; elsewhere torch's own rms_norm
        y = rms_norm_cpu(x32, w32, self.eps)
        if y is None:
            y = F.rms_norm(x32, (x.shape[-1],), w32, self.eps)
        return y.to(x.dtype)


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
        x32 = upcast(x)
        # on the CPU one C pass forward and one backward; elsewhere the formulas below
        y = rms_norm_cpu(
            x32, upcast(self.weight), self.eps, None if z is None else upcast(z), self.group_size, self.norm_before_gate
        )
        if y is not None:
            return y.to(x.dtype)
        if z is not None and not self.norm_before_gate:
            x32 = x32 * F.silu(upcast(z))
        groups = x32.unflatten(-1, (-1, self.group_size))  # (..., groups, group_size)
        y = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        y = y * upcast(self.weight)
        if z is not None and self.norm_before_gate:
            y = y * F.silu(upcast(z))
        return y.to(x.dtype)
