"""RMSNorm and Mamba-2's gated, grouped RMSNorm as one op, computed in float32.

    rms_norm(x, weight, eps, z=None, group_size=None, norm_before_gate=False, backend=...)

Backends: "cpu" (one C pass forward and one backward, ops/cpu.py) and "torch" (torch's
``F.rms_norm``, or the formulas written out for groups and gates). ``reference.rms_norm_ref``
is the float64 formula every backend is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._backends import BackendTable
from .cpu import rms_norm_cpu


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, or as it is when wider (float64 models compute in float64)."""
    return x if x.dtype == torch.float64 else x.float()


def _rms_norm_torch(x, weight, eps, z, group_size, norm_before_gate) -> torch.Tensor:
    M = x.shape[-1]
    if z is None and group_size == M:
        return F.rms_norm(x, (M,), weight, eps)
    if z is not None and not norm_before_gate:
        x = x * F.silu(z)
    groups = x.unflatten(-1, (-1, group_size))  # (..., M / group_size, group_size)
    y = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * weight
    if z is not None and norm_before_gate:
        y = y * F.silu(z)
    return y


# Backends take (x, weight, eps, z, group_size, norm_before_gate), all validated and upcast;
# "cpu" returns None where it does not apply, and "auto" then runs "torch".
BACKENDS = BackendTable("rms_norm", auto={"cpu": ("cpu", "torch"), "*": ("torch",)})
BACKENDS.add("torch", _rms_norm_torch)
BACKENDS.add("cpu", rms_norm_cpu, devices=("cpu",))


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    z: torch.Tensor | None = None,
    group_size: int | None = None,
    norm_before_gate: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """RMSNorm of x (..., M) over groups of ``group_size`` channels (default M): each group
    divided by sqrt(mean(group²) + eps), times ``weight`` (M,). With ``z`` (like x), Mamba-2's
    gate: norm(x·silu(z)), or norm(x)·silu(z) with ``norm_before_gate``. Computed in float32
    (float64 for float64 inputs); returned in x's dtype.

    ``backend="auto"`` takes the C kernels on the CPU where they apply (x contiguous) and
    torch's tensor code elsewhere; ``"cpu"`` where they do not apply is an error."""
    if not isinstance(x, torch.Tensor) or x.ndim == 0:
        raise ValueError(f"x must be a tensor of shape (..., M), got {x!r}")
    M = x.shape[-1]
    group = M if group_size is None else group_size
    if group < 1 or M % group:
        raise ValueError(f"group_size must divide the last dim of x ({M}), got {group_size}")
    if weight.shape != (M,):
        raise ValueError(f"weight must have shape ({M},) for x of shape {tuple(x.shape)}, got {tuple(weight.shape)}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    x32, w32, z32 = upcast(x), upcast(weight), None if z is None else upcast(z)
    needs = lambda: f"CPU tensors and x contiguous (got x {x.dtype} on {x.device}, contiguous {x.is_contiguous()})"
    args = (x32, w32, eps, z32, group, norm_before_gate)
    return BACKENDS.run(backend, x.device, args, fallback="torch", needs=needs).to(x.dtype)
