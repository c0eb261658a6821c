"""The two Triton kernels of the selective scan, forward and backward, with the @triton.jit
helpers they share; their launch heuristics, launchers, custom ops and entry point are in
selective_scan.py.

A program covers BLOCK_D channels of one batch row, the whole state (BLOCK_N >= N) and CHUNK
time steps at a time; tiles are laid out (BLOCK_D, BLOCK_N, CHUNK). The state h stays in
float32 registers; it leaves them once per chunk, as the chunk-start state that the backward
recomputes the chunk from (_chunk_forward, the code the forward runs). So a forward+backward
holds O(B·D·L + B·D·N·L/CHUNK) memory, never the (B, D, L, N) states. Gradients are bitwise
reproducible: sums across programs are partial sums added in a fixed order, never atomics.

Optional inputs and options are compile-time flags, derived from the arguments in one place
(``_FLAGS``, applied with ``@triton.heuristics``), so each combination compiles to a kernel
without the unused loads and arithmetic.

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

import torch
import triton
import triton.language as tl

from ._jit import at_time, first_order_combine, flip_time, restarting_combine, softplus, tl_dtype

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
def _BC_setup(
    M_ptr, pid_b, segment_start, d, n, dn_mask, stride_0, stride_1, PER_GROUP,
    VARYING: tl.constexpr, COMPUTE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """B or C for the whole program: time-varying, a base pointer into this program's group
    (and a zero tile, unused); fixed, the pointer itself and the loaded (BLOCK_D, BLOCK_N) tile."""
    if VARYING:
        base = M_ptr + pid_b * stride_0 + (segment_start // PER_GROUP) * stride_1
        fixed = tl.zeros([BLOCK_D, BLOCK_N], dtype=COMPUTE)
    else:
        base = M_ptr
        fixed = tl.load(M_ptr + d[:, None] * stride_0 + n[None, :] * stride_1, mask=dn_mask, other=0.0).to(COMPUTE)
    return base, fixed


@triton.jit
def _prologue(
    A_ptr, D_ptr, delta_bias_ptr, B_ptr, C_ptr,
    N, SEGMENT, stride_B0, stride_B1, stride_C0, stride_C1, B_PER_GROUP, C_PER_GROUP,
    COMPUTE: tl.constexpr, B_VARYING: tl.constexpr, C_VARYING: tl.constexpr, HAS_D: tl.constexpr,
    HAS_DELTA_BIAS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
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
    B_base, B_fixed = _BC_setup(
        B_ptr, pid_b, segment_start, d, n, dn_mask, stride_B0, stride_B1, B_PER_GROUP,
        B_VARYING, COMPUTE, BLOCK_D, BLOCK_N,
    )  # fmt: skip
    C_base, C_fixed = _BC_setup(
        C_ptr, pid_b, segment_start, d, n, dn_mask, stride_C0, stride_C1, C_PER_GROUP,
        C_VARYING, COMPUTE, BLOCK_D, BLOCK_N,
    )  # fmt: skip
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
        # the steps from a restart on take nothing from before it, selected (restarting_combine)
        flags = tl.zeros_like(scan_gate) + tl.where(restart, 1.0, 0.0)
        gate_prod, drive_sum, restarted = tl.associative_scan((scan_gate, scan_drive, flags), 2, restarting_combine)
        states = tl.where(restarted > 0, drive_sum, drive_sum + gate_prod * h_start[:, :, None])
    else:
        scan_gate = gate
        gate_prod, drive_sum = tl.associative_scan((scan_gate, drive), 2, first_order_combine)
        states = drive_sum + gate_prod * h_start[:, :, None]
    return states, gate, drive, scan_gate


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


@triton.jit
def _chunk_forward(
    u_ptr, delta_ptr, seq_ptr, initial_state_ptr,
    t, t_mask, row, d, d_mask, n, n_mask, dn_mask, A, delta_bias, B_base, B_fixed, C_base, C_fixed, h_start,
    dim, L, N, stride_B2, stride_B3, stride_C2, stride_C3,
    COMPUTE: tl.constexpr, SOFTPLUS: tl.constexpr, B_VARYING: tl.constexpr, C_VARYING: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, PACKED: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """The chunk at steps t (CHUNK,; mask t_mask) as the forward runs it, from the state before
    it h_start (BLOCK_D, BLOCK_N): the (BLOCK_D, CHUNK) mask and offsets into (B, D, L);
    u, Δ and Δ before the softplus (BLOCK_D, CHUNK); B and C at t (_BC_at); packed, each step's
    sequence and whether it starts or ends one (else t, t_mask, t_mask: unused); and the states
    with the gates and inputs of _chunk_states. The backward recomputes its chunks with it."""
    mask = d_mask[:, None] & t_mask[None, :]
    offsets = row[:, None] + t[None, :]  # (BLOCK_D, CHUNK)
    u = tl.load(u_ptr + offsets, mask=mask, other=0.0).to(COMPUTE)
    delta, raw = _delta_at(delta_ptr, offsets, mask, delta_bias, COMPUTE, SOFTPLUS)
    Bt = _BC_at(B_base, B_fixed, n, n_mask, t, t_mask, stride_B2, stride_B3, B_VARYING, COMPUTE)
    Ct = _BC_at(C_base, C_fixed, n, n_mask, t, t_mask, stride_C2, stride_C3, C_VARYING, COMPUTE)
    h0 = tl.zeros([BLOCK_D, BLOCK_N, CHUNK], dtype=COMPUTE)
    if PACKED:
        seq, starts, ends = _sequence_edges(seq_ptr, t, t_mask, L)
        if HAS_INITIAL_STATE:
            h0_ptrs, h0_mask = _per_sequence(initial_state_ptr, seq, d, n, dn_mask, starts, dim, N)
            h0 = tl.load(h0_ptrs, mask=h0_mask, other=0.0).to(COMPUTE)
    else:
        seq = t
        starts = t_mask
        ends = t_mask
    hs, gate, drive, scan_gate = _chunk_states(delta, u, A, Bt, mask, h_start, starts, h0, PACKED)
    return mask, offsets, u, delta, raw, Bt, Ct, seq, starts, ends, hs, gate, drive, scan_gate


@triton.heuristics(_FWD_FLAGS)
@triton.jit
def _selective_scan_fwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, delta_bias_ptr, initial_state_ptr,  # inputs
    seq_ptr,  # packed: (L,) int32, the sequence of each step; else None
    out_ptr, last_state_ptr, chunk_states_ptr,  # outputs
    dim, L, N, n_chunks,
    stride_B0, stride_B1, stride_B2, stride_B3,  # B: (B, G, N, L), or (D, N) using the first two
    stride_C0, stride_C1, stride_C2, stride_C3,
    B_PER_GROUP, C_PER_GROUP, SEGMENT,
    SOFTPLUS: tl.constexpr, COMPUTE: tl.constexpr, B_VARYING: tl.constexpr, C_VARYING: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DELTA_BIAS: tl.constexpr, HAS_INITIAL_STATE: tl.constexpr,
    SAVE_CHUNK_STATES: tl.constexpr, PACKED: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """out (B, D, L), the last state (B, D, N) and the state before each chunk (B, D, n_chunks, N).

    u, delta, z, out: contiguous (B, D, L); A: contiguous (D, N); D, delta_bias: (D,);
    initial and last state: contiguous (B, D, N), or (S, D, N) when PACKED (B = 1; the last
    states of empty sequences are left as the launcher wrote them); B, C: any strides."""
    pid_b, d, d_mask, n, n_mask, dn_mask, A, D_skip, delta_bias, B_base, B_fixed, C_base, C_fixed = _prologue(
        A_ptr, D_ptr, delta_bias_ptr, B_ptr, C_ptr,
        N, SEGMENT, stride_B0, stride_B1, stride_C0, stride_C1, B_PER_GROUP, C_PER_GROUP,
        COMPUTE, B_VARYING, C_VARYING, HAS_D, HAS_DELTA_BIAS, BLOCK_D, BLOCK_N,
    )  # fmt: skip
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
        mask, offsets, u, _, _, _, Ct, seq, _, ends, hs, _, _, _ = _chunk_forward(
            u_ptr, delta_ptr, seq_ptr, initial_state_ptr,
            t, t_mask, row, d, d_mask, n, n_mask, dn_mask, A, delta_bias, B_base, B_fixed, C_base, C_fixed, h,
            dim, L, N, stride_B2, stride_B3, stride_C2, stride_C3,
            COMPUTE, SOFTPLUS, B_VARYING, C_VARYING, HAS_INITIAL_STATE, PACKED, BLOCK_D, BLOCK_N, CHUNK,
        )  # fmt: skip
        y = tl.sum(hs * Ct, axis=1)  # (BLOCK_D, CHUNK)
        h = at_time(hs, t_local, CHUNK - 1)
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
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, delta_bias_ptr, chunk_states_ptr,  # forward
    initial_state_ptr, seq_ptr,  # packed only (else None): (S, D, N) and (L,) int32
    dout_ptr, dlast_ptr,  # upstream gradients
    du_ptr, ddelta_ptr, dz_ptr, dinitial_state_ptr,  # gradients written in full
    dA_part_ptr, dD_part_ptr, ddelta_bias_part_ptr,  # per batch row: (B, D, N), (B, D), (B, D)
    dB_part_ptr, dC_part_ptr,  # time-varying: (B, D/SEGMENT, n_blocks, N, L); fixed: (B, D, N)
    dim, L, N, n_chunks, n_blocks,
    stride_B0, stride_B1, stride_B2, stride_B3,
    stride_C0, stride_C1, stride_C2, stride_C3,
    B_PER_GROUP, C_PER_GROUP, SEGMENT,
    SOFTPLUS: tl.constexpr, COMPUTE: tl.constexpr, B_VARYING: tl.constexpr, C_VARYING: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DELTA_BIAS: tl.constexpr, HAS_DLAST: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, PACKED: tl.constexpr, LOG2_CHUNK: tl.constexpr, INT: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Chunks from last to first: recompute the chunk's states from its saved start state, then
    run the adjoint recurrence λ_t = g_t + a_{t+1}·λ_{t+1} (g_t = dLoss/dy_t·C_t) backwards
    through it, carrying dLoss/dh into the chunk before. Reductions over channels (dB, dC when
    time-varying) and over batch rows and time (dA, dD, d delta_bias, fixed dB, dC) are written
    as partial sums, one per program, and summed in a fixed order by the launcher.
    PACKED: dlast and dinitial_state are (S, D, N), read at each sequence's last step and
    written at its first (those of empty sequences are left as the launcher wrote them)."""
    pid_b, d, d_mask, n, n_mask, dn_mask, A, D_skip, delta_bias, B_base, B_fixed, C_base, C_fixed = _prologue(
        A_ptr, D_ptr, delta_bias_ptr, B_ptr, C_ptr,
        N, SEGMENT, stride_B0, stride_B1, stride_C0, stride_C1, B_PER_GROUP, C_PER_GROUP,
        COMPUTE, B_VARYING, C_VARYING, HAS_D, HAS_DELTA_BIAS, BLOCK_D, BLOCK_N,
    )  # fmt: skip
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
        mask, offsets, u, delta, raw, Bt, Ct, seq, starts, _, hs, gate, drive, scan_gate = _chunk_forward(
            u_ptr, delta_ptr, seq_ptr, initial_state_ptr,
            t, t_mask, row, d, d_mask, n, n_mask, dn_mask, A, delta_bias, B_base, B_fixed, C_base, C_fixed, h_start,
            dim, L, N, stride_B2, stride_B3, stride_C2, stride_C3,
            COMPUTE, SOFTPLUS, B_VARYING, C_VARYING, HAS_INITIAL_STATE, PACKED, BLOCK_D, BLOCK_N, CHUNK,
        )  # fmt: skip

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
        lam = flip_time(lam_sum + lam_prod * carry[:, :, None], BLOCK_D, BLOCK_N, LOG2_CHUNK, INT)
        carry = at_time(scan_gate * lam, t_local, 0)  # dLoss/dh before the chunk
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
