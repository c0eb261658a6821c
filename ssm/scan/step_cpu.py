"""The one-token step of ``selective_scan`` (recurrent decoding) in one C call: the binding of
selective_step in ssm/native/selective.c. ``step.py`` calls it and runs its PyTorch form when it
returns None (gradients wanted, another dtype or device, torch.compile, no kernels built)."""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from ..native import declare, kernel, ptr, ready, threads
from ._checks import compute_dtype


class _StepArgs(ctypes.Structure):
    """StepArgs of ssm/native/selective.c, field for field."""

    _fields_ = (
        [(name, ctypes.c_int64) for name in ("batch", "dim", "N", "softplus", "nthreads")]
        + [(name, ctypes.c_void_p) for name in ("state", "u", "delta", "A", "B", "C", "D", "z", "delta_bias")]
        + [(name, ctypes.c_int64) for name in ("su", "sdelta", "sz", "sB", "sC")]
        + [(name, ctypes.c_void_p) for name in ("out", "new_state")]
    )


declare("selective_step", [ctypes.POINTER(_StepArgs)])


def selective_step_cpu(state, u, delta, A, B, C, D, z, delta_bias, delta_softplus) -> tuple[Tensor, Tensor] | None:
    """``selective_scan_step`` in one C call, or None when it does not apply: CPU tensors of one
    float dtype (float32 or float64, the state's and u's), B and C (batch, N), no gradient to
    keep, not inside torch.compile, kernels built. Arguments validated by the caller."""
    dtype = state.dtype
    if (
        dtype not in (torch.float32, torch.float64)
        or state.device.type != "cpu"
        or u.dtype != dtype
        or compute_dtype(state, u, delta, A, B, C, D, z, delta_bias) != dtype
        or B.ndim != 2
        or C.ndim != 2
        or torch.compiler.is_compiling()
        or (
            torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in (state, u, delta, A, B, C, D, z, delta_bias))
        )
    ):
        return None
    if not ready():
        return None
    batch, dim, N = state.shape

    def rows(x):  # (batch, k) with the last dim contiguous, in the state's dtype
        x = x.to(dtype)
        return x if x.stride(-1) == 1 else x.contiguous()

    state = state.contiguous()
    u, delta, B, C = rows(u), rows(delta), rows(B), rows(C)
    z = None if z is None else rows(z)
    A = A.to(dtype).contiguous()
    D = None if D is None else D.to(dtype).contiguous()
    delta_bias = None if delta_bias is None else delta_bias.to(dtype).contiguous()
    out, new_state = u.new_empty(batch, dim), torch.empty_like(state)
    a = _StepArgs()
    a.batch, a.dim, a.N, a.softplus, a.nthreads = batch, dim, N, int(delta_softplus), threads()
    a.state, a.u, a.delta, a.A, a.B, a.C = (x.data_ptr() for x in (state, u, delta, A, B, C))
    a.D, a.z, a.delta_bias = ptr(D), ptr(z), ptr(delta_bias)
    a.su, a.sdelta, a.sB, a.sC = u.stride(0), delta.stride(0), B.stride(0), C.stride(0)
    a.sz = 0 if z is None else z.stride(0)
    a.out, a.new_state = out.data_ptr(), new_state.data_ptr()
    kernel("selective_step", state.dtype)(ctypes.byref(a))
    return out, new_state
