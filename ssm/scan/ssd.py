"""The public SSD scan (Mamba-2): mamba-ssm's ``mamba_chunk_scan_combined`` with named options."""

from __future__ import annotations

import math

import torch

from ._backends import BackendTable
from ._checks import check_same_device, check_shape, check_tensor, compute_dtype
from .chunked import ssd_chunked
from .reference import ssd_ref

# Backends take the public arguments less return_last_state, in the same order, and return
# (out, last_state).
BACKENDS = BackendTable("ssd", auto={"*": ("chunked",)})
BACKENDS.add("ref", ssd_ref)
BACKENDS.add("chunked", ssd_chunked)


def ssd(
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
    initial_state: torch.Tensor | None = None,
    return_last_state: bool = False,
    chunk_size: int = 64,
    backend: str = "auto",
):
    """State-space duality scan (Mamba-2): a selective scan whose decay is one scalar per head.

    Shapes (time second, as in mamba-ssm's ``mamba_chunk_scan_combined``):
        x, z:           (batch, L, H, P)      H heads of P channels
        dt:             (batch, L, H)
        A, dt_bias:     (H,), real; A < 0 for a decaying state
        B, C:           (batch, L, G, N)      H % G == 0; head h uses group h // (H / G)
        D:              (H,) or (H, P)
        initial_state:  (batch, H, P, N), the state before the first step (default 0)

    Computes, for t = 0 .. L-1,
        Δ_t = clamp(softplus(dt_t + dt_bias), *dt_limit)   (bias, softplus, clamp only when asked)
        h_t = exp(Δ_t·A)·h_{t-1} + Δ_t·x_t ⊗ B_t           h: (batch, H, P, N)
        y_t = h_t·C_t + D·x_t,   out_t = y_t·silu(z_t)

    Returns ``out`` (batch, L, H, P) in x's dtype, or ``(out, last_state)`` with ``last_state``
    (batch, H, P, N) in float32 (float64 for float64 inputs). Gradients flow to every tensor
    argument, into ``initial_state`` and from ``last_state``.

    ``chunk_size`` is the block length of the chunked algorithm (ignored by "ref").
    ``backend``: ``"auto"`` or a name from ``ssm.scan.backends("ssd")``: "ref" (a loop over
    time) or "chunked" (the SSD chunked algorithm, see chunked.py).
    """
    check_tensor("x", x, ndim=4)
    batch, length, heads, head_dim = x.shape
    check_tensor("dt", dt, ndim=3)
    check_shape("dt", dt, (batch, length, heads), "(batch, L, H)")
    check_tensor("A", A, ndim=1)
    check_shape("A", A, (heads,), "(H,)")
    check_tensor("B", B, ndim=4)
    groups, N = B.shape[2], B.shape[3]
    check_shape("B", B, (batch, length, groups, N), "(batch, L, G, N)")
    if groups == 0 or heads % groups != 0:
        raise ValueError(f"B has G = {groups} groups, but H = {heads} heads (from x) is not divisible by G")
    check_tensor("C", C, ndim=4)
    check_shape("C", C, (batch, length, groups, N), "(batch, L, G, N) like B")
    if D is not None:
        check_tensor("D", D, ndim=(1, 2))
        expected = (heads,) if D.ndim == 1 else (heads, head_dim)
        check_shape("D", D, expected, "(H,)" if D.ndim == 1 else "(H, P)")
    if z is not None:
        check_tensor("z", z, ndim=4)
        check_shape("z", z, x.shape, "(batch, L, H, P) like x")
    if dt_bias is not None:
        check_tensor("dt_bias", dt_bias, ndim=1)
        check_shape("dt_bias", dt_bias, (heads,), "(H,)")
    if initial_state is not None:
        check_tensor("initial_state", initial_state, ndim=4)
        check_shape("initial_state", initial_state, (batch, heads, head_dim, N), "(batch, H, P, N)")
    if not (isinstance(dt_limit, (tuple, list)) and len(dt_limit) == 2 and dt_limit[0] <= dt_limit[1]):
        raise ValueError(f"dt_limit must be a pair (low, high) with low <= high, got {dt_limit!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    check_same_device(
        "x", x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, initial_state=initial_state
    )
    impl = BACKENDS.resolve(backend, x.device)

    if length == 0:
        out = x.new_empty(x.shape)
        if not return_last_state:
            return out
        state_dtype = compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_state)
        if initial_state is None:
            return out, x.new_zeros(batch, heads, head_dim, N, dtype=state_dtype)
        return out, initial_state.to(state_dtype, copy=True)

    out, last_state = impl.fn(
        x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus), tuple(dt_limit), initial_state, chunk_size
    )
    out = out.contiguous()  # as mamba-ssm's are: callers may .view() it
    return (out, last_state) if return_last_state else out
