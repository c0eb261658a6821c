"""Backend "cpu" of the non-scan ops: the causal depthwise conv with its SiLU (ssm/native/conv.c)
and RMSNorm / Mamba-2's gated, grouped RMSNorm (ssm/native/norm.c), bound as torch custom ops
(``torch.ops.ssm.cpu_causal_conv_fwd`` / ``_bwd``, ``cpu_rms_norm_fwd`` / ``_bwd``) with fake
implementations and an autograd formula (registered together by ssm._custom_op.kernel_op), so
``torch.compile`` traces through them.

Each public function here returns None where its kernel does not apply (another device or dtype,
a layout it does not read, the library not built); the op in conv.py / norm.py then takes its
tensor path. Shape symbols: B batch, L length, D channels, K the conv's width, M a row's width.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from .._custom_op import kernel_op
from ..native import declare, empty, kernel, ptr, ready, threads


class _ConvArgs(ctypes.Structure):
    """ConvArgs of ssm/native/conv.c, field for field."""

    _fields_ = [
        (name, ctypes.c_int64) for name in ("batch", "length", "dim", "K", "sxb", "sx", "nseq", "silu", "nthreads")
    ]
    _fields_ += [(name, ctypes.c_void_p) for name in ("x", "wt", "bias", "cu_seqlens", "state")]
    _fields_ += [("sst", ctypes.c_int64 * 3)]
    _fields_ += [(name, ctypes.c_void_p) for name in ("y", "yT", "grad", "gradT", "d_x", "d_wt", "d_bias", "part")]


class _NormArgs(ctypes.Structure):
    """NormArgs of ssm/native/norm.c, field for field."""

    _fields_ = [(name, ctypes.c_int64) for name in ("rows", "M", "group", "gate", "nthreads", "sz")]
    _fields_ += [("eps", ctypes.c_double)]
    _fields_ += [(name, ctypes.c_void_p) for name in ("x", "z", "w", "y", "rstd", "grad", "d_x", "d_z", "d_w", "part")]


declare("conv_fwd", [ctypes.POINTER(_ConvArgs)])
declare("conv_bwd", [ctypes.POINTER(_ConvArgs)])
declare("rms_norm_fwd", [ctypes.POINTER(_NormArgs)])
declare("rms_norm_bwd", [ctypes.POINTER(_NormArgs)])


# ----------------------------------------------------------------------------- causal conv


def _conv_args(
    x: Tensor, wt: Tensor, bias: Tensor | None, cu_seqlens: Tensor | None, state: Tensor | None, silu: bool
) -> _ConvArgs:
    batch, length, dim = x.shape
    a = _ConvArgs()
    a.batch, a.length, a.dim, a.K, a.sxb, a.sx = batch, length, dim, wt.shape[0], x.stride(0), x.stride(1)
    a.nseq = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    a.silu, a.nthreads = int(silu), threads()
    a.x, a.wt, a.bias, a.cu_seqlens = x.data_ptr(), wt.data_ptr(), ptr(bias), ptr(cu_seqlens)
    if state is not None:
        a.state, a.sst = state.data_ptr(), (ctypes.c_int64 * 3)(*state.stride())
    return a


def _conv_fwd_fake(x, wt, bias, cu_seqlens, state, silu, transposed):
    return x.new_empty(x.shape), x.new_empty(x.shape[0], x.shape[2], x.shape[1]) if transposed else x.new_empty(0)


def _conv_setup(ctx, inputs, output):
    x, wt, bias, cu_seqlens, state, silu, transposed = inputs
    ctx.save_for_backward(x, wt, bias, cu_seqlens, state)
    ctx.silu, ctx.transposed = silu, transposed


def _conv_backward(ctx, grad, gradT):
    x, wt, bias, cu_seqlens, state = ctx.saved_tensors
    grad = None if grad is None else grad.contiguous()
    gradT = None if gradT is None or not ctx.transposed else gradT.contiguous()
    # the kernel reads the state for the first steps' pre-activations (SiLU's slope there), but
    # sums the gradients of the taps on x only; those on the state are added here
    d_x, d_wt, d_bias = _conv_bwd(grad, gradT, x, wt, bias, cu_seqlens, state, ctx.silu)
    d_state = None
    if state is not None and x.shape[1] > 0 and (ctx.needs_input_grad[1] or ctx.needs_input_grad[4]):
        d_state, d_wt_state = _state_taps_backward(grad, gradT, x, wt, bias, state, ctx.silu)
        d_wt = d_wt + d_wt_state
    return d_x, d_wt, (d_bias if bias is not None else None), None, d_state, None, None


def _state_taps_backward(grad, gradT, x, wt, bias, state, silu: bool) -> tuple[Tensor, Tensor]:
    """The gradients of the state (B, D, K) and of the taps on it (K, D), from the first
    R = min(K - 1, L) steps, the only ones whose taps reach before step 0: their pre-activation
    recomputed (state and x), its gradient through SiLU, then the taps that read the state.
    O(B·K²·D) tensor operations, against the kernel's O(B·L·K·D)."""
    K = wt.shape[0]
    R = min(K - 1, x.shape[1])
    history = torch.cat([state[:, :, 1:].transpose(1, 2), x[:, :R]], dim=1)  # (B, K - 1 + R, D)
    g = 0
    if grad is not None:
        g = g + grad[:, :R]
    if gradT is not None:
        g = g + gradT[:, :, :R].transpose(1, 2)
    if not isinstance(g, Tensor):  # neither output has a gradient
        return torch.zeros_like(state), torch.zeros_like(wt)
    rows = []  # the gradient of each of the first R pre-activations (B, D)
    for t in range(R):
        if silu:
            v = (history[:, t : t + K] * wt).sum(1) + (0 if bias is None else bias)
            sig = torch.sigmoid(v)
            rows.append(g[:, t] * sig * (1 + v * (1 - sig)))
        else:
            rows.append(g[:, t])
    d_history = torch.zeros_like(history[:, : K - 1])  # (B, K - 1, D): state positions 1 .. K - 1
    d_wt = torch.zeros_like(wt)
    for t, gv in enumerate(rows):
        for k in range(K - 1 - t):  # tap k of step t reads history[t + k], a state position
            d_history[:, t + k] += wt[k] * gv
            d_wt[k] += (gv * history[:, t + k]).sum(0)
    d_state = torch.cat([torch.zeros_like(state[:, :, :1]), d_history.transpose(1, 2)], dim=2)
    return d_state.to(state.dtype), d_wt


