"""The public selective scan: mamba-ssm's ``selective_scan_fn`` with an initial state."""

from __future__ import annotations

import torch

from .._backends import BackendTable
from . import triton
from ._checks import (
    check_cu_seqlens,
    check_same_device,
    check_shape,
    check_state_size,
    check_tensor,
    compute_dtype,
    empty_output,
)
from .cpu import selective_scan_cpu
from .pscan import selective_scan_pscan
from .reference import selective_scan_ref

# Backends take the public arguments less return_last_state, in the same order, with B and C
# as (D, N) or (B, G, N, L), and cu_seqlens last (None, or validated int64 (S + 1,) on the
# inputs' device); they return (out, last_state), last_state (S, D, N) when packed.
BACKENDS = BackendTable(
    "selective_scan",
    auto={"cpu": ("cpu", "pscan"), "cuda": ("triton", "pscan"), "*": ("pscan",)},
)
BACKENDS.add("ref", selective_scan_ref)
BACKENDS.add("pscan", selective_scan_pscan)
BACKENDS.add("cpu", selective_scan_cpu, devices=("cpu",))
BACKENDS.add("triton", triton.selective_scan_triton, devices=triton.devices, hint=triton.hint)


def _check_BC(name: str, M: torch.Tensor, batch: int, dim: int, N: int, length: int) -> torch.Tensor:
    """Validate B or C and return it as (D, N) fixed or (B, G, N, L) time-varying."""
    check_tensor(name, M, ndim=(2, 3, 4))
    if M.ndim == 2:
        check_shape(name, M, (dim, N), "(dim, N)")
        return M
    if M.ndim == 3:
        check_shape(name, M, (batch, N, length), "(batch, N, L)")
        return M.unsqueeze(1)  # (B, 1, N, L)
    groups = M.shape[1]
    check_shape(name, M, (batch, groups, N, length), "(batch, G, N, L)")
    if groups == 0 or dim % groups != 0:
        raise ValueError(f"{name} has G = {groups} groups, but dim = {dim} (from u) is not divisible by G")
    return M


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    *,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
):
    """Selective scan (Mamba-1 / S6), a drop-in replacement for mamba-ssm's ``selective_scan_fn``.

    Shapes (channels first, as in mamba-ssm):
        u, delta:       (batch, dim, L)
        A:              (dim, N), real
        B, C:           (batch, N, L) time-varying, (batch, G, N, L) grouped with dim % G == 0
                        (channel d uses group d // (dim / G)), or (dim, N) fixed
        D, delta_bias:  (dim,)
        z:              (batch, dim, L)
        initial_state:  (batch, dim, N), the state before the first step (default 0);
                        (S, dim, N) with cu_seqlens
        cu_seqlens:     (S + 1,) integer, packed sequences (batch must be 1), see below

    Computes, for t = 0 .. L-1,
        Δ_t = softplus(delta_t + delta_bias)     (bias and softplus only when asked)
        h_t = exp(Δ_t·A)·h_{t-1} + Δ_t·B_t·u_t
        y_t = C_t·h_t + D·u_t,   out_t = y_t·silu(z_t)

    Returns ``out`` (batch, dim, L) in u's dtype, or ``(out, last_state)`` with
    ``last_state`` = h_{L-1} (batch, dim, N) in float32 (float64 for float64 inputs). The state
    is always computed in float32 or wider, whatever the input dtype. Gradients flow to every
    tensor argument, into ``initial_state`` and from ``last_state``.

    Packed sequences: ``cu_seqlens`` (S + 1,) int32 or int64, the cumulative lengths of S
    sequences laid end to end along L in a batch of one (0 = cu_seqlens[0] <= ... <=
    cu_seqlens[S] = L; sequence s is positions cu_seqlens[s] .. cu_seqlens[s+1] - 1). The state
    restarts at every sequence's first step, from ``initial_state[s]`` ((S, dim, N)) or 0, and
    ``last_state`` is (S, dim, N), each sequence's state after its last step: every sequence
    gets exactly what it would get run alone. A zero-length sequence is allowed; its last state
    is its initial state. Gradients flow into and from the per-sequence states as well.

    ``backend``: ``"auto"`` (the best one for the inputs' device: "cpu" on the CPU, "triton"
    on CUDA, "pscan" elsewhere) or a name from ``ssm.scan.backends("selective_scan")``.
    """
    check_tensor("u", u, ndim=3)
    batch, dim, length = u.shape
    check_tensor("delta", delta, ndim=3)
    check_shape("delta", delta, (batch, dim, length), "(batch, dim, L)")
    check_tensor("A", A, ndim=2)
    if A.shape[0] != dim:
        raise ValueError(f"A must have shape (dim, N) with dim = {dim}, got {tuple(A.shape)}")
    N = A.shape[1]
    check_state_size("A", A, N, "(dim, N)")
    B = _check_BC("B", B, batch, dim, N, length)
    C = _check_BC("C", C, batch, dim, N, length)
    for name, x in (("D", D), ("delta_bias", delta_bias)):
        if x is not None:
            check_tensor(name, x, ndim=1)
            check_shape(name, x, (dim,), "(dim,)")
    if z is not None:
        check_tensor("z", z, ndim=3)
        check_shape("z", z, (batch, dim, length), "(batch, dim, L)")
    state_batch = batch
    if cu_seqlens is not None:
        cu_seqlens = check_cu_seqlens(cu_seqlens, length, batch, u.device)
        state_batch = cu_seqlens.numel() - 1
    if initial_state is not None:
        check_tensor("initial_state", initial_state, ndim=3)
        check_shape(
            "initial_state",
            initial_state,
            (state_batch, dim, N),
            "(batch, dim, N)" if cu_seqlens is None else "(num_seqs, dim, N)",
        )
    check_same_device(
        "u",
        u,
        delta=delta,
        A=A,
        B=B,
        C=C,
        D=D,
        z=z,
        delta_bias=delta_bias,
        initial_state=initial_state,
    )
    impl = BACKENDS.resolve(backend, u.device)

    if length == 0 or batch * dim == 0:  # no output to compute: no backend runs
        out = empty_output((batch, dim, length), u.dtype, u, delta, A, B, C, D, z, delta_bias, initial_state)
        if not return_last_state:
            return out
        state_dtype = compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
        if initial_state is None:
            return out, u.new_zeros(state_batch, dim, N, dtype=state_dtype)
        return out, initial_state.to(state_dtype, copy=True)

    out, last_state = impl.fn(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), initial_state, cu_seqlens)
    out = out.contiguous()  # as mamba-ssm's are: callers may .view() it
    return (out, last_state) if return_last_state else out
