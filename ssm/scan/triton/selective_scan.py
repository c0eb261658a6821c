"""Backend "triton" of ``selective_scan``, top to bottom: launch heuristics, kernels, launchers,
the custom ops with their autograd formula, and the backend entry point.

    _selective_scan_fwd_kernel  →  _selective_scan_fwd  →  ssm::selective_scan_fwd  →  selective_scan_triton
    _selective_scan_bwd_kernel  →  _selective_scan_bwd  →  ssm::selective_scan_bwd     (its autograd formula)

A program covers BLOCK_D channels of one batch row, the whole state (BLOCK_N >= N) and CHUNK
time steps at a time; tiles are laid out (BLOCK_D, BLOCK_N, CHUNK). The state h stays in
float32 registers; it leaves them once per chunk, as the chunk-start state that the backward
recomputes the chunk from. So a forward+backward holds O(B·D·L + B·D·N·L/CHUNK) memory, never
the (B, D, L, N) states. Gradients are bitwise reproducible: sums across programs are partial
sums added in a fixed order, never atomics.

Optional inputs and options are compile-time flags, derived from the arguments in one place
(``_FLAGS``, applied with ``@triton.heuristics``), so each combination compiles to a kernel
without the unused loads and arithmetic.

torch.compile sees each custom op as one opaque node whose output shapes come from its fake
implementation, and whose backward is another custom op: a model calling them traces with
``fullgraph=True``. Custom ops cannot return None: the backward returns an empty tensor for an
absent input, and the autograd formula turns it back into None.

Packed sequences (cu_seqlens, batch 1): the launcher gives the kernels the sequence of each
step (``seq_ptr``, (L,) int32). At a sequence's first step the scan's gate becomes 0 and its
input gains exp(Δ·A)·h0[s] (the sequence's initial state, or nothing), so the state restarts
wherever the step falls in a chunk; each sequence's last state is stored at its last step.
The backward mirrors it: the adjoint is cut at the same steps, dLoss/d(last state of s) enters
at s's last step, and dLoss/dh0[s] = exp(Δ·A)·λ leaves at its first.

Shape symbols: B batch, L length, D channels, N state size, G groups, T chunk length (CHUNK),
S packed sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._jit import at_time as _at_time
from ._jit import check_launchable, compute_dtype, first_order_combine, next_power_of_2, softplus, tl_dtype
from ._jit import flip_time as _flip_time

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
    num_warps_bwd: int  # backward: about twice the live tiles of the forward

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
    # At a (4, 16, 32) tile, compiled for sm_90: forward 128 registers a thread with 4 warps,
    # backward 177 with 8, none spilled (tests/scan/compile_kernels.py prints them).
    return Config(segment, block_d, block_n, CHUNK, 4 if tile <= 2048 else 8, 8 if tile <= 2048 else 16)


# ----------------------------------------------------------------------------- kernels

# Compile-time flags of both kernels, from their arguments.
_FLAGS = {
    "B_VARYING": lambda a: a["B_ptr"].ndim == 4,
    "C_VARYING": lambda a: a["C_ptr"].ndim == 4,
    "HAS_D": lambda a: a["D_ptr"] is not None,
    "HAS_Z": lambda a: a["z_ptr"] is not None,
    "HAS_DELTA_BIAS": lambda a: a["delta_bias_ptr"] is not None,
    "PACKED": lambda a: a["seq_ptr"] is not None,
    "HAS_INITIAL_STATE": lambda a: a["initial_state_ptr"] is not None,
}
_FWD_FLAGS = {
    **_FLAGS,
    "COMPUTE": lambda a: tl_dtype(a["last_state_ptr"].dtype),  # float32, or float64 for float64 inputs
    "SAVE_CHUNK_STATES": lambda a: a["chunk_states_ptr"].shape[2] > 0,  # off when no backward follows
}
_BWD_FLAGS = {
    **_FLAGS,
    "HAS_DLAST": lambda a: a["dlast_ptr"] is not None,
    "COMPUTE": lambda a: tl_dtype(a["chunk_states_ptr"].dtype),
    "INT": lambda a: tl.int64 if a["chunk_states_ptr"].dtype == torch.float64 else tl.int32,  # COMPUTE's width
    "LOG2_CHUNK": lambda a: a["CHUNK"].bit_length() - 1,
}


@triton.jit
def _prologue(
    A_ptr,
    D_ptr,
    delta_bias_ptr,
    B_ptr,
    C_ptr,
    N,
    SEGMENT,
    stride_B0,
    stride_B1,
    stride_C0,
    stride_C1,
    B_PER_GROUP,
    C_PER_GROUP,
    COMPUTE: tl.constexpr,
    B_VARYING: tl.constexpr,
    C_VARYING: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_DELTA_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """What both kernels set up first: this program's batch row, channels and state indices,
    and its per-channel parameters. B and C are either a base pointer into this program's
    group (time-varying) or a loaded (BLOCK_D, BLOCK_N) tile (fixed): one group for the whole
    program, since a segment never straddles one."""
    pid_b = tl.program_id(0).to(tl.int64)  # offsets past 2**31 elements
    segment_start = tl.program_id(1) * SEGMENT
    d = segment_start + tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    d_mask = d < segment_start + SEGMENT
    n = tl.arange(0, BLOCK_N)
    n_mask = n < N
    dn_mask = d_mask[:, None] & n_mask[None, :]

    A = tl.load(A_ptr + d[:, None] * N + n[None, :], mask=dn_mask, other=0.0).to(COMPUTE)
    if HAS_D:
        D_skip = tl.load(D_ptr + d, mask=d_mask, other=0.0).to(COMPUTE)
    else:
        D_skip = tl.zeros([BLOCK_D], dtype=COMPUTE)
    if HAS_DELTA_BIAS:
        delta_bias = tl.load(delta_bias_ptr + d, mask=d_mask, other=0.0).to(COMPUTE)
    else:
        delta_bias = tl.zeros([BLOCK_D], dtype=COMPUTE)
    if B_VARYING:
        B_base = B_ptr + pid_b * stride_B0 + (segment_start // B_PER_GROUP) * stride_B1
        B_fixed = tl.zeros([BLOCK_D, BLOCK_N], dtype=COMPUTE)
    else:
        B_base = B_ptr
        B_fixed = tl.load(B_ptr + d[:, None] * stride_B0 + n[None, :] * stride_B1, mask=dn_mask, other=0.0).to(COMPUTE)
    if C_VARYING:
        C_base = C_ptr + pid_b * stride_C0 + (segment_start // C_PER_GROUP) * stride_C1
        C_fixed = tl.zeros([BLOCK_D, BLOCK_N], dtype=COMPUTE)
    else:
        C_base = C_ptr
        C_fixed = tl.load(C_ptr + d[:, None] * stride_C0 + n[None, :] * stride_C1, mask=dn_mask, other=0.0).to(COMPUTE)
    return pid_b, d, d_mask, n, n_mask, dn_mask, A, D_skip, delta_bias, B_base, B_fixed, C_base, C_fixed


@triton.jit
def _BC_at(base, fixed, n, n_mask, t, t_mask, stride_2, stride_3, VARYING: tl.constexpr, COMPUTE: tl.constexpr):
    """B or C at time steps t: a (1, BLOCK_N, CHUNK) tile (time-varying) or the fixed
    (BLOCK_D, BLOCK_N, 1) one."""
    if VARYING:
        tile = tl.load(
            base + n[:, None] * stride_2 + t[None, :] * stride_3, mask=n_mask[:, None] & t_mask[None, :], other=0.0
        ).to(COMPUTE)[None, :, :]
    else:
        tile = fixed[:, :, None]
    return tile


@triton.jit
def _delta_at(delta_ptr, offsets, mask, delta_bias, COMPUTE: tl.constexpr, SOFTPLUS: tl.constexpr):
    """Δ (BLOCK_D, CHUNK) at ``offsets``, and the pre-softplus value it came from."""
    raw = tl.load(delta_ptr + offsets, mask=mask, other=0.0).to(COMPUTE) + delta_bias[:, None]
    if SOFTPLUS:
        delta = softplus(raw)
    else:
        delta = raw
    return delta, raw


@triton.jit
def _chunk_states(delta, u, A, Bt, mask, h_start, starts, h0, PACKED: tl.constexpr):
    """The states of one chunk (BLOCK_D, BLOCK_N, CHUNK) from the state before it, and the
    chunk's gates exp(Δ·A) and inputs Δ·u·B. Steps past L are the identity (gate 1, input 0).
    PACKED: at the steps where ``starts`` (CHUNK,) the scan's gate is 0 and its input gains
    gate·h0 (h0: (BLOCK_D, BLOCK_N, CHUNK), zero elsewhere): a sequence restarts there.
    Returns (states, the true gates and inputs, the gates the scan ran with)."""
    valid = mask[:, None, :]
    gate = tl.where(valid, tl.exp(delta[:, None, :] * A[:, :, None]), 1.0)
    drive = tl.where(valid, (delta * u)[:, None, :] * Bt, 0.0)
    if PACKED:
        restart = starts[None, None, :]
        scan_gate = tl.where(restart, 0.0, gate)
        scan_drive = drive + tl.where(restart, gate * h0, 0.0)
    else:
        scan_gate = gate
        scan_drive = drive
    gate_prod, drive_sum = tl.associative_scan((scan_gate, scan_drive), 2, first_order_combine)
    return drive_sum + gate_prod * h_start[:, :, None], gate, drive, scan_gate


@triton.jit
def _sequence_edges(seq_ptr, t, t_mask, L):
    """For steps t (CHUNK,) of packed sequences: each step's sequence, and whether it is its
    sequence's first and last step."""
    seq = tl.load(seq_ptr + t, mask=t_mask, other=-1)
    before = tl.load(seq_ptr + t - 1, mask=t_mask & (t > 0), other=-1)
    after = tl.load(seq_ptr + t + 1, mask=t_mask & (t + 1 < L), other=-1)
    return seq, t_mask & (seq != before), t_mask & (seq != after)


