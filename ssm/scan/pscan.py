"""Parallel scan ("PScan") in pure PyTorch.

The first-order recurrence h_t = a_t·h_{t-1} + x_t is solved by the work-efficient parallel
scan (Blelloch's up-sweep / down-sweep, written recursively): neighbouring steps are paired
and composed, (a_2, x_2)∘(a_1, x_1) = (a_2·a_1, a_2·x_1 + x_2), the half-length problem is
solved, and the remaining steps are filled in from their solved neighbours. Every level is a
handful of whole-tensor ops, so there are O(log L) sequential steps and O(L) work in total,
for any length L (no padding to a power of two).

The backward is its own parallel scan, not autograd through the sweep: with λ_t = dLoss/dh_t
accumulated through the recurrence,

    λ_t = g_t + a_{t+1}·λ_{t+1}     (a reverse scan of the upstream gradient g on shifted gates)
    dx_t = λ_t,   da_t = λ_t·h_{t-1},   dh_{-1} = a_0·λ_0.

Nothing here writes into a caller's tensor.

Shape symbols: B batch, L length, D channels, N state size, G groups; E and F are the
flattened dimensions before and after the scanned one of a linear scan.
"""

from __future__ import annotations

import math

import torch

from ._checks import compute_dtype
from ._common import selective_delta, selective_skip_and_gate


def _into(out: torch.Tensor, fn, *args) -> torch.Tensor:
    """``fn(*args)`` written into the (often strided) view ``out`` without a temporary.
    torch.compile does not take ``out=`` views, so there the result is copied in instead,
    a copy the compiler fuses away."""
    if torch.compiler.is_compiling():
        return out.copy_(fn(*args))
    return fn(*args, out=out)


