"""Sequential reference implementations: the ground truth every other backend is tested against.

They are written to be read, not to be fast: one Python loop over time, state in float32
(float64 when the inputs are float64), gradients by autograd through the loop. They share no
helper with the fast paths (those use _common.py), so that a bug in a shared piece of
arithmetic cannot hide from the comparison.

Shape symbols: B batch, L length, D channels, N state size, G groups, H heads, P head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import compute_dtype


def selective_scan_ref(
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
    """The selective scan as a loop over time.

    u, delta, z: (B, D, L); A: (D, N); B, C: (D, N) fixed or (B, G, N, L) time-varying;
    D, delta_bias: (D,); initial_state: (B, D, N).
    Returns out (B, D, L) in u's dtype and the last state (B, D, N) in the compute dtype.

        Δ_t = softplus(delta_t + delta_bias)            (as asked)
        h_t = exp(Δ_t·A) ⊙ h_{t-1} + Δ_t·u_t·B_t        h_{-1} = initial_state or 0
        y_t = C_t · h_t + D·u_t,  out_t = y_t · silu(z_t)

    With ``cu_seqlens`` (S + 1,) (batch 1), each of the S sequences is run alone, one after
    the other, from initial_state[s] ((S, D, N)) or 0; the last state is (S, D, N).
    """
    if cu_seqlens is not None:
        outs, lasts = [], []
        bounds = cu_seqlens.tolist()
        for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            def part(M):  # the time steps of sequence s of a time-varying input
                return M if M is None or M.ndim == 2 else M[..., start:end]

            out, last = selective_scan_ref(
                part(u), part(delta), A, part(B), part(C), D, part(z), delta_bias, delta_softplus,
                None if initial_state is None else initial_state[s : s + 1],
            )
            outs.append(out)
            lasts.append(last)
        return torch.cat(outs, dim=-1), torch.cat(lasts, dim=0)
    dtype = compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    batch, dim, length = u.shape
    out_dtype = u.dtype
    u, delta, A = u.to(dtype), delta.to(dtype), A.to(dtype)
    if delta_bias is not None:
        delta = delta + delta_bias.to(dtype)[:, None]
    if delta_softplus:
        delta = F.softplus(delta)  # (B, D, L)
    # Each channel gets its own copy of B and C: (D, N) when fixed, (B, D, N, L) when time-
    # varying, channel d reading group d // (D / G).
    B, C = B.to(dtype), C.to(dtype)
    if B.ndim == 4:
        B = B.repeat_interleave(dim // B.shape[1], dim=1)
    if C.ndim == 4:
        C = C.repeat_interleave(dim // C.shape[1], dim=1)

    if initial_state is None:
        h = u.new_zeros(batch, dim, A.shape[1])  # (B, D, N)
    else:
        h = initial_state.to(dtype)
    # One slice per time step. (unbind rather than indexing inside the loop: the backward of
    # an index allocates a full-size gradient per step, which makes the loop quadratic.)
    steps = zip(
        delta.unbind(-1),  # (B, D) each
        u.unbind(-1),
        [B] * length if B.ndim == 2 else B.unbind(-1),  # (D, N) or (B, D, N) each
        [C] * length if C.ndim == 2 else C.unbind(-1),
    )
    ys = []
    for delta_t, u_t, B_t, C_t in steps:
        decay = torch.exp(delta_t[..., None] * A)  # (B, D, N)
        h = decay * h + (delta_t * u_t)[..., None] * B_t
        ys.append((h * C_t).sum(-1))  # (B, D)
    y = torch.stack(ys, dim=-1) if ys else u.new_zeros(batch, dim, 0)  # (B, D, L)
    if D is not None:
        y = y + D.to(dtype)[:, None] * u
    if z is not None:
        y = y * F.silu(z.to(dtype))
    return y.to(out_dtype), h


def linear_scan_ref(
    gates: torch.Tensor,
    inputs: torch.Tensor,
    dim: int,
    initial_state: torch.Tensor | None = None,
    reverse: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """h_t = gates_t·h_{t-1} + inputs_t along ``dim`` (h_t = gates_t·h_{t+1} + inputs_t when
    ``reverse``), starting from ``initial_state`` (the input shape without ``dim``) or 0.
    Returns all states, shaped like ``inputs``, in the inputs' promoted dtype.

    With ``cu_seqlens`` (S + 1,) (every dimension before ``dim`` of size 1), each of the S
    sequences along ``dim`` is scanned alone, from initial_state[s] ((S, *dims after dim)) or 0.
    """
    if cu_seqlens is not None:
        parts = []
        bounds = cu_seqlens.tolist()
        for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            if end == start:
                continue
            h0 = None if initial_state is None else initial_state[s].reshape(inputs.shape[:dim] + inputs.shape[dim + 1 :])
            parts.append(linear_scan_ref(
                gates.narrow(dim, start, end - start), inputs.narrow(dim, start, end - start), dim, h0, reverse
            ))
        return torch.cat(parts, dim=dim)
    dtype = compute_dtype(gates, inputs, initial_state)
    out_dtype = torch.promote_types(gates.dtype, inputs.dtype)
    a, x = gates.to(dtype), inputs.to(dtype)
    length = x.shape[dim]
    a_steps, x_steps = a.unbind(dim), x.unbind(dim)  # one slice per step (why: selective_scan_ref)
    h = torch.zeros_like(x_steps[0]) if initial_state is None else initial_state.to(dtype)
    order = range(length - 1, -1, -1) if reverse else range(length)
    states = [None] * length
    for t in order:
        h = a_steps[t] * h + x_steps[t]
        states[t] = h
    return torch.stack(states, dim=dim).to(out_dtype)


def ssd_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_state: torch.Tensor | None = None,
    chunk_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba-2 (SSD) recurrence as a loop over time; ``chunk_size`` is ignored.

    x, z: (B, L, H, P); dt: (B, L, H); A, dt_bias: (H,); B, C: (B, L, G, N) with head h using
    group h // (H / G); D: (H,) or (H, P); initial_state: (B, H, P, N).

        Δ_t = clamp(softplus(dt_t + dt_bias), dt_limit)       (as asked)
        h_t = exp(Δ_t·A)·h_{t-1} + Δ_t·x_t ⊗ B_t             (a scalar decay per head)
        y_t = h_t·C_t + D·x_t,  out_t = y_t · silu(z_t)
    Returns out (B, L, H, P) in x's dtype and the last state (B, H, P, N) in the compute dtype.

    With ``cu_seqlens`` (S + 1,) (batch 1), each of the S sequences is run alone, one after
    the other, from initial_state[s] ((S, H, P, N)) or 0; the last state is (S, H, P, N).
    """
    if cu_seqlens is not None:
        outs, lasts = [], []
        bounds = cu_seqlens.tolist()
        for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            def part(M):  # the time steps of sequence s
                return None if M is None else M[:, start:end]

            out, last = ssd_ref(
                part(x), part(dt), A, part(B), part(C), D, part(z), dt_bias, dt_softplus, dt_limit,
                None if initial_state is None else initial_state[s : s + 1],
            )
            outs.append(out)
            lasts.append(last)
        return torch.cat(outs, dim=1), torch.cat(lasts, dim=0)
    dtype = compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_state)
    batch, length, heads, head_dim = x.shape
    groups, N = B.shape[2], B.shape[3]
    out_dtype = x.dtype
    x, A, dt = x.to(dtype), A.to(dtype), dt.to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, float("inf")):  # the default limits mean "no clamp"
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])  # (B, L, H)
    B = B.to(dtype).repeat_interleave(heads // groups, dim=2)  # (B, L, H, N)
    C = C.to(dtype).repeat_interleave(heads // groups, dim=2)

    if initial_state is None:
        h = x.new_zeros(batch, heads, head_dim, N)  # (B, H, P, N)
    else:
        h = initial_state.to(dtype)
    ys = []
    for x_t, dt_t, B_t, C_t in zip(x.unbind(1), dt.unbind(1), B.unbind(1), C.unbind(1)):
        decay = torch.exp(dt_t * A)[..., None, None]  # (B, H, 1, 1)
        h = decay * h + (dt_t[..., None] * x_t)[..., None] * B_t[:, :, None, :]
        ys.append((h * C_t[:, :, None, :]).sum(-1))  # (B, H, P)
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(batch, 0, heads, head_dim)  # (B, L, H, P)
    if D is not None:
        D = D.to(dtype)
        y = y + (D[:, None] if D.ndim == 1 else D) * x  # D: (H,) or (H, P)
    if z is not None:
        y = y * F.silu(z.to(dtype))
    return y.to(out_dtype), h
