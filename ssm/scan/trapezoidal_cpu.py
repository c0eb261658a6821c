"""Backend "cpu" of ``trapezoidal_scan`` (Mamba-3): rank 1 with its keys' rotation and its
output pass in C (ssm/native/trapezoidal.c), and its core on the C selective sweeps that Mamba-2's
``ssd`` runs on the CPU (cpu.py) or, at large N·P, as the chunked form's batched matrix
products; forward and backward, packed sequences and states included.

The fast paths' shifted form (_common_trapezoidal.py) is, for rank 1, the SSD recurrence with a
decay a_t = Δ_t·A_t and an input scale s_t of its own:

    H_t = exp(a_t)·H_{t-1} + s_t·v_t ⊗ k̃_t,     y_t = H_t·q̃_t − c_t·(q̃_t·k̃_t)·v_t

and ``ssd`` ties the two together (exp(Δ·A) beside Δ·x ⊗ B). So it runs with A = −1, Δ = −a_t
and x = v_t·s_t / (−a_t): the sweep's Δ·x is s_t·v_t again, to a rounding or two, and its
state and output are the core's. The keys and queries are rotated first (per head: the sweep's
groups are the heads), the diagonal term −c·(q̃·k̃)·v, D and the gate are added after, in one C
pass each way (``trapezoidal_output``).

The sweeps cost O(N·P) per step and head, the products O(T·(N + P)) with fewer, larger
operations: above N·P = SWEEPS_UP_TO the products run (``products_heads_first``, keys and values
laid out heads first, so that each chunk's products are one batched matrix product; the diagonal
term is theirs). The division needs −a_t positive and finite: where some a_t is 0 (no decay),
below 1e-30 or not finite, the products run too, as under torch.compile. MIMO ranks above 1 (a
rank-R input is not one sweep) run the products with a step's R ranks as R positions that share
its decay (``_mimo``). The same answer, by another route.
``chunk_size`` is the products'; the sweeps walk every step.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from .._custom_op import kernel_op
from ..native import declare, empty, kernel, ptr, ready, threads
from ._common import all_finite
from ._common_trapezoidal import (
    Prepared,
    TrapezoidalArgs,
    decays_in_range,
    gate_and_contract,
    keys_queries_values,
    run_core,
    values,
)
from .cpu import ssd_cpu
from .trapezoidal_chunked import chunked_products, each_sequence, products_heads_first

# ----------------------------------------------------------------------------- the output pass (C)


class _TrapOutArgs(ctypes.Structure):
    """TrapOutArgs of ssm/native/trapezoidal.c, field for field."""

    _fields_ = [(name, ctypes.c_int64) for name in ("rows", "L", "H", "P", "N", "sv", "sz", "nthreads")]
    _fields_ += [("sy", ctypes.c_int64 * 4)]
    _fields_ += [(name, ctypes.c_void_p) for name in ("y", "v", "z", "q", "k", "c", "D", "out", "grad")]
    _fields_ += [(name, ctypes.c_void_p) for name in ("d_y", "d_v", "d_z", "d_q", "d_k", "d_c", "d_D", "part")]


declare("trap_out_fwd", [ctypes.POINTER(_TrapOutArgs)])
declare("trap_out_bwd", [ctypes.POINTER(_TrapOutArgs)])


def _trap_out_args(y, v, z, q, k, c, D) -> _TrapOutArgs:
    B, L, H, P = y.shape
    a = _TrapOutArgs()
    a.rows, a.L, a.H, a.P, a.N, a.nthreads = B * L, L, H, P, (0 if q is None else q.shape[-1]), threads()
    a.sy = (ctypes.c_int64 * 4)(*y.stride())
    a.sv, a.sz = v.stride(1), (0 if z is None else z.stride(1))
    a.y, a.v, a.z, a.q, a.k, a.c, a.D = (ptr(t) for t in (y, v, z, q, k, c, D))
    return a


def _trap_out_fake(y, v, z, q, k, c, D):
    return y.new_empty(y.shape)


def _trap_out_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _trap_out_backward(ctx, grad):
    y, v, z, q, k, c, D = ctx.saved_tensors
    d_y, d_v, d_z, d_q, d_k, d_c, d_D = _trap_out_bwd(grad.contiguous(), y, v, z, q, k, c, D)
    d_q, d_k, d_c = (None, None, None) if q is None else (d_q, d_k, d_c)
    return d_y, d_v, (d_z if z is not None else None), d_q, d_k, d_c, (d_D if D is not None else None)


@kernel_op(
    "ssm::cpu_trap_out_fwd",
    fake=_trap_out_fake,
    device_types="cpu",
    backward=_trap_out_backward,
    setup_context=_trap_out_setup,
)
def _trap_out_fwd(
    y: Tensor, v: Tensor, z: Tensor | None, q: Tensor | None, k: Tensor | None, c: Tensor | None, D: Tensor | None
) -> Tensor:
    """``trapezoidal_output``'s kernel, its arguments in the layouts it reads."""
    a = _trap_out_args(y, v, z, q, k, c, D)
    out = empty(y.shape, y)
    a.out = out.data_ptr()
    kernel("trap_out_fwd", y.dtype)(ctypes.byref(a))
    return out


