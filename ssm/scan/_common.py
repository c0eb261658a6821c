"""Pieces of arithmetic shared by the fast paths (pscan, cpu, chunked, triton's wrappers, the
one-step functions). The references in reference.py do not import them: each writes its own
plain version, so that a bug here shows up as a difference against the reference.

Shape symbols: B batch, L length, D channels, N state size, G groups, H heads, P head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def selective_delta(
    delta: torch.Tensor, delta_bias: torch.Tensor | None, delta_softplus: bool
) -> torch.Tensor:
    """Δ = softplus(delta + delta_bias), each part only when asked. delta: (B, D, L)."""
    if delta_bias is not None:
        delta = delta + delta_bias.to(delta.dtype)[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    return delta


def selective_skip_and_gate(
    y: torch.Tensor, u: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None
) -> torch.Tensor:
    """(y + D·u)·silu(z), each part only when given. y, u, z: (B, D, L); D: (D,)."""
    if D is not None:
        y = y + D.to(y.dtype)[:, None] * u
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y


def ssd_delta(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> torch.Tensor:
    """Δ = clamp(softplus(dt + dt_bias), *dt_limit), each part only when asked. dt: (B, L, H)."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, float("inf")):  # the default means no clamp, as in mamba-ssm
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def ssd_skip_and_gate(
    y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None
) -> torch.Tensor:
    """(y + D·x)·silu(z). y, x, z: (B, L, H, P) (or without L); D: (H,) or (H, P)."""
    if D is not None:
        D = D.to(y.dtype)
        y = y + (D[:, None] if D.ndim == 1 else D) * x
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y
