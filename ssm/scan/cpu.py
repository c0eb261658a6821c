"""Backend "cpu" of the scans: sequential sweeps in C (ssm/native/selective.c, linear.c), bound
here as torch custom ops with autograd.

On a CPU the parallel scan is the wrong algorithm: batch × channels already give ample
parallelism, and a sweep over L that keeps the state h in registers does O(L) work with no
(B, D, L, N) temporaries. Every thread takes whole channels (a work unit is one channel, or one
block of columns of the linear scan) and walks all L steps of them alone, vectorised over N, so
threads never wait on one another inside a sweep. Units are handed out dynamically, so a thread
that shares its core with another busy process simply does fewer of them; the selective
backward's units are blocks of channels, each summing its dB and dC into rows of its own, added
up in block order (bitwise-reproducible gradients for a given thread count). Softplus, the D·u
skip and the silu(z) gate are fused into the sweep, and the backward writes every gradient in
one reverse sweep. ``ssd`` runs on the same sweeps; the one-token step of recurrent decoding is
bound in step_cpu.py.

The library is built, cached and loaded by ``ssm.native`` (one library for every C-backed op).
Without it (no compiler, or ``SSM_CPU_KERNEL=0``) these functions run ``pscan``'s pure-PyTorch
path instead: correct, several times slower.

The kernels are torch custom ops (``torch.ops.ssm.cpu_selective_scan_fwd`` / ``_bwd``,
``cpu_linear_scan_fwd`` / ``_bwd``) with fake implementations and an autograd formula
(registered together by ssm._custom_op.kernel_op), so a user's ``torch.compile`` traces
through them without graph breaks and calls the same kernels. No shape, dtype or option
recompiles anything: one library serves every input.

Backward memory: the forward keeps the state at the start of every chunk of ``CHUNK`` steps,
(B, L / CHUNK, D, N), beside its inputs; the backward recomputes a chunk's states from it and runs
the adjoint recurrence back through the chunk (see selective_bwd in ssm/native/selective.c). So
memory is O(B·D·L), never O(B·D·L·N). Under ``torch.no_grad()`` (or when no input needs a
gradient) nothing is kept.

Shape symbols: B batch, D channels, L length, N state size, G groups, S packed sequences,
T chunk length (``CHUNK``), E / F linear_scan's flattened dims before / after the scanned one.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from .._custom_op import kernel_op
from ..native import declare, empty, flushed_subnormals, kernel, ptr, ready, strides3, threads
from ._checks import compute_dtype
from ._common import ssd_delta
from .pscan import linear_scan_pscan, selective_scan_pscan

CHUNK = 64  # T: steps between the states the forward keeps for the backward


class _SelectiveArgs(ctypes.Structure):
    """SelectiveArgs of ssm/native/selective.c, field for field."""

    _fields_ = (
        [
            (name, ctypes.c_int64)
            for name in (
                "batch",
                "dim",
                "length",
                "N",
                "groups_B",
                "groups_C",
                "nseq",
                "nthreads",
                "chunk",
                "B_fixed",
                "C_fixed",
                "softplus",
                "nparts",
                "delta_decay_only",
            )
        ]
        + [
            (name, ctypes.c_void_p)
            for name in (
                "u",
                "delta",
                "A",
                "B",
                "C",
                "D",
                "z",
                "delta_bias",
                "h0",
                "cu_seqlens",
            )
        ]
        + [(name, ctypes.c_int64 * 3) for name in ("su", "sdelta", "sz", "sB", "sC")]
        + [(name, ctypes.c_void_p) for name in ("out", "last", "ckpt", "grad_out", "grad_last")]
        + [("sgo", ctypes.c_int64 * 3)]
        + [
            (name, ctypes.c_void_p)
            for name in (
                "d_u",
                "d_delta",
                "d_z",
                "d_A",
                "d_B",
                "d_C",
                "part_B",
                "part_C",
                "d_D",
                "d_delta_bias",
                "d_h0",
            )
        ]
        + [(name, ctypes.c_int64 * 3) for name in ("sdB", "sdC")]
    )


class _LinearArgs(ctypes.Structure):
    """LinearArgs of ssm/native/linear.c, field for field."""

    _fields_ = [(name, ctypes.c_int64) for name in ("E", "length", "F", "nseq", "reverse", "nthreads")] + [
        (name, ctypes.c_void_p)
        for name in (
            "gates",
            "inputs",
            "h0",
            "cu_seqlens",
            "states",
            "grad",
            "d_gates",
            "d_inputs",
            "d_h0",
        )
    ]


declare("selective_fwd", [ctypes.POINTER(_SelectiveArgs)])
declare("selective_bwd", [ctypes.POINTER(_SelectiveArgs)])
declare("linear_fwd", [ctypes.POINTER(_LinearArgs)])
declare("linear_bwd", [ctypes.POINTER(_LinearArgs)])


# ----------------------------------------------------------------------------- selective scan
# In the ops, B and C are either fixed (D, N) or time-varying (B, G, L, N) with N contiguous:
# the layout of a Mamba layer's x_proj output, so that a step reads B_t as N adjacent values.


def _selective_args(u, delta, A, B, C, D, z, delta_bias, softplus, h0, cu_seqlens) -> _SelectiveArgs:
    batch, dim, length = u.shape
    a = _SelectiveArgs()
    a.batch, a.dim, a.length, a.N = batch, dim, length, A.shape[1]
    a.nseq = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    a.nthreads, a.chunk, a.softplus = threads(), CHUNK, int(softplus)
    for name, M in (("B", B), ("C", C)):
        fixed = M.ndim == 2
        setattr(a, f"{name}_fixed", int(fixed))
        setattr(a, f"groups_{name}", dim if fixed else M.shape[1])
        # fixed: channel d reads row d ("group" d), the same at every step and batch row
        setattr(a, f"s{name}", (0, M.shape[1], 0) if fixed else M.stride()[:3])
    a.u, a.delta, a.A, a.B, a.C = (x.data_ptr() for x in (u, delta, A, B, C))
    a.D, a.z, a.delta_bias, a.h0, a.cu_seqlens = (ptr(x) for x in (D, z, delta_bias, h0, cu_seqlens))
    a.su, a.sdelta, a.sz = strides3(u), strides3(delta), strides3(z)
    return a


def _selective_fwd_fake(u, delta, A, B, C, D, z, delta_bias, softplus, h0, cu_seqlens, keep_states, decay_only):
    batch, dim, length = u.shape
    S = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    ckpt = u.new_empty(batch, -(-length // CHUNK), dim, A.shape[1]) if keep_states else u.new_empty(0)
    return u.new_empty(batch, dim, length), u.new_empty(S, dim, A.shape[1]), ckpt


def _selective_setup(ctx, inputs, output):
    u, delta, A, B, C, D, z, delta_bias, softplus, h0, cu_seqlens, _, decay_only = inputs
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, h0, cu_seqlens, output[2])
    ctx.softplus, ctx.decay_only = softplus, decay_only
    ctx.set_materialize_grads(False)  # no zero tensors for the gradients of unused outputs (the states)


def _selective_backward(ctx, grad_out, grad_last, _grad_ckpt):
    u, delta, A, B, C, D, z, delta_bias, h0, cu_seqlens, ckpt = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(u)
    grads = _selective_bwd(
        grad_out,
        None if grad_last is None else grad_last.contiguous(),
        u,
        delta,
        A,
        B,
        C,
        D,
        z,
        delta_bias,
        ctx.softplus,
        h0,
        cu_seqlens,
        ckpt,
        ctx.decay_only,
    )
    d_u, d_delta, d_A, d_B, d_C, d_D, d_z, d_bias, d_h0 = grads
    return (
        d_u,
        d_delta,
        d_A,
        d_B,
        d_C,
        d_D if D is not None else None,
        d_z if z is not None else None,
        d_bias if delta_bias is not None else None,
        None,
        d_h0 if h0 is not None else None,
        None,
        None,
        None,
    )


@kernel_op(
    "ssm::cpu_selective_scan_fwd",
    fake=_selective_fwd_fake,
    device_types="cpu",
    backward=_selective_backward,
    setup_context=_selective_setup,
)
def _selective_fwd(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    delta_bias: Tensor | None,
    softplus: bool,
    h0: Tensor | None,
    cu_seqlens: Tensor | None,
    keep_states: bool,
    decay_only: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """u, delta, z (B, D, L), any strides; A (D, N), D and delta_bias (D,), h0 (S, D, N)
    contiguous; B, C as above; all of one dtype (float32 or float64).
    Returns out (B, D, L), the last states (S, D, N), and the state entering each chunk
    (B, ceil(L / T), D, N) when ``keep_states`` (else an empty tensor). ``decay_only``: the
    backward's gradient of delta is its share through exp(Δ·A) alone (see selective_scan_cpu)."""
    batch, dim, length = u.shape
    a = _selective_args(u, delta, A, B, C, D, z, delta_bias, softplus, h0, cu_seqlens)
    out = empty((batch, dim, length), u)
    last = empty((a.nseq, dim, A.shape[1]), u)
    ckpt = empty((batch, -(-length // CHUNK), dim, A.shape[1]) if keep_states else (0,), u)
    a.out, a.last, a.ckpt = out.data_ptr(), last.data_ptr(), (ckpt.data_ptr() if keep_states else None)
    kernel("selective_fwd", u.dtype)(ctypes.byref(a))
    return out, last, ckpt


def _laid_out_as(M: Tensor, new: Callable[[tuple[int, ...]], Tensor]) -> Tensor:
    """The gradient of B or C: (B, G, L, N) as M is laid out in memory, its (B, G, L) in the order
    of M's strides (N innermost, as the kernels read M), from ``new(shape)`` (contiguous). The
    gradient of Mamba-3's rotated keys, (B, L, H, N) seen as (B, H, L, N), then meets the one from
    their other use in the same layout, with no transposing add. (D, N): contiguous."""
    if M.ndim == 2:
        return new(M.shape)
    order = sorted(range(3), key=lambda i: -M.stride(i))  # stable: dims of equal stride keep their order
    inverse = [order.index(i) for i in range(3)]
    return new((*(M.shape[i] for i in order), M.shape[3])).permute(*inverse, 3)


def _selective_bwd_fake(
    grad_out, grad_last, u, delta, A, B, C, D, z, delta_bias, softplus, h0, cu_seqlens, ckpt, decay_only
):
    return (
        u.new_empty(u.shape),
        u.new_empty(u.shape),
        u.new_empty(A.shape),
        _laid_out_as(B, u.new_empty),
        _laid_out_as(C, u.new_empty),
        u.new_empty(u.shape[1] if D is not None else 0),
        u.new_empty(u.shape if z is not None else 0),
        u.new_empty(u.shape[1] if delta_bias is not None else 0),
        u.new_empty(h0.shape if h0 is not None else 0),
    )


def _channel_blocks(dim: int, nthreads: int, groups: list[int]) -> tuple[int, bool]:
    """The backward's blocks of channels, and whether each block's channels are whole groups of
    the time-varying B and C (``groups``: their group counts). Four blocks per thread share the
    work out under load; their sums over channels go to per-block scratch, added up at the end.
    With groups enough for two blocks per thread (Mamba-3's key per head), the blocks are whole
    groups instead and write their gradients' rows directly, with no scratch to zero and add up:
    ssd_cpu's backward at the parity model's (128, 81, 4 heads of 16), N 64, 2 threads, went from
    26.9-28.1 to 24.2-24.5 ms (medians of two runs each)."""
    blocks = min(dim, 4 * nthreads)
    if not groups:
        return blocks, False
    common = math.gcd(*groups)
    whole = max(b for b in range(1, min(common, blocks) + 1) if common % b == 0)
    return (whole, True) if whole >= 2 * nthreads else (blocks, False)


@kernel_op("ssm::cpu_selective_scan_bwd", fake=_selective_bwd_fake, device_types="cpu")
def _selective_bwd(
    grad_out: Tensor,
    grad_last: Tensor | None,
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    delta_bias: Tensor | None,
    softplus: bool,
    h0: Tensor | None,
    cu_seqlens: Tensor | None,
    ckpt: Tensor,
    decay_only: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of u, delta, A, B, C, D, z, delta_bias, h0 (an empty tensor for each absent
    one) from those of out (any strides) and of the last states (contiguous, or None)."""
    batch, dim, length = u.shape
    if grad_out.stride(-1) != 1:
        # e.g. out_proj's gradient, (B, L, D) seen as (B, D, L): one transposing copy costs less
        # than the sweeps' reading it a step apart (a cache line a step and channel).
        grad_out = empty(grad_out.shape, u).copy_(grad_out)
    a = _selective_args(u, delta, A, B, C, D, z, delta_bias, softplus, h0, cu_seqlens)
    a.ckpt, a.grad_out, a.grad_last, a.sgo = ckpt.data_ptr(), grad_out.data_ptr(), ptr(grad_last), grad_out.stride()
    a.delta_decay_only = int(decay_only)
    d_u, d_delta = empty(u.shape, u), empty(u.shape, u)
    d_z = empty(u.shape if z is not None else (0,), u)  # (an empty tensor stands for an absent input's)
    d_A = torch.empty_like(A)
    d_B, d_C = (_laid_out_as(M, lambda shape: empty(shape, u)) for M in (B, C))
    d_D, d_bias = (u.new_empty(dim if x is not None else 0) for x in (D, delta_bias))
    d_h0 = u.new_empty(h0.shape if h0 is not None else 0)
    a.nparts, owned = _channel_blocks(dim, a.nthreads, [M.shape[1] for M in (B, C) if M.ndim == 4])
    parts = [empty((a.nparts, *M.shape), u) if M.ndim == 4 and not owned else None for M in (B, C)]
    a.d_u, a.d_delta, a.d_A, a.d_B, a.d_C = (x.data_ptr() for x in (d_u, d_delta, d_A, d_B, d_C))
    a.d_z, a.d_D, a.d_delta_bias, a.d_h0 = (
        x.data_ptr() if p is not None else None for x, p in ((d_z, z), (d_D, D), (d_bias, delta_bias), (d_h0, h0))
    )
    a.part_B, a.part_C = (ptr(p) for p in parts)
    a.sdB, a.sdC = (M.stride()[:3] if M.ndim == 4 else (0, 0, 0) for M in (d_B, d_C))
    kernel("selective_bwd", u.dtype)(ctypes.byref(a))
    return d_u, d_delta, d_A, d_B, d_C, d_D, d_z, d_bias, d_h0


def _kernel_layout(M: Tensor, dtype: torch.dtype) -> Tensor:
    """B or C, (D, N) or (B, G, N, L), as the kernels read it: (D, N) contiguous or
    (B, G, L, N) with N contiguous (a view when it already is, e.g. a Mamba layer's x_proj output)."""
    M = M.to(dtype)
    if M.ndim == 2:
        return M.contiguous()
    M = M.transpose(-1, -2)  # (B, G, L, N)
    return M if M.stride(-1) == 1 else M.contiguous()


def _steps_adjacent(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x (B, D, L) in ``dtype`` with its steps adjacent in memory. The sweeps read a channel's
    steps one after another; from a (B, L, D) layout seen transposed (a Mamba layer's z, its Δ)
    each step is a row apart, and those strided reads cost more than one copy (measured: a
    Mamba layer at (8, 512, 256) fwd+bwd 138 -> 114 ms, medians of 3)."""
    x = x.to(dtype)
    return x if x.stride(-1) == 1 else x.contiguous()


def selective_scan_cpu(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    delta_decay_only: bool = False,
) -> tuple[Tensor, Tensor]:
    """Backend "cpu" of :func:`ssm.scan.selective_scan`.

    u, delta, z: (B, D, L); A: (D, N); B, C: (D, N) or (B, G, N, L); D, delta_bias: (D,);
    initial_state: (B, D, N), or (S, D, N) with cu_seqlens (S + 1,) (validated; batch 1).
    Returns out (B, D, L) in u's dtype and the last state (B or S, D, N) in float32 (float64
    for float64 inputs). ``delta_decay_only``: delta's gradient through the decay exp(Δ·A) alone,
    not through the input Δ·B·u, for a caller whose u or B divides by Δ (Mamba-3's scan on the
    sweeps, trapezoidal_cpu.py): through both, two rounded terms that cancel would be left."""
    if not ready():
        return selective_scan_pscan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, cu_seqlens)
    dtype = compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    args = (
        _steps_adjacent(u, dtype),
        _steps_adjacent(delta, dtype),
        A.to(dtype).contiguous(),
        _kernel_layout(B, dtype),
        _kernel_layout(C, dtype),
        None if D is None else D.to(dtype).contiguous(),
        None if z is None else _steps_adjacent(z, dtype),
        None if delta_bias is None else delta_bias.to(dtype).contiguous(),
    )
    h0 = None if initial_state is None else initial_state.to(dtype).contiguous()
    keep = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (*args, h0))
    out, last, _ = _selective_fwd(*args, bool(delta_softplus), h0, cu_seqlens, keep, bool(delta_decay_only))
    return out.to(u.dtype), last


# ----------------------------------------------------------------------------- linear scan


def _linear_args(gates, inputs, h0, cu_seqlens, reverse) -> _LinearArgs:
    E, length, F = inputs.shape
    p = _LinearArgs()
    p.E, p.length, p.F, p.reverse, p.nthreads = E, length, F, int(reverse), threads()
    p.nseq = E if cu_seqlens is None else cu_seqlens.numel() - 1
    p.gates, p.inputs, p.h0, p.cu_seqlens = (ptr(x) for x in (gates, inputs, h0, cu_seqlens))
    return p


def _linear_fwd_fake(gates, inputs, h0, cu_seqlens, reverse):
    return torch.empty_like(inputs)


def _linear_setup(ctx, inputs, output):
    gates, _, h0, cu_seqlens, reverse = inputs
    ctx.save_for_backward(gates, output, h0, cu_seqlens)
    ctx.reverse = reverse


def _linear_backward(ctx, grad):
    gates, states, h0, cu_seqlens = ctx.saved_tensors
    d_gates, d_inputs, d_h0 = _linear_bwd(grad, gates, states, h0, cu_seqlens, ctx.reverse)
    return d_gates, d_inputs, (d_h0 if h0 is not None else None), None, None


@kernel_op(
    "ssm::cpu_linear_scan_fwd",
    fake=_linear_fwd_fake,
    device_types="cpu",
    backward=_linear_backward,
    setup_context=_linear_setup,
)
def _linear_fwd(gates: Tensor, inputs: Tensor, h0: Tensor | None, cu_seqlens: Tensor | None, reverse: bool) -> Tensor:
    """gates, inputs (E, L, F) contiguous, one dtype; h0 (E, F), or (S, F) with cu_seqlens
    (E = 1). Returns every state, (E, L, F)."""
    p = _linear_args(gates, inputs, h0, cu_seqlens, reverse)
    states = empty(inputs.shape, inputs)
    p.states = states.data_ptr()
    kernel("linear_fwd", inputs.dtype)(ctypes.byref(p))
    return states


def _linear_bwd_fake(grad, gates, states, h0, cu_seqlens, reverse):
    return (
        torch.empty_like(gates),
        torch.empty_like(gates),
        torch.empty_like(h0) if h0 is not None else gates.new_empty(0),
    )


@kernel_op("ssm::cpu_linear_scan_bwd", fake=_linear_bwd_fake, device_types="cpu")
def _linear_bwd(
    grad: Tensor, gates: Tensor, states: Tensor, h0: Tensor | None, cu_seqlens: Tensor | None, reverse: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of gates, inputs and h0 (empty when h0 is None) from grad (E, L, F)."""
    p = _linear_args(gates, states, h0, cu_seqlens, reverse)
    grad = grad.contiguous()
    d_gates, d_inputs = empty(gates.shape, gates), empty(gates.shape, gates)
    d_h0 = torch.empty_like(h0) if h0 is not None else gates.new_empty(0)
    p.states, p.grad, p.d_gates, p.d_inputs = (
        states.data_ptr(),
        grad.data_ptr(),
        d_gates.data_ptr(),
        d_inputs.data_ptr(),
    )
    p.d_h0 = d_h0.data_ptr() if h0 is not None else None
    kernel("linear_bwd", gates.dtype)(ctypes.byref(p))
    return d_gates, d_inputs, d_h0


def linear_scan_cpu(
    gates: Tensor,
    inputs: Tensor,
    dim: int,
    initial_state: Tensor | None = None,
    reverse: bool = False,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """Backend "cpu" of :func:`ssm.scan.linear_scan` (``dim`` non-negative): the inputs are
    viewed as (E, L, F) around the scanned dimension (no copy when contiguous) and scanned in
    place along it. With cu_seqlens (validated; E = 1), initial_state is (S, *shape after dim)."""
    if not ready():
        return linear_scan_pscan(gates, inputs, dim, initial_state, reverse, cu_seqlens)
    dtype = compute_dtype(gates, inputs, initial_state)
    out_dtype = torch.promote_types(gates.dtype, inputs.dtype)
    shape = inputs.shape
    length = shape[dim]
    E, F = math.prod(shape[:dim]), math.prod(shape[dim + 1 :])
    a = gates.to(dtype).reshape(E, length, F).contiguous()
    x = inputs.to(dtype).reshape(E, length, F).contiguous()
    rows = E if cu_seqlens is None else cu_seqlens.numel() - 1  # E, or S packed sequences
    h0 = None if initial_state is None else initial_state.to(dtype).reshape(rows, F).contiguous()
    return _linear_fwd(a, x, h0, cu_seqlens, bool(reverse)).view(shape).to(out_dtype)


# ----------------------------------------------------------------------------- SSD (Mamba-2)


def ssd_cpu(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_state: Tensor | None = None,
    chunk_size: int = 64,
    cu_seqlens: Tensor | None = None,
    dt_decay_only: bool = False,
) -> tuple[Tensor, Tensor]:
    """Backend "cpu" of :func:`ssm.scan.ssd`: the SSD recurrence is a selective scan whose
    channels are the H·P head channels, whose Δ and A are shared by the P channels of a head and
    whose B and C are grouped, so it runs on the selective sweeps. x, z, B and C are passed as
    views (the kernels take strides); Δ (softplus and clamp included, by autograd) and A are
    broadcast to the channels. ``chunk_size`` is not used: the sweeps walk every step.
    Same contract as ``reference.ssd_ref``, packed sequences included. ``dt_decay_only``: see
    selective_scan_cpu's ``delta_decay_only``."""
    batch, length, heads, P = x.shape
    dim = heads * P
    N = B.shape[-1]
    dtype = compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_state)
    delta = ssd_delta(dt.to(dtype), dt_bias, dt_softplus, dt_limit)  # (batch, L, H)

    def per_channel(t: Tensor) -> Tensor:  # (..., H) -> (..., H·P), each head's value on its P channels
        # expand + reshape rather than an index: the backward is then a sum over P, not a scatter
        return t[..., None].expand(*t.shape, P).reshape(*t.shape[:-1], dim)

    if D is not None:
        D = per_channel(D.to(dtype)) if D.ndim == 1 else D.to(dtype).reshape(dim)
    out, last = selective_scan_cpu(
        x.reshape(batch, length, dim).transpose(1, 2),
        per_channel(delta).transpose(1, 2),
        per_channel(A.to(dtype))[:, None].expand(dim, N),
        B.permute(0, 2, 3, 1),  # (batch, G, N, L)
        C.permute(0, 2, 3, 1),
        D,
        None if z is None else z.reshape(batch, length, dim).transpose(1, 2),
        initial_state=None if initial_state is None else initial_state.reshape(-1, dim, N),
        cu_seqlens=cu_seqlens,
        delta_decay_only=dt_decay_only,
    )
    return out.transpose(1, 2).reshape(batch, length, heads, P), last.reshape(-1, heads, P, N)


def subnormals_flushed(fn):
    """Backend ``fn`` (a chunked PyTorch form; its first argument has the inputs' ``.device``: a
    tensor, or trapezoidal_scan's TrapezoidalArgs) with, on the CPU, torch's threads flushing
    subnormals to zero while its forward runs (ssm.native.flushed_subnormals): the exps of strong
    decays make weights in the subnormal range, and each product that reads one takes a microcode
    assist. Measured: a 512-token prefill of a 24-layer Mamba-2 with transformers'
    initialisation (A up to -24), 527-582 -> 769-842 tokens/s. The backward (run later by
    autograd) is not covered; nor is a traced function (torch.compile)."""

    @functools.wraps(fn)
    def run(first, *args, **kwargs):
        if first.device.type != "cpu" or torch.compiler.is_compiling():
            return fn(first, *args, **kwargs)
        with flushed_subnormals():
            return fn(first, *args, **kwargs)

    return run
