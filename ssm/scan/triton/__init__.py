"""Backend "triton" of ``selective_scan`` and ``linear_scan``: fused GPU kernels.

    _kernels.py     the @triton.jit kernel bodies
    _heuristics.py  block sizes and warps (launch choices, apart from the kernels)
    _launch.py      launchers: check, allocate, launch; the reductions of the backward
    _ops.py         torch custom ops with autograd formulas and fake implementations

The selective scan keeps the state h (batch, dim, N) in float32 registers: the forward saves
only the state at the start of each chunk of time steps, and the backward recomputes each
chunk from it before running the adjoint recurrence through it, so a forward+backward holds
O(batch·dim·L + batch·dim·N·L/chunk) memory, never the (batch, dim, L, N) states. Gradients
are bitwise reproducible: cross-program sums are partial sums added in a fixed order.

triton is optional: importing this package does not import it; running a kernel without it
raises an ImportError saying what to install. The backend runs on CUDA (and ROCm) tensors,
and on CPU tensors when TRITON_INTERPRET=1 was set before the kernels were first imported
(Triton's interpreter: slow, for tests).
"""

from __future__ import annotations

import importlib.util
import math
import os

import torch

# The custom ops are registered on import; triton itself is imported on the first launch.
from ._ops import linear_scan_fwd, selective_scan_fwd


def available() -> bool:
    """Whether the triton package is installed."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton's interpreter is on (TRITON_INTERPRET=1): kernels then run on CPU."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def devices() -> tuple[str, ...]:
    """The device types the backend runs on: CUDA (which is also ROCm in torch), and the CPU
    under the interpreter."""
    return ("cuda", "cpu") if interpreting() else ("cuda",)


def selective_scan_triton(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backend "triton" of :func:`ssm.scan.selective_scan` (inputs already validated).

    u, delta, z: (B, D, L); A: (D, N); B, C: (D, N) fixed or (B, G, N, L); D, delta_bias: (D,);
    initial_state: (B, D, N). Returns out (B, D, L) in u's dtype and the last state (B, D, N)
    in float32 (float64 for float64 inputs)."""
    tensors = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    # Chunk states are only for a backward: not written when none can follow (inference).
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    out, last, _ = selective_scan_fwd(*tensors, delta_softplus, save)
    return out, last


def linear_scan_triton(
    gates: torch.Tensor,
    inputs: torch.Tensor,
    dim: int,
    initial_state: torch.Tensor | None = None,
    reverse: bool = False,
) -> torch.Tensor:
    """Backend "triton" of :func:`ssm.scan.linear_scan` (``dim`` non-negative)."""
    shape = inputs.shape
    P, T, Q = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])
    h0 = None if initial_state is None else initial_state.reshape(P, Q)
    states = linear_scan_fwd(gates.reshape(P, T, Q), inputs.reshape(P, T, Q), h0, reverse)
    return states.reshape(shape)


__all__ = ["selective_scan_triton", "linear_scan_triton", "available", "devices", "interpreting"]
