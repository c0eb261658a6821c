"""The two Triton kernels of the trapezoidal scan (Mamba-3), forward and backward; their
launchers, custom ops and entry point are in trapezoidal_scan.py, the helpers they share in
_trapezoidal_jit.py.

The kernels run the *core* of the shifted form (_common_trapezoidal.py): given a = Δ·A, σ, c,
cos φ, sin φ and H_{-1} (which the shared prologue computes in PyTorch, as for the chunked
backend),

    H_t = exp(a_t)·H_{t-1} + σ_t·Σ_r v_{t,r} ⊗ k̃_{t,r}
    y_{t,r} = H_t·q̃_{t,r} − c_t·Σ_{r'} (q̃_{t,r}·k̃_{t,r'}) v_{t,r'} + D·v_{t,r},  gated, contracted

with k̃ = Rot(φ)(B + B_bias) and q̃ = Rot(φ)(C + C_bias) rotated, and v = x ⊙ mimo_x formed, in
registers. A program covers one sequence (a batch row, or a packed sequence of cu_seqlens), one
head, BLOCK_P of its P channels, the whole state (BLOCK_N ≥ N) and all R ranks, CHUNK steps at a
time: tiles are (BLOCK_P, BLOCK_N, CHUNK), with (BLOCK_R, ·) in front while ranks are summed. The
state H stays in float32 registers and leaves them once per chunk, as the chunk-start state the
backward recomputes the chunk from: O(B·L·(H·P + R·G·N) + B·H·P·N·L/CHUNK) memory, never the
(B, L, H, P, N) states.

The backward runs the chunks from last to first: the adjoint G_t = dLoss/dH_t obeys
G_t = Σ_r dy_{t,r} ⊗ q̃_{t,r} + exp(a_{t+1})·G_{t+1}, a forward scan over the chunk in reversed
time. Sums over programs (over P-blocks: the gradients of k̃, q̃, a, σ, c; over sequences: of
D and the MIMO weights) are partial sums, one per program, added in a fixed order by the
launcher: the gradients are reproducible, no atomics.

Optional inputs are compile-time flags (``_FLAGS``, applied with ``@triton.heuristics``).

Shape symbols: B batch, L length, H heads, P head dim, G groups, N state size, R MIMO rank,
M rotary pairs, T chunk length (CHUNK). Positions are flattened: the (B, L) of every per-step
tensor is one axis of B·L positions, and a program's sequence is the range
bounds[row] .. bounds[row + 1] of it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import at_time, first_order_combine, flip_time, tl_dtype
from ._trapezoidal_jit import chunk_forward, gate, per_rank, positions, prologue, setup

_FLAGS = {
    "HAS_B_BIAS": lambda a: a["B_bias_ptr"] is not None,
    "HAS_C_BIAS": lambda a: a["C_bias_ptr"] is not None,
    "HAS_MIMO_X": lambda a: a["mimo_x_ptr"] is not None,
    "HAS_Z": lambda a: a["z_ptr"] is not None,
    "HAS_MIMO_Z": lambda a: a["mimo_z_ptr"] is not None,
    "HAS_MIMO_O": lambda a: a["mimo_o_ptr"] is not None,
    "HAS_D": lambda a: a["D_ptr"] is not None,
    "COMPUTE": lambda a: tl_dtype(a["a_ptr"].dtype),  # float32, or float64 for float64 inputs
}
_FWD_FLAGS = {
    **_FLAGS,
    "HAS_INITIAL_STATE": lambda a: a["H_init_ptr"] is not None,
    "SAVE_CHUNK_STATES": lambda a: a["chunk_states_ptr"].shape[0] > 0,  # off when no backward follows
}
_BWD_FLAGS = {
    **_FLAGS,
    "HAS_DLAST": lambda a: a["dH_last_ptr"] is not None,
    "INT": lambda a: tl.int64 if a["a_ptr"].dtype == torch.float64 else tl.int32,  # COMPUTE's width
    "LOG2_CHUNK": lambda a: a["CHUNK"].bit_length() - 1,
}


@triton.heuristics(_FWD_FLAGS)
@triton.jit
def _trapezoidal_scan_fwd_kernel(
    x_ptr, B_ptr, C_ptr, B_bias_ptr, C_bias_ptr, mimo_x_ptr, z_ptr, mimo_z_ptr, mimo_o_ptr, D_ptr,  # inputs
    a_ptr, sigma_ptr, c_ptr, cos_ptr, sin_ptr, H_init_ptr, bounds_ptr, chunk_first_ptr,  # core inputs, rows
    out_ptr, H_last_ptr, chunk_states_ptr,  # outputs
    H, P, N, M, R, G,
    HALVED: tl.constexpr,
    HAS_B_BIAS: tl.constexpr, HAS_C_BIAS: tl.constexpr, HAS_MIMO_X: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_MIMO_Z: tl.constexpr, HAS_MIMO_O: tl.constexpr, HAS_D: tl.constexpr, COMPUTE: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, SAVE_CHUNK_STATES: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """out ((B·L, H, P), or (B·L, R, H, P) per rank), the last state (rows, H, P, N) and the
    state before each chunk (chunks, H, P, N). Every tensor contiguous."""
    row, h, p, p_mask, start, end, first_chunk, g, r, r_mask, n, n_mask, m, partner, sign, rot = setup(
        bounds_ptr, chunk_first_ptr, H, P, N, M, R, G, HALVED, BLOCK_R, BLOCK_P, BLOCK_N
    )
    t_local, pn_mask, rp_mask, state_offsets, H_state, D_h, mimo_o = prologue(
        H_init_ptr, D_ptr, mimo_o_ptr, row, h, p, p_mask, r, r_mask, n, n_mask, H, P, N, R,
        HAS_INITIAL_STATE, HAS_D, HAS_MIMO_O, COMPUTE, BLOCK_P, BLOCK_N, CHUNK,
    )  # fmt: skip

    n_chunks = (end - start + CHUNK - 1) // CHUNK
    for ci in range(0, n_chunks):
        if SAVE_CHUNK_STATES:
            tl.store(chunk_states_ptr + (first_chunk + ci) * H * P * N + state_offsets, H_state, mask=pn_mask)
        pos, t_mask, step = positions(ci, start, end, t_local, h, H, CHUNK)
        _, _, _, _, _, _, _, _, _, _, H_state, y, _ = chunk_forward(
            x_ptr, B_ptr, C_ptr, B_bias_ptr, C_bias_ptr, mimo_x_ptr, a_ptr, sigma_ptr, c_ptr, cos_ptr, sin_ptr,
            pos, t_mask, t_local, H_state, D_h, h, g, p, p_mask, r, r_mask, n, n_mask, m, partner, sign, rot,
            H, P, M, R, G, N, HAS_B_BIAS, HAS_C_BIAS, HAS_MIMO_X, HAS_D, COMPUTE, CHUNK,
        )  # fmt: skip
        pt_mask = p_mask[:, None] & t_mask[None, :]
        if HAS_Z:
            _, _, zg = gate(z_ptr, mimo_z_ptr, step, h, p, r, rp_mask, pt_mask, P, R, HAS_MIMO_Z, COMPUTE)
            y = y * zg * tl.sigmoid(zg)
        if HAS_MIMO_O:
            out = tl.sum(y * mimo_o[:, :, None], axis=0)  # (BLOCK_P, CHUNK)
            tl.store(out_ptr + step[None, :] * P + p[:, None], out, mask=pt_mask)
        else:
            offsets, out_mask = per_rank(pos, h, p, r, r_mask, pt_mask, R, H, P)
            tl.store(out_ptr + offsets, y, mask=out_mask)

    tl.store(H_last_ptr + row * H * P * N + state_offsets, H_state, mask=pn_mask)


@triton.heuristics(_BWD_FLAGS)
@triton.jit
def _trapezoidal_scan_bwd_kernel(
    x_ptr, B_ptr, C_ptr, B_bias_ptr, C_bias_ptr, mimo_x_ptr, z_ptr, mimo_z_ptr, mimo_o_ptr, D_ptr,  # forward
    a_ptr, sigma_ptr, c_ptr, cos_ptr, sin_ptr, bounds_ptr, chunk_first_ptr, chunk_states_ptr,  # core, rows, saved
    dout_ptr, dH_last_ptr,  # upstream gradients
    dx_ptr, dz_ptr, dH_init_ptr,  # gradients written in full
    dk_part_ptr, dq_part_ptr,  # d k̃, d q̃ per P-block: (P-blocks, B·L, R, H, N)
    da_part_ptr, dsigma_part_ptr, dc_part_ptr,  # (P-blocks, B·L, H)
    dD_part_ptr, dmimo_part_ptr,  # (rows, H, P-blocks); (3, rows, H, R, P): d mimo_x, mimo_z, mimo_o
    H, P, N, M, R, G, BL,
    HALVED: tl.constexpr,
    HAS_B_BIAS: tl.constexpr, HAS_C_BIAS: tl.constexpr, HAS_MIMO_X: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_MIMO_Z: tl.constexpr, HAS_MIMO_O: tl.constexpr, HAS_D: tl.constexpr, COMPUTE: tl.constexpr,
    HAS_DLAST: tl.constexpr, INT: tl.constexpr, LOG2_CHUNK: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Chunks from last to first: recompute the chunk from its saved start state, run the
    adjoint G backwards through it (carrying dLoss/dH into the chunk before), and write every
    gradient of the core: in full where this program owns it, else as this program's part."""
    row, h, p, p_mask, start, end, first_chunk, g, r, r_mask, n, n_mask, m, partner, sign, rot = setup(
        bounds_ptr, chunk_first_ptr, H, P, N, M, R, G, HALVED, BLOCK_R, BLOCK_P, BLOCK_N
    )
    pblk = tl.program_id(2)
    # carry: dLoss/dH of the step after the chunk, as seen from the chunk's last state
    t_local, pn_mask, rp_mask, state_offsets, carry, D_h, mimo_o = prologue(
        dH_last_ptr, D_ptr, mimo_o_ptr, row, h, p, p_mask, r, r_mask, n, n_mask, H, P, N, R,
        HAS_DLAST, HAS_D, HAS_MIMO_O, COMPUTE, BLOCK_P, BLOCK_N, CHUNK,
    )  # fmt: skip
    dD_acc = tl.zeros([BLOCK_R, BLOCK_P], dtype=COMPUTE)
    dmimo_x_acc = tl.zeros([BLOCK_R, BLOCK_P], dtype=COMPUTE)
    dmimo_z_acc = tl.zeros([BLOCK_R, BLOCK_P], dtype=COMPUTE)
    dmimo_o_acc = tl.zeros([BLOCK_R, BLOCK_P], dtype=COMPUTE)

    n_chunks = (end - start + CHUNK - 1) // CHUNK
    for c_rev in range(0, n_chunks):
        ci = n_chunks - 1 - c_rev
        H_start = tl.load(
            chunk_states_ptr + (first_chunk + ci) * H * P * N + state_offsets, mask=pn_mask, other=0.0
        ).to(COMPUTE)
        pos, t_mask, step = positions(ci, start, end, t_local, h, H, CHUNK)
        pt_mask = p_mask[:, None] & t_mask[None, :]
        sigma, c, k, q, x, v, mimo_x, Hs, U, drive, _, y, qk = chunk_forward(
            x_ptr, B_ptr, C_ptr, B_bias_ptr, C_bias_ptr, mimo_x_ptr, a_ptr, sigma_ptr, c_ptr, cos_ptr, sin_ptr,
            pos, t_mask, t_local, H_start, D_h, h, g, p, p_mask, r, r_mask, n, n_mask, m, partner, sign, rot,
            H, P, M, R, G, N, HAS_B_BIAS, HAS_C_BIAS, HAS_MIMO_X, HAS_D, COMPUTE, CHUNK,
        )  # fmt: skip

        # Through the output: out = Σ_r mimo_o ⊙ y·silu(z ⊙ mimo_z) (each part when present).
        if HAS_MIMO_O:
            dout = tl.load(dout_ptr + step[None, :] * P + p[:, None], mask=pt_mask, other=0.0).to(COMPUTE)
            dgated = dout[None, :, :] * mimo_o[:, :, None]  # (BLOCK_R, BLOCK_P, CHUNK)
        else:
            offsets, out_mask = per_rank(pos, h, p, r, r_mask, pt_mask, R, H, P)
            dgated = tl.load(dout_ptr + offsets, mask=out_mask, other=0.0).to(COMPUTE)
        if HAS_Z:
            z, mimo_z, zg = gate(z_ptr, mimo_z_ptr, step, h, p, r, rp_mask, pt_mask, P, R, HAS_MIMO_Z, COMPUTE)
            sig = tl.sigmoid(zg)
            dzg = dgated * y * sig * (1.0 + zg * (1.0 - sig))
            tl.store(dz_ptr + step[None, :] * P + p[:, None], tl.sum(dzg * mimo_z[:, :, None], axis=0), mask=pt_mask)
            dmimo_z_acc += tl.sum(dzg * z[None, :, :], axis=2)
            gated = y * zg * sig
            dy = dgated * zg * sig
        else:
            gated = y
            dy = dgated
        if HAS_MIMO_O:
            dmimo_o_acc += tl.sum(dout[None, :, :] * gated, axis=2)
        if HAS_D:
            dD_acc += tl.sum(dy * v, axis=2)

        # The adjoint, G_t = Σ_r dy_{t,r} ⊗ q̃_{t,r} + exp(a_{t+1})·G_{t+1}, as a forward scan in
        # reversed time (flip_time; not associative_scan(reverse=True), whose compiled form has
        # had correctness bugs). Past the sequence's end a is 0: the gate is 1 there, so `carry`
        # reaches the last step unchanged.
        a_next = tl.load(a_ptr + step + H, mask=(pos + 1) < end, other=0.0).to(COMPUTE)
        source = tl.sum(dy[:, :, None, :] * q[:, None, :, :], axis=0)  # (BLOCK_P, BLOCK_N, CHUNK)
        gate_next = tl.exp(a_next)[None, None, :] + tl.zeros_like(source)
        gate_prod, source_sum = tl.associative_scan(
            (
                flip_time(gate_next, BLOCK_P, BLOCK_N, LOG2_CHUNK, INT),
                flip_time(source, BLOCK_P, BLOCK_N, LOG2_CHUNK, INT),
            ),
            2,
            first_order_combine,
        )
        adj = flip_time(source_sum + gate_prod * carry[:, :, None], BLOCK_P, BLOCK_N, LOG2_CHUNK, INT)  # G
        carry = at_time(adj, t_local, 0)

        # Gradients of the chunk's inputs.
        dyv = tl.sum(dy[:, None, :, :] * v[None, :, :, :], axis=2)  # (R, R', CHUNK): dy_r · v_r'
        dq = tl.sum(Hs[None, :, :, :] * dy[:, :, None, :], axis=1)
        dq -= c[None, None, :] * tl.sum(dyv[:, :, None, :] * k[None, :, :, :], axis=1)
        dk = sigma[None, None, :] * tl.sum(adj[None, :, :, :] * v[:, :, None, :], axis=1)
        dk -= c[None, None, :] * tl.sum(dyv[:, :, None, :] * q[:, None, :, :], axis=0)
        dv = sigma[None, None, :] * tl.sum(adj[None, :, :, :] * k[:, None, :, :], axis=2)
        dv -= c[None, None, :] * tl.sum(qk[:, :, None, :] * dy[:, None, :, :], axis=0)
        if HAS_D:
            dv += D_h * dy
        dsigma = tl.sum(tl.sum(adj * U, axis=0), axis=0)  # (CHUNK,)
        dc = -tl.sum(tl.sum(qk * dyv, axis=0), axis=0)
        da = tl.sum(tl.sum(adj * (Hs - drive), axis=0), axis=0)  # α_t·Σ G_t ⊙ H_{t-1}
        tl.store(dx_ptr + step[None, :] * P + p[:, None], tl.sum(dv * mimo_x[:, :, None], axis=0), mask=pt_mask)
        if HAS_MIMO_X:
            dmimo_x_acc += tl.sum(dv * x[None, :, :], axis=2)
        rnt_mask = r_mask[:, None, None] & n_mask[None, :, None] & t_mask[None, None, :]
        part = (((pblk * BL + pos[None, None, :]) * R + r[:, None, None]) * H + h) * N + n[None, :, None]
        tl.store(dk_part_ptr + part, dk, mask=rnt_mask)
        tl.store(dq_part_ptr + part, dq, mask=rnt_mask)
        scalar_part = (pblk * BL + pos) * H + h
        tl.store(da_part_ptr + scalar_part, da, mask=t_mask)
        tl.store(dsigma_part_ptr + scalar_part, dsigma, mask=t_mask)
        tl.store(dc_part_ptr + scalar_part, dc, mask=t_mask)

    # dLoss/dH_{-1} = α_0·G_0 (just the carry for a sequence without steps, whose a loads as 0)
    a_first = tl.load(a_ptr + start * H + h, mask=start < end, other=0.0).to(COMPUTE)
    tl.store(dH_init_ptr + row * H * P * N + state_offsets, tl.exp(a_first) * carry, mask=pn_mask)
    if HAS_D:
        tl.store(dD_part_ptr + (row * H + h) * tl.num_programs(2) + pblk, tl.sum(tl.sum(dD_acc, axis=1), axis=0))
    rp_offsets = ((row * H + h) * R + r[:, None]) * P + p[None, :]  # into (rows, H, R, P)
    mimo_stride = tl.num_programs(0) * H * R * P
    if HAS_MIMO_X:
        tl.store(dmimo_part_ptr + rp_offsets, dmimo_x_acc, mask=rp_mask)
    if HAS_MIMO_Z:
        tl.store(dmimo_part_ptr + mimo_stride + rp_offsets, dmimo_z_acc, mask=rp_mask)
    if HAS_MIMO_O:
        tl.store(dmimo_part_ptr + 2 * mimo_stride + rp_offsets, dmimo_o_acc, mask=rp_mask)
