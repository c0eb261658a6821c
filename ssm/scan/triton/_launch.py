"""Launchers: check what the kernels assume, allocate, pick block sizes, launch.

Each takes and returns plain tensors (no autograd); _ops.py wraps them as custom ops.

Shape symbols: B batch, D channels, L length, N state size, G groups; P and Q are the
flattened dimensions before and after the scanned one of the linear scan, T its length.
"""

from __future__ import annotations

import torch

from . import _heuristics


def _kernels():
    """The kernel module, imported on first use: triton is optional (Linux only)."""
    try:
        from . import _kernels
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the 'triton' backend of ssm.scan needs the triton package: pip install triton "
            "(Linux; a CUDA or ROCm GPU, or TRITON_INTERPRET=1 to run on the CPU)"
        ) from err
    return _kernels


def _compute_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _contiguous(*tensors):
    return [None if t is None else t.contiguous() for t in tensors]


def _tl_int(dtype: torch.dtype):
    import triton.language as tl

    return tl.int64 if dtype == torch.float64 else tl.int32


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return tl.float64 if dtype == torch.float64 else tl.float32


def selective_scan_config(u, B, C) -> _heuristics.SelectiveScanConfig:
    dim = u.shape[1]
    return _heuristics.selective_scan_config(
        dim,
        B.shape[-2] if B.ndim == 4 else B.shape[1],
        _heuristics.channels_per_group(B.ndim, B.shape[1], dim),
        _heuristics.channels_per_group(C.ndim, C.shape[1], dim),
    )


def _BC_args(M: torch.Tensor, dim: int):
    """Strides (4 of them, zero-padded) and channels per group of B or C."""
    strides = list(M.stride()) + [0] * (4 - M.ndim)
    return strides, _heuristics.channels_per_group(M.ndim, M.shape[1], dim)


def _selective_scan_fwd(
    u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus: bool, save_chunk_states: bool = True
):
    """u, delta, z: (B, D, L); A: (D, N); B, C: (D, N) or (B, G, N, L); D, delta_bias: (D,);
    initial_state: (B, D, N). Returns out (B, D, L) in u's dtype, the last state (B, D, N) and
    the state before each chunk (B, D, n_chunks, N), both in the compute dtype (float32, or
    float64 for float64 inputs); with ``save_chunk_states=False`` (no backward to come) the
    last is (B, D, 0, N) and nothing is written for it."""
    K = _kernels()
    batch, dim, length = u.shape
    N = A.shape[1]
    dtype = _compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    cfg = selective_scan_config(u, B, C)
    n_chunks = cfg.n_chunks(length)
    saved_chunks = n_chunks if save_chunk_states else 0
    u, delta, A, z, D, delta_bias = _contiguous(u, delta, A, z, D, delta_bias)
    h0 = None if initial_state is None else initial_state.contiguous()
    out = torch.empty_like(u)
    last = torch.empty(batch, dim, N, device=u.device, dtype=dtype)
    chunk_states = torch.empty(batch, dim, saved_chunks, N, device=u.device, dtype=dtype)
    if out.numel() == 0:
        last.zero_() if h0 is None else last.copy_(h0)
        return out, last, chunk_states.zero_()
    B_strides, B_per_group = _BC_args(B, dim)
    C_strides, C_per_group = _BC_args(C, dim)
    K._selective_scan_fwd_kernel[cfg.grid(batch, dim)](
        u, delta, A, B, C, D, z, delta_bias, h0,
        out, last, chunk_states,
        dim, length, N, n_chunks,
        *B_strides, *C_strides, B_per_group, C_per_group,
        cfg.segment, _tl_dtype(dtype),
        B.ndim == 4, C.ndim == 4, D is not None, z is not None,
        delta_bias is not None, bool(delta_softplus), h0 is not None, bool(save_chunk_states),
        BLOCK_D=cfg.block_d, BLOCK_N=cfg.block_n, CHUNK=cfg.chunk, num_warps=cfg.num_warps,
    )
    return out, last, chunk_states


