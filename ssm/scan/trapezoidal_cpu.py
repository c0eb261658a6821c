"""Backend "cpu" of ``trapezoidal_scan`` (Mamba-3): its SISO core on the C selective sweeps
that Mamba-2's ``ssd`` runs on the CPU (cpu.py), forward and backward, packed sequences and
states included.

The fast paths' shifted form (_common_trapezoidal.py) is, for rank 1, the SSD recurrence with a
decay a_t = Δ_t·A_t and an input scale s_t of its own:

    H_t = exp(a_t)·H_{t-1} + s_t·v_t ⊗ k̃_t,     y_t = H_t·q̃_t − c_t·(q̃_t·k̃_t)·v_t

and ``ssd`` ties the two together (exp(Δ·A) beside Δ·x ⊗ B). So it runs with A = −1, Δ = −a_t
and x = v_t·s_t / (−a_t): the sweep's Δ·x is s_t·v_t again, to a rounding or two, and its
state and output are the core's. The keys and queries are rotated first (per head: the sweep's
groups are the heads), the diagonal term −c·(q̃·k̃)·v, D and the gate are added after, in one C
pass each way (``trapezoidal_output``).

That division needs −a_t positive and finite. Where some a_t is 0 (no decay), below 1e-30 or not
finite, and for MIMO ranks above 1 (a rank-R input is not one sweep), the chunked core runs
instead, as under torch.compile: the same answer, by another route. ``chunk_size`` is the
chunked core's; the sweeps walk every step.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from .._custom_op import kernel_op
from ..native import declare, empty, kernel, ptr, ready, threads
from ._common_trapezoidal import Prepared, TrapezoidalArgs, gate_and_contract, keys_queries_values, run_core
from .cpu import ssd_cpu
from .trapezoidal_chunked import chunked_core

# The smallest −a_t (a decay of exp(−1e-30) per step) that the input's division by −a_t takes:
# v·s/(−a) stays finite for any finite v·s in float32 and float64.
SMALLEST_DECAY_RATE = 1e-30


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
    a.rows, a.L, a.H, a.P, a.N, a.nthreads = B * L, L, H, P, q.shape[-1], threads()
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
    return d_y, d_v, (d_z if z is not None else None), d_q, d_k, d_c, (d_D if D is not None else None)


@kernel_op(
    "ssm::cpu_trap_out_fwd",
    fake=_trap_out_fake,
    device_types="cpu",
    backward=_trap_out_backward,
    setup_context=_trap_out_setup,
)
def _trap_out_fwd(y: Tensor, v: Tensor, z: Tensor | None, q: Tensor, k: Tensor, c: Tensor, D: Tensor | None) -> Tensor:
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
    return d_y, y.new_empty(y.shape), d_z, torch.empty_like(q), torch.empty_like(k), torch.empty_like(c), d_D


@kernel_op("ssm::cpu_trap_out_bwd", fake=_trap_out_bwd_fake, device_types="cpu")
def _trap_out_bwd(
    grad: Tensor, y: Tensor, v: Tensor, z: Tensor | None, q: Tensor, k: Tensor, c: Tensor, D: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of y, v, z (empty without one), q, k, c and D (empty without one)."""
    a = _trap_out_args(y, v, z, q, k, c, D)
    d_y = torch.empty_strided(y.shape, y.stride(), dtype=y.dtype)  # laid out as y: the sweep's layout
    d_v, d_q, d_k, d_c = empty(y.shape, y), empty(q.shape, q), empty(k.shape, k), empty(c.shape, c)
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
    q, k (B, L, H, N), c (B, L, H), D (H,); z or D None to leave the gate or the skip term out.
    One C pass forward and one backward (ssm/native/trapezoidal.c), in place of the tensor
    operations and their gradients. None where it does not apply (another device, a dtype other
    than float32 or float64 for all of them, no library): the caller computes it with tensors."""
    tensors = [t for t in (y, v, z, q, k, c, D) if t is not None]
    dtype = y.dtype
    if dtype not in (torch.float32, torch.float64) or not ready():
        return None
    if any(t.device.type != "cpu" or t.dtype != dtype for t in tensors):
        return None

    def rows(x):  # (B, L, H, ·) whose (B, L) flatten to one row stride, the rest contiguous
        ok = (
            x.stride(-1) == 1
            and x.stride(-2) == x.shape[-1]
            and (x.shape[0] == 1 or x.stride(0) == x.shape[1] * x.stride(1))
        )
        return x if ok else x.contiguous()

    if min(y.stride()) < 1:
        y = y.contiguous()  # y is read with its strides (its gradient written with them): none broadcast
    q, k, c = q.contiguous(), k.contiguous(), c.contiguous()
    v, z = rows(v), (None if z is None else rows(z))
    D = None if D is None else D.contiguous()
    return _trap_out_fwd(y, v, z, q, k, c, D)


# ----------------------------------------------------------------------------- the core


def sweeps_take(args: TrapezoidalArgs, p: Prepared) -> bool:
    """Whether the sweeps compute this call's core: rank 1, and every −a_t in [1e-30, ∞). Not
    under torch.compile, where reading the decays would break the graph: the chunked core
    traces whole."""
    if args.B.shape[2] != 1 or torch.compiler.is_compiling():
        return False
    rate = -p.a
    return bool(((rate >= SMALLEST_DECAY_RATE) & (rate < float("inf"))).all())


def _core(args: TrapezoidalArgs, p: Prepared):
    """The core on the selective sweeps: out in x's dtype and H_{L-1}."""
    if not sweeps_take(args, p):
        return chunked_core(args, p)
    x, dtype = args.x, args.dtype
    heads = x.shape[2]
    k, q, v = keys_queries_values(args, p.cos, p.sin)  # rank 1: (B, L, 1, H, N), (B, L, 1, H, P)
    # rank 1 dropped as views (squeeze, not [:, :, 0], whose backward writes a zero-filled
    # tensor of the whole and copies into it)
    k, q, v1 = k.squeeze(2), q.squeeze(2), v.squeeze(2)
    rate = -p.a  # (B, L, H), in [1e-30, ∞)
    scaled = v1 * (p.s / rate)[..., None]
    y, H_last = ssd_cpu(
        scaled, rate, -torch.ones(heads, dtype=dtype, device=x.device), k, q,
        initial_state=p.H_init, cu_seqlens=args.cu_seqlens,
    )  # fmt: skip
    z, D = (None if t is None else t.to(dtype) for t in (args.z, args.D))
    out = None
    if args.mimo_z is None and args.mimo_o is None:  # rank 1 here: nothing to contract
        out = trapezoidal_output(y, v1, z, q, k, p.c, D)  # one C pass, or None
        out = None if out is None else out[:, :, None]  # (B, L, 1, H, P): the rank axis
    if out is None:
        y = y - (p.c * (q * k).sum(-1))[..., None] * v1  # the diagonal's shifted part
        out = gate_and_contract(y[:, :, None], v, args.D, args.z, args.mimo_z, args.mimo_o, dtype)
    return out.to(x.dtype), H_last


def trapezoidal_scan_cpu(args: TrapezoidalArgs):
    """Backend "cpu" of :func:`ssm.scan.trapezoidal_scan`: (out, last state)."""
    return run_core(_core, args)
