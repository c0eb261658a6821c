"""One step of each recurrence: what recurrent inference runs per token, in O(1) time and memory.

These are the single-step forms of ``selective_scan`` and ``ssd`` (the same formulas, for one
time index), so that ``scan(x[:, :t]) -> state`` followed by ``step(x[:, t], state)`` equals the
scan over ``x[:, :t+1]``. The state is computed in float32 (float64 for float64 inputs); the
output is returned in the dtype of ``u`` / ``x``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._checks import check_shape, check_state_size, check_tensor, compute_dtype
from ._common import ssd_delta, ssd_skip_and_gate
from ._common_trapezoidal import TrapezoidalState, gate_and_contract, per_head, rotate, values
from .step_cpu import selective_step_cpu


def selective_scan_step(
    state: torch.Tensor,
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of ``selective_scan``.

    Shapes: state (batch, dim, N); u, delta, z (batch, dim); A (dim, N); B, C (batch, N) or
    (batch, G, N) grouped; D, delta_bias (dim,).
    Returns ``(out, new_state)``: out (batch, dim) in u's dtype, new_state like ``state``.
    """
    check_tensor("state", state, ndim=3)
    batch, dim, N = state.shape
    check_state_size("state", state, N, "(batch, dim, N)")
    for name, x in (("u", u), ("delta", delta), ("z", z)):
        if x is not None:
            check_tensor(name, x, ndim=2)
            check_shape(name, x, (batch, dim), "(batch, dim)")
    check_tensor("A", A, ndim=2)
    check_shape("A", A, (dim, N), "(dim, N)")
    for name, M in (("B", B), ("C", C)):
        check_tensor(name, M, ndim=(2, 3))
        if M.ndim == 2:
            check_shape(name, M, (batch, N), "(batch, N)")
    for name, v in (("D", D), ("delta_bias", delta_bias)):
        if v is not None:
            check_tensor(name, v, ndim=1)
            check_shape(name, v, (dim,), "(dim,)")
    fused = selective_step_cpu(state, u, delta, A, B, C, D, z, delta_bias, delta_softplus)
    if fused is not None:  # CPU, no gradient: the same formulas in one C call (ssm/native/selective.c)
        return fused
    dtype = compute_dtype(state, u, delta, A, B, C, D, z, delta_bias)
    B, C = (_per_channel_step(n, M, batch, dim, N, dtype) for n, M in (("B", B), ("C", C)))
    # The reference's formulas for one time index, in as few tensor operations as they allow:
    # decoding runs this once per layer and token, where each operation's fixed cost counts.
    delta = delta.to(dtype)
    if delta_bias is not None:
        delta = delta + delta_bias.to(dtype)
    if delta_softplus:
        delta = F.softplus(delta)
    u32 = u.to(dtype)
    h = torch.exp(delta[..., None] * A.to(dtype)) * state.to(dtype)
    h = h.addcmul_((delta * u32)[..., None], B)  # + Δ·u·B
    # y = C·h: a batched product when C is one row per batch row, else a product and a sum
    y = torch.matmul(h, C.mT)[..., 0] if C.shape[1] == 1 else (h * C).sum(-1)  # (batch, dim)
    if D is not None:
        y = torch.addcmul(y, u32, D.to(dtype))
    if z is not None:
        y = y * F.silu(z.to(dtype))
    return y.to(u.dtype), h


