"""Pieces of arithmetic shared by the fast paths (pscan, cpu, chunked, the one-step functions).
The references in reference.py do not import them: each writes its own plain version, so that a
bug here shows up as a difference against the reference. It imports no scan: the backends that
linear_scan dispatches to (cpu.py, pscan.py) import it.

Shape symbols: B batch, L length, D channels, N state size, G groups, H heads, P head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import compute_dtype, sequence_bounds


def selective_delta(delta: torch.Tensor, delta_bias: torch.Tensor | None, delta_softplus: bool) -> torch.Tensor:
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


def ssd_skip_and_gate(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
    """(y + D·x)·silu(z). y, x, z: (B, L, H, P) (or without L); D: (H,) or (H, P)."""
    if D is not None:
        D = D.to(y.dtype)
        y = y + (D[:, None] if D.ndim == 1 else D) * x
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y


def selective_per_sequence(fn, u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, cu_seqlens):
    """Packed sequences (``cu_seqlens`` (S + 1,), batch 1) run one at a time through a
    selective-scan backend ``fn`` that knows nothing of packing: out (1, D, L) and the last
    states (S, D, N), a zero-length sequence's being its initial state (or 0)."""
    dtype = compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    outs, lasts = [], []
    bounds = sequence_bounds(cu_seqlens)
    for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        h0 = None if initial_state is None else initial_state[s : s + 1]
        if end == start:
            lasts.append(u.new_zeros(1, u.shape[1], A.shape[1], dtype=dtype) if h0 is None else h0.to(dtype))
            continue

        def part(M):  # the time steps of sequence s of a time-varying input
            return M if M is None or M.ndim == 2 else M[..., start:end]

        out, last = fn(part(u), part(delta), A, part(B), part(C), D, part(z), delta_bias, delta_softplus, h0)
        outs.append(out)
        lasts.append(last)
    return torch.cat(outs, dim=-1), torch.cat(lasts, dim=0)


def linear_per_sequence(fn, gates, inputs, dim, initial_state, reverse, cu_seqlens):
    """Packed sequences along ``dim`` (``cu_seqlens`` (S + 1,), every dimension before ``dim``
    of size 1) run one at a time through a linear-scan backend ``fn`` that knows nothing of
    packing. Returns all states, shaped like ``inputs``."""
    state_shape = inputs.shape[:dim] + inputs.shape[dim + 1 :]
    parts = []
    bounds = sequence_bounds(cu_seqlens)
    for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end > start:
            h0 = None if initial_state is None else initial_state[s].reshape(state_shape)
            parts.append(
                fn(gates.narrow(dim, start, end - start), inputs.narrow(dim, start, end - start), dim, h0, reverse)
            )
    return torch.cat(parts, dim=dim)