@triton.jit
def _per_sequence(ptr, seq, d, n, dn_mask, at, dim, N):
    """Pointers (BLOCK_D, BLOCK_N, CHUNK) into a (S, D, N) per-sequence state at each step's
    sequence, and the mask of the steps ``at`` (CHUNK,)."""
    offsets = (seq[None, None, :] * dim + d[:, None, None]) * N + n[None, :, None]
    return ptr + offsets, dn_mask[:, :, None] & at[None, None, :]


@triton.heuristics(_FWD_FLAGS)
@triton.jit
def _selective_scan_fwd_kernel(
    u_ptr,
    delta_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    z_ptr,
    delta_bias_ptr,
    initial_state_ptr,  # inputs
    seq_ptr,  # packed: (L,) int32, the sequence of each step; else None
    out_ptr,
    last_state_ptr,
    chunk_states_ptr,  # outputs
    dim,
    L,
    N,
    n_chunks,
    stride_B0,
    stride_B1,
    stride_B2,
    stride_B3,  # B: (B, G, N, L), or (D, N) using the first two
    stride_C0,
    stride_C1,
    stride_C2,
    stride_C3,
    B_PER_GROUP,
    C_PER_GROUP,
    SEGMENT,
    SOFTPLUS: tl.constexpr,
    COMPUTE: tl.constexpr,
    B_VARYING: tl.constexpr,
    C_VARYING: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DELTA_BIAS: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr,
    SAVE_CHUNK_STATES: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """out (B, D, L), the last state (B, D, N) and the state before each chunk (B, D, n_chunks, N).

    u, delta, z, out: contiguous (B, D, L); A: contiguous (D, N); D, delta_bias: (D,);
    initial and last state: contiguous (B, D, N), or (S, D, N) when PACKED (B = 1; the last
    states of empty sequences are left as the launcher wrote them); B, C: any strides."""
    pid_b, d, d_mask, n, n_mask, dn_mask, A, D_skip, delta_bias, B_base, B_fixed, C_base, C_fixed = _prologue(
        A_ptr,
        D_ptr,
        delta_bias_ptr,
        B_ptr,
        C_ptr,
        N,
        SEGMENT,
        stride_B0,
        stride_B1,
        stride_C0,
        stride_C1,
        B_PER_GROUP,
        C_PER_GROUP,
        COMPUTE,
        B_VARYING,
        C_VARYING,
        HAS_D,
        HAS_DELTA_BIAS,
        BLOCK_D,
        BLOCK_N,
    )
    t_local = tl.arange(0, CHUNK)
    state_offsets = (pid_b * dim + d[:, None]) * N + n[None, :]  # into (B, D, N)
    if HAS_INITIAL_STATE and not PACKED:
        h = tl.load(initial_state_ptr + state_offsets, mask=dn_mask, other=0.0).to(COMPUTE)
    else:  # (packed: the first step starts a sequence, which brings its own initial state)
        h = tl.zeros([BLOCK_D, BLOCK_N], dtype=COMPUTE)
    row = (pid_b * dim + d) * L  # (BLOCK_D,) start of each channel's row in (B, D, L)
    chunk_offsets = ((pid_b * dim + d[:, None]) * n_chunks) * N + n[None, :]  # (B, D, n_chunks, N)

    for c in range(0, n_chunks):
        if SAVE_CHUNK_STATES:
            tl.store(chunk_states_ptr + chunk_offsets + c * N, h, mask=dn_mask)
        t = c * CHUNK + t_local
        t_mask = t < L
        mask = d_mask[:, None] & t_mask[None, :]
        offsets = row[:, None] + t[None, :]  # (BLOCK_D, CHUNK)
        u = tl.load(u_ptr + offsets, mask=mask, other=0.0).to(COMPUTE)
        delta, _ = _delta_at(delta_ptr, offsets, mask, delta_bias, COMPUTE, SOFTPLUS)
        Bt = _BC_at(B_base, B_fixed, n, n_mask, t, t_mask, stride_B2, stride_B3, B_VARYING, COMPUTE)
        Ct = _BC_at(C_base, C_fixed, n, n_mask, t, t_mask, stride_C2, stride_C3, C_VARYING, COMPUTE)
        h0 = tl.zeros([BLOCK_D, BLOCK_N, CHUNK], dtype=COMPUTE)
        if PACKED:
            seq, starts, ends = _sequence_edges(seq_ptr, t, t_mask, L)
            if HAS_INITIAL_STATE:
                h0_ptrs, h0_mask = _per_sequence(initial_state_ptr, seq, d, n, dn_mask, starts, dim, N)
                h0 = tl.load(h0_ptrs, mask=h0_mask, other=0.0).to(COMPUTE)
        else:
            starts = t_mask
            ends = t_mask
        hs, _, _, _ = _chunk_states(delta, u, A, Bt, mask, h, starts, h0, PACKED)
        y = tl.sum(hs * Ct, axis=1)  # (BLOCK_D, CHUNK)
        h = _at_time(hs, t_local, CHUNK - 1)
        if PACKED:  # each sequence's state after its last step
            last_ptrs, last_mask = _per_sequence(last_state_ptr, seq, d, n, dn_mask, ends, dim, N)
            tl.store(last_ptrs, hs, mask=last_mask)
        if HAS_D:
            y += D_skip[:, None] * u
        if HAS_Z:
            z = tl.load(z_ptr + offsets, mask=mask, other=0.0).to(COMPUTE)
            y = y * z * tl.sigmoid(z)
        tl.store(out_ptr + offsets, y, mask=mask)

    if not PACKED:
        tl.store(last_state_ptr + state_offsets, h, mask=dn_mask)


@triton.heuristics(_BWD_FLAGS)
@triton.jit
def _selective_scan_bwd_kernel(
    u_ptr,
    delta_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    z_ptr,
    delta_bias_ptr,
    chunk_states_ptr,  # forward
    initial_state_ptr,
    seq_ptr,  # packed only (else None): (S, D, N) and (L,) int32
    dout_ptr,
    dlast_ptr,  # upstream gradients
    du_ptr,
    ddelta_ptr,
    dz_ptr,
    dinitial_state_ptr,  # gradients written in full
    dA_part_ptr,
    dD_part_ptr,
    ddelta_bias_part_ptr,  # per batch row: (B, D, N), (B, D), (B, D)
    dB_part_ptr,
    dC_part_ptr,  # time-varying: (B, D/SEGMENT, n_blocks, N, L); fixed: (B, D, N)
    dim,
    L,
    N,
    n_chunks,
    n_blocks,
    stride_B0,
    stride_B1,
    stride_B2,
    stride_B3,
    stride_C0,
    stride_C1,
    stride_C2,
    stride_C3,
    B_PER_GROUP,
    C_PER_GROUP,
    SEGMENT,
    SOFTPLUS: tl.constexpr,
    COMPUTE: tl.constexpr,
    B_VARYING: tl.constexpr,
    C_VARYING: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DELTA_BIAS: tl.constexpr,
    HAS_DLAST: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr,
    PACKED: tl.constexpr,
    LOG2_CHUNK: tl.constexpr,
    INT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Chunks from last to first: recompute the chunk's states from its saved start state, then
    run the adjoint recurrence λ_t = g_t + a_{t+1}·λ_{t+1} (g_t = dLoss/dy_t·C_t) backwards
    through it, carrying dLoss/dh into the chunk before. Reductions over channels (dB, dC when
    time-varying) and over batch rows and time (dA, dD, d delta_bias, fixed dB, dC) are written
    as partial sums, one per program, and summed in a fixed order by the launcher.
    PACKED: dlast and dinitial_state are (S, D, N), read at each sequence's last step and
    written at its first (those of empty sequences are left as the launcher wrote them)."""
    pid_b, d, d_mask, n, n_mask, dn_mask, A, D_skip, delta_bias, B_base, B_fixed, C_base, C_fixed = _prologue(
        A_ptr,
        D_ptr,
        delta_bias_ptr,
        B_ptr,
        C_ptr,
        N,
        SEGMENT,
        stride_B0,
        stride_B1,
        stride_C0,
        stride_C1,
        B_PER_GROUP,
        C_PER_GROUP,
        COMPUTE,
        B_VARYING,
        C_VARYING,
        HAS_D,
        HAS_DELTA_BIAS,
        BLOCK_D,
        BLOCK_N,
    )
    t_local = tl.arange(0, CHUNK)
    state_offsets = (pid_b * dim + d[:, None]) * N + n[None, :]
    if HAS_DLAST and not PACKED:  # dLoss/dh of the step after the chunk, seen from the last state
        carry = tl.load(dlast_ptr + state_offsets, mask=dn_mask, other=0.0).to(COMPUTE)
    else:
        carry = tl.zeros([BLOCK_D, BLOCK_N], dtype=COMPUTE)
    dA_acc = tl.zeros([BLOCK_D, BLOCK_N], dtype=COMPUTE)
    dB_acc = tl.zeros([BLOCK_D, BLOCK_N], dtype=COMPUTE)
    dC_acc = tl.zeros([BLOCK_D, BLOCK_N], dtype=COMPUTE)
    dD_acc = tl.zeros([BLOCK_D], dtype=COMPUTE)
    ddelta_bias_acc = tl.zeros([BLOCK_D], dtype=COMPUTE)
    row = (pid_b * dim + d) * L
    chunk_offsets = ((pid_b * dim + d[:, None]) * n_chunks) * N + n[None, :]
    # time-varying dB/dC partials: this program's (N, L) slice of (B, D/SEGMENT, n_blocks, N, L)
    part_base = ((pid_b * (dim // SEGMENT) + tl.program_id(1)) * n_blocks + tl.program_id(2)) * N * L
    part_offsets_n = n[:, None] * L

    for c_rev in range(0, n_chunks):
        c = n_chunks - 1 - c_rev
        h_start = tl.load(chunk_states_ptr + chunk_offsets + c * N, mask=dn_mask, other=0.0).to(COMPUTE)
        t = c * CHUNK + t_local
        t_mask = t < L
        nt_mask = n_mask[:, None] & t_mask[None, :]
        mask = d_mask[:, None] & t_mask[None, :]
        offsets = row[:, None] + t[None, :]
        u = tl.load(u_ptr + offsets, mask=mask, other=0.0).to(COMPUTE)
        delta, raw = _delta_at(delta_ptr, offsets, mask, delta_bias, COMPUTE, SOFTPLUS)
        Bt = _BC_at(B_base, B_fixed, n, n_mask, t, t_mask, stride_B2, stride_B3, B_VARYING, COMPUTE)
        Ct = _BC_at(C_base, C_fixed, n, n_mask, t, t_mask, stride_C2, stride_C3, C_VARYING, COMPUTE)
        h0 = tl.zeros([BLOCK_D, BLOCK_N, CHUNK], dtype=COMPUTE)
        if PACKED:
            seq, starts, _ = _sequence_edges(seq_ptr, t, t_mask, L)
            if HAS_INITIAL_STATE:
                h0_ptrs, h0_mask = _per_sequence(initial_state_ptr, seq, d, n, dn_mask, starts, dim, N)
                h0 = tl.load(h0_ptrs, mask=h0_mask, other=0.0).to(COMPUTE)
        else:
            starts = t_mask
        hs, gate, drive, scan_gate = _chunk_states(delta, u, A, Bt, mask, h_start, starts, h0, PACKED)

        # Through the output: out = (y + D·u)·silu(z).
        dout = tl.load(dout_ptr + offsets, mask=mask, other=0.0).to(COMPUTE)
        if HAS_Z:
            z = tl.load(z_ptr + offsets, mask=mask, other=0.0).to(COMPUTE)
            sig = tl.sigmoid(z)
            y = tl.sum(hs * Ct, axis=1)
            if HAS_D:
                y += D_skip[:, None] * u
            tl.store(dz_ptr + offsets, dout * y * sig * (1.0 + z * (1.0 - sig)), mask=mask)
            dy = dout * z * sig
        else:
            dy = dout
        if HAS_D:
            du = dy * D_skip[:, None]
            dD_acc += tl.sum(dy * u, axis=1)
        else:
            du = tl.zeros([BLOCK_D, CHUNK], dtype=COMPUTE)
        if C_VARYING:
            dC_part = tl.sum(dy[:, None, :] * hs, axis=0)  # (BLOCK_N, CHUNK)
            tl.store(dC_part_ptr + part_base + part_offsets_n + t[None, :], dC_part, mask=nt_mask)
        else:
            dC_acc += tl.sum(dy[:, None, :] * hs, axis=2)

        # The adjoint, as a forward scan over the chunk in reversed time (not
        # associative_scan(reverse=True), whose compiled form has had correctness bugs). Its
        # inputs are built from loads at reversed time indices, so only λ itself is flipped
        # back in registers. Step t's gate is a_{t+1}; at the chunk's last step (and past L)
        # it is 1, because `carry` already holds a_{t+1}·λ_{t+1} from the chunk after.
        t_rev = c * CHUNK + (CHUNK - 1 - t_local)
        t_rev_mask = t_rev < L
        rev_mask = d_mask[:, None] & t_rev_mask[None, :]
        rev_offsets = row[:, None] + t_rev[None, :]
        dy_rev = tl.load(dout_ptr + rev_offsets, mask=rev_mask, other=0.0).to(COMPUTE)
        if HAS_Z:
            z_rev = tl.load(z_ptr + rev_offsets, mask=rev_mask, other=0.0).to(COMPUTE)
            dy_rev = dy_rev * z_rev * tl.sigmoid(z_rev)
        C_rev = _BC_at(C_base, C_fixed, n, n_mask, t_rev, t_rev_mask, stride_C2, stride_C3, C_VARYING, COMPUTE)
        next_mask = d_mask[:, None] & (t_rev + 1 < L)[None, :] & (t_local > 0)[None, :]
        delta_next, _ = _delta_at(delta_ptr, rev_offsets + 1, next_mask, delta_bias, COMPUTE, SOFTPLUS)
        gate_next = tl.where(next_mask[:, None, :], tl.exp(delta_next[:, None, :] * A[:, :, None]), 1.0)
        g_rev = dy_rev[:, None, :] * C_rev
        if PACKED:
            # A sequence's last step: nothing flows back from the next step (it starts another
            # sequence: its carry is 0 too), and dLoss/d(its last state) enters here.
            seq_rev, _, ends_rev = _sequence_edges(seq_ptr, t_rev, t_rev_mask, L)
            gate_next = tl.where(ends_rev[None, None, :], 0.0, gate_next)
            if HAS_DLAST:
                dlast_ptrs, dlast_mask = _per_sequence(dlast_ptr, seq_rev, d, n, dn_mask, ends_rev, dim, N)
                g_rev += tl.load(dlast_ptrs, mask=dlast_mask, other=0.0).to(COMPUTE)
        lam_prod, lam_sum = tl.associative_scan((gate_next, g_rev), 2, first_order_combine)
        lam = _flip_time(lam_sum + lam_prod * carry[:, :, None], BLOCK_D, BLOCK_N, LOG2_CHUNK, INT)
        carry = _at_time(scan_gate * lam, t_local, 0)  # dLoss/dh before the chunk
        if PACKED:  # dLoss/dh0[s] at each sequence's first step
            dh0_ptrs, dh0_mask = _per_sequence(dinitial_state_ptr, seq, d, n, dn_mask, starts, dim, N)
            tl.store(dh0_ptrs, gate * lam, mask=dh0_mask)

        # h_t = a_t·h_{t-1} + Δ_t·u_t·B_t with a_t = exp(Δ_t·A): a_t·h_{t-1} = h_t - drive_t
        # (no shift of h needed); dLoss/d(Δ_t·A) = λ_t·a_t·h_{t-1}.
        w = tl.where(mask[:, None, :], lam * (hs - drive), 0.0)
        dA_acc += tl.sum(w * delta[:, None, :], axis=2)
        lam_B = lam * Bt
        ddelta = tl.sum(w * A[:, :, None], axis=1) + u * tl.sum(lam_B, axis=1)
        du += delta * tl.sum(lam_B, axis=1)
        lam_delta_u = lam * (delta * u)[:, None, :]
        if B_VARYING:
            dB_part = tl.sum(lam_delta_u, axis=0)
            tl.store(dB_part_ptr + part_base + part_offsets_n + t[None, :], dB_part, mask=nt_mask)
        else:
            dB_acc += tl.sum(lam_delta_u, axis=2)
        if SOFTPLUS:
            ddelta = ddelta * tl.sigmoid(raw)
        ddelta = tl.where(mask, ddelta, 0.0)
        ddelta_bias_acc += tl.sum(ddelta, axis=1)
        tl.store(du_ptr + offsets, du, mask=mask)
        tl.store(ddelta_ptr + offsets, ddelta, mask=mask)

    if not PACKED:
        tl.store(dinitial_state_ptr + state_offsets, carry, mask=dn_mask)
    tl.store(dA_part_ptr + state_offsets, dA_acc, mask=dn_mask)
    if not B_VARYING:
        tl.store(dB_part_ptr + state_offsets, dB_acc, mask=dn_mask)
    if not C_VARYING:
        tl.store(dC_part_ptr + state_offsets, dC_acc, mask=dn_mask)
    if HAS_D:
        tl.store(dD_part_ptr + pid_b * dim + d, dD_acc, mask=d_mask)
    if HAS_DELTA_BIAS:
        tl.store(ddelta_bias_part_ptr + pid_b * dim + d, ddelta_bias_acc, mask=d_mask)


# ----------------------------------------------------------------------------- launchers


def _contiguous(*tensors):
    return [None if t is None else t.contiguous() for t in tensors]


def _BC_args(name: str, M: Tensor, dim: int) -> dict:
    """Strides (four, zero-padded) and channels per group of B or C, as kernel arguments."""
    strides = list(M.stride()) + [0] * (4 - M.ndim)
    args = {f"stride_{name}{i}": s for i, s in enumerate(strides)}
    args[f"{name}_PER_GROUP"] = channels_per_group(M, dim)
    return args


def _sequence_of_steps(cu_seqlens: Tensor | None, length: int) -> Tensor | None:
    """(L,) int32: the packed sequence each step belongs to (None when not packed)."""
    if cu_seqlens is None:
        return None
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    steps = torch.arange(lengths.numel(), device=cu_seqlens.device, dtype=torch.int32)
    return torch.repeat_interleave(steps, lengths, output_size=length)


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
    u, delta, A, z, D, delta_bias, initial_state = _contiguous(u, delta, A, z, D, delta_bias, initial_state)
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
        u_ptr=u,
        delta_ptr=delta,
        A_ptr=A,
        B_ptr=B,
        C_ptr=C,
        D_ptr=D,
        z_ptr=z,
        delta_bias_ptr=delta_bias,
        initial_state_ptr=initial_state,
        seq_ptr=_sequence_of_steps(cu_seqlens, length),
        out_ptr=out,
        last_state_ptr=last_state,
        chunk_states_ptr=chunk_states,
        dim=dim,
        L=length,
        N=N,
        n_chunks=n_chunks,
        **_BC_args("B", B, dim),
        **_BC_args("C", C, dim),
        SEGMENT=cfg.segment,
        SOFTPLUS=bool(delta_softplus),
        BLOCK_D=cfg.block_d,
        BLOCK_N=cfg.block_n,
        CHUNK=cfg.chunk,
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
    u, delta, A, z, D, delta_bias, dout, dlast, chunk_states, initial_state = _contiguous(
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
            u_ptr=u,
            delta_ptr=delta,
            A_ptr=A,
            B_ptr=B,
            C_ptr=C,
            D_ptr=D,
            z_ptr=z,
            delta_bias_ptr=delta_bias,
            chunk_states_ptr=chunk_states,
            initial_state_ptr=initial_state if cu_seqlens is not None else None,
            seq_ptr=_sequence_of_steps(cu_seqlens, length),
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
            dim=dim,
            L=length,
            N=N,
            n_chunks=chunk_states.shape[2],
            n_blocks=n_blocks,
            **_BC_args("B", B, dim),
            **_BC_args("C", C, dim),
            SEGMENT=cfg.segment,
            SOFTPLUS=bool(delta_softplus),
            BLOCK_D=cfg.block_d,
            BLOCK_N=cfg.block_n,
            CHUNK=cfg.chunk,
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

_NONE = (0,)  # shape of the placeholder a custom op returns for an absent optional input


@torch.library.custom_op("ssm::selective_scan_fwd", mutates_args=())
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


@selective_scan_fwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, save_chunk_states=True, cu_seqlens=None):
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


@torch.library.custom_op("ssm::selective_scan_bwd", mutates_args=())
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
    return tuple(u.new_empty(_NONE) if g is None else g for g in grads)


@selective_scan_bwd.register_fake
def _(
    dout, dlast, u, delta, A, B, C, D, z, delta_bias, delta_softplus, chunk_states, initial_state=None, cu_seqlens=None
):
    def like(x):
        return u.new_empty(_NONE) if x is None else torch.empty_like(x)

    states = u.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dinitial_state = chunk_states.new_empty(states, u.shape[1], A.shape[1])
    return like(u), like(delta), like(A), like(B), like(C), like(D), like(z), like(delta_bias), dinitial_state


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


selective_scan_fwd.register_autograd(_backward, setup_context=_setup_context)


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
    # Chunk states are only for a backward: not written when none can follow (inference).
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    out, last_state, _ = selective_scan_fwd(
        u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, save, cu_seqlens
    )
    return out, last_state
