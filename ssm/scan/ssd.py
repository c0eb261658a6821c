"""The public SSD scan (Mamba-2): mamba-ssm's ``mamba_chunk_scan_combined`` with named options."""

from __future__ import annotations

import math

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
from .chunked import ssd_chunked
from .cpu import ssd_cpu, subnormals_flushed
from .reference import ssd_ref

# Backends take the public arguments less return_last_state and seq_idx, in the same order, with
# cu_seqlens last (None, or validated int64 (S + 1,) on the inputs' device), and return
# (out, last_state), last_state (S, H, P, N) when packed. seq_idx is turned into cu_seqlens here.
BACKENDS = BackendTable("ssd", auto={"cpu": ("cpu", "chunked"), "cuda": ("triton", "chunked"), "*": ("chunked",)})
BACKENDS.add("ref", ssd_ref)
BACKENDS.add("chunked", subnormals_flushed(ssd_chunked))
BACKENDS.add("cpu", ssd_cpu, devices=("cpu",))
BACKENDS.add("triton", triton.ssd_triton, devices=triton.devices, hint=triton.hint)
# "auto" on the CPU: the sweeps of "cpu" walk every state element at every step, while "chunked"
# shares each B·C product among a head's P channels in matrix products. Measured fwd+bwd at
# L 1024 (docs/benchmarks-history/2026-11.md, "SSD on the CPU"): the op alone is 4.5-7x faster with cpu at P·N = 512
# and 2048, 2.1x at 4096, 1.3-1.8x above; but the whole Mamba2 layer at mamba2-130m's width
# (P 64, N 128) takes as long with either (231 vs 239 ms). So auto takes "cpu" up to 4096.
CPU_SWEEP_MAX_HEAD_STATE = 4096
# ... and runs "chunked" in blocks of at most 64 positions on the CPU, whatever chunk_size says:
# chunk_size is a GPU kernel's tile (mamba-ssm's 256), and on a CPU the chunked form's (T, T)
# blocks of every head outgrow the caches as T grows. Measured on 2 threads at mamba2-130m's
# width (H 24, P 64, N 128): fwd+bwd at L 1024 262 ms in blocks of 256, 68 of 64, 87 of 32; a
# 512-token prefill of the whole model 396 tokens/s in blocks of 256, 880 of 64 (docs/
# benchmarks-history/2026-11.md, "The attention block's C decoding step; SSD's chunk ...").
CPU_MAX_CHUNK = 64


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
    cu_seqlens: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    backend: str = "auto",
):
    """State-space duality scan (Mamba-2): a selective scan whose decay is one scalar per head.

    Shapes (time second, as in mamba-ssm's ``mamba_chunk_scan_combined``):
        x, z:           (batch, L, H, P)      H heads of P channels
        dt:             (batch, L, H)
        A, dt_bias:     (H,), real; A < 0 for a decaying state
        B, C:           (batch, L, G, N)      H % G == 0; head h uses group h // (H / G)
        D:              (H,) or (H, P)
        initial_state:  (batch, H, P, N), the state before the first step (default 0);
                        (S, H, P, N) with cu_seqlens
        cu_seqlens:     (S + 1,) integer, packed sequences (batch must be 1), see below
        seq_idx:        (batch, L) integer, mamba-ssm's sequence index per position, see below

    Computes, for t = 0 .. L-1,
        Δ_t = clamp(softplus(dt_t + dt_bias), *dt_limit)   (bias, softplus, clamp only when asked)
        h_t = exp(Δ_t·A)·h_{t-1} + Δ_t·x_t ⊗ B_t           h: (batch, H, P, N)
        y_t = h_t·C_t + D·x_t,   out_t = y_t·silu(z_t)

    Returns ``out`` (batch, L, H, P) in x's dtype, or ``(out, last_state)`` with ``last_state``
    (batch, H, P, N) in float32 (float64 for float64 inputs). Gradients flow to every tensor
    argument, into ``initial_state`` and from ``last_state``.

    Packed sequences, two ways:
    - ``cu_seqlens`` (S + 1,), as in ``selective_scan``: S sequences end to end along L in a
      batch of one; each restarts from ``initial_state[s]`` ((S, H, P, N)) or 0, and
      ``last_state`` is (S, H, P, N), each sequence's state after its last step (its initial
      state for a zero-length sequence).
    - ``seq_idx`` (batch, L), as in mamba-ssm's ``mamba_chunk_scan_combined``: the state
      restarts from 0 wherever seq_idx[b, t] != seq_idx[b, t-1]. ``initial_state`` (batch, H,
      P, N) is the state before each row's first position, and ``last_state`` (batch, H, P, N)
      the state after each row's last position, as without seq_idx.
    Give one or the other, not both.

    ``chunk_size`` is the block length of the chunked algorithm (ignored by "ref"); "auto" on
    CPU tensors takes at most 64, much the fastest there (see ``CPU_MAX_CHUNK``).
    ``backend``: ``"auto"`` or a name from ``ssm.scan.backends("ssd")``: "ref" (a loop over
    time), "chunked" (the SSD chunked algorithm, see chunked.py), "cpu" (the C sweeps of
    ``selective_scan``'s cpu backend, CPU tensors) or "triton" (the chunked algorithm as fused
    GPU kernels, CUDA tensors; chunk_size rounded up to a power of two from 16 to 256; it
    declines a head dim or state size above 256). "auto" takes "cpu" for CPU tensors when a
    head's state is small (P·N <= 4096), else "chunked"; "triton" for CUDA tensors, or
    "chunked" where it declines.
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
    check_state_size("B", B, N, "(batch, L, G, N)")
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
    state_batch = batch
    if cu_seqlens is not None and seq_idx is not None:
        raise ValueError("give cu_seqlens or seq_idx, not both (they describe the same boundaries)")
    if cu_seqlens is not None:
        cu_seqlens = check_cu_seqlens(cu_seqlens, length, batch, x.device)
        state_batch = cu_seqlens.numel() - 1
    if seq_idx is not None:
        _check_seq_idx(seq_idx, batch, length, x.device)
    if initial_state is not None:
        check_tensor("initial_state", initial_state, ndim=4)
        check_shape(
            "initial_state",
            initial_state,
            (state_batch, heads, head_dim, N),
            "(batch, H, P, N)" if cu_seqlens is None else "(num_seqs, H, P, N)",
        )
    if not (isinstance(dt_limit, (tuple, list)) and len(dt_limit) == 2 and dt_limit[0] <= dt_limit[1]):
        raise ValueError(f"dt_limit must be a pair (low, high) with low <= high, got {dt_limit!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    check_same_device("x", x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, initial_state=initial_state)
    if backend == "auto" and x.device.type == "cpu":
        chunk_size = min(chunk_size, CPU_MAX_CHUNK)
        if head_dim * N > CPU_SWEEP_MAX_HEAD_STATE:
            backend = "chunked"
    BACKENDS.resolve(backend, x.device)  # an unknown name, or one that cannot run here, fails before any work

    def run(*args):  # a backend that declines the inputs (triton: P or N too large) is replaced under "auto"
        return BACKENDS.run(backend, x.device, args, fallback="chunked", needs=lambda: _triton_needs(head_dim, N))

    if x.numel() == 0:  # no output to compute (L, batch, H or P is 0): no backend runs
        out = empty_output(x.shape, x.dtype, x, dt, A, B, C, D, z, dt_bias, initial_state)
        if not return_last_state:
            return out
        state_dtype = compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_state)
        if initial_state is None:
            return out, x.new_zeros(state_batch, heads, head_dim, N, dtype=state_dtype)
        return out, initial_state.to(state_dtype, copy=True)

    options = (bool(dt_softplus), tuple(dt_limit))
    if seq_idx is not None:
        out, last_state = _ssd_seq_idx(run, x, dt, A, B, C, D, z, dt_bias, options, initial_state, chunk_size, seq_idx)
    else:
        out, last_state = run(x, dt, A, B, C, D, z, dt_bias, *options, initial_state, chunk_size, cu_seqlens)
    out = out.contiguous()  # as mamba-ssm's are: callers may .view() it
    return (out, last_state) if return_last_state else out


def _triton_needs(head_dim: int, N: int) -> str:
    from .triton.ssd import declines  # imports triton: only when the triton backend declined

    return declines(head_dim, N) or "inputs it takes"


def _check_seq_idx(seq_idx, batch: int, length: int, device: torch.device) -> None:
    if not isinstance(seq_idx, torch.Tensor):
        raise ValueError(f"seq_idx must be a torch.Tensor, got {type(seq_idx).__name__}")
    if seq_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_idx must have dtype torch.int32 or torch.int64, got {seq_idx.dtype}")
    if tuple(seq_idx.shape) != (batch, length):
        raise ValueError(f"seq_idx must have shape (batch, L) = {(batch, length)}, got {tuple(seq_idx.shape)}")
    if seq_idx.device != device:
        raise ValueError(f"seq_idx is on device '{seq_idx.device}' but the inputs are on '{device}'")


def _ssd_seq_idx(fn, x, dt, A, B, C, D, z, dt_bias, options, initial_state, chunk_size, seq_idx):
    """mamba-ssm's seq_idx as packed sequences: the rows are laid end to end in a batch of one,
    with a new sequence at every row start and wherever seq_idx changes; a row's initial state
    starts its first sequence, and its last sequence's last state is the row's."""
    batch, length = seq_idx.shape
    starts = torch.ones(batch, length, dtype=torch.bool, device=x.device)
    starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    positions = starts.flatten().nonzero()[:, 0]  # (S,) each sequence's first position
    cu_seqlens = torch.cat([positions, positions.new_full((1,), batch * length)])
    row_first = torch.arange(batch, device=x.device) * length  # each row's first position ...
    first_seq = torch.searchsorted(positions, row_first)  # ... is the start of this sequence
    last_seq = torch.cat([first_seq[1:], first_seq.new_full((1,), positions.numel())]) - 1
    num_seqs = positions.numel()
    if initial_state is not None:
        per_seq = initial_state.new_zeros(num_seqs, *initial_state.shape[1:])
        initial_state = per_seq.index_copy(0, first_seq, initial_state)

    def packed(t):
        return None if t is None else t.reshape(1, batch * length, *t.shape[2:])

    out, last = fn(
        packed(x),
        packed(dt),
        A,
        packed(B),
        packed(C),
        D,
        packed(z),
        dt_bias,
        *options,
        initial_state,
        chunk_size,
        cu_seqlens,
    )
    return out.reshape(x.shape), last[last_seq]
