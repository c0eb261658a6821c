"""Backend "triton" of ``linear_scan``, top to bottom: launch heuristics, the kernel, launchers,
the custom ops with their autograd formula, and the backend entry point.

    _linear_scan_kernel  →  _linear_scan_fwd / _linear_scan_bwd  →  ssm::linear_scan_fwd / _bwd  →  linear_scan_triton

One kernel serves both directions: the backward of a scan is a scan of the upstream gradient
in the other direction on the gates shifted by one step (λ_t = g_t + a_{next}·λ_{next}), so
the backward launches the same kernel with BACKWARD set, which also writes the gates' gradient.
A program scans BLOCK_T steps of BLOCK_F lanes at a time and carries the state across blocks.

Packed sequences (cu_seqlens, E = 1): the launcher gives the kernel the sequence of each step
(``seq_ptr``, (L,) int32). At each sequence's first step in scan order the gate becomes 0 and
the input gains gate·h0[s] (its initial state, (S, F)), wherever the step falls in a block;
the backward cuts the adjoint at the same steps and reads h0[s] as the state before them.

Shape symbols: the inputs are viewed as (E, L, F): E the flattened dimensions before the
scanned one, L its length, F those after it; S packed sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..._custom_op import kernel_op
from ._jit import (
    NONE,
    check_launchable,
    compute_dtype,
    first_order_combine,
    next_power_of_2,
    restarting_combine,
    sequence_of_steps,
    tl_dtype,
)

# ----------------------------------------------------------------------------- launch heuristics

TILE = 2048  # elements of one (BLOCK_T, BLOCK_F) tile


@dataclass(frozen=True)
class Config:
    block_t: int  # time steps per iteration (power of two)
    block_f: int  # lanes of the trailing dimension per program (power of two)
    num_warps: int


def config(length: int, F: int) -> Config:
    """Block sizes for the scan of (E, L, F) tensors along L."""
    block_f = min(next_power_of_2(F), 64)
    block_t = max(1, min(next_power_of_2(length), TILE // block_f))
    # Compiled for sm_90 at 2048 x 1 (forward, backward): no spills with 8 warps.
    return Config(block_t, block_f, 4 if block_t * block_f <= 1024 else 8)


# ----------------------------------------------------------------------------- kernel


@triton.heuristics(
    {
        "COMPUTE": lambda a: tl_dtype(compute_dtype(a["gates_ptr"], a["inputs_ptr"], a["initial_state_ptr"])),
        "HAS_INITIAL_STATE": lambda a: a["initial_state_ptr"] is not None,
        "BACKWARD": lambda a: a["dgates_ptr"] is not None,
        "PACKED": lambda a: a["seq_ptr"] is not None,
    }
)
@triton.jit
def _linear_scan_kernel(
    gates_ptr,
    inputs_ptr,
    initial_state_ptr,
    out_ptr,
    states_ptr,
    dgates_ptr,  # backward only: the forward's states (read) and the gates' gradient
    seq_ptr,  # packed: (L,) int32, the sequence of each step; else None
    L,
    F,
    n_f_blocks,
    REVERSE: tl.constexpr,
    COMPUTE: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr,
    BACKWARD: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """States of h_t = a_t·h_prev + x_t along L of contiguous (E, L, F) tensors, h_prev being
    the step before in scan order (t-1, or t+1 when REVERSE), the initial state (E, F) or 0
    before the first.

    The scan order is realised by index arithmetic: block k holds scan steps
    k·BLOCK_T + 0..BLOCK_T-1, which live at t = s (forward) or t = L-1-s (reverse), so the
    in-register scan always runs forwards (no associative_scan(reverse=True)).

    BACKWARD: the adjoint of a forward scan run in direction not-REVERSE, i.e. this kernel is
    launched with the opposite REVERSE flag: out = λ with λ_t = x_t + a_{prev(t)}·λ_{prev(t)}
    (x = upstream gradient, a = the forward's gates, read one step back in this scan's order),
    and dgates_t = λ_t·h_{t∓1} (the forward's state before step t, or the initial state / 0 at
    its first step).

    PACKED (E = 1): the initial state is (S, F), one per sequence, entering at each sequence's
    first step in the forward's scan order, where the forward's gate is cut to 0.
    """
    pid = tl.program_id(0)
    e = (pid // n_f_blocks).to(tl.int64)  # offsets past 2**31 elements
    f = (pid % n_f_blocks) * BLOCK_F + tl.arange(0, BLOCK_F)
    f_mask = f < F
    s_local = tl.arange(0, BLOCK_T)
    base = e * L * F
    if HAS_INITIAL_STATE and not BACKWARD and not PACKED:
        carry = tl.load(initial_state_ptr + e * F + f, mask=f_mask, other=0.0).to(COMPUTE)
    else:
        carry = tl.zeros([BLOCK_F], dtype=COMPUTE)

    for k in range(0, tl.cdiv(L, BLOCK_T)):
        s = k * BLOCK_T + s_local  # scan step
        if REVERSE:
            t = L - 1 - s
        else:
            t = s
        t = t.to(tl.int64)  # t·F below: past 2**31 elements in a row (e.g. ssd's chunk states at long L)
        mask = (s < L)[:, None] & f_mask[None, :]
        offsets = base + t[:, None] * F + f[None, :]  # (BLOCK_T, BLOCK_F)
        x = tl.load(inputs_ptr + offsets, mask=mask, other=0.0).to(COMPUTE)
        # the step before each one in this scan's order (there is none before the first)
        if REVERSE:
            t_before = t + 1
        else:
            t_before = t - 1
        if PACKED:
            seq = tl.load(seq_ptr + t, mask=s < L, other=-1)
            seq_before = tl.load(seq_ptr + t_before, mask=(s < L) & (s >= 1), other=-1)
            cut = (s < L) & (seq != seq_before)  # a sequence boundary between the two
        if BACKWARD:
            # the gate of step s is a at scan step s-1, the forward's next step; there is none
            # before the first step, nor across a sequence boundary (where the forward cut it)
            gate_mask = mask & (s >= 1)[:, None]
            if PACKED:
                gate_mask = gate_mask & ~cut[:, None]
            a = tl.load(gates_ptr + base + t_before[:, None] * F + f[None, :], mask=gate_mask, other=0.0).to(COMPUTE)
        else:
            a = tl.load(gates_ptr + offsets, mask=mask, other=1.0).to(COMPUTE)
            if PACKED:  # a sequence's first step: the state restarts from its initial state or 0
                if HAS_INITIAL_STATE:
                    h0 = tl.load(initial_state_ptr + seq[:, None] * F + f[None, :], mask=mask & cut[:, None], other=0.0)
                    x += tl.where(cut[:, None], a * h0.to(COMPUTE), 0.0)
                a = tl.where(cut[:, None], 0.0, a)
        if PACKED and not BACKWARD:  # a sequence's steps take nothing from before its start, selected
            flags = tl.zeros_like(a) + tl.where(cut[:, None], 1.0, 0.0)
            a_prod, x_sum, restarted = tl.associative_scan((a, x, flags), 0, restarting_combine)
            h = tl.where(restarted > 0, x_sum, x_sum + a_prod * carry[None, :])
        else:
            a_prod, x_sum = tl.associative_scan((a, x), 0, first_order_combine)
            h = x_sum + a_prod * carry[None, :]
        tl.store(out_ptr + offsets, h, mask=mask)
        carry = tl.sum(tl.where((s_local == BLOCK_T - 1)[:, None], h, 0.0), axis=0)

        if BACKWARD:
            # the forward's previous state of step t: t-1 in its order, i.e. t+1 here if REVERSE
            if REVERSE:
                t_prev = t - 1
            else:
                t_prev = t + 1
            prev_mask = mask & (t_prev >= 0)[:, None] & (t_prev < L)[:, None]
            if PACKED:  # the forward's first step of a sequence: its previous state is h0[s] or 0
                seq_prev = tl.load(seq_ptr + t_prev, mask=(s < L) & (t_prev >= 0) & (t_prev < L), other=-1)
                is_first = mask & (seq_prev != seq)[:, None]
                prev_mask = prev_mask & ~is_first
            h_prev = tl.load(states_ptr + base + t_prev[:, None] * F + f[None, :], mask=prev_mask, other=0.0)
            h_prev = h_prev.to(COMPUTE)
            if HAS_INITIAL_STATE:
                if PACKED:
                    h0 = tl.load(initial_state_ptr + seq[:, None] * F + f[None, :], mask=is_first, other=0.0)
                    h_prev = tl.where(is_first, h0.to(COMPUTE), h_prev)
                else:
                    is_first = mask & ((t_prev < 0) | (t_prev >= L))[:, None]
                    h0 = tl.load(initial_state_ptr + e * F + f, mask=f_mask, other=0.0).to(COMPUTE)
                    h_prev = tl.where(is_first, h0[None, :], h_prev)
            tl.store(dgates_ptr + offsets, h * h_prev, mask=mask)


# ----------------------------------------------------------------------------- launchers


def _launch(gates, inputs, initial_state, out, states, dgates, reverse: bool, cu_seqlens=None):
    E, L, F = out.shape
    cfg = config(L, F)
    n_f_blocks = -(-F // cfg.block_f)
    check_launchable(out)
    _linear_scan_kernel[(E * n_f_blocks,)](
        gates_ptr=gates,
        inputs_ptr=inputs,
        initial_state_ptr=initial_state,
        out_ptr=out,
        states_ptr=states,
        dgates_ptr=dgates,
        seq_ptr=sequence_of_steps(cu_seqlens, L),
        L=L,
        F=F,
        n_f_blocks=n_f_blocks,
        REVERSE=bool(reverse),
        BLOCK_T=cfg.block_t,
        BLOCK_F=cfg.block_f,
        num_warps=cfg.num_warps,
    )


def _linear_scan_fwd(gates, inputs, initial_state, reverse: bool, cu_seqlens=None):
    """States (E, L, F) in the inputs' promoted dtype, computed in the state dtype (float32, or
    float64 for float64 inputs); initial_state: (E, F) or None; packed (``cu_seqlens`` (S + 1,),
    E = 1): (S, F) or None."""
    gates, inputs = gates.contiguous(), inputs.contiguous()
    initial_state = None if initial_state is None else initial_state.contiguous()
    out = torch.empty(inputs.shape, device=inputs.device, dtype=torch.promote_types(gates.dtype, inputs.dtype))
    if out.numel():
        _launch(gates, inputs, initial_state, out, None, None, reverse, cu_seqlens)
    return out


def _linear_scan_bwd(grad, gates, states, initial_state, reverse: bool, cu_seqlens=None):
    """(dgates, dinputs, dinitial_state) of :func:`_linear_scan_fwd` given its states."""
    E, L, F = states.shape
    grad, gates, states = grad.contiguous(), gates.contiguous(), states.contiguous()
    initial_state = None if initial_state is None else initial_state.contiguous()
    dtype = compute_dtype(gates, states, initial_state)
    lam = torch.empty(E, L, F, device=states.device, dtype=dtype)
    dgates = torch.empty(E, L, F, device=states.device, dtype=dtype)
    if lam.numel():
        _launch(gates, grad, initial_state, lam, states, dgates, not reverse, cu_seqlens)
    if initial_state is None:
        return dgates, lam, None
    if cu_seqlens is None:
        first = L - 1 if reverse else 0
        return dgates, lam, gates[:, first].to(dtype) * lam[:, first]
    # dLoss/dh0[s] = a·λ at sequence s's first step in scan order (0 for an empty sequence)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    nonempty = (lengths > 0).nonzero()[:, 0]
    first = (cu_seqlens[1:] - 1 if reverse else cu_seqlens[:-1])[nonempty]
    dinitial_state = torch.zeros(initial_state.shape, device=states.device, dtype=dtype)
    dinitial_state[nonempty] = gates[0, first].to(dtype) * lam[0, first]
    return dgates, lam, dinitial_state


# ----------------------------------------------------------------------------- custom ops


def _fwd_fake(gates, inputs, initial_state, reverse, cu_seqlens=None):
    return torch.empty_like(inputs, dtype=torch.promote_types(gates.dtype, inputs.dtype))


def _setup_context(ctx, inputs, output):
    gates, inputs_, initial_state, reverse, cu_seqlens = inputs
    ctx.save_for_backward(gates, output, initial_state, cu_seqlens)
    ctx.reverse = reverse
    ctx.dtypes = (gates.dtype, inputs_.dtype, None if initial_state is None else initial_state.dtype)


def _backward(ctx, grad):
    gates, states, initial_state, cu_seqlens = ctx.saved_tensors
    dgates, dinputs, dinitial_state = linear_scan_bwd(grad, gates, states, initial_state, ctx.reverse, cu_seqlens)
    gates_dtype, inputs_dtype, initial_state_dtype = ctx.dtypes
    return (
        dgates.to(gates_dtype),
        dinputs.to(inputs_dtype),
        None if initial_state is None else dinitial_state.to(initial_state_dtype),
        None,  # reverse
        None,  # cu_seqlens
    )


@kernel_op("ssm::linear_scan_fwd", fake=_fwd_fake, backward=_backward, setup_context=_setup_context)
def linear_scan_fwd(
    gates: Tensor, inputs: Tensor, initial_state: Tensor | None, reverse: bool, cu_seqlens: Tensor | None = None
) -> Tensor:
    return _linear_scan_fwd(gates, inputs, initial_state, reverse, cu_seqlens)


def _bwd_fake(grad, gates, states, initial_state, reverse, cu_seqlens=None):
    dtype = compute_dtype(gates, states, initial_state)
    dinitial_state = states.new_empty(NONE if initial_state is None else initial_state.shape, dtype=dtype)
    return states.new_empty(states.shape, dtype=dtype), states.new_empty(states.shape, dtype=dtype), dinitial_state


@kernel_op("ssm::linear_scan_bwd", fake=_bwd_fake)
def linear_scan_bwd(
    grad: Tensor,
    gates: Tensor,
    states: Tensor,
    initial_state: Tensor | None,
    reverse: bool,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    dgates, dinputs, dinitial_state = _linear_scan_bwd(grad, gates, states, initial_state, reverse, cu_seqlens)
    if dinitial_state is None:
        dinitial_state = states.new_empty(NONE, dtype=dgates.dtype)
    return dgates, dinputs, dinitial_state


# ----------------------------------------------------------------------------- backend entry point


def linear_scan_triton(
    gates: Tensor,
    inputs: Tensor,
    dim: int,
    initial_state: Tensor | None,
    reverse: bool,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """Backend "triton" of :func:`ssm.scan.linear_scan` (``dim`` non-negative; packed
    sequences with ``cu_seqlens``, E = 1, initial_state (S, ...))."""
    shape = inputs.shape
    E, L, F = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])
    if initial_state is not None:
        initial_state = initial_state.reshape(E if cu_seqlens is None else initial_state.shape[0], F)
    states = linear_scan_fwd(gates.reshape(E, L, F), inputs.reshape(E, L, F), initial_state, reverse, cu_seqlens)
    return states.reshape(shape)
