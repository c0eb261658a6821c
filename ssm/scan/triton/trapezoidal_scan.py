"""Backend "triton" of ``trapezoidal_scan`` (Mamba-3), top to bottom: launch heuristics,
kernels, launchers, the custom ops with their autograd formula, and the backend entry point.

    _trapezoidal_scan_fwd_kernel  →  _trapezoidal_scan_fwd  →  ssm::trapezoidal_scan_fwd  →  trapezoidal_scan_triton
    _trapezoidal_scan_bwd_kernel  →  _trapezoidal_scan_bwd  →  ssm::trapezoidal_scan_bwd     (its autograd formula)

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
launcher: the gradients are reproducible, no atomics. The rotation's own backward (to B, C,
the biases and cos, sin) is elementwise, in PyTorch, in the launcher.

Optional inputs are compile-time flags (``_FLAGS``, applied with ``@triton.heuristics``).

Shape symbols: B batch, L length, H heads, P head dim, G groups, N state size, R MIMO rank,
M rotary pairs, S packed sequences, T chunk length (CHUNK). Positions are flattened: the (B, L)
of every per-step tensor is one axis of B·L positions, and a program's sequence is the range
bounds[row] .. bounds[row + 1] of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import _common_trapezoidal as common
from .._checks import compute_dtype as state_dtype
from ._jit import at_time, check_launchable, first_order_combine, flip_time, next_power_of_2, tl_dtype

# ----------------------------------------------------------------------------- launch heuristics
# Pure functions of shapes, shared by the launchers and the fake implementations. Not tuned on
# a GPU. The largest live tiles are (BLOCK_R, BLOCK_P, BLOCK_N, CHUNK) products, kept near TILE
# elements by the channels a program takes.

CHUNK = 16  # time steps a program scans at once (a power of two)
TILE = 4096


@dataclass(frozen=True)
class Config:
    block_r: int
    block_p: int
    block_n: int
    chunk: int
    num_warps: int

    def p_blocks(self, P: int) -> int:
        return -(-P // self.block_p)

    def max_chunks(self, rows: int, length, packed: bool):
        """Saved chunk states: rows·⌈L/T⌉ for a batch; for S packed sequences at most
        ⌈L/T⌉ + S (each sequence starts a chunk). A function of shapes only (the fake op's)."""
        per_row = (length + self.chunk - 1) // self.chunk
        return per_row + rows if packed else rows * per_row


def config(P: int, N: int, R: int) -> Config:
    block_r, block_n = next_power_of_2(R), next_power_of_2(N)
    block_p = max(1, min(next_power_of_2(P), TILE // (block_r * block_n * CHUNK)))
    tile = block_r * block_p * block_n * CHUNK
    # At P 64, N 128, compiled for sm_90 (tests/scan/compile_kernels.py prints it): 8 warps, no
    # spills, at or near the 255-register cap; rank 4 gets a (4, 1, 128, 16) tile.
    return Config(block_r, block_p, block_n, CHUNK, 4 if tile <= TILE // 4 else 8)


# ----------------------------------------------------------------------------- kernels

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


@triton.jit
def _setup(
    bounds_ptr,
    chunk_first_ptr,
    H,
    P,
    N,
    M,
    R,
    G,
    HALVED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
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
def _rotated(
    M_ptr,
    bias_ptr,
    pos,
    t_mask,
    h,
    g,
    r,
    r_mask,
    n,
    n_mask,
    partner,
    sign,
    rot,
    cos,
    sin,
    R,
    G,
    N,
    HAS_BIAS: tl.constexpr,
    COMPUTE: tl.constexpr,
):
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
def _chunk(
    x_ptr,
    B_ptr,
    C_ptr,
    B_bias_ptr,
    C_bias_ptr,
    mimo_x_ptr,
    a_ptr,
    sigma_ptr,
    c_ptr,
    cos_ptr,
    sin_ptr,
    pos,
    t_mask,
    h,
    g,
    p,
    p_mask,
    r,
    r_mask,
    n,
    n_mask,
    m,
    partner,
    sign,
    rot,
    H,
    P,
    M,
    R,
    G,
    N,
    HAS_B_BIAS: tl.constexpr,
    HAS_C_BIAS: tl.constexpr,
    HAS_MIMO_X: tl.constexpr,
    COMPUTE: tl.constexpr,
):
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
    k = _rotated(
        B_ptr,
        B_bias_ptr,
        pos,
        t_mask,
        h,
        g,
        r,
        r_mask,
        n,
        n_mask,
        partner,
        sign,
        rot,
        cos,
        sin,
        R,
        G,
        N,
        HAS_B_BIAS,
        COMPUTE,
    )
    q = _rotated(
        C_ptr,
        C_bias_ptr,
        pos,
        t_mask,
        h,
        g,
        r,
        r_mask,
        n,
        n_mask,
        partner,
        sign,
        rot,
        cos,
        sin,
        R,
        G,
        N,
        HAS_C_BIAS,
        COMPUTE,
    )
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
def _states(a, sigma, k, v, H_start):
    """The chunk's states (BLOCK_P, BLOCK_N, CHUNK) from the one before it, with its inputs
    U = Σ_r v ⊗ k̃ and drives σ·U. Steps past the end have a = σ = 0: identity steps."""
    U = tl.sum(v[:, :, None, :] * k[:, None, :, :], axis=0)  # (BLOCK_P, BLOCK_N, CHUNK)
    drive = sigma[None, None, :] * U
    gate = tl.exp(a)[None, None, :] + tl.zeros_like(drive)
    gate_prod, drive_sum = tl.associative_scan((gate, drive), 2, first_order_combine)
    return drive_sum + gate_prod * H_start[:, :, None], U, drive


@triton.jit
def _readout(Hs, k, q, v, c, D_h, HAS_D: tl.constexpr):
    """y (BLOCK_R, BLOCK_P, CHUNK) before the gate, and q̃·k̃ (BLOCK_R, BLOCK_R, CHUNK)."""
    y = tl.sum(Hs[None, :, :, :] * q[:, None, :, :], axis=2)
    qk = tl.sum(q[:, None, :, :] * k[None, :, :, :], axis=2)
    y -= c[None, None, :] * tl.sum(qk[:, :, None, :] * v[None, :, :, :], axis=1)
    if HAS_D:
        y += D_h * v
    return y, qk


@triton.jit
def _gate(z_ptr, mimo_z_ptr, step, h, p, r, rp_mask, pt_mask, P, R, HAS_MIMO_Z: tl.constexpr, COMPUTE: tl.constexpr):
    """z (BLOCK_P, CHUNK), mimo_z (BLOCK_R, BLOCK_P) and the gate's argument z ⊙ mimo_z
    (BLOCK_R, BLOCK_P, CHUNK)."""
    z = tl.load(z_ptr + step[None, :] * P + p[:, None], mask=pt_mask, other=0.0).to(COMPUTE)
    if HAS_MIMO_Z:
        mimo_z = tl.load(mimo_z_ptr + (h * R + r[:, None]) * P + p[None, :], mask=rp_mask, other=0.0).to(COMPUTE)
    else:
        mimo_z = tl.where(rp_mask, 1.0, 0.0).to(COMPUTE)
    return z, mimo_z, z[None, :, :] * mimo_z[:, :, None]


@triton.heuristics(_FWD_FLAGS)
@triton.jit
def _trapezoidal_scan_fwd_kernel(
    x_ptr,
    B_ptr,
    C_ptr,
    B_bias_ptr,
    C_bias_ptr,
    mimo_x_ptr,
    z_ptr,
    mimo_z_ptr,
    mimo_o_ptr,
    D_ptr,  # inputs
    a_ptr,
    sigma_ptr,
    c_ptr,
    cos_ptr,
    sin_ptr,
    H_init_ptr,
    bounds_ptr,
    chunk_first_ptr,
    out_ptr,
    H_last_ptr,
    chunk_states_ptr,  # outputs
    H,
    P,
    N,
    M,
    R,
    G,
    HALVED: tl.constexpr,
    HAS_B_BIAS: tl.constexpr,
    HAS_C_BIAS: tl.constexpr,
    HAS_MIMO_X: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_MIMO_Z: tl.constexpr,
    HAS_MIMO_O: tl.constexpr,
    HAS_D: tl.constexpr,
    COMPUTE: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr,
    SAVE_CHUNK_STATES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """out ((B·L, H, P), or (B·L, R, H, P) per rank), the last state (rows, H, P, N) and the
    state before each chunk (chunks, H, P, N). Every tensor contiguous."""
    row, h, p, p_mask, start, end, first_chunk, g, r, r_mask, n, n_mask, m, partner, sign, rot = _setup(
        bounds_ptr, chunk_first_ptr, H, P, N, M, R, G, HALVED, BLOCK_R, BLOCK_P, BLOCK_N
    )
    t_local = tl.arange(0, CHUNK)
    pn_mask = p_mask[:, None] & n_mask[None, :]
    rp_mask = r_mask[:, None] & p_mask[None, :]
    state_offsets = (h * P + p[:, None]) * N + n[None, :]  # into one (H, P, N) state
    if HAS_INITIAL_STATE:
        H_state = tl.load(H_init_ptr + row * H * P * N + state_offsets, mask=pn_mask, other=0.0).to(COMPUTE)
    else:
        H_state = tl.zeros([BLOCK_P, BLOCK_N], dtype=COMPUTE)
    if HAS_D:
        D_h = tl.load(D_ptr + h).to(COMPUTE)
    else:
        D_h = 0.0
    if HAS_MIMO_O:
        mimo_o = tl.load(mimo_o_ptr + (h * R + r[:, None]) * P + p[None, :], mask=rp_mask, other=0.0).to(COMPUTE)

    n_chunks = (end - start + CHUNK - 1) // CHUNK
    for ci in range(0, n_chunks):
        if SAVE_CHUNK_STATES:
            tl.store(chunk_states_ptr + (first_chunk + ci) * H * P * N + state_offsets, H_state, mask=pn_mask)
        pos = start + ci * CHUNK + t_local
        t_mask = pos < end
        a, sigma, c, k, q, x, v, mimo_x = _chunk(
            x_ptr,
            B_ptr,
            C_ptr,
            B_bias_ptr,
            C_bias_ptr,
            mimo_x_ptr,
            a_ptr,
            sigma_ptr,
            c_ptr,
            cos_ptr,
            sin_ptr,
            pos,
            t_mask,
            h,
            g,
            p,
            p_mask,
            r,
            r_mask,
            n,
            n_mask,
            m,
            partner,
            sign,
            rot,
            H,
            P,
            M,
            R,
            G,
            N,
            HAS_B_BIAS,
            HAS_C_BIAS,
            HAS_MIMO_X,
            COMPUTE,
        )
        Hs, _, _ = _states(a, sigma, k, v, H_state)
        H_state = at_time(Hs, t_local, CHUNK - 1)
        y, _ = _readout(Hs, k, q, v, c, D_h, HAS_D)
        step = pos * H + h
        pt_mask = p_mask[:, None] & t_mask[None, :]
        if HAS_Z:
            _, _, zg = _gate(z_ptr, mimo_z_ptr, step, h, p, r, rp_mask, pt_mask, P, R, HAS_MIMO_Z, COMPUTE)
            y = y * zg * tl.sigmoid(zg)
        if HAS_MIMO_O:
            out = tl.sum(y * mimo_o[:, :, None], axis=0)  # (BLOCK_P, CHUNK)
            tl.store(out_ptr + step[None, :] * P + p[:, None], out, mask=pt_mask)
        else:
            offsets = ((pos[None, None, :] * R + r[:, None, None]) * H + h) * P + p[None, :, None]
            tl.store(out_ptr + offsets, y, mask=r_mask[:, None, None] & pt_mask[None, :, :])

    tl.store(H_last_ptr + row * H * P * N + state_offsets, H_state, mask=pn_mask)


@triton.heuristics(_BWD_FLAGS)
@triton.jit
def _trapezoidal_scan_bwd_kernel(
    x_ptr,
    B_ptr,
    C_ptr,
    B_bias_ptr,
    C_bias_ptr,
    mimo_x_ptr,
    z_ptr,
    mimo_z_ptr,
    mimo_o_ptr,
    D_ptr,  # forward
    a_ptr,
    sigma_ptr,
    c_ptr,
    cos_ptr,
    sin_ptr,
    bounds_ptr,
    chunk_first_ptr,
    chunk_states_ptr,
    dout_ptr,
    dH_last_ptr,  # upstream gradients
    dx_ptr,
    dz_ptr,
    dH_init_ptr,  # gradients written in full
    dk_part_ptr,
    dq_part_ptr,  # d k̃, d q̃ per P-block: (P-blocks, B·L, R, H, N)
    da_part_ptr,
    dsigma_part_ptr,
    dc_part_ptr,  # (P-blocks, B·L, H)
    dD_part_ptr,
    dmimo_part_ptr,  # (rows, H, P-blocks); (3, rows, H, R, P): d mimo_x, mimo_z, mimo_o
    H,
    P,
    N,
    M,
    R,
    G,
    BL,
    HALVED: tl.constexpr,
    HAS_B_BIAS: tl.constexpr,
    HAS_C_BIAS: tl.constexpr,
    HAS_MIMO_X: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_MIMO_Z: tl.constexpr,
    HAS_MIMO_O: tl.constexpr,
    HAS_D: tl.constexpr,
    COMPUTE: tl.constexpr,
    HAS_DLAST: tl.constexpr,
    INT: tl.constexpr,
    LOG2_CHUNK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Chunks from last to first: recompute the chunk from its saved start state, run the
    adjoint G backwards through it (carrying dLoss/dH into the chunk before), and write every
    gradient of the core: in full where this program owns it, else as this program's part."""
    row, h, p, p_mask, start, end, first_chunk, g, r, r_mask, n, n_mask, m, partner, sign, rot = _setup(
        bounds_ptr, chunk_first_ptr, H, P, N, M, R, G, HALVED, BLOCK_R, BLOCK_P, BLOCK_N
    )
    pblk = tl.program_id(2)
    t_local = tl.arange(0, CHUNK)
    pn_mask = p_mask[:, None] & n_mask[None, :]
    rp_mask = r_mask[:, None] & p_mask[None, :]
    state_offsets = (h * P + p[:, None]) * N + n[None, :]
    if HAS_DLAST:  # dLoss/dH of the step after the chunk, as seen from the chunk's last state
        carry = tl.load(dH_last_ptr + row * H * P * N + state_offsets, mask=pn_mask, other=0.0).to(COMPUTE)
    else:
        carry = tl.zeros([BLOCK_P, BLOCK_N], dtype=COMPUTE)
    if HAS_D:
        D_h = tl.load(D_ptr + h).to(COMPUTE)
    else:
        D_h = 0.0
    if HAS_MIMO_O:
        mimo_o = tl.load(mimo_o_ptr + (h * R + r[:, None]) * P + p[None, :], mask=rp_mask, other=0.0).to(COMPUTE)
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
        pos = start + ci * CHUNK + t_local
        t_mask = pos < end
        step = pos * H + h
        pt_mask = p_mask[:, None] & t_mask[None, :]
        a, sigma, c, k, q, x, v, mimo_x = _chunk(
            x_ptr,
            B_ptr,
            C_ptr,
            B_bias_ptr,
            C_bias_ptr,
            mimo_x_ptr,
            a_ptr,
            sigma_ptr,
            c_ptr,
            cos_ptr,
            sin_ptr,
            pos,
            t_mask,
            h,
            g,
            p,
            p_mask,
            r,
            r_mask,
            n,
            n_mask,
            m,
            partner,
            sign,
            rot,
            H,
            P,
            M,
            R,
            G,
            N,
            HAS_B_BIAS,
            HAS_C_BIAS,
            HAS_MIMO_X,
            COMPUTE,
        )
        Hs, U, drive = _states(a, sigma, k, v, H_start)
        y, qk = _readout(Hs, k, q, v, c, D_h, HAS_D)

        # Through the output: out = Σ_r mimo_o ⊙ y·silu(z ⊙ mimo_z) (each part when present).
        if HAS_MIMO_O:
            dout = tl.load(dout_ptr + step[None, :] * P + p[:, None], mask=pt_mask, other=0.0).to(COMPUTE)
            dgated = dout[None, :, :] * mimo_o[:, :, None]  # (BLOCK_R, BLOCK_P, CHUNK)
        else:
            offsets = ((pos[None, None, :] * R + r[:, None, None]) * H + h) * P + p[None, :, None]
            dgated = tl.load(dout_ptr + offsets, mask=r_mask[:, None, None] & pt_mask[None, :, :], other=0.0).to(
                COMPUTE
            )
        if HAS_Z:
            z, mimo_z, zg = _gate(z_ptr, mimo_z_ptr, step, h, p, r, rp_mask, pt_mask, P, R, HAS_MIMO_Z, COMPUTE)
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


# ----------------------------------------------------------------------------- launchers


def _contiguous(*tensors):
    return [None if t is None else t.contiguous() for t in tensors]


def _bounds(batch: int, length: int, cu_seqlens: Tensor | None, cfg: Config, device):
    """Each program row's range of flattened positions (rows + 1,) and the index of its first
    saved chunk state (rows,), both int64."""
    if cu_seqlens is None:
        bounds = torch.arange(batch + 1, device=device, dtype=torch.int64) * length
    else:
        bounds = cu_seqlens.to(torch.int64)
    chunks = (bounds[1:] - bounds[:-1] + cfg.chunk - 1) // cfg.chunk
    return bounds.contiguous(), (torch.cumsum(chunks, 0) - chunks).contiguous()


def _trapezoidal_scan_fwd(
    x,
    B,
    C,
    B_bias,
    C_bias,
    mimo_x,
    z,
    mimo_z,
    mimo_o,
    D,
    a,
    sigma,
    c,
    cos,
    sin,
    H_init,
    cu_seqlens,
    halved: bool,
    save_chunk_states: bool,
):
    """x, z: (B, L, H, P); B, C: (B, L, R, G, N); B_bias, C_bias: (H, R, N); mimo_*: (H, R, P);
    D: (H,); a, σ, c: (B, L, H); cos, sin: (B, L, H, M); H_init: (rows, H, P, N). Returns out
    (B, L, H, P) in x's dtype ((B, L, R, H, P) without mimo_o), the last state (rows, H, P, N)
    and the chunk-start states (chunks, H, P, N) (none without ``save_chunk_states``)."""
    batch, length, heads, P = x.shape
    ranks, groups, N = B.shape[2:]
    M = cos.shape[-1]
    dtype = a.dtype
    cfg = config(P, N, ranks)
    rows = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    x, B, C, B_bias, C_bias, mimo_x, z, mimo_z, mimo_o, D, a, sigma, c, cos, sin, H_init = _contiguous(
        x, B, C, B_bias, C_bias, mimo_x, z, mimo_z, mimo_o, D, a, sigma, c, cos, sin, H_init
    )
    out = x.new_empty(batch, length, heads, P) if mimo_o is not None else x.new_empty(batch, length, ranks, heads, P)
    H_last = x.new_empty(rows, heads, P, N, dtype=dtype)
    n_saved = cfg.max_chunks(rows, length, cu_seqlens is not None) if save_chunk_states else 0
    chunk_states = x.new_empty(n_saved, heads, P, N, dtype=dtype)
    bounds, chunk_first = _bounds(batch, length, cu_seqlens, cfg, x.device)
    check_launchable(x)
    _trapezoidal_scan_fwd_kernel[(rows, heads, cfg.p_blocks(P))](
        x_ptr=x,
        B_ptr=B,
        C_ptr=C,
        B_bias_ptr=B_bias,
        C_bias_ptr=C_bias,
        mimo_x_ptr=mimo_x,
        z_ptr=z,
        mimo_z_ptr=mimo_z,
        mimo_o_ptr=mimo_o,
        D_ptr=D,
        a_ptr=a,
        sigma_ptr=sigma,
        c_ptr=c,
        cos_ptr=cos,
        sin_ptr=sin,
        H_init_ptr=H_init,
        bounds_ptr=bounds,
        chunk_first_ptr=chunk_first,
        out_ptr=out,
        H_last_ptr=H_last,
        chunk_states_ptr=chunk_states,
        H=heads,
        P=P,
        N=N,
        M=M,
        R=ranks,
        G=groups,
        HALVED=halved,
        BLOCK_R=cfg.block_r,
        BLOCK_P=cfg.block_p,
        BLOCK_N=cfg.block_n,
        CHUNK=cfg.chunk,
        num_warps=cfg.num_warps,
    )
    return out, H_last, chunk_states


def _trapezoidal_scan_bwd(
    dout,
    dH_last,
    x,
    B,
    C,
    B_bias,
    C_bias,
    mimo_x,
    z,
    mimo_z,
    mimo_o,
    D,
    a,
    sigma,
    c,
    cos,
    sin,
    cu_seqlens,
    halved: bool,
    chunk_states,
):
    """Gradients of :func:`_trapezoidal_scan_fwd`'s out and last state, given its saved chunk
    states: (dx, dB, dC, dB_bias, dC_bias, dmimo_x, dz, dmimo_z, dmimo_o, dD, da, dσ, dc, dcos,
    dsin, dH_init), each in its input's dtype (None for an absent input; dH_init in the state
    dtype)."""
    batch, length, heads, P = x.shape
    ranks, groups, N = B.shape[2:]
    M = cos.shape[-1]
    dtype = a.dtype
    cfg = config(P, N, ranks)
    rows = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    blocks = cfg.p_blocks(P)
    x, B, C, B_bias, C_bias, mimo_x, z, mimo_z, mimo_o, D, a, sigma, c, cos, sin, dout, dH_last = _contiguous(
        x, B, C, B_bias, C_bias, mimo_x, z, mimo_z, mimo_o, D, a, sigma, c, cos, sin, dout, dH_last
    )
    new = dict(device=x.device, dtype=dtype)
    dx = torch.empty(batch, length, heads, P, **new)
    dz = None if z is None else torch.empty(batch, length, heads, P, **new)
    dH_init = torch.empty(rows, heads, P, N, **new)
    dk_part = torch.empty(blocks, batch, length, ranks, heads, N, **new)
    dq_part = torch.empty(blocks, batch, length, ranks, heads, N, **new)
    da_part, dsigma_part, dc_part = (torch.empty(blocks, batch, length, heads, **new) for _ in range(3))
    dD_part = torch.zeros(rows, heads, blocks, **new)
    dmimo_part = torch.zeros(3, rows, heads, ranks, P, **new)
    bounds, chunk_first = _bounds(batch, length, cu_seqlens, cfg, x.device)
    check_launchable(x)
    _trapezoidal_scan_bwd_kernel[(rows, heads, blocks)](
        x_ptr=x,
        B_ptr=B,
        C_ptr=C,
        B_bias_ptr=B_bias,
        C_bias_ptr=C_bias,
        mimo_x_ptr=mimo_x,
        z_ptr=z,
        mimo_z_ptr=mimo_z,
        mimo_o_ptr=mimo_o,
        D_ptr=D,
        a_ptr=a,
        sigma_ptr=sigma,
        c_ptr=c,
        cos_ptr=cos,
        sin_ptr=sin,
        bounds_ptr=bounds,
        chunk_first_ptr=chunk_first,
        chunk_states_ptr=chunk_states,
        dout_ptr=dout,
        dH_last_ptr=dH_last,
        dx_ptr=dx,
        dz_ptr=dz,
        dH_init_ptr=dH_init,
        dk_part_ptr=dk_part,
        dq_part_ptr=dq_part,
        da_part_ptr=da_part,
        dsigma_part_ptr=dsigma_part,
        dc_part_ptr=dc_part,
        dD_part_ptr=dD_part,
        dmimo_part_ptr=dmimo_part,
        H=heads,
        P=P,
        N=N,
        M=M,
        R=ranks,
        G=groups,
        BL=batch * length,
        HALVED=halved,
        BLOCK_R=cfg.block_r,
        BLOCK_P=cfg.block_p,
        BLOCK_N=cfg.block_n,
        CHUNK=cfg.chunk,
        num_warps=cfg.num_warps,
    )
    # Sums over P-blocks, then the rotation's backward: k̃ = Rot(φ)·(B + B_bias) per head.
    rotary = "halved" if halved else "interleaved"
    cos5, sin5 = cos[:, :, None], sin[:, :, None]  # (B, L, 1, H, M)
    grads_BC, dcos, dsin = [], 0, 0
    for M_, bias, part in ((B, B_bias, dk_part), (C, C_bias, dq_part)):
        w = common.per_head(M_, heads, bias, dtype)  # (B, L, R, H, N)
        dw, dcos_, dsin_ = common.rotate_backward(part.sum(0), w, cos5, sin5, rotary)
        dcos, dsin = dcos + dcos_.sum(2), dsin + dsin_.sum(2)
        dM = dw.unflatten(3, (groups, heads // groups)).sum(4)  # heads → their group
        dbias = None if bias is None else dw.sum((0, 1)).transpose(0, 1).to(bias.dtype)  # (H, R, N)
        grads_BC.append((dM.to(M_.dtype), dbias))
    (dB, dB_bias), (dC, dC_bias) = grads_BC
    dmimo = [None if t is None else dmimo_part[i].sum(0).to(t.dtype) for i, t in enumerate((mimo_x, mimo_z, mimo_o))]
    return (
        dx.to(x.dtype),
        dB,
        dC,
        dB_bias,
        dC_bias,
        dmimo[0],
        None if z is None else dz.to(z.dtype),
        dmimo[1],
        dmimo[2],
        None if D is None else dD_part.sum((0, 2)).to(D.dtype),
        da_part.sum(0).to(a.dtype),
        dsigma_part.sum(0).to(sigma.dtype),
        dc_part.sum(0).to(c.dtype),
        dcos.to(cos.dtype),
        dsin.to(sin.dtype),
        dH_init,
    )


# ----------------------------------------------------------------------------- custom ops

_NONE = (0,)  # shape of the placeholder a custom op returns for an absent optional input


@torch.library.custom_op("ssm::trapezoidal_scan_fwd", mutates_args=())
def trapezoidal_scan_fwd(
    x: Tensor,
    B: Tensor,
    C: Tensor,
    B_bias: Tensor | None,
    C_bias: Tensor | None,
    mimo_x: Tensor | None,
    z: Tensor | None,
    mimo_z: Tensor | None,
    mimo_o: Tensor | None,
    D: Tensor | None,
    a: Tensor,
    sigma: Tensor,
    c: Tensor,
    cos: Tensor,
    sin: Tensor,
    H_init: Tensor | None,
    cu_seqlens: Tensor | None,
    halved: bool,
    save_chunk_states: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """out, last state, chunk-start states (what the backward needs)."""
    return _trapezoidal_scan_fwd(
        x,
        B,
        C,
        B_bias,
        C_bias,
        mimo_x,
        z,
        mimo_z,
        mimo_o,
        D,
        a,
        sigma,
        c,
        cos,
        sin,
        H_init,
        cu_seqlens,
        halved,
        save_chunk_states,
    )


@trapezoidal_scan_fwd.register_fake
def _(
    x,
    B,
    C,
    B_bias,
    C_bias,
    mimo_x,
    z,
    mimo_z,
    mimo_o,
    D,
    a,
    sigma,
    c,
    cos,
    sin,
    H_init,
    cu_seqlens,
    halved,
    save_chunk_states=True,
):
    batch, length, heads, P = x.shape
    ranks, _, N = B.shape[2:]
    rows = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    cfg = config(P, N, ranks)
    n_saved = cfg.max_chunks(rows, length, cu_seqlens is not None) if save_chunk_states else 0
    out = x.new_empty(batch, length, heads, P) if mimo_o is not None else x.new_empty(batch, length, ranks, heads, P)
    return out, a.new_empty(rows, heads, P, N), a.new_empty(n_saved, heads, P, N)


@torch.library.custom_op("ssm::trapezoidal_scan_bwd", mutates_args=())
def trapezoidal_scan_bwd(
    dout: Tensor,
    dH_last: Tensor | None,
    x: Tensor,
    B: Tensor,
    C: Tensor,
    B_bias: Tensor | None,
    C_bias: Tensor | None,
    mimo_x: Tensor | None,
    z: Tensor | None,
    mimo_z: Tensor | None,
    mimo_o: Tensor | None,
    D: Tensor | None,
    a: Tensor,
    sigma: Tensor,
    c: Tensor,
    cos: Tensor,
    sin: Tensor,
    cu_seqlens: Tensor | None,
    halved: bool,
    chunk_states: Tensor,
) -> tuple[
    Tensor,
    Tensor,
    Tensor,
    Tensor,
    Tensor,
    Tensor,
    Tensor,
    Tensor,
    Tensor,
    Tensor,
    Tensor,
    Tensor,
    Tensor,
    Tensor,
    Tensor,
    Tensor,
]:
    """dx, dB, dC, dB_bias, dC_bias, dmimo_x, dz, dmimo_z, dmimo_o, dD, da, dσ, dc, dcos, dsin,
    dH_init (empty for absent inputs)."""
    grads = _trapezoidal_scan_bwd(
        dout,
        dH_last,
        x,
        B,
        C,
        B_bias,
        C_bias,
        mimo_x,
        z,
        mimo_z,
        mimo_o,
        D,
        a,
        sigma,
        c,
        cos,
        sin,
        cu_seqlens,
        halved,
        chunk_states,
    )
    return tuple(x.new_empty(_NONE) if g is None else g for g in grads)


@trapezoidal_scan_bwd.register_fake
def _(
    dout,
    dH_last,
    x,
    B,
    C,
    B_bias,
    C_bias,
    mimo_x,
    z,
    mimo_z,
    mimo_o,
    D,
    a,
    sigma,
    c,
    cos,
    sin,
    cu_seqlens,
    halved,
    chunk_states,
):
    def like(t):
        return x.new_empty(_NONE) if t is None else torch.empty_like(t)

    rows = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dH_init = a.new_empty(rows, x.shape[2], x.shape[3], B.shape[4])
    return (
        like(x),
        like(B),
        like(C),
        like(B_bias),
        like(C_bias),
        like(mimo_x),
        like(z),
        like(mimo_z),
        like(mimo_o),
        like(D),
        like(a),
        like(sigma),
        like(c),
        like(cos),
        like(sin),
        dH_init,
    )


def _setup_context(ctx, inputs, output):
    (
        x,
        B,
        C,
        B_bias,
        C_bias,
        mimo_x,
        z,
        mimo_z,
        mimo_o,
        D,
        a,
        sigma,
        c,
        cos,
        sin,
        H_init,
        cu_seqlens,
        halved,
        _save,
    ) = inputs
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(
        x, B, C, B_bias, C_bias, mimo_x, z, mimo_z, mimo_o, D, a, sigma, c, cos, sin, cu_seqlens, output[2]
    )
    ctx.halved = halved
    ctx.H_init_dtype = None if H_init is None else H_init.dtype


def _backward(ctx, dout, dH_last, _dchunk_states):
    x, B, C, B_bias, C_bias, mimo_x, z, mimo_z, mimo_o, D, a, sigma, c, cos, sin, cu_seqlens, chunk_states = (
        ctx.saved_tensors
    )
    if dout is None:
        rank_shape = () if mimo_o is not None else (B.shape[2],)
        dout = x.new_zeros(*x.shape[:2], *rank_shape, *x.shape[2:])
    grads = trapezoidal_scan_bwd(
        dout,
        dH_last,
        x,
        B,
        C,
        B_bias,
        C_bias,
        mimo_x,
        z,
        mimo_z,
        mimo_o,
        D,
        a,
        sigma,
        c,
        cos,
        sin,
        cu_seqlens,
        ctx.halved,
        chunk_states,
    )
    inputs = (x, B, C, B_bias, C_bias, mimo_x, z, mimo_z, mimo_o, D, a, sigma, c, cos, sin)
    result = [None if t is None else g for t, g in zip(inputs, grads)]
    dH_init = None if ctx.H_init_dtype is None else grads[-1].to(ctx.H_init_dtype)
    return (*result, dH_init, None, None, None)  # cu_seqlens, halved, save_chunk_states


trapezoidal_scan_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- backend entry point


def _core(
    x, B, C, B_bias, C_bias, mimo_x, z, mimo_z, mimo_o, D, a, sigma, c, cos, sin, H_init, rotary, chunk_size, cu_seqlens
):
    """The core of the shared fast-path skeleton (common.run) on the kernels; ``chunk_size`` is
    the chunked backend's, not used here (the kernels scan CHUNK steps at a time)."""
    tensors = (x, B, C, B_bias, C_bias, mimo_x, z, mimo_z, mimo_o, D, a, sigma, c, cos, sin, H_init)
    # Chunk states are only for a backward: not written when none can follow (inference).
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    out, H_last, _ = trapezoidal_scan_fwd(
        x,
        B,
        C,
        B_bias,
        C_bias,
        mimo_x,
        z,
        mimo_z,
        mimo_o,
        D,
        a,
        sigma,
        c,
        cos,
        sin,
        H_init,
        cu_seqlens,
        rotary == "halved",
        save,
    )
    return out, H_last


def trapezoidal_scan_triton(
    x,
    dt,
    A,
    B,
    C,
    trap,
    angles,
    D,
    z,
    B_bias,
    C_bias,
    mimo_x,
    mimo_z,
    mimo_o,
    rotary,
    initial_state,
    chunk_size,
    cu_seqlens,
):
    """Backend "triton" of :func:`ssm.scan.trapezoidal_scan` (inputs validated, B and C
    (B, L, R, G, N), biases (H, R, N), the key state (·, R, H, N)). Returns out in x's dtype and
    the last state in float32 (float64 for float64 inputs)."""
    dtype = state_dtype(
        x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, mimo_x, mimo_z, mimo_o, *(initial_state or ())
    )
    return common.run(
        _core,
        x,
        dt,
        A,
        B,
        C,
        trap,
        angles,
        D,
        z,
        B_bias,
        C_bias,
        mimo_x,
        mimo_z,
        mimo_o,
        rotary,
        initial_state,
        chunk_size,
        cu_seqlens,
        dtype,
    )