def _per_channel_step(name, M, batch, dim, N, dtype):
    """B or C of one step, (batch, N) or (batch, G, N), as (batch, dim, N)."""
    check_tensor(name, M, ndim=(2, 3))
    if M.ndim == 2:
        check_shape(name, M, (batch, N), "(batch, N)")
        return M.to(dtype)[:, None, :]
    groups = M.shape[1]
    check_shape(name, M, (batch, groups, N), "(batch, G, N)")
    if groups == 0 or dim % groups:
        raise ValueError(f"{name} has G = {groups} groups, but dim = {dim} is not divisible by G")
    return M.to(dtype).repeat_interleave(dim // groups, dim=1)


def ssd_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    *,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of ``ssd``.

    Shapes: state (batch, H, P, N); x, z (batch, H, P); dt (batch, H); A, dt_bias (H,);
    B, C (batch, G, N); D (H,) or (H, P).

    ``dt_limit`` clamps Δ exactly as ``ssd`` does, so that a scan followed by steps equals one
    longer scan. (mamba-ssm's and transformers' recurrent steps ignore ``dt_limit``: with a
    non-default limit their decoding differs from their own forward pass.)
    Returns ``(out, new_state)``: out (batch, H, P) in x's dtype, new_state like ``state``.
    """
    check_tensor("state", state, ndim=4)
    batch, heads, head_dim, N = state.shape
    check_state_size("state", state, N, "(batch, H, P, N)")
    check_tensor("x", x, ndim=3)
    check_shape("x", x, (batch, heads, head_dim), "(batch, H, P)")
    check_tensor("dt", dt, ndim=2)
    check_shape("dt", dt, (batch, heads), "(batch, H)")
    check_tensor("B", B, ndim=3)
    groups = B.shape[1]
    check_shape("B", B, (batch, groups, N), "(batch, G, N)")
    check_shape("C", C, (batch, groups, N), "(batch, G, N) like B")
    if groups == 0 or heads % groups:
        raise ValueError(f"B has G = {groups} groups, but H = {heads} is not divisible by G")
    dtype = compute_dtype(state, x, dt, A, B, C, D, z, dt_bias)
    dt = ssd_delta(dt.to(dtype), dt_bias, dt_softplus, dt_limit)  # (batch, H)
    B = B.to(dtype).repeat_interleave(heads // groups, dim=1)[:, :, None, :]  # (batch, H, 1, N)
    C = C.to(dtype).repeat_interleave(heads // groups, dim=1)[:, :, None, :]
    x32 = x.to(dtype)
    decay = torch.exp(dt * A.to(dtype))[..., None, None]  # (batch, H, 1, 1)
    h = decay * state.to(dtype) + (dt[..., None] * x32)[..., None] * B
    y = ssd_skip_and_gate((h * C).sum(-1), x32, D, z)  # (batch, H, P)
    return y.to(x.dtype), h


def trapezoidal_scan_step(
    state: tuple,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    trap: torch.Tensor,
    angles: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    *,
    B_bias: torch.Tensor | None = None,
    C_bias: torch.Tensor | None = None,
    mimo_x: torch.Tensor | None = None,
    mimo_z: torch.Tensor | None = None,
    mimo_o: torch.Tensor | None = None,
    rotary: str = "interleaved",
) -> tuple[torch.Tensor, TrapezoidalState]:
    """One step of ``trapezoidal_scan`` (Mamba-3), in the direct form of its recurrence.

    Shapes: state a TrapezoidalState (phase (batch, H, M), ssm (batch, H, P, N), key
    (batch, H, N) or (batch, R, H, N), value (batch, H, P)); x, z (batch, H, P); dt, A, trap
    (batch, H); B, C (batch, G, N) or (batch, R, G, N) (as the key); angles (batch, H, M);
    D (H,); biases (H, N) or (H, R, N); mimo_x, mimo_z, mimo_o (H, R, P).
    Returns ``(out, new_state)``: out (batch, H, P) ((batch, R, H, P) per rank when B has a
    rank axis and mimo_o is None) in x's dtype, new_state in the state's compute dtype.
    """
    if not isinstance(state, (tuple, list)) or len(state) != 4:
        raise ValueError(f"state must be a TrapezoidalState (phase, ssm, key, value), got {type(state).__name__}")
    phase, h, key, value = state
    check_tensor("state.ssm", h, ndim=4)
    batch, heads, head_dim, N = h.shape
    check_state_size("state.ssm", h, N, "(batch, H, P, N)")
    check_tensor("x", x, ndim=3)
    check_shape("x", x, (batch, heads, head_dim), "(batch, H, P)")
    for name, t in (("dt", dt), ("A", A), ("trap", trap)):
        check_tensor(name, t, ndim=2)
        check_shape(name, t, (batch, heads), "(batch, H)")
    check_tensor("B", B, ndim=(3, 4))
    rank_axis = B.ndim == 4
    ranks, groups = (B.shape[1], B.shape[2]) if rank_axis else (1, B.shape[1])
    check_shape(
        "B",
        B,
        (batch, *((ranks,) if rank_axis else ()), groups, N),
        "(batch, R, G, N)" if rank_axis else "(batch, G, N)",
    )
    check_shape("C", C, B.shape, "like B")
    if groups == 0 or heads % groups:
        raise ValueError(f"B has G = {groups} groups, but H = {heads} is not divisible by G")
    check_tensor("angles", angles, ndim=3)
    M = angles.shape[-1]
    check_shape("angles", angles, (batch, heads, M), "(batch, H, M)")
    check_shape("state.phase", phase, (batch, heads, M), "(batch, H, M)")
    check_shape("state.key", key, (batch, ranks, heads, N) if rank_axis else (batch, heads, N), "like B's rank axis")
    check_shape("state.value", value, (batch, heads, head_dim), "(batch, H, P)")
    if rotary not in ("interleaved", "halved"):
        raise ValueError(f"rotary must be 'interleaved' or 'halved', got {rotary!r}")
    dtype = compute_dtype(h, x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, mimo_x, mimo_z, mimo_o)
    if not rank_axis:
        B, C, key = B[:, None], C[:, None], key[:, None]
        B_bias = None if B_bias is None else B_bias[:, None]
        C_bias = None if C_bias is None else C_bias[:, None]

    delta, lam = dt.to(dtype), trap.to(dtype)
    new_phase = phase.to(dtype) + delta[..., None] * angles.to(dtype)  # (batch, H, M)
    cos, sin = torch.cos(new_phase)[:, None], torch.sin(new_phase)[:, None]  # (batch, 1, H, M)
    k = rotate(per_head(B, heads, B_bias, dtype), cos, sin, rotary)  # (batch, R, H, N)
    q = rotate(per_head(C, heads, C_bias, dtype), cos, sin, rotary)
    v = values(x, mimo_x, ranks, dtype)  # (batch, R, H, P)
    v_prev = values(value, mimo_x, ranks, dtype)
    alpha = torch.exp(delta * A.to(dtype))[..., None, None]  # (batch, H, 1, 1)
    beta = ((1 - lam) * delta)[..., None, None] * alpha
    gamma = (lam * delta)[..., None, None]
    new_h = (
        alpha * h.to(dtype)
        + beta * torch.einsum("brhp,brhn->bhpn", v_prev, key.to(dtype))
        + gamma * torch.einsum("brhp,brhn->bhpn", v, k)
    )
    y = torch.einsum("bhpn,brhn->brhp", new_h, q)  # (batch, R, H, P)
    out = gate_and_contract(y[:, None], v[:, None], D, None if z is None else z[:, None], mimo_z, mimo_o, dtype)[:, 0]
    if mimo_o is None and not rank_axis:
        out = out[:, 0]
    new_key = k if rank_axis else k[:, 0]
    return out.to(x.dtype), TrapezoidalState(new_phase, new_h, new_key, x.to(dtype))
