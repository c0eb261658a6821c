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
from .activation import dsilu
from .cpu import rms_norm_cpu


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, or as it is when wider (float64 models compute in float64)."""
    return x if x.dtype == torch.float64 else x.float()


def _rms_norm_torch(x, weight, eps, z, group_size, norm_before_gate) -> torch.Tensor:
    M = x.shape[-1]
    if z is None and group_size == M and x.dtype == weight.dtype == upcast(x).dtype:
        return F.rms_norm(x, (M,), weight, eps)  # keeps x, which is kept anyway, and 1/rms
    return _RMSNorm.apply(x, weight, eps, z, group_size, norm_before_gate)


def _rms_norm_cpu(x, weight, eps, z, group_size, norm_before_gate) -> torch.Tensor | None:
    """The C kernels (float32 or float64 only) on the inputs upcast, or None where they do not apply."""
    z = None if z is None else upcast(z)
    out = rms_norm_cpu(upcast(x), upcast(weight), eps, z, group_size, norm_before_gate)
    return None if out is None else out.to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    """The tensor formulas of ``rms_norm`` with a backward written out, keeping for it only the
    inputs as they came and each group's 1/rms. Autograd through the formulas kept five float32
    tensors of x's size (x and z upcast, silu(z), the gated product, the normalised one): 20
    bytes a channel, where this keeps bfloat16 x (2 bytes) and z, most often a view of
    in_proj's output that is kept anyway. Computed in float32 (float64 for float64 inputs),
    forward and backward; returned in x's dtype."""

    @staticmethod
    def forward(ctx, x, weight, eps, z, group, norm_before_gate):
        _, v, gate = _RMSNorm._gated_input(x, z, norm_before_gate)
        groups = v.unflatten(-1, (-1, group))
        rstd = torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)  # (..., M / group, 1)
        y = (groups * rstd).flatten(-2) * upcast(weight).to(v.dtype)
        if gate is not None and norm_before_gate:
            y = y * gate
        ctx.save_for_backward(x, weight, z, rstd)
        ctx.group, ctx.norm_before_gate = group, norm_before_gate
        return y.to(x.dtype)

    @staticmethod
    def _gated_input(x, z, norm_before_gate):
        """(x, what is normalised, silu(z) or None), in the compute dtype."""
        x = upcast(x)
        gate = None if z is None else F.silu(z.to(x.dtype))
        return x, (x if gate is None or norm_before_gate else x * gate), gate

    @staticmethod
    def backward(ctx, grad):
        x, weight, z, rstd = ctx.saved_tensors
        group, before = ctx.group, ctx.norm_before_gate
        x_c, v, gate = _RMSNorm._gated_input(x, z, before)
        w = upcast(weight).to(v.dtype)
        n = (v.unflatten(-1, (-1, group)) * rstd).flatten(-2)  # the normalised input
        g = grad.to(v.dtype)
        dz = None
        if gate is not None and before:  # y = n·w·silu(z)
            if ctx.needs_input_grad[3]:
                dz = g * n * w * dsilu(z.to(v.dtype))
            g = g * gate
        dw = (g * n).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        dn = (g * w).unflatten(-1, (-1, group))
        n = n.unflatten(-1, (-1, group))
        dv = (rstd * (dn - n * (dn * n).mean(-1, keepdim=True))).flatten(-2)
        if gate is not None and not before:  # v = x·silu(z)
            if ctx.needs_input_grad[3]:
                dz = dv * x_c * dsilu(z.to(v.dtype))
            dv = dv * gate
        dx = dv.to(x.dtype) if ctx.needs_input_grad[0] else None
        return dx, dw, None, None if dz is None else dz.to(z.dtype), None, None


# Backends take (x, weight, eps, z, group_size, norm_before_gate), validated, in the caller's
# dtypes, and return x's dtype; "cpu" returns None where it does not apply, and "auto" then
# runs "torch".
BACKENDS = BackendTable("rms_norm", auto={"cpu": ("cpu", "torch"), "*": ("torch",)})
BACKENDS.add("torch", _rms_norm_torch)
BACKENDS.add("cpu", _rms_norm_cpu, devices=("cpu",))


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
    needs = lambda: f"CPU tensors and x contiguous (got x {x.dtype} on {x.device}, contiguous {x.is_contiguous()})"
    args = (x, weight, eps, z, group, norm_before_gate)
    return BACKENDS.run(backend, x.device, args, fallback="torch", needs=needs)