@kernel_op(
    "ssm::cpu_causal_conv_fwd",
    fake=_conv_fwd_fake,
    device_types="cpu",
    backward=_conv_backward,
    setup_context=_conv_setup,
)
def _conv_fwd(
    x: Tensor,
    wt: Tensor,
    bias: Tensor | None,
    cu_seqlens: Tensor | None,
    state: Tensor | None,
    silu: bool,
    transposed: bool,
) -> tuple[Tensor, Tensor]:
    """x (B, L, D) with its channels contiguous (any batch and step strides), wt (K, D) and bias
    (D,) contiguous, all of one dtype → (silu of) the causal depthwise convolution, (B, L, D),
    and with ``transposed`` the same values as (B, D, L) contiguous (else an empty tensor).
    ``state`` (B, D, K), any strides, x's dtype, no cu_seqlens: the inputs before step 0, most
    recent last."""
    a = _conv_args(x, wt, bias, cu_seqlens, state, silu)
    y = empty(x.shape, x)
    yT = empty((x.shape[0], x.shape[2], x.shape[1]) if transposed else (0,), x)
    a.y, a.yT = y.data_ptr(), (yT.data_ptr() if transposed else None)
    kernel("conv_fwd", x.dtype)(ctypes.byref(a))
    return y, yT


def _conv_bwd_fake(grad, gradT, x, wt, bias, cu_seqlens, state, silu):
    return x.new_empty(x.shape), torch.empty_like(wt), x.new_empty(wt.shape[1] if bias is not None else 0)


