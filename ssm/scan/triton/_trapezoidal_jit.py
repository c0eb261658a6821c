"""The @triton.jit helpers of the trapezoidal scan's two kernels (_trapezoidal_kernels.py): what
both set up, and the forward chunk, which the backward recomputes exactly as the forward ran it.

    setup          this program's sequence, head, group, channels and rotary pairing
    prologue       before the chunk loop: masks, the carried state, D, mimo_o
    positions      a chunk's positions, mask and steps
    chunk_forward  a chunk as the forward runs it: inputs (chunk_inputs, rotated), states, readout
    gate           the output gate's z, mimo_z and argument
    per_rank       offsets into a per-rank (B·L, R, H, P) output

Triton inlines these into the kernels, compile-time flags included: the kernels compile as if
written out in full. Shape symbols as in _trapezoidal_kernels.py; T is CHUNK.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._jit import at_time, first_order_combine


@triton.jit
def setup(
    bounds_ptr, chunk_first_ptr,
    H, P, N, M, R, G,
    HALVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """What both kernels set up first: this program's sequence, head, group and channels, and
    the rotary pairing of the state entries: entry n turns with pair m(n) and partner entry
    n' (sign −1 for the first of a pair, +1 for the second), or not at all."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    start = tl.load(bounds_ptr + row)  # int64: offsets past 2**31 elements
    end = tl.load(bounds_ptr + row + 1)
    first_chunk = tl.load(chunk_first_ptr + row)
    g = h // (H // G)
    r = tl.arange(0, BLOCK_R)
    n = tl.arange(0, BLOCK_N)
    if HALVED:  # pairs (m, m + N/2)
        second = n >= N // 2
        m = tl.where(second, n - N // 2, n)
        partner = tl.where(second, n - N // 2, n + N // 2)
    else:  # pairs (2m, 2m + 1)
        second = (n % 2) == 1
        m = n // 2
        partner = tl.where(second, n - 1, n + 1)
    sign = tl.where(second, 1.0, -1.0)
    n_mask = n < N
    rot = n_mask & (m < M)
    return row, h, p, p < P, start, end, first_chunk, g, r, r < R, n, n_mask, m, partner, sign, rot


@triton.jit
def prologue(
    state_ptr, D_ptr, mimo_o_ptr,
    row, h, p, p_mask, r, r_mask, n, n_mask,
    H, P, N, R,
    HAS_STATE: tl.constexpr, HAS_D: tl.constexpr, HAS_MIMO_O: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """What both kernels set up before their chunk loop: time within a chunk (CHUNK,), the masks
    (BLOCK_P, BLOCK_N) and (BLOCK_R, BLOCK_P), the offsets of this program's part of one (H, P, N)
    state, the state the loop carries ((rows, H, P, N) at ``state_ptr``, or 0 without
    HAS_STATE), D of this head, and mimo_o (BLOCK_R, BLOCK_P) (0.0 where absent: unused then)."""
    t_local = tl.arange(0, CHUNK)
    pn_mask = p_mask[:, None] & n_mask[None, :]
    rp_mask = r_mask[:, None] & p_mask[None, :]
    state_offsets = (h * P + p[:, None]) * N + n[None, :]  # into one (H, P, N) state
    if HAS_STATE:
        state = tl.load(state_ptr + row * H * P * N + state_offsets, mask=pn_mask, other=0.0).to(COMPUTE)
    else:
        state = tl.zeros([BLOCK_P, BLOCK_N], dtype=COMPUTE)
    if HAS_D:
        D_h = tl.load(D_ptr + h).to(COMPUTE)
    else:
        D_h = 0.0
    if HAS_MIMO_O:
        mimo_o = tl.load(mimo_o_ptr + (h * R + r[:, None]) * P + p[None, :], mask=rp_mask, other=0.0).to(COMPUTE)
    else:
        mimo_o = 0.0
    return t_local, pn_mask, rp_mask, state_offsets, state, D_h, mimo_o


@triton.jit
def rotated(
    M_ptr, bias_ptr,
    pos, t_mask, h, g, r, r_mask, n, n_mask, partner, sign, rot, cos, sin,
    R, G, N,
    HAS_BIAS: tl.constexpr, COMPUTE: tl.constexpr,
):  # fmt: skip
    """Rot(φ)(B + B_bias) (or C's) at positions ``pos``: a (BLOCK_R, BLOCK_N, CHUNK) tile; cos,
    sin (BLOCK_N, CHUNK) are 1, 0 for entries that do not turn."""
    base = ((pos[None, None, :] * R + r[:, None, None]) * G + g) * N  # (BLOCK_R, 1, CHUNK)
    mask = r_mask[:, None, None] & n_mask[None, :, None] & t_mask[None, None, :]
    w = tl.load(M_ptr + base + n[None, :, None], mask=mask, other=0.0).to(COMPUTE)
    w_partner = tl.load(M_ptr + base + partner[None, :, None], mask=mask & rot[None, :, None], other=0.0).to(COMPUTE)
    if HAS_BIAS:
        bias_base = (h * R + r[:, None]) * N  # bias (H, R, N)
        rn_mask = r_mask[:, None] & n_mask[None, :]
        bias = tl.load(bias_ptr + bias_base + n[None, :], mask=rn_mask, other=0.0).to(COMPUTE)
        bias_partner = tl.load(bias_ptr + bias_base + partner[None, :], mask=rn_mask & rot[None, :], other=0.0).to(
            COMPUTE
        )
        w = tl.where(mask, w + bias[:, :, None], 0.0)
        w_partner = tl.where(mask & rot[None, :, None], w_partner + bias_partner[:, :, None], 0.0)
    return w * cos[None, :, :] + sign[None, :, None] * w_partner * sin[None, :, :]


@triton.jit
def chunk_inputs(
    x_ptr, B_ptr, C_ptr, B_bias_ptr, C_bias_ptr, mimo_x_ptr, a_ptr, sigma_ptr, c_ptr, cos_ptr, sin_ptr,
    pos, t_mask, h, g, p, p_mask, r, r_mask, n, n_mask, m, partner, sign, rot,
    H, P, M, R, G, N,
    HAS_B_BIAS: tl.constexpr, HAS_C_BIAS: tl.constexpr, HAS_MIMO_X: tl.constexpr, COMPUTE: tl.constexpr,
):  # fmt: skip
    """One chunk's inputs, as both kernels need them: a, σ, c (CHUNK,); k̃, q̃ (BLOCK_R, BLOCK_N,
    CHUNK); x (BLOCK_P, CHUNK); v = x ⊙ mimo_x (BLOCK_R, BLOCK_P, CHUNK); mimo_x (BLOCK_R, BLOCK_P)."""
    step = pos * H + h  # into (B·L, H)
    a = tl.load(a_ptr + step, mask=t_mask, other=0.0).to(COMPUTE)
    sigma = tl.load(sigma_ptr + step, mask=t_mask, other=0.0).to(COMPUTE)
    c = tl.load(c_ptr + step, mask=t_mask, other=0.0).to(COMPUTE)
    angle_offsets = step[None, :] * M + m[:, None]  # into (B·L, H, M): (BLOCK_N, CHUNK)
    angle_mask = rot[:, None] & t_mask[None, :]
    cos = tl.load(cos_ptr + angle_offsets, mask=angle_mask, other=1.0).to(COMPUTE)
    sin = tl.load(sin_ptr + angle_offsets, mask=angle_mask, other=0.0).to(COMPUTE)
    k = rotated(
        B_ptr, B_bias_ptr, pos, t_mask, h, g, r, r_mask, n, n_mask, partner, sign, rot, cos, sin, R, G, N,
        HAS_B_BIAS, COMPUTE,
    )  # fmt: skip
    q = rotated(
        C_ptr, C_bias_ptr, pos, t_mask, h, g, r, r_mask, n, n_mask, partner, sign, rot, cos, sin, R, G, N,
        HAS_C_BIAS, COMPUTE,
    )  # fmt: skip
    pt_mask = p_mask[:, None] & t_mask[None, :]
    x = tl.load(x_ptr + step[None, :] * P + p[:, None], mask=pt_mask, other=0.0).to(COMPUTE)
    rp_mask = r_mask[:, None] & p_mask[None, :]
    if HAS_MIMO_X:
        mimo_x = tl.load(mimo_x_ptr + (h * R + r[:, None]) * P + p[None, :], mask=rp_mask, other=0.0).to(COMPUTE)
    else:
        mimo_x = tl.where(rp_mask, 1.0, 0.0).to(COMPUTE)
    v = x[None, :, :] * mimo_x[:, :, None]
    return a, sigma, c, k, q, x, v, mimo_x


@triton.jit
def chunk_states(a, sigma, k, v, H_start):
    """The chunk's states (BLOCK_P, BLOCK_N, CHUNK) from the one before it, with its inputs
    U = Σ_r v ⊗ k̃ and drives σ·U. Steps past the end have a = σ = 0: identity steps."""
    U = tl.sum(v[:, :, None, :] * k[:, None, :, :], axis=0)  # (BLOCK_P, BLOCK_N, CHUNK)
    drive = sigma[None, None, :] * U
    gate = tl.exp(a)[None, None, :] + tl.zeros_like(drive)
    gate_prod, drive_sum = tl.associative_scan((gate, drive), 2, first_order_combine)
    return drive_sum + gate_prod * H_start[:, :, None], U, drive


@triton.jit
def readout(Hs, k, q, v, c, D_h, HAS_D: tl.constexpr):
    """y (BLOCK_R, BLOCK_P, CHUNK) before the gate, and q̃·k̃ (BLOCK_R, BLOCK_R, CHUNK)."""
    y = tl.sum(Hs[None, :, :, :] * q[:, None, :, :], axis=2)
    qk = tl.sum(q[:, None, :, :] * k[None, :, :, :], axis=2)
    y -= c[None, None, :] * tl.sum(qk[:, :, None, :] * v[None, :, :, :], axis=1)
    if HAS_D:
        y += D_h * v
    return y, qk


@triton.jit
def chunk_forward(
    x_ptr, B_ptr, C_ptr, B_bias_ptr, C_bias_ptr, mimo_x_ptr, a_ptr, sigma_ptr, c_ptr, cos_ptr, sin_ptr,
    pos, t_mask, t_local, H_start, D_h,
    h, g, p, p_mask, r, r_mask, n, n_mask, m, partner, sign, rot,
    H, P, M, R, G, N,
    HAS_B_BIAS: tl.constexpr, HAS_C_BIAS: tl.constexpr, HAS_MIMO_X: tl.constexpr, HAS_D: tl.constexpr,
    COMPUTE: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """The chunk at positions ``pos`` (CHUNK,) as the forward runs it, from the state before it
    H_start (BLOCK_P, BLOCK_N): its inputs (chunk_inputs, less a); its states Hs, inputs U and
    drives (chunk_states), and its last state (the next chunk's H_start); y before the gate and
    q̃·k̃ (readout). The backward recomputes its chunks with it, so both see the same values."""
    a, sigma, c, k, q, x, v, mimo_x = chunk_inputs(
        x_ptr, B_ptr, C_ptr, B_bias_ptr, C_bias_ptr, mimo_x_ptr, a_ptr, sigma_ptr, c_ptr, cos_ptr, sin_ptr,
        pos, t_mask, h, g, p, p_mask, r, r_mask, n, n_mask, m, partner, sign, rot, H, P, M, R, G, N,
        HAS_B_BIAS, HAS_C_BIAS, HAS_MIMO_X, COMPUTE,
    )  # fmt: skip
    Hs, U, drive = chunk_states(a, sigma, k, v, H_start)
    H_end = at_time(Hs, t_local, CHUNK - 1)
    y, qk = readout(Hs, k, q, v, c, D_h, HAS_D)
    return sigma, c, k, q, x, v, mimo_x, Hs, U, drive, H_end, y, qk


@triton.jit
def positions(ci, start, end, t_local, h, H, CHUNK: tl.constexpr):
    """Chunk ``ci`` of this program's sequence: its positions (CHUNK,) in B·L, their mask, and
    its steps into (B·L, H). (Each kernel forms the (BLOCK_P, CHUNK) mask itself, where it first
    needs it: where it is formed shapes the compiled code's order.)"""
    pos = start + ci * CHUNK + t_local
    return pos, pos < end, pos * H + h


@triton.jit
def gate(z_ptr, mimo_z_ptr, step, h, p, r, rp_mask, pt_mask, P, R, HAS_MIMO_Z: tl.constexpr, COMPUTE: tl.constexpr):
    """z (BLOCK_P, CHUNK), mimo_z (BLOCK_R, BLOCK_P) and the gate's argument z ⊙ mimo_z
    (BLOCK_R, BLOCK_P, CHUNK)."""
    z = tl.load(z_ptr + step[None, :] * P + p[:, None], mask=pt_mask, other=0.0).to(COMPUTE)
    if HAS_MIMO_Z:
        mimo_z = tl.load(mimo_z_ptr + (h * R + r[:, None]) * P + p[None, :], mask=rp_mask, other=0.0).to(COMPUTE)
    else:
        mimo_z = tl.where(rp_mask, 1.0, 0.0).to(COMPUTE)
    return z, mimo_z, z[None, :, :] * mimo_z[:, :, None]


@triton.jit
def per_rank(pos, h, p, r, r_mask, pt_mask, R, H, P):
    """Offsets (BLOCK_R, BLOCK_P, CHUNK) into a (B·L, R, H, P) output (no mimo_o: one per rank),
    and their mask."""
    offsets = ((pos[None, None, :] * R + r[:, None, None]) * H + h) * P + p[None, :, None]
    return offsets, r_mask[:, None, None] & pt_mask[None, :, :]
