"""The Triton scans as torch custom ops with autograd formulas and fake implementations.

torch.compile sees each op as one opaque node whose output shapes come from the fake
implementation, and whose backward is another custom op: a model calling them traces with
fullgraph=True, with no graph break (mamba-ssm's CUDA op does break the graph, its #740).

    ssm::selective_scan_fwd   -> out, last state, chunk-start states (saved for the backward)
    ssm::selective_scan_bwd   -> every input's gradient
    ssm::linear_scan_fwd      -> states, on (P, T, Q) tensors
    ssm::linear_scan_bwd      -> gates', inputs' and initial state's gradients

Custom ops cannot return None: the backward returns an empty tensor for an absent input,
and the autograd formula turns it back into None.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _launch

_NONE = (0,)  # shape of the placeholder returned for an absent optional input


def _state_dtype(*tensors) -> torch.dtype:
    return _launch._compute_dtype(*tensors)


# ----------------------------------------------------------------------------- selective scan


@torch.library.custom_op("ssm::selective_scan_fwd", mutates_args=())
def selective_scan_fwd(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Optional[Tensor],
    z: Optional[Tensor],
    delta_bias: Optional[Tensor],
    initial_state: Optional[Tensor],
    delta_softplus: bool,
    save_chunk_states: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    return _launch._selective_scan_fwd(
        u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, save_chunk_states
    )


@selective_scan_fwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, save_chunk_states=True):
    batch, dim, length = u.shape
    N = A.shape[1]
    dtype = _state_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    n_chunks = _launch.selective_scan_config(u, B, C).n_chunks(length) if save_chunk_states else 0
    return (
        torch.empty_like(u),
        u.new_empty(batch, dim, N, dtype=dtype),
        u.new_empty(batch, dim, n_chunks, N, dtype=dtype),
    )


@torch.library.custom_op("ssm::selective_scan_bwd", mutates_args=())
def selective_scan_bwd(
    dout: Tensor,
    dlast: Optional[Tensor],
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Optional[Tensor],
    z: Optional[Tensor],
    delta_bias: Optional[Tensor],
    chunk_states: Tensor,
    delta_softplus: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = _launch._selective_scan_bwd(
        dout, dlast, u, delta, A, B, C, D, z, delta_bias, chunk_states, delta_softplus
    )
    return tuple(u.new_empty(_NONE) if g is None else g for g in grads)


@selective_scan_bwd.register_fake
def _(dout, dlast, u, delta, A, B, C, D, z, delta_bias, chunk_states, delta_softplus):
    def like(x, dtype=None):
        return u.new_empty(_NONE) if x is None else torch.empty_like(x, dtype=dtype)

    dh0 = chunk_states.new_empty(u.shape[0], u.shape[1], A.shape[1])
    return like(u), like(delta), like(A), like(B), like(C), like(D), like(z), like(delta_bias), dh0


def _selective_setup_context(ctx, inputs, output):
    u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, _save = inputs
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, output[2])
    ctx.delta_softplus = delta_softplus
    ctx.initial_state_dtype = None if initial_state is None else initial_state.dtype


def _selective_backward(ctx, dout, dlast, _dchunk_states):
    u, delta, A, B, C, D, z, delta_bias, chunk_states = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(u)
    grads = selective_scan_bwd(
        dout, dlast, u, delta, A, B, C, D, z, delta_bias, chunk_states, ctx.delta_softplus
    )
    du, ddelta, dA, dB, dC, dD, dz, dbias, dh0 = grads
    h0_dtype = ctx.initial_state_dtype
    return (
        du, ddelta, dA, dB, dC,
        None if D is None else dD,
        None if z is None else dz,
        None if delta_bias is None else dbias,
        None if h0_dtype is None else dh0.to(h0_dtype),
        None,
        None,
    )


selective_scan_fwd.register_autograd(_selective_backward, setup_context=_selective_setup_context)


# ----------------------------------------------------------------------------- linear scan


@torch.library.custom_op("ssm::linear_scan_fwd", mutates_args=())
def linear_scan_fwd(a: Tensor, x: Tensor, h0: Optional[Tensor], reverse: bool) -> Tensor:
    return _launch._linear_scan_fwd(a, x, h0, reverse, torch.promote_types(a.dtype, x.dtype))


@linear_scan_fwd.register_fake
def _(a, x, h0, reverse):
    return torch.empty_like(x, dtype=torch.promote_types(a.dtype, x.dtype))


@torch.library.custom_op("ssm::linear_scan_bwd", mutates_args=())
def linear_scan_bwd(
    grad: Tensor, a: Tensor, h: Tensor, h0: Optional[Tensor], reverse: bool
) -> tuple[Tensor, Tensor, Tensor]:
    da, dx, dh0 = _launch._linear_scan_bwd(grad, a, h, h0, reverse)
    return da, dx, (h.new_empty(_NONE, dtype=da.dtype) if dh0 is None else dh0)


@linear_scan_bwd.register_fake
def _(grad, a, h, h0, reverse):
    dtype = _state_dtype(a, h, h0)
    dh0 = h.new_empty(_NONE, dtype=dtype) if h0 is None else h0.new_empty(h0.shape, dtype=dtype)
    return h.new_empty(h.shape, dtype=dtype), h.new_empty(h.shape, dtype=dtype), dh0


def _linear_setup_context(ctx, inputs, output):
    a, x, h0, reverse = inputs
    ctx.save_for_backward(a, output, h0)
    ctx.reverse = reverse
    ctx.dtypes = (a.dtype, x.dtype, None if h0 is None else h0.dtype)


def _linear_backward(ctx, grad):
    a, h, h0 = ctx.saved_tensors
    da, dx, dh0 = linear_scan_bwd(grad, a, h, h0, ctx.reverse)
    a_dtype, x_dtype, h0_dtype = ctx.dtypes
    return da.to(a_dtype), dx.to(x_dtype), (None if h0 is None else dh0.to(h0_dtype)), None


linear_scan_fwd.register_autograd(_linear_backward, setup_context=_linear_setup_context)

__all__ = ["selective_scan_fwd", "selective_scan_bwd", "linear_scan_fwd", "linear_scan_bwd"]