def _trap_out_bwd_fake(grad, y, v, z, q, k, c, D):
    d_z = y.new_empty(y.shape) if z is not None else y.new_empty(0)
    d_D = y.new_empty(y.shape[2] if D is not None else 0)
    d_y = torch.empty_strided(y.shape, y.stride(), dtype=y.dtype, device=y.device)
    d_q, d_k, d_c = (
        (y.new_empty(0), y.new_empty(0), y.new_empty(0))
        if q is None
        else (torch.empty_like(q), torch.empty_like(k), torch.empty_like(c))
    )
    return d_y, y.new_empty(y.shape), d_z, d_q, d_k, d_c, d_D


@kernel_op("ssm::cpu_trap_out_bwd", fake=_trap_out_bwd_fake, device_types="cpu")
def _trap_out_bwd(
    grad: Tensor,
    y: Tensor,
    v: Tensor,
    z: Tensor | None,
    q: Tensor | None,
    k: Tensor | None,
    c: Tensor | None,
    D: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of y, v, z (empty without one), q, k, c (empty without them) and D (empty
    without one)."""
    a = _trap_out_args(y, v, z, q, k, c, D)
    d_y = torch.empty_strided(y.shape, y.stride(), dtype=y.dtype)  # laid out as y: the sweep's layout
    d_v = empty(y.shape, y)
    d_q, d_k, d_c = (
        (y.new_empty(0), y.new_empty(0), y.new_empty(0))
        if q is None
        else (empty(q.shape, q), empty(k.shape, k), empty(c.shape, c))
    )
    d_z = empty(y.shape, y) if z is not None else y.new_empty(0)
    d_D = y.new_empty(y.shape[2] if D is not None else 0)
    part = empty((a.nthreads * y.shape[2],), y)
    a.grad, a.d_y, a.d_v, a.d_q, a.d_k, a.d_c, a.part = (t.data_ptr() for t in (grad, d_y, d_v, d_q, d_k, d_c, part))
    a.d_z = d_z.data_ptr() if z is not None else None
    a.d_D = d_D.data_ptr() if D is not None else None
    kernel("trap_out_bwd", y.dtype)(ctypes.byref(a))
    return d_y, d_v, d_z, d_q, d_k, d_c, d_D


def trapezoidal_output(y, v, z, q, k, c, D) -> Tensor | None:
    """(y + (D − c·Σ_n q·k)·v)·silu(z) for Mamba-3's rank-1 scan on the CPU: y, v, z (B, L, H, P),
    q, k (B, L, H, N), c (B, L, H), D (H,); z or D None to leave the gate or the skip term out,
    q, k and c None to leave the diagonal term out (y holds it).
    One C pass forward and one backward (ssm/native/trapezoidal.c), in place of the tensor
    operations and their gradients. None where it does not apply (another device, a dtype other
    than float32 or float64 for all of them, no library): the caller computes it with tensors."""
    tensors = [t for t in (y, v, z, q, k, c, D) if t is not None]
    dtype = y.dtype
    if dtype not in (torch.float32, torch.float64) or not ready():
        return None
    if any(t.device.type != "cpu" or t.dtype != dtype for t in tensors):
        return None

    if min(y.stride()) < 1:
        y = y.contiguous()  # y is read with its strides (its gradient written with them): none broadcast
    q, k, c = (None if t is None else t.contiguous() for t in (q, k, c))
    v, z = _rows(v), (None if z is None else _rows(z))
    D = None if D is None else D.contiguous()
    return _trap_out_fwd(y, v, z, q, k, c, D)


# ----------------------------------------------------------------------------- the rotary phase (C)


class _TrapPhaseArgs(ctypes.Structure):
    """TrapPhaseArgs of ssm/native/trapezoidal.c, field for field."""

    _fields_ = [(name, ctypes.c_int64) for name in ("batch", "length", "H", "M", "nseq", "nthreads")]
    _fields_ += [(name, ctypes.c_void_p) for name in ("cu_seqlens", "delta", "angles", "phase0", "phase", "cos")]
    _fields_ += [(name, ctypes.c_void_p) for name in ("sin", "d_phase", "d_cos", "d_sin", "d_delta", "d_angles")]
    _fields_ += [("d_phase0", ctypes.c_void_p)]


declare("trap_phase_fwd", [ctypes.POINTER(_TrapPhaseArgs)])
declare("trap_phase_bwd", [ctypes.POINTER(_TrapPhaseArgs)])


def _trap_phase_args(delta, angles, cu_seqlens) -> _TrapPhaseArgs:
    a = _TrapPhaseArgs()
    a.batch, a.length, a.H, a.M = angles.shape
    a.nseq, a.nthreads = (angles.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1), threads()
    a.cu_seqlens, a.delta, a.angles = ptr(cu_seqlens), delta.data_ptr(), angles.data_ptr()
    return a


def _trap_phase_fake(delta, angles, phase0, cu_seqlens):
    return tuple(angles.new_empty(angles.shape) for _ in range(3))


def _trap_phase_setup(ctx, inputs, output):
    delta, angles, phase0, cu_seqlens = inputs
    ctx.save_for_backward(delta, angles, output[1], output[2], cu_seqlens)
    ctx.with_phase0 = phase0 is not None
    ctx.set_materialize_grads(False)  # no zeros for the outputs without a gradient


def _trap_phase_backward(ctx, d_phase, d_cos, d_sin):
    delta, angles, cos, sin, cu_seqlens = ctx.saved_tensors
    d_phase, d_cos, d_sin = (None if g is None else g.contiguous() for g in (d_phase, d_cos, d_sin))
    d_delta, d_angles, d_phase0 = _trap_phase_bwd(
        d_phase, d_cos, d_sin, delta, angles, cos, sin, cu_seqlens, ctx.with_phase0
    )
    return d_delta, d_angles, (d_phase0 if ctx.with_phase0 else None), None


@kernel_op(
    "ssm::cpu_trap_phase_fwd",
    fake=_trap_phase_fake,
    device_types="cpu",
    backward=_trap_phase_backward,
    setup_context=_trap_phase_setup,
)
def _trap_phase_fwd(
    delta: Tensor, angles: Tensor, phase0: Tensor | None, cu_seqlens: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """``rotary_phase``'s kernel: delta (B, L, H), angles (B, L, H, M), phase0 (B or S, H, M) or
    None, contiguous, one dtype; returns phase, cos, sin (B, L, H, M)."""
    a = _trap_phase_args(delta, angles, cu_seqlens)
    phase, cos, sin = (empty(angles.shape, angles) for _ in range(3))
    a.phase0, a.phase, a.cos, a.sin = ptr(phase0), phase.data_ptr(), cos.data_ptr(), sin.data_ptr()
    kernel("trap_phase_fwd", angles.dtype)(ctypes.byref(a))
    return phase, cos, sin


def _trap_phase_bwd_fake(d_phase, d_cos, d_sin, delta, angles, cos, sin, cu_seqlens, with_phase0):
    rows = angles.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    d_phase0 = angles.new_empty((rows, *angles.shape[2:]) if with_phase0 else (0,))
    return delta.new_empty(delta.shape), angles.new_empty(angles.shape), d_phase0


@kernel_op("ssm::cpu_trap_phase_bwd", fake=_trap_phase_bwd_fake, device_types="cpu")
def _trap_phase_bwd(
    d_phase: Tensor | None,
    d_cos: Tensor | None,
    d_sin: Tensor | None,
    delta: Tensor,
    angles: Tensor,
    cos: Tensor,
    sin: Tensor,
    cu_seqlens: Tensor | None,
    with_phase0: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of delta, angles and phase0 (an empty tensor without one) from those of
    phase, cos and sin (contiguous, any of them None)."""
    a = _trap_phase_args(delta, angles, cu_seqlens)
    rows = a.nseq
    d_delta, d_angles = empty(delta.shape, delta), empty(angles.shape, angles)
    d_phase0 = empty((rows, *angles.shape[2:]) if with_phase0 else (0,), angles)
    a.cos, a.sin, a.d_phase, a.d_cos, a.d_sin = cos.data_ptr(), sin.data_ptr(), ptr(d_phase), ptr(d_cos), ptr(d_sin)
    a.d_delta, a.d_angles, a.d_phase0 = d_delta.data_ptr(), d_angles.data_ptr(), ptr(d_phase0 if with_phase0 else None)
    kernel("trap_phase_bwd", angles.dtype)(ctypes.byref(a))
    return d_delta, d_angles, d_phase0


def rotary_phase(delta: Tensor, angles: Tensor, phase0: Tensor | None, cu_seqlens: Tensor | None, dtype):
    """The prologue's phase φ (not reduced) and its cos and sin (B, L, H, M), in ``dtype``, by one
    C pass each way (the sum in float64, as the tensor code's): delta (B, L, H) in ``dtype``,
    angles (B, L, H, M), phase0 (B or S, H, M) or None. None where it does not apply (another
    device or dtype, no library): the prologue's tensors then compute it."""
    if dtype not in (torch.float32, torch.float64) or not ready() or delta.device.type != "cpu":
        return None
    phase0 = None if phase0 is None else phase0.to(dtype).contiguous()
    return _trap_phase_fwd(delta.contiguous(), angles.to(dtype).contiguous(), phase0, cu_seqlens)


# ----------------------------------------------------------------------------- the rotation (C)


class _TrapRotArgs(ctypes.Structure):
    """TrapRotArgs of ssm/native/trapezoidal.c, field for field."""

    _fields_ = [(name, ctypes.c_int64) for name in ("rows", "L", "H", "G", "N", "M", "halved", "heads_first")]
    _fields_ += [(name, ctypes.c_int64) for name in ("sw", "nthreads")]
    _fields_ += [(name, ctypes.c_void_p) for name in ("w", "bias", "cos", "sin", "scale", "out", "grad")]
    _fields_ += [(name, ctypes.c_void_p) for name in ("d_w", "d_bias", "d_cos", "d_sin", "d_scale", "part")]


declare("trap_rot_fwd", [ctypes.POINTER(_TrapRotArgs)])
declare("trap_rot_bwd", [ctypes.POINTER(_TrapRotArgs)])


def _trap_rot_args(w, bias, cos, sin, scale, halved: int, heads_first: int) -> _TrapRotArgs:
    batch, length, groups, N = w.shape
    a = _TrapRotArgs()
    a.rows, a.L, a.H, a.G, a.N, a.M = batch * length, length, cos.shape[2], groups, N, cos.shape[3]
    a.halved, a.heads_first, a.sw, a.nthreads = halved, heads_first, w.stride(1), threads()
    a.w, a.bias, a.cos, a.sin, a.scale = (ptr(t) for t in (w, bias, cos, sin, scale))
    return a


def _rotated_shape(w, cos, heads_first: int) -> tuple[int, ...]:
    (batch, length, heads, _), N = cos.shape, w.shape[-1]
    return (batch, heads, length, N) if heads_first else (batch, length, heads, N)


def _trap_rot_fake(w, bias, cos, sin, scale, halved, heads_first):
    return w.new_empty(_rotated_shape(w, cos, heads_first))


def _trap_rot_setup(ctx, inputs, output):
    w, bias, cos, sin, scale, ctx.halved, ctx.heads_first = inputs
    ctx.save_for_backward(w, bias, cos, sin, scale)


def _trap_rot_backward(ctx, grad):
    w, bias, cos, sin, scale = ctx.saved_tensors
    d_w, d_bias, d_cos, d_sin, d_scale = _trap_rot_bwd(
        grad.contiguous(), w, bias, cos, sin, scale, ctx.halved, ctx.heads_first
    )
    d_bias, d_scale = (d if t is not None else None for d, t in ((d_bias, bias), (d_scale, scale)))
    return d_w, d_bias, d_cos, d_sin, d_scale, None, None


@kernel_op(
    "ssm::cpu_trap_rot_fwd",
    fake=_trap_rot_fake,
    device_types="cpu",
    backward=_trap_rot_backward,
    setup_context=_trap_rot_setup,
)
def _trap_rot_fwd(
    w: Tensor, bias: Tensor | None, cos: Tensor, sin: Tensor, scale: Tensor | None, halved: int, heads_first: int
) -> Tensor:
    """``rotated_keys``' kernel, its arguments in the layouts it reads."""
    a = _trap_rot_args(w, bias, cos, sin, scale, halved, heads_first)
    out = empty(_rotated_shape(w, cos, heads_first), w)
    a.out = out.data_ptr()
    kernel("trap_rot_fwd", w.dtype)(ctypes.byref(a))
    return out


def _trap_rot_bwd_fake(grad, w, bias, cos, sin, scale, halved, heads_first):
    d_bias = w.new_empty(bias.shape if bias is not None else 0)
    d_scale = w.new_empty(scale.shape if scale is not None else 0)
    return w.new_empty(w.shape), d_bias, torch.empty_like(cos), torch.empty_like(sin), d_scale


@kernel_op("ssm::cpu_trap_rot_bwd", fake=_trap_rot_bwd_fake, device_types="cpu")
def _trap_rot_bwd(
    grad: Tensor,
    w: Tensor,
    bias: Tensor | None,
    cos: Tensor,
    sin: Tensor,
    scale: Tensor | None,
    halved: int,
    heads_first: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of w (contiguous), bias (empty without one), cos, sin and scale (empty
    without one)."""
    a = _trap_rot_args(w, bias, cos, sin, scale, halved, heads_first)
    d_w, d_cos, d_sin = empty(w.shape, w), empty(cos.shape, cos), empty(sin.shape, sin)
    d_bias = w.new_empty(bias.shape if bias is not None else 0)
    d_scale = empty(scale.shape, scale) if scale is not None else w.new_empty(0)
    part = empty((a.nthreads * bias.numel(),), w) if bias is not None else w.new_empty(0)
    a.grad, a.d_w, a.d_cos, a.d_sin, a.part = (t.data_ptr() for t in (grad, d_w, d_cos, d_sin, part))
    a.d_bias = d_bias.data_ptr() if bias is not None else None
    a.d_scale = d_scale.data_ptr() if scale is not None else None
    kernel("trap_rot_bwd", w.dtype)(ctypes.byref(a))
    return d_w, d_bias, d_cos, d_sin, d_scale


def _rows(x: Tensor) -> Tensor:
    """x (B, L, ·, ·) whose (B, L) flatten to one row stride, the rest contiguous (else a copy)."""
    ok = (
        x.stride(-1) == 1
        and x.stride(-2) == x.shape[-1]
        and (x.shape[0] == 1 or x.stride(0) == x.shape[1] * x.stride(1))
    )
    return x if ok else x.contiguous()


def rotated_keys(
    M: Tensor,
    heads: int,
    bias: Tensor | None,
    cos: Tensor,
    sin: Tensor,
    rotary: str,
    dtype,
    heads_first=False,
    scale: Tensor | None = None,
):
    """``rotated_per_head`` (_common_trapezoidal.py) for rank 1 in one C pass each way: B or C
    (B, L, G, N) as the rotated keys or queries (B, L, H, N), or (B, H, L, N) with
    ``heads_first``; bias (H, N) or None, cos and sin (B, L, H, M), in ``dtype``; each (step,
    head) times ``scale`` (B, L, H) when given. None where it does not apply (another device or
    dtype, no library): the caller rotates with tensors."""
    if dtype not in (torch.float32, torch.float64) or not ready() or M.device.type != "cpu":
        return None
    w = _rows(M.to(dtype))
    b = None if bias is None else bias.to(dtype).contiguous()
    scale = None if scale is None else scale.to(dtype).contiguous()
    return _trap_rot_fwd(w, b, cos.contiguous(), sin.contiguous(), scale, int(rotary == "halved"), int(heads_first))


# ----------------------------------------------------------------------------- the core


# The largest N·P per head for which the sweeps run the core; above it the chunked form's matrix
# products do. Measured with the "chunked" backend before the products here existed, on 2 cores
# (loaded), fwd+bwd of the scan alone, batch 1, 8 heads, chunked against the sweeps: N 16, P 16,
# L 16384 1.26x; N 32, P 32, L 8192 1.15x; N 64, P 64, L 4096 0.66x; N 128, P 64, L 4096 0.32x.
# At N·P = 1024 the two are about even: a Mamba3 training step at the parity task's shape
# (d_model 64, N 64, P 16, batch 64, chunks of 32; 1 thread, alternating) took 149 ms on the
# sweeps and 185 on these products at L 80, 360 and 339 at L 160.
SWEEPS_UP_TO = 1024


def sweeps_take(args: TrapezoidalArgs, p: Prepared) -> bool:
    """Whether the sweeps compute this call's core: rank 1, N·P up to SWEEPS_UP_TO, every −a_t in
    [1e-30, ∞) and every s_t above 0. Not under torch.compile, where reading the decays would
    break the graph: the chunked core traces whole."""
    if args.B.shape[2] != 1 or torch.compiler.is_compiling():
        return False
    if args.B.shape[-1] * args.x.shape[-1] > SWEEPS_UP_TO:
        return False
    # and s_t > 0: the output pass divides c_t by the keys' scale s_t / −a_t
    return decays_in_range(p.a) and bool((p.s > 0).all())


def _keys_queries_values(args: TrapezoidalArgs, p: Prepared, heads_first: bool, key_scale: Tensor | None = None):
    """Rank 1: the rotated keys (times ``key_scale`` (B, L, H) when given) and queries
    (B, L, H, N), or (B, H, L, N) with ``heads_first``, by the C rotation where it applies, and
    the values (B, L, 1, H, P)."""
    heads, dtype = args.x.shape[2], args.dtype
    # the rank axis dropped as views (squeeze, not [:, :, 0], whose backward writes a
    # zero-filled tensor of the whole and copies into it)
    B, C = args.B.squeeze(2), args.C.squeeze(2)
    B_bias, C_bias = (None if b is None else b.squeeze(1) for b in (args.B_bias, args.C_bias))
    k = rotated_keys(B, heads, B_bias, p.cos, p.sin, args.rotary, dtype, heads_first, key_scale)
    q = None if k is None else rotated_keys(C, heads, C_bias, p.cos, p.sin, args.rotary, dtype, heads_first)
    v = values(args.x, args.mimo_x, 1, dtype)
    if q is None:
        k, q, v = keys_queries_values(args, p.cos, p.sin)
        k, q = k.squeeze(2), q.squeeze(2)
        if key_scale is not None:
            k = k * key_scale[..., None]
        if heads_first:
            k, q = k.transpose(1, 2).contiguous(), q.transpose(1, 2).contiguous()
    return k, q, v


def _heads_first(k, q, v, p: Prepared, cu_seqlens, chunk_size: int, ranks: int = 1):
    """``products_heads_first`` over k, q (B, H, L·R, N) and v (B, H, L·R, P), packed sequences
    one after another: y (B, H, L·R, P) and H_{L-1}."""
    if cu_seqlens is None:
        return products_heads_first(k, q, v, p.a, p.s, p.c, p.H_init, chunk_size, ranks)
    (_, heads, _, N), P = k.shape, v.shape[-1]

    def run(start, end, H0):
        k_i, q_i, v_i = (t[:, :, start * ranks : end * ranks] for t in (k, q, v))
        a_i, s_i, c_i = (t[:, start:end] for t in (p.a, p.s, p.c))
        return products_heads_first(k_i, q_i, v_i, a_i, s_i, c_i, H0, chunk_size, ranks)

    ys, H_last = each_sequence(cu_seqlens, p.H_init, lambda: v.new_zeros(1, heads, P, N), run)
    return torch.cat([v.new_zeros(1, heads, 0, P), *ys], dim=2), H_last


def _products(k, q, v, args: TrapezoidalArgs, p: Prepared):
    """y (B, L, H, P) (the diagonal term included) and H_{L-1} by the chunked form's products,
    from k, q (B, H, L, N) and v (B, L, H, P); packed sequences one after another."""
    v = v.transpose(1, 2).contiguous()  # (B, H, L, P)
    if not all_finite(k, v, p.a, p.s, p.c):  # the general form: it masks what a non-finite entry reaches
        k, q, v = (t.transpose(1, 2)[:, :, None] for t in (k, q, v))
        y, H_last = chunked_products(k, q, v, p.a, p.s, p.c, p.H_init, args.cu_seqlens, args.chunk_size)
        return y.squeeze(2), H_last
    y, H_last = _heads_first(k, q, v, p, args.cu_seqlens, args.chunk_size)
    return y.transpose(1, 2), H_last


def _mimo(args: TrapezoidalArgs, p: Prepared):
    """MIMO (rank R > 1): the chunked form's products laid out heads first, a step's R ranks R
    positions sharing its decay (``products_heads_first``); out in x's dtype and H_{L-1}. Inputs
    with a non-finite entry run the chunked form's general products, which mask what it reaches."""
    k, q, v = keys_queries_values(args, p.cos, p.sin)  # (B, L, R, H, N), (B, L, R, H, P)
    if not all_finite(k, v, p.a, p.s, p.c):
        y, H_last = chunked_products(k, q, v, p.a, p.s, p.c, p.H_init, args.cu_seqlens, args.chunk_size)
    else:
        length, ranks = v.shape[1:3]
        # chunks of chunk_size positions, not steps: the intra-chunk weights grow as the square of
        # a chunk's positions (at R 4, chunks of 64 steps were 256 positions and 16 times the work)
        steps = max(1, args.chunk_size // ranks)
        kh, qh, vh = (t.permute(0, 3, 1, 2, 4).flatten(2, 3) for t in (k, q, v))  # (B, H, L·R, ·)
        y, H_last = _heads_first(kh, qh, vh, p, args.cu_seqlens, steps, ranks)
        y = y.unflatten(2, (length, ranks)).permute(0, 2, 3, 1, 4)  # (B, L, R, H, P)
    out = gate_and_contract(y, v, args.D, args.z, args.mimo_z, args.mimo_o, args.dtype)
    return out.to(args.x.dtype), H_last


def _core(args: TrapezoidalArgs, p: Prepared):
    """The core: rank 1 on the sweeps or the chunked form's products, with the keys' rotation and
    the output pass in C; out in x's dtype and H_{L-1}. MIMO on the products (``_mimo``)."""
    if args.B.shape[2] != 1:
        return _mimo(args, p)
    x, dtype = args.x, args.dtype
    heads = x.shape[2]
    sweeps = sweeps_take(args, p)
    rate = -p.a  # (B, L, H), in [1e-30, ∞) for the sweeps
    # the sweeps' input Δ·x ⊗ B is rate·v ⊗ k' with the keys k' = k̃·s/rate: s·v ⊗ k̃, which does
    # not depend on the rate. So the rate's gradient is the decay's share alone: the scale takes
    # the rate as a constant, and the sweeps' backward leaves out Δ's share through their input
    # (through both, two terms of size 1/|A| would cancel after rounding: at |A| ~ 1e-4 that was
    # dA 2e-3 off in float32).
    key_scale = p.s / rate.detach() if sweeps else None
    k, q, v = _keys_queries_values(args, p, not sweeps, key_scale)  # (B, L, 1, H, P) values
    v1 = v.squeeze(2)
    if sweeps:
        y, H_last = ssd_cpu(
            v1, rate, -torch.ones(heads, dtype=dtype, device=x.device), k, q,
            initial_state=p.H_init, cu_seqlens=args.cu_seqlens, dt_decay_only=True,
        )  # fmt: skip
        # the diagonal's shifted part, −c·(q̃·k̃)·v = −(c·rate/s)·(q̃·k')·v, still to come
        diagonal = (q, k, p.c / key_scale)
    else:
        y, H_last = _products(k, q, v1, args, p)
        diagonal = (None, None, None)  # in y already
    z, D = (None if t is None else t.to(dtype) for t in (args.z, args.D))
    out = None
    if args.mimo_z is None and args.mimo_o is None:  # rank 1 here: nothing to contract
        out = trapezoidal_output(y, v1, z, *diagonal, D)  # one C pass, or None
        out = None if out is None else out[:, :, None]  # (B, L, 1, H, P): the rank axis
    if out is None:
        if sweeps:
            y = y - (diagonal[2] * (q * k).sum(-1))[..., None] * v1
        out = gate_and_contract(y[:, :, None], v, args.D, args.z, args.mimo_z, args.mimo_o, dtype)
    return out.to(x.dtype), H_last


def trapezoidal_scan_cpu(args: TrapezoidalArgs):
    """Backend "cpu" of :func:`ssm.scan.trapezoidal_scan`: (out, last state)."""
    return run_core(_core, args, rotary_phase)
