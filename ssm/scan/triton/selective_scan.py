"""Backend "triton" of ``selective_scan``, top to bottom: launch heuristics, launchers, the
custom ops with their autograd formula, and the backend entry point. The kernels, and the
@triton.jit helpers they share, are in _selective_kernels.py (how a program covers its tile,
and how packed sequences restart the scan, is said there).

    _selective_scan_fwd_kernel  →  _selective_scan_fwd  →  ssm::selective_scan_fwd  →  selective_scan_triton
    _selective_scan_bwd_kernel  →  _selective_scan_bwd  →  ssm::selective_scan_bwd     (its autograd formula)

torch.compile sees each custom op as one opaque node whose output shapes come from its fake
implementation, and whose backward is another custom op (each registered with its fake and
formula by ssm._custom_op.kernel_op): a model calling them traces with ``fullgraph=True``.
Custom ops cannot return None: the backward returns an empty tensor for an absent input, and
the autograd formula turns it back into None.

Packed sequences (cu_seqlens, batch 1): initial and last states are (S, D, N), and the
launchers give the kernels the sequence of each step.

Shape symbols: B batch, L length, D channels, N state size, G groups, T chunk length (CHUNK),
S packed sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..._custom_op import kernel_op
from ._jit import (
    check_launchable,
    compute_dtype,
    contiguous,
    fake_like,
    needs_backward,
    next_power_of_2,
    placeholders,
    sequence_of_steps,
)
from ._selective_kernels import _selective_scan_bwd_kernel, _selective_scan_fwd_kernel

# ----------------------------------------------------------------------------- launch heuristics
# Pure functions of shapes, so that the launchers, the fake implementations and the tests agree
# (the number of saved chunk states depends on the chunk length). Not yet tuned on a GPU.
#
# Memory the block sizes set (float32): saved for the backward, one state per chunk,
# B·D·N·L / CHUNK elements; during the backward only, for time-varying B (and C), one partial
# sum of dB (dC) per channel block, B·(D / BLOCK_D)·N·L elements, summed in a fixed order
# afterwards (what keeps the gradients deterministic without atomics).

CHUNK = 32  # time steps a program scans at once (a power of two)
TILE = 2048  # elements of one (BLOCK_D, BLOCK_N, CHUNK) tile, a few of which are live at once


@dataclass(frozen=True)
class Config:
    segment: int  # channels per program group; a block never straddles a group of B or C
    block_d: int  # channels per program (power of two)
    block_n: int  # N rounded up to a power of two
    chunk: int  # time steps per iteration (power of two)
    num_warps: int  # forward
    num_warps_bwd: int  # backward

    def n_chunks(self, length) -> int:
        # (also on torch.compile's symbolic lengths: the fake op computes it)
        return (length + self.chunk - 1) // self.chunk

    def grid(self, batch: int, dim: int) -> tuple[int, int, int]:
        return batch, dim // self.segment, -(-self.segment // self.block_d)


def channels_per_group(M: Tensor, dim: int) -> int:
    """Channels sharing one group of B or C: all D of them when it is fixed (D, N)."""
    return dim if M.ndim == 2 else dim // M.shape[1]


def config(u: Tensor, B: Tensor, C: Tensor) -> Config:
    """Block sizes for u (B, D, L) and B, C of any form; the same for every L.

    Programs cover channels within one segment of gcd(channels per group of B, of C), so each
    program reads one group of B and one of C and its partial gradients of B and C belong to
    one group."""
    dim = u.shape[1]
    N = B.shape[-2] if B.ndim == 4 else B.shape[1]
    segment = math.gcd(channels_per_group(B, dim), channels_per_group(C, dim))
    block_n = next_power_of_2(N)
    block_d = max(1, min(next_power_of_2(segment), TILE // (block_n * CHUNK)))
    tile = block_d * block_n * CHUNK
    # Warps from a sweep on an H200 (BENCHMARKS.md, "CUDA"): at batch 8, D 1536, N 16, L 2048,
    # the backward with 4 warps took half the time it took with 8 (forward+backward fp32 7.96
    # against 17.39 ms, bf16 8.86 against 18.02), and 8/16 warps were slower still at every tile;
    # chunks of 16 or 64 steps were no faster than 32. scripts/dev/compile_kernels.py prints the
    # registers and spills of each variant.
    return Config(segment, block_d, block_n, CHUNK, 4, 4 if tile <= 2048 else 8)


# ----------------------------------------------------------------------------- launchers


def _BC_args(name: str, M: Tensor, dim: int) -> dict:
    """Strides (four, zero-padded) and channels per group of B or C, as kernel arguments."""
    strides = list(M.stride()) + [0] * (4 - M.ndim)
    args = {f"stride_{name}{i}": s for i, s in enumerate(strides)}
    args[f"{name}_PER_GROUP"] = channels_per_group(M, dim)
    return args


def _kernel_args(u, delta, A, B, C, D, z, delta_bias, delta_softplus: bool, cu_seqlens, cfg: Config) -> dict:
    """The arguments both kernels take: the forward's inputs (the caller makes u, delta, A, D,
    z, delta_bias contiguous), the sequence of each packed step, sizes, B's and C's strides and
    channels per group, the options and block sizes."""
    dim, length = u.shape[1:]
    return dict(
        u_ptr=u,
        delta_ptr=delta,
        A_ptr=A,
        B_ptr=B,
        C_ptr=C,
        D_ptr=D,
        z_ptr=z,
        delta_bias_ptr=delta_bias,
        seq_ptr=sequence_of_steps(cu_seqlens, length),
        dim=dim,
        L=length,
        N=A.shape[1],
        **_BC_args("B", B, dim),
        **_BC_args("C", C, dim),
        SEGMENT=cfg.segment,
        SOFTPLUS=bool(delta_softplus),
        BLOCK_D=cfg.block_d,
        BLOCK_N=cfg.block_n,
        CHUNK=cfg.chunk,
    )


def _per_sequence_or_zeros(state: Tensor | None, num_seqs: int, dim: int, N: int, like: Tensor, dtype) -> Tensor:
    """A (S, D, N) state to be overwritten for every non-empty sequence: for the empty ones it
    is ``state`` (their initial state, or dLoss/d(last state)) or 0."""
    if state is None:
        return like.new_zeros(num_seqs, dim, N, dtype=dtype)
    return state.to(dtype, copy=True).contiguous()


def _selective_scan_fwd(
    u,
    delta,
    A,
    B,
    C,
    D,
    z,
    delta_bias,
    delta_softplus: bool,
    initial_state,
    save_chunk_states: bool,
    cu_seqlens=None,
):
    """u, delta, z: (B, D, L); A: (D, N); B, C: (D, N) or (B, G, N, L); D, delta_bias: (D,);
    initial_state: (B, D, N). Returns out (B, D, L) in u's dtype, the last state (B, D, N) and
    the state before each chunk (B, D, n_chunks, N), both in the state dtype; with
    ``save_chunk_states=False`` (no backward to come) the last is (B, D, 0, N), never written.
    Packed (``cu_seqlens`` (S + 1,) int64, B = 1): initial and last states are (S, D, N)."""
    batch, dim, length = u.shape
    N = A.shape[1]
    dtype = compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    cfg = config(u, B, C)
    n_chunks = cfg.n_chunks(length)
    u, delta, A, z, D, delta_bias, initial_state = contiguous(u, delta, A, z, D, delta_bias, initial_state)
    out = torch.empty_like(u)
    chunk_states = u.new_empty(batch, dim, n_chunks if save_chunk_states else 0, N, dtype=dtype)
    if cu_seqlens is None:
        last_state = u.new_empty(batch, dim, N, dtype=dtype)
    else:
        last_state = _per_sequence_or_zeros(initial_state, cu_seqlens.numel() - 1, dim, N, u, dtype)
    if out.numel() == 0:
        if cu_seqlens is None:
            last_state.zero_() if initial_state is None else last_state.copy_(initial_state)
        return out, last_state, chunk_states.zero_()
    check_launchable(u)
    _selective_scan_fwd_kernel[cfg.grid(batch, dim)](
        **_kernel_args(u, delta, A, B, C, D, z, delta_bias, delta_softplus, cu_seqlens, cfg),
        initial_state_ptr=initial_state,
        out_ptr=out,
        last_state_ptr=last_state,
        chunk_states_ptr=chunk_states,
        n_chunks=n_chunks,
        num_warps=cfg.num_warps,
    )
    return out, last_state, chunk_states


def _selective_scan_bwd(
    dout,
    dlast,
    u,
    delta,
    A,
    B,
    C,
    D,
    z,
    delta_bias,
    delta_softplus: bool,
    chunk_states,
    initial_state=None,
    cu_seqlens=None,
):
    """Gradients of :func:`_selective_scan_fwd`'s out and last state, given its saved chunk
    states: (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state), each in its input's
    dtype (None for an absent input; dinitial_state in the state dtype). Packed: the forward's
    ``initial_state`` (S, D, N) (or None) and ``cu_seqlens``; dlast and dinitial_state are
    (S, D, N)."""
    batch, dim, length = u.shape
    N = A.shape[1]
    dtype = chunk_states.dtype
    cfg = config(u, B, C)
    n_segments, n_blocks = cfg.grid(batch, dim)[1:]
    u, delta, A, z, D, delta_bias, dout, dlast, chunk_states, initial_state = contiguous(
        u, delta, A, z, D, delta_bias, dout, dlast, chunk_states, initial_state
    )
    new = dict(device=u.device, dtype=dtype)
    du, ddelta = torch.empty_like(u), torch.empty_like(delta)
    dz = None if z is None else torch.empty_like(z)
    if cu_seqlens is None:
        dinitial_state = torch.empty(batch, dim, N, **new)
    else:  # an empty sequence's last state is its initial state: the gradient passes through
        dinitial_state = _per_sequence_or_zeros(dlast, cu_seqlens.numel() - 1, dim, N, u, dtype)
    dA_part = torch.empty(batch, dim, N, **new)
    dD_part = None if D is None else torch.empty(batch, dim, **new)
    ddelta_bias_part = None if delta_bias is None else torch.empty(batch, dim, **new)

    def part(M):  # time-varying: one (N, L) slice per program; fixed: one (D, N) per batch row
        return (
            torch.empty(batch, n_segments, n_blocks, N, length, **new)
            if M.ndim == 4
            else torch.empty(batch, dim, N, **new)
        )

    dB_part, dC_part = part(B), part(C)
    if u.numel():
        check_launchable(u)
        _selective_scan_bwd_kernel[cfg.grid(batch, dim)](
            **_kernel_args(u, delta, A, B, C, D, z, delta_bias, delta_softplus, cu_seqlens, cfg),
            chunk_states_ptr=chunk_states,
            initial_state_ptr=initial_state if cu_seqlens is not None else None,
            dout_ptr=dout,
            dlast_ptr=dlast,
            du_ptr=du,
            ddelta_ptr=ddelta,
            dz_ptr=dz,
            dinitial_state_ptr=dinitial_state,
            dA_part_ptr=dA_part,
            dD_part_ptr=dD_part,
            ddelta_bias_part_ptr=ddelta_bias_part,
            dB_part_ptr=dB_part,
            dC_part_ptr=dC_part,
            n_chunks=chunk_states.shape[2],
            n_blocks=n_blocks,
            num_warps=cfg.num_warps_bwd,
        )
    else:
        for t in (dA_part, dD_part, ddelta_bias_part, dB_part, dC_part):
            if t is not None:
                t.zero_()
        if cu_seqlens is None:
            dinitial_state.zero_() if dlast is None else dinitial_state.copy_(dlast)

    def reduce_BC(M, partial):
        if M.ndim == 2:  # (B, D, N) -> (D, N)
            return partial.sum(0).to(M.dtype)
        groups = M.shape[1]  # (B, S, n_blocks, N, L) -> (B, G, N, L): S/G segments per group
        return partial.reshape(batch, groups, -1, N, length).sum(2).to(M.dtype)

    return (
        du,
        ddelta,
        dA_part.sum(0).to(A.dtype),
        reduce_BC(B, dB_part),
        reduce_BC(C, dC_part),
        None if D is None else dD_part.sum(0).to(D.dtype),
        dz,
        None if delta_bias is None else ddelta_bias_part.sum(0).to(delta_bias.dtype),
        dinitial_state,
    )


# ----------------------------------------------------------------------------- custom ops


def _fwd_fake(
    u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, save_chunk_states=True, cu_seqlens=None
):
    batch, dim, length = u.shape
    dtype = compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    n_chunks = config(u, B, C).n_chunks(length) if save_chunk_states else 0
    N = A.shape[1]
    states = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (
        torch.empty_like(u),
        u.new_empty(states, dim, N, dtype=dtype),
        u.new_empty(batch, dim, n_chunks, N, dtype=dtype),
    )


def _setup_context(ctx, inputs, output):
    u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, _save, cu_seqlens = inputs
    ctx.mark_non_differentiable(output[2])
    packed_initial_state = initial_state if cu_seqlens is not None else None  # read again only when packed
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, output[2], packed_initial_state, cu_seqlens)
    ctx.delta_softplus = delta_softplus
    ctx.initial_state_dtype = None if initial_state is None else initial_state.dtype


def _backward(ctx, dout, dlast, _dchunk_states):
    u, delta, A, B, C, D, z, delta_bias, chunk_states, initial_state, cu_seqlens = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(u)
    du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state = selective_scan_bwd(
        dout, dlast, u, delta, A, B, C, D, z, delta_bias, ctx.delta_softplus, chunk_states, initial_state, cu_seqlens
    )
    initial_state_dtype = ctx.initial_state_dtype
    return (
        du,
        ddelta,
        dA,
        dB,
        dC,
        None if D is None else dD,
        None if z is None else dz,
        None if delta_bias is None else ddelta_bias,
        None,  # delta_softplus
        None if initial_state_dtype is None else dinitial_state.to(initial_state_dtype),
        None,  # save_chunk_states
        None,  # cu_seqlens
    )


@kernel_op("ssm::selective_scan_fwd", fake=_fwd_fake, backward=_backward, setup_context=_setup_context)
def selective_scan_fwd(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    delta_bias: Tensor | None,
    delta_softplus: bool,
    initial_state: Tensor | None,
    save_chunk_states: bool = True,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """out, last state, chunk-start states (what the backward needs)."""
    return _selective_scan_fwd(
        u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, save_chunk_states, cu_seqlens
    )


def _bwd_fake(
    dout, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus, chunk_states, initial_state=None, cu_seqlens=None
):
    def like(x):
        return fake_like(x, u)

    states = u.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dinitial_state = chunk_states.new_empty(states, u.shape[1], A.shape[1])
    return like(u), like(delta), like(A), like(B), like(C), like(D), like(z), like(delta_bias), dinitial_state


@kernel_op("ssm::selective_scan_bwd", fake=_bwd_fake)
def selective_scan_bwd(
    dout: Tensor,
    dlast: Tensor | None,
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    delta_bias: Tensor | None,
    delta_softplus: bool,
    chunk_states: Tensor,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state (empty for absent inputs).
    ``initial_state`` is read only when packed (``cu_seqlens``)."""
    grads = _selective_scan_bwd(
        dout, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus, chunk_states, initial_state, cu_seqlens
    )
    return placeholders(grads, u)


# ----------------------------------------------------------------------------- backend entry point


def selective_scan_triton(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    delta_bias: Tensor | None,
    delta_softplus: bool,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Backend "triton" of :func:`ssm.scan.selective_scan` (inputs already validated; B and C
    as (D, N) or (B, G, N, L)). Returns out (B, D, L) in u's dtype and the last state (B, D, N)
    in float32 (float64 for float64 inputs); packed (``cu_seqlens``), the states are (S, D, N)."""
    tensors = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    save = needs_backward(*tensors)  # chunk states are only for a backward
    out, last_state, _ = selective_scan_fwd(
        u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, save, cu_seqlens
    )
    return out, last_state