def _selective_scan_bwd(
    dout, dlast, u, delta, A, B, C, D, z, delta_bias, chunk_states, delta_softplus: bool
):
    """Gradients of :func:`_selective_scan_fwd`'s out and last state, given its saved chunk
    states: (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state), each in its input's
    dtype (None for an absent input; dinitial_state in the compute dtype).

    Sums over channels, batch rows and time are taken from per-program partial sums in a fixed
    order, never with atomics: the gradients are bitwise reproducible."""
    K = _kernels()
    batch, dim, length = u.shape
    N = A.shape[1]
    dtype = chunk_states.dtype
    cfg = selective_scan_config(u, B, C)
    n_chunks = chunk_states.shape[2]
    n_segments, n_blocks = cfg.grid(batch, dim)[1:]
    u, delta, A, z, D, delta_bias = _contiguous(u, delta, A, z, D, delta_bias)
    dout = dout.contiguous()
    dlast = None if dlast is None else dlast.contiguous()
    chunk_states = chunk_states.contiguous()
    new = dict(device=u.device, dtype=dtype)

    du, ddelta = torch.empty_like(u), torch.empty_like(delta)
    dz = None if z is None else torch.empty_like(z)
    dh0 = torch.empty(batch, dim, N, **new)
    dA_part = torch.empty(batch, dim, N, **new)
    dD_part = torch.empty(batch, dim, **new) if D is not None else None
    dbias_part = torch.empty(batch, dim, **new) if delta_bias is not None else None

    def part(M):  # varying: one (N, L) slice per program; fixed: one (D, N) per batch row
        if M.ndim == 4:
            return torch.empty(batch, n_segments, n_blocks, N, length, **new)
        return torch.empty(batch, dim, N, **new)

    dB_part, dC_part = part(B), part(C)
    B_strides, B_per_group = _BC_args(B, dim)
    C_strides, C_per_group = _BC_args(C, dim)
    if u.numel():
        K._selective_scan_bwd_kernel[cfg.grid(batch, dim)](
            u, delta, A, B, C, D, z, delta_bias, chunk_states,
            dout, dlast,
            du, ddelta, dz, dh0,
            dA_part, dD_part, dbias_part, dB_part, dC_part,
            dim, length, N, n_chunks, n_blocks,
            *B_strides, *C_strides, B_per_group, C_per_group,
            cfg.segment, _tl_dtype(dtype),
            B.ndim == 4, C.ndim == 4, D is not None, z is not None,
            delta_bias is not None, bool(delta_softplus), dlast is not None,
            BLOCK_D=cfg.block_d, BLOCK_N=cfg.block_n, CHUNK=cfg.chunk,
            LOG2_CHUNK=cfg.chunk.bit_length() - 1, INT=_tl_int(dtype), num_warps=cfg.num_warps_bwd,
        )
    else:
        for t in (dh0, dA_part, dD_part, dbias_part, dB_part, dC_part):
            if t is not None:
                t.zero_()
        if dlast is not None:
            dh0.copy_(dlast)

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
        None if delta_bias is None else dbias_part.sum(0).to(delta_bias.dtype),
        dh0,
    )


def _linear_scan_fwd(a, x, h0, reverse: bool, out_dtype: torch.dtype):
    """States of the scan along dim 1 of (P, T, Q) tensors; h0: (P, Q) or None."""
    K = _kernels()
    P, T, Q = x.shape
    a, x = a.contiguous(), x.contiguous()
    h0 = None if h0 is None else h0.contiguous()
    out = torch.empty(P, T, Q, device=x.device, dtype=out_dtype)
    if out.numel():
        cfg = _heuristics.linear_scan_config(T, Q)
        n_q_blocks = -(-Q // cfg.block_q)
        K._linear_scan_kernel[(P * n_q_blocks,)](
            a, x, h0, out, None, None, T, Q, n_q_blocks,
            _tl_dtype(_compute_dtype(a, x, h0)), bool(reverse), h0 is not None, False,
            BLOCK_T=cfg.block_t, BLOCK_Q=cfg.block_q, num_warps=cfg.num_warps,
        )
    return out


def _linear_scan_bwd(grad, a, h, h0, reverse: bool):
    """(da, dx, dh0) of :func:`_linear_scan_fwd` given its states h: λ is a scan of the
    upstream gradient in the other direction on the gates shifted by one step."""
    K = _kernels()
    P, T, Q = h.shape
    grad, a, h = grad.contiguous(), a.contiguous(), h.contiguous()
    h0 = None if h0 is None else h0.contiguous()
    dtype = _compute_dtype(a, h, h0)
    lam = torch.empty(P, T, Q, device=h.device, dtype=dtype)
    da = torch.empty(P, T, Q, device=h.device, dtype=dtype)
    if lam.numel():
        cfg = _heuristics.linear_scan_config(T, Q)
        n_q_blocks = -(-Q // cfg.block_q)
        K._linear_scan_kernel[(P * n_q_blocks,)](
            a, grad, h0, lam, h, da, T, Q, n_q_blocks,
            _tl_dtype(dtype), not reverse, h0 is not None, True,
            BLOCK_T=cfg.block_t, BLOCK_Q=cfg.block_q, num_warps=cfg.num_warps,
        )
    first = T - 1 if reverse else 0
    dh0 = None if h0 is None else a[:, first].to(dtype) * lam[:, first]
    return da, lam, dh0