@kernel_op("ssm::cpu_causal_conv_bwd", fake=_conv_bwd_fake, device_types="cpu")
def _conv_bwd(
    grad: Tensor | None,
    gradT: Tensor | None,
    x: Tensor,
    wt: Tensor,
    bias: Tensor | None,
    cu_seqlens: Tensor | None,
    state: Tensor | None,
    silu: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of x (B, L, D) contiguous, wt and bias (an empty tensor without one) from
    those of the two outputs, grad (B, L, D) and gradT (B, D, L), contiguous, either None.
    ``state`` as the forward's: read for the first steps' pre-activations; the gradients of the
    taps on it are not summed here (``_state_taps_backward``)."""
    a = _conv_args(x, wt, bias, cu_seqlens, state, silu)
    d_x, d_wt = empty(x.shape, x), torch.empty_like(wt)
    d_bias = x.new_empty(wt.shape[1] if bias is not None else 0)
    part = empty((a.nthreads * (2 * a.K + 2) * a.dim,), x)  # per thread: its sums, its ring of rows, a row
    a.grad, a.gradT, a.d_x, a.d_wt = ptr(grad), ptr(gradT), d_x.data_ptr(), d_wt.data_ptr()
    a.d_bias, a.part = (d_bias.data_ptr() if bias is not None else None), part.data_ptr()
    kernel("conv_bwd", x.dtype)(ctypes.byref(a))
    return d_x, d_wt, d_bias


def causal_conv1d_cpu(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    silu: bool = False,
    transposed: bool = False,
    state: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor] | None:
    """The causal depthwise convolution of x (B, L, D), channels last as a Mamba layer's in_proj
    leaves it (its channels contiguous; no copy of x), with weight (D, 1, K) and optional bias
    (D,), each step reading itself and the K - 1 steps before it in its sequence (zeros before
    a sequence's start; ``cu_seqlens`` (S + 1,) validated, int64, B = 1: packed sequences).
    With ``silu``, SiLU of it, fused: the pre-activation is recomputed in the backward, never
    stored. Returns (B, L, D) contiguous; with ``transposed``, (that, the same values as
    (B, D, L) contiguous): the scans' layout, written by the same pass instead of a transposed
    copy (and the gradients of both are added in the backward's pass).

    ``state`` (B, D, K): the K inputs before step 0 of each row, most recent last (a
    convolution state, as a cache keeps it, or a context-parallel rank's halo), read by the
    first K - 1 steps' taps instead of zeros, with gradients (to it and to the taps that read
    it); without ``cu_seqlens``.

    None when it does not apply, and the caller takes the tensor path: x, weight and bias on
    the CPU in one dtype (float32 or float64), x's channels contiguous, kernels built; with a
    state, no cu_seqlens."""
    dtype = x.dtype
    if (
        dtype not in (torch.float32, torch.float64)
        or x.ndim != 3
        or x.stride(-1) != 1
        or any(t is not None and (t.device.type != "cpu" or t.dtype != dtype) for t in (x, weight, bias))
        or not ready()
    ):
        return None
    if state is not None:
        if (
            cu_seqlens is not None
            or state.device.type != "cpu"
            or state.shape != (x.shape[0], x.shape[2], weight.shape[-1])
        ):
            return None
        state = state.to(dtype)
    wt = weight[:, 0, :].t().contiguous()  # (K, D): a step's taps across channels are adjacent
    bias = None if bias is None else bias.contiguous()
    y, yT = _conv_fwd(x, wt, bias, cu_seqlens, state, bool(silu), bool(transposed))
    return (y, yT) if transposed else y


# ----------------------------------------------------------------------------- RMSNorm


def _norm_args(x: Tensor, z: Tensor | None, w: Tensor, eps: float, group: int, gate: int) -> _NormArgs:
    a = _NormArgs()
    a.M, a.group, a.gate = w.shape[0], group, gate
    a.rows, a.nthreads, a.eps = x.numel() // max(a.M, 1), threads(), eps
    a.x, a.z, a.w = x.data_ptr(), ptr(z), w.data_ptr()
    a.sz = 0 if z is None else z.stride(0)
    return a


def _rms_norm_fwd_fake(x, z, w, eps, group, gate):
    return torch.empty_like(x), x.new_empty(x.numel() // max(w.shape[0], 1), w.shape[0] // group)


def _rms_norm_setup(ctx, inputs, output):
    x, z, w, _, group, gate = inputs
    ctx.save_for_backward(x, z, w, output[1])
    ctx.group, ctx.gate = group, gate


def _rms_norm_backward(ctx, grad, _grad_rstd):
    x, z, w, rstd = ctx.saved_tensors
    d_x, d_z, d_w = _rms_norm_bwd(grad.contiguous(), x, z, w, rstd, ctx.group, ctx.gate)
    return d_x, (d_z if z is not None else None), d_w, None, None, None


@kernel_op(
    "ssm::cpu_rms_norm_fwd",
    fake=_rms_norm_fwd_fake,
    device_types="cpu",
    backward=_rms_norm_backward,
    setup_context=_rms_norm_setup,
)
def _rms_norm_fwd(x: Tensor, z: Tensor | None, w: Tensor, eps: float, group: int, gate: int) -> tuple[Tensor, Tensor]:
    """x (..., M) and w (M,) contiguous, z None or (rows, M) with its rows any stride apart, all
    of one dtype → (y like x, rstd (rows, M / group)). gate: 0 none, 1 norm(x·silu(z)), 2
    norm(x)·silu(z) (NormArgs in ssm/native/norm.c)."""
    a = _norm_args(x, z, w, eps, group, gate)
    y, rstd = empty(x.shape, x), empty((a.rows, a.M // group), x)
    a.y, a.rstd = y.data_ptr(), rstd.data_ptr()
    kernel("rms_norm_fwd", x.dtype)(ctypes.byref(a))
    return y, rstd


def _rms_norm_bwd_fake(grad, x, z, w, rstd, group, gate):
    return torch.empty_like(x), torch.empty_like(z) if z is not None else x.new_empty(0), torch.empty_like(w)


@kernel_op("ssm::cpu_rms_norm_bwd", fake=_rms_norm_bwd_fake, device_types="cpu")
def _rms_norm_bwd(
    grad: Tensor, x: Tensor, z: Tensor | None, w: Tensor, rstd: Tensor, group: int, gate: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of x, z (an empty tensor without one) and w."""
    a = _norm_args(x, z, w, 0.0, group, gate)
    d_x, d_w, part = empty(x.shape, x), torch.empty_like(w), empty((a.nthreads * a.M,), x)
    d_z = empty(z.shape, z) if z is not None else x.new_empty(0)
    a.rstd, a.grad, a.d_x, a.d_w, a.part = (
        rstd.data_ptr(),
        grad.data_ptr(),
        d_x.data_ptr(),
        d_w.data_ptr(),
        part.data_ptr(),
    )
    a.d_z = d_z.data_ptr() if z is not None else None
    kernel("rms_norm_bwd", x.dtype)(ctypes.byref(a))
    return d_x, d_z, d_w


def rms_norm_cpu(
    x: Tensor,
    weight: Tensor,
    eps: float,
    z: Tensor | None = None,
    group_size: int | None = None,
    norm_before_gate: bool = False,
) -> Tensor | None:
    """RMSNorm of x (..., M) over groups of ``group_size`` channels (default M), times
    ``weight``, in one pass, and its backward in one pass (torch's eager backward of these
    formulas is a handful of elementwise operations, each a fresh tensor). With ``z`` it is
    Mamba-2's gated norm: norm(x·silu(z)), or norm(x)·silu(z) with ``norm_before_gate``.
    None where it does not apply and the caller takes the tensor formulas: x, z and weight on
    the CPU in one dtype (float32 or float64), x and z contiguous, kernels built."""
    dtype, M = x.dtype, x.shape[-1] if x.ndim else 0
    group = M if group_size is None else group_size
    if (
        dtype not in (torch.float32, torch.float64)
        or x.ndim == 0
        or group < 1
        or M % group
        or any(t is not None and (t.device.type != "cpu" or t.dtype != dtype) for t in (x, z, weight))
        or not x.is_contiguous()
        or (z is not None and z.shape != x.shape)
        or not ready()
    ):
        return None
    if z is not None:  # rows of M a stride apart, as the kernels read it (a view where it can be)
        z = z.reshape(-1, M)
        z = z if z.stride(1) == 1 else z.contiguous()
    gate = 0 if z is None else 2 if norm_before_gate else 1
    return _rms_norm_fwd(x, z, weight.contiguous(), float(eps), group, gate)[0]