def _pscan(
    a: torch.Tensor,
    x: torch.Tensor,
    h0: torch.Tensor | None,
    reverse: bool,
    out: torch.Tensor | None = None,
    restart: torch.Tensor | None = None,
) -> torch.Tensor:
    """All states of h_t = a_t·h_prev + x_t along dim 1 of (E, L, F) tensors; h_prev is the
    previous step in scan order (t-1, or t+1 when ``reverse``) and ``h0`` (E, F) or 0 before
    the first step. Writes the states into ``out`` (any (E, L, F) view; a new tensor if None)
    and returns it.

    ``restart`` (1, L, 1) bool (packed sequences): the steps that ignore h_prev, h_t = x_t. Their
    gate is 0 as well, but 0·h_prev is NaN when h_prev is (a non-finite value of the sequence
    before): so each step and each composed pair that restarts takes its own input by a
    selection (where), never by a product with what came before."""
    if out is None:
        out = torch.empty_like(x)
    T = x.shape[1]
    if T == 1:
        return out.copy_(x) if h0 is None else _into(out, torch.addcmul, x, a, h0[:, None])

    # In scan order the steps pair up as (first, second); with odd T one step is left over,
    # last in scan order. Forward: pairs (0,1), (2,3), ...; reverse: (T-1,T-2), (T-3,T-4), ...
    n, odd = divmod(T, 2)
    if reverse:
        first, second = slice(odd + 1, T, 2), slice(odd, T, 2)
    else:
        first, second = slice(0, 2 * n, 2), slice(1, 2 * n, 2)
    a_first, a_second = a[:, first], a[:, second]

    # Compose each pair into one step and solve the half-length problem: its states are the
    # states at the second step of every pair, written straight into their places in `out`.
    # h0 passes through unchanged, because composing the scan's first pair with h0 gives the
    # first composed step applied to h0.
    gates, inputs = a_second * a_first, torch.addcmul(x[:, second], a_second, x[:, first])  # (E, L/2, F)
    pair_restart = None
    if restart is not None:  # a pair whose second step restarts is that step alone
        r_second = restart[:, second]
        gates, inputs = torch.where(r_second, 0.0, gates), torch.where(r_second, x[:, second], inputs)
        pair_restart = r_second | restart[:, first]
    h_pairs = _pscan(gates, inputs, h0, reverse, out=out[:, second], restart=pair_restart)

    # Every other step follows from the solved step just before it in scan order; the very
    # first step in scan order starts from h0.
    if reverse:
        start, rest, previous = T - 1, slice(1 - odd, T - 1, 2), h_pairs[:, 1 - odd :]
    else:
        start, rest, previous = 0, slice(2, T, 2), h_pairs[:, : (T - 1) // 2]
    if restart is None:
        _into(out[:, rest], torch.addcmul, x[:, rest], a[:, rest], previous)
    else:
        out[:, rest] = torch.where(restart[:, rest], x[:, rest], torch.addcmul(x[:, rest], a[:, rest], previous))
    if h0 is None:
        out[:, start] = x[:, start]
    else:
        _into(out[:, start], torch.addcmul, x[:, start], a[:, start], h0)
    return out


class LinearScanFn(torch.autograd.Function):
    """Differentiable parallel linear scan over dim 1 of (E, L, F) tensors of one dtype."""

    @staticmethod
    def forward(ctx, a, x, h0, reverse: bool, restart=None):
        h = _pscan(a, x, h0, reverse, restart=restart)
        ctx.reverse = reverse
        ctx.save_for_backward(a, h, h0)
        return h

    @staticmethod
    def backward(ctx, grad_h):
        a, h, h0 = ctx.saved_tensors
        reverse = ctx.reverse
        need_a, need_x, need_h0, _, _ = ctx.needs_input_grad
        # Steps in `after` have their predecessor (in scan order) at the same place in `before`.
        if reverse:
            after, before, start, end = slice(None, -1), slice(1, None), -1, 0
        else:
            after, before, start, end = slice(1, None), slice(None, -1), 0, -1

        # The adjoint runs against the scan direction, each step weighted by the gate of the
        # step that follows it in scan order (a_{t+1} forward, a_{t-1} reverse).
        a_next = torch.empty_like(a)
        a_next[:, before] = a[:, after]
        a_next[:, end] = 0  # the last step in scan order has no successor; this slot is unused
        lam = _pscan(a_next, grad_h.contiguous(), None, not reverse)  # (E, L, F)

        grad_a = grad_h0 = None
        if need_a:  # da_t = λ_t·h_prev(t), with h_prev = h0 (or 0) at the first step
            grad_a = torch.empty_like(a)
            _into(grad_a[:, after], torch.mul, lam[:, after], h[:, before])
            grad_a[:, start] = 0 if h0 is None else lam[:, start] * h0
        if need_h0:
            grad_h0 = a[:, start] * lam[:, start]
        return grad_a, (lam if need_x else None), grad_h0, None, None


def _restart_sequences(a, x, h0, cu_seqlens, reverse: bool):
    """Gates and inputs (1, L, F) of packed sequences rewritten so that one plain scan over L
    scans each sequence alone: at each sequence's first step in scan order (its first position,
    or its last when ``reverse``) the gate becomes 0, cutting the state carried from the
    sequence before, and that step's input gains gate·h0[s], the sequence's own initial state
    (S, F), when given; and those steps, (1, L, 1) bool, for the scan (``_pscan``'s restart).
    Differentiable in a, x and h0 (gradients reach the true gate through the injected term)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    nonempty = (lengths > 0).nonzero()[:, 0]  # (S',) zero-length sequences have no first step
    first = (cu_seqlens[1:] - 1 if reverse else cu_seqlens[:-1])[nonempty]  # (S',)
    restart = torch.zeros(1, a.shape[1], 1, dtype=torch.bool, device=a.device)
    restart[0, first] = True
    gates = torch.where(restart, 0.0, a)
    if h0 is not None:
        x = x.index_add(1, first, a[:, first] * h0[nonempty][None])
    return gates, x, restart


def _last_states(h, h0, cu_seqlens, state_shape):
    """Each packed sequence's state after its last step, (S, *state_shape), from the states
    h (1, L, F) of a forward scan: h at position cu_seqlens[s+1] - 1, or the sequence's initial
    state (or 0) when it is empty."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    nonempty = (lengths > 0).nonzero()[:, 0]
    num_seqs = lengths.numel()
    last = h0 if h0 is not None else h.new_zeros(num_seqs, h.shape[-1])  # (S, F)
    last = last.index_copy(0, nonempty, h[0, cu_seqlens[1:][nonempty] - 1])
    return last.reshape(num_seqs, *state_shape)


def _as_3d(x: torch.Tensor, dim: int) -> torch.Tensor:
    """View ``x`` as (E, L, F) with the scanned dimension in the middle."""
    return x.reshape(math.prod(x.shape[:dim]), x.shape[dim], math.prod(x.shape[dim + 1 :]))


def linear_scan_pscan(
    gates: torch.Tensor,
    inputs: torch.Tensor,
    dim: int,
    initial_state: torch.Tensor | None = None,
    reverse: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Backend "pscan" of :func:`ssm.scan.linear_scan` (``dim`` non-negative). Packed
    sequences (``cu_seqlens``, E = 1) are one scan with the gate cut at each sequence's start."""
    dtype = compute_dtype(gates, inputs, initial_state)
    out_dtype = torch.promote_types(gates.dtype, inputs.dtype)
    shape = inputs.shape
    a = _as_3d(gates.to(dtype), dim)  # (E, L, F)
    x = _as_3d(inputs.to(dtype), dim)
    if cu_seqlens is None:
        h0 = None if initial_state is None else initial_state.to(dtype).reshape(a.shape[0], a.shape[2])
    else:
        h0_seq = None if initial_state is None else initial_state.to(dtype).reshape(-1, a.shape[2])  # (S, F)
        a, x, restart = _restart_sequences(a, x, h0_seq, cu_seqlens, reverse)
        h0 = None
    h = LinearScanFn.apply(a.contiguous(), x.contiguous(), h0, reverse, None if cu_seqlens is None else restart)
    return h.reshape(shape).to(out_dtype)


def selective_scan_pscan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backend "pscan" of :func:`ssm.scan.selective_scan`: materialises the discretised gates
    and inputs and runs the parallel linear scan over L. Packed sequences (``cu_seqlens``,
    batch 1) are one scan with the gate cut at each sequence's first step.

    It works time-major, (B, L, D, N), so that every step of the scan is one contiguous block
    and the readout C_t·h_t is a batched matrix-vector product; channels-first (B, D, L, N)
    would make both strided."""
    dtype = compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    batch, dim, length = u.shape
    N = A.shape[1]
    out_dtype = u.dtype
    u, delta, A = u.to(dtype), delta.to(dtype), A.to(dtype)
    delta = selective_delta(delta, delta_bias, delta_softplus)  # (B, D, L)

    delta_t = delta.transpose(1, 2).contiguous()  # (B, L, D)
    decay = torch.exp_(delta_t[..., None] * A)  # (B, L, D, N); in place: one temporary fewer
    delta_u = (delta * u).transpose(1, 2).contiguous()  # (B, L, D)
    if B.ndim == 2:  # fixed (D, N)
        drive = delta_u[..., None] * B.to(dtype)  # (B, L, D, N)
    else:  # (B, G, N, L): channel d reads group d // (D / G)
        G = B.shape[1]
        B_t = B.to(dtype).permute(0, 3, 1, 2)[:, :, :, None, :]  # (B, L, G, 1, N)
        drive = (delta_u.view(batch, length, G, dim // G, 1) * B_t).view(batch, length, dim, N)

    gates, inputs = decay.view(batch, length, dim * N), drive.view(batch, length, dim * N)
    h0 = None if initial_state is None else initial_state.to(dtype).reshape(-1, dim * N)
    restart = None
    if cu_seqlens is not None:  # h0: (S, D·N) per sequence
        gates, inputs, restart = _restart_sequences(gates, inputs, h0, cu_seqlens, False)
    h = LinearScanFn.apply(gates, inputs, None if cu_seqlens is not None else h0, False, restart)
    if cu_seqlens is not None:
        last = _last_states(h, h0, cu_seqlens, (dim, N))
    h = h.view(batch, length, dim, N)

    if C.ndim == 2:  # fixed (D, N)
        y = (h * C.to(dtype)).sum(-1)  # (B, L, D)
    else:
        G = C.shape[1]
        C_t = C.to(dtype).permute(0, 3, 1, 2)[..., None]  # (B, L, G, N, 1)
        y = torch.matmul(h.view(batch, length, G, dim // G, N), C_t).view(batch, length, dim)
    out = selective_skip_and_gate(y.transpose(1, 2), u, D, z)  # (B, D, L)
    if cu_seqlens is not None:
        return out.to(out_dtype), last
    # A copy, so that holding on to the last state does not keep all of h alive.
    return out.to(out_dtype), h[:, -1].clone()
