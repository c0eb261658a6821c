"""The backward Triton kernels of ``ssd``; the forward ones, the chunked algorithm they
differentiate and the helpers both share are in _ssd_kernels.py, the launchers in ssd.py.

The backward first reruns the forward's first four kernels (Δ, cum, C·Bᵀ, the entering states
E): the forward saves only its inputs (and, with z, the output before the gate). Then, in order:

    _ssd_gate_bwd_kernel          dy = dout·silu(z), dz, per-block partial sums of dD
    _ssd_dstate_kernel            what each chunk's outputs (and, packed, the last state of the
                                  sequence entering it) ask of its entering state E_k
    _ssd_state_passing_bwd_kernel the chunks in reverse: λ_k = dLoss/d(state at chunk k's end),
                                  written over the above; dh0 (unpacked); the decay's share of dcum
    _ssd_bwd_dx_kernel            per block of source steps u: dx, dB (summed over a group's heads
                                  in the program), Δ's direct gradients
    _ssd_bwd_dc_kernel            per block of output steps t: dC (summed likewise), dcum_t
    _ssd_sequence_bwd_kernel      packed only: dh0 of each sequence, and the dcum of its last state
    _ssd_dt_bwd_kernel            dcum → da = Δ·A's gradient (reverse sums inside each chunk and
                                  sequence), then dΔ → ddt, partial sums of dA and ddt_bias

How dcum becomes da. Every factor exp(cum_hi − cum_lo) in the forward is exp(a_{lo+1} + ... +
a_hi), so its gradient g reaches a_v for lo < v ≤ hi. The kernels write +g at hi and −g at lo
("dcum"), and a reverse cumulative sum inside the chunk turns that into da. When lo is before
the chunk or before a sequence's first step (E and h0 are anchored there), −g is left out and
the sum is taken inside each sequence (packed), which is the same. The factors of the states a
chunk or a sequence leaves at its end, exp(cum_end − cum_u), have many lo's and one hi: each
writes g_u at u ("rr"), and da_v gets the sum of rr over the earlier steps u < v of v's sequence.

Sums across programs (dB and dC over groups of heads split between programs, dD, dA, ddt_bias,
the decay's dcum over blocks of the state) are partial sums, one per program, added in a fixed
order by the launcher: the gradients are the same bits from run to run, no atomics.

Shape symbols: B batch, L length, H heads, P head dim, N state size, G groups, T chunk length
(CHUNK), c chunks, S packed sequences.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._ssd_kernels import anchor, decay_between, delta_of, dot, load_state, sequence_before


@triton.jit
def _ssd_gate_bwd_kernel(
    dout_ptr, x_ptr, z_ptr, y_pre_ptr, dy_ptr, dz_ptr, dD_part_ptr,
    L, H, P, n_lb, stride_x_b, stride_x_l, stride_x_h, stride_z_b, stride_z_l, stride_z_h,
    HAS_Z: tl.constexpr, HAS_D: tl.constexpr, COMPUTE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Grid (B·⌈L / BLOCK_L⌉, H). out = y_pre·silu(z): dy = dout·silu(z) and dz; the partial sum
    of dD = Σ dy·x over the block's steps. dout, y_pre, dy, dz: contiguous (B, L, H, P)."""
    pid = tl.program_id(0).to(tl.int64)
    b, lb = pid // n_lb, pid % n_lb
    h = tl.program_id(1)
    pos = lb * BLOCK_L + tl.arange(0, BLOCK_L)
    p = tl.arange(0, BLOCK_P)
    tile = (pos < L)[:, None] & (p < P)[None, :]
    offsets = ((b * L + pos[:, None]) * H + h) * P + p[None, :]
    g = tl.load(dout_ptr + offsets, mask=tile, other=0.0).to(COMPUTE)
    if HAS_Z:
        z = tl.load(
            z_ptr + b * stride_z_b + h * stride_z_h + pos[:, None] * stride_z_l + p[None, :], mask=tile, other=0.0
        ).to(COMPUTE)
        sig = tl.sigmoid(z)
        y_pre = tl.load(y_pre_ptr + offsets, mask=tile, other=0.0).to(COMPUTE)
        tl.store(dz_ptr + offsets, g * y_pre * sig * (1.0 + z * (1.0 - sig)), mask=tile)
        g = g * z * sig
        tl.store(dy_ptr + offsets, g, mask=tile)
    if HAS_D:
        x = tl.load(
            x_ptr + b * stride_x_b + h * stride_x_h + pos[:, None] * stride_x_l + p[None, :], mask=tile, other=0.0
        )
        tl.store(dD_part_ptr + (pid * H + h) * P + p, tl.sum(g * x.to(COMPUTE), axis=0), mask=p < P)


@triton.jit
def _ssd_dstate_kernel(
    dy_ptr, C_ptr, cum_ptr, seq_ptr, cu_ptr, dlast_ptr, dstates_ptr,
    L, Lp, H, P, N, G, n_chunks, stride_C_b, stride_C_l, stride_C_g,
    PACKED: tl.constexpr, HAS_DLAST: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    COMPUTE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid (B·c, H, ⌈P / BLOCK_P⌉). The gradient of E_k from chunk k itself: Σ_t exp(cum_t)
    dy_t ⊗ C_t over the steps that read it, and (packed) exp(cum_q)·dlast of the sequence
    entering the chunk if it ends in it (at q). dy: contiguous (B, L, H, P)."""
    pid = tl.program_id(0).to(tl.int64)
    b, k = pid // n_chunks, pid % n_chunks
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    g = h // (H // G)
    l0 = k * CHUNK
    cum_base = cum_ptr + (b * H + h) * Lp
    prev = sequence_before(seq_ptr, l0, PACKED)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=COMPUTE)
    for m in range(0, CHUNK // BLOCK_T):
        lt = l0 + m * BLOCK_T + tl.arange(0, BLOCK_T)
        keep = lt < L
        if PACKED:
            keep = keep & (tl.load(seq_ptr + lt) == prev)
        w = tl.where(keep, tl.exp(tl.load(cum_base + lt)), 0.0)
        dyT = tl.load(
            dy_ptr + ((b * L + lt[None, :]) * H + h) * P + p[:, None], mask=keep[None, :] & (p < P)[:, None], other=0.0
        )
        Ct = tl.load(
            C_ptr + b * stride_C_b + g * stride_C_g + lt[:, None] * stride_C_l + n[None, :],
            mask=keep[:, None] & (n < N)[None, :],
            other=0.0,
        )
        acc += dot(dyT.to(COMPUTE) * w[None, :], Ct, DOT, PRECISION, COMPUTE)
    if PACKED and HAS_DLAST:
        if prev >= 0:
            q = tl.load(cu_ptr + prev + 1) - 1
            if (q >= l0) & (q < l0 + CHUNK):  # it ends in the chunk (not on the step before it)
                acc += tl.exp(tl.load(cum_base + q)) * load_state(dlast_ptr + (prev * H + h) * P * N, p, n, P, N)
    offsets = ((pid * H + h) * P + p[:, None]) * N + n[None, :]
    tl.store(dstates_ptr + offsets, acc, mask=(p < P)[:, None] & (n < N)[None, :])


@triton.jit
def _ssd_state_passing_bwd_kernel(
    dstates_ptr, states_ptr, cum_ptr, seq_ptr, cu_ptr, dlast_ptr, h0_ptr, dh0_ptr, yend_ptr,
    H, Lp, PN, n_chunks, n_blocks,
    PACKED: tl.constexpr, HAS_DLAST: tl.constexpr, HAS_H0: tl.constexpr, COMPUTE: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid (B·H, n_blocks = ⌈P·N / BLOCK⌉). The chunks in reverse: λ_k (the gradient of the state
    at chunk k's end) is written over dstates_k, then λ_{k−1} = dstates_k + decay_k·λ_k. Also the
    dcum at chunk k's last step of what reaches its end from before it (decay_k·⟨λ_k, E_k⟩, and
    packed, the initial state of a sequence starting in it): a partial sum per block of the
    state, (B, H, c, n_blocks). Unpacked, λ_{−1} is dh0 and λ_{c−1} is dlast."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = e < PN
    cum_base = cum_ptr + bh * Lp
    if HAS_DLAST and not PACKED:
        lam = tl.load(dlast_ptr + bh * PN + e, mask=mask, other=0.0).to(COMPUTE)
    else:
        lam = tl.zeros([BLOCK], dtype=COMPUTE)
    for i in range(0, n_chunks):
        k = n_chunks - 1 - i
        l0 = k * CHUNK
        offsets = ((b * n_chunks + k) * H + h) * PN + e
        local = tl.load(dstates_ptr + offsets, mask=mask, other=0.0)
        tl.store(dstates_ptr + offsets, lam, mask=mask)
        entering = tl.load(states_ptr + offsets, mask=mask, other=0.0)
        cum_end = tl.load(cum_base + l0 + CHUNK - 1)
        decay = tl.exp(cum_end)
        if PACKED:
            end_seq = tl.load(seq_ptr + l0 + CHUNK - 1)
            decay = tl.where(end_seq == sequence_before(seq_ptr, l0, PACKED), decay, 0.0)
        y = decay * tl.sum(lam * entering, axis=0)
        if PACKED and HAS_H0:
            start = tl.load(cu_ptr + end_seq)
            if start >= l0:
                h0 = tl.load(h0_ptr + (end_seq * H + h) * PN + e, mask=mask, other=0.0).to(COMPUTE)
                y += tl.exp(cum_end - anchor(cum_base, start, l0)) * tl.sum(lam * h0, axis=0)
        tl.store(yend_ptr + (bh * n_chunks + k) * n_blocks + tl.program_id(1), y)
        lam = local + decay * lam
    if HAS_H0 and not PACKED:
        tl.store(dh0_ptr + bh * PN + e, lam, mask=mask)


@triton.jit
def state_grad(
    lam, q, target, u, u_ok, seq_u, cum_base, l0, cum_u, d_u, xu, Bu, dx, dd_state, dB,
    PACKED: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, COMPUTE: tl.constexpr,
):  # fmt: skip
    """At source steps u (a block), the gradients of Σ_{u ≤ q, seq_u = target} exp(cum_q − cum_u)
    Δ_u x_u ⊗ B_u (the state they leave at chunk offset q) given its gradient lam (BLOCK_P,
    BLOCK_N): added to dx (BLOCK_T, BLOCK_P), dB (BLOCK_T, BLOCK_N) and dd_state, Δ's direct
    gradient (BLOCK_T,), whose Δ-multiple is also the rr of that state's factor."""
    keep = (u <= q) & u_ok
    if PACKED:
        keep = keep & (seq_u == target)
    f = decay_between(tl.load(cum_base + l0 + q), cum_u, keep)
    fd = f * d_u
    B_lam = dot(Bu, tl.trans(lam), DOT, PRECISION, COMPUTE)  # (BLOCK_T, BLOCK_P)
    dx += B_lam * fd[:, None]
    dd_state += f * tl.sum(xu * B_lam, axis=1)
    dB += dot(xu * fd[:, None], lam, DOT, PRECISION, COMPUTE)
    return dx, dd_state, dB


@triton.jit
def _ssd_bwd_dx_kernel(
    x_ptr, dy_ptr, B_ptr, C_ptr, CB_ptr, delta_ptr, cum_ptr, seq_ptr, cu_ptr, lam_ptr, dlast_ptr, D_ptr,
    dx_ptr, dd_intra_ptr, dd_state_ptr, dB_part_ptr,
    L, Lp, H, P, N, G, n_chunks, n_splits, heads_per_split,
    stride_x_b, stride_x_l, stride_x_h, stride_B_b, stride_B_l, stride_B_g, stride_C_b, stride_C_l, stride_C_g,
    PACKED: tl.constexpr, HAS_DLAST: tl.constexpr, HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr, COMPUTE: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid (B·c, G·n_splits, T / BLOCK_T). For a block of source steps u of one chunk and the
    heads of one split of a group: through the output steps t ≥ u of the chunk (C·Bᵀ tiles on and
    below the diagonal) and the states the steps leave (the chunk's end: λ_k; packed, the last
    states of the sequences ending in the chunk), dx (+ D·dy), Δ's direct gradients dd_intra
    (whose Δ-multiple is the −dcum at u of the weights) and dd_state, and dB summed over the
    split's heads: a partial sum per split, (B, L, n_splits, G, N)."""
    pid = tl.program_id(0).to(tl.int64)
    b, k = pid // n_chunks, pid % n_chunks
    g, split = tl.program_id(1) // n_splits, tl.program_id(1) % n_splits
    j = tl.program_id(2)
    heads = H // G
    l0 = k * CHUNK
    u = j * BLOCK_T + tl.arange(0, BLOCK_T)
    lu = l0 + u
    u_ok = lu < L
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    PN = P * N
    Bu = tl.load(
        B_ptr + b * stride_B_b + g * stride_B_g + lu[:, None] * stride_B_l + n[None, :],
        mask=u_ok[:, None] & (n < N)[None, :],
        other=0.0,
    )
    C_base = C_ptr + b * stride_C_b + g * stride_C_g
    CB_base = CB_ptr + (pid * G + g) * CHUNK * CHUNK
    seq_u = u
    target = 0
    if PACKED:
        seq_u = tl.load(seq_ptr + lu)
        target = tl.load(seq_ptr + l0 + CHUNK - 1)
    dB = tl.zeros([BLOCK_T, BLOCK_N], dtype=COMPUTE)
    for head in range(split * heads_per_split, tl.minimum(split * heads_per_split + heads_per_split, heads)):
        h = g * heads + head
        cum_base = cum_ptr + (b * H + h) * Lp
        cum_u = tl.load(cum_base + lu)
        d_u = tl.load(delta_ptr + (b * H + h) * Lp + lu)
        xu = tl.load(
            x_ptr + b * stride_x_b + h * stride_x_h + lu[:, None] * stride_x_l + p[None, :],
            mask=u_ok[:, None] & (p < P)[None, :],
            other=0.0,
        ).to(COMPUTE)
        dx = tl.zeros([BLOCK_T, BLOCK_P], dtype=COMPUTE)
        dd_intra = tl.zeros([BLOCK_T], dtype=COMPUTE)
        dd_state = tl.zeros([BLOCK_T], dtype=COMPUTE)
        for m in range(j, CHUNK // BLOCK_T):
            lt = l0 + m * BLOCK_T + tl.arange(0, BLOCK_T)
            t_ok = lt < L
            keep = (u[None, :] <= (lt - l0)[:, None]) & u_ok[None, :] & t_ok[:, None]
            if PACKED:
                keep = keep & (tl.load(seq_ptr + lt)[:, None] == seq_u[None, :])
            dyt = tl.load(
                dy_ptr + ((b * L + lt[:, None]) * H + h) * P + p[None, :],
                mask=t_ok[:, None] & (p < P)[None, :],
                other=0.0,
            )
            Ct = tl.load(
                C_base + lt[:, None] * stride_C_l + n[None, :], mask=t_ok[:, None] & (n < N)[None, :], other=0.0
            )
            decay = decay_between(tl.load(cum_base + lt)[:, None], cum_u[None, :], keep)
            cb = tl.where(keep, tl.load(CB_base + (lt - l0)[:, None] * CHUNK + u[None, :]) * decay, 0.0)
            dW = dot(dyt, tl.trans(xu), DOT, PRECISION, COMPUTE)  # (t, u)
            dx += dot(tl.trans(cb * d_u[None, :]), dyt, DOT, PRECISION, COMPUTE)
            dB += dot(tl.trans(dW * decay * d_u[None, :]), Ct, DOT, PRECISION, COMPUTE)
            dd_intra += tl.sum(dW * cb, axis=0)
        lam = load_state(lam_ptr + (pid * H + h) * PN, p, n, P, N)
        dx, dd_state, dB = state_grad(
            lam, CHUNK - 1, target, u, u_ok, seq_u, cum_base, l0, cum_u, d_u, xu, Bu, dx, dd_state, dB,
            PACKED, DOT, PRECISION, COMPUTE,
        )  # fmt: skip
        if PACKED and HAS_DLAST:  # the last states of the sequences ending in this chunk
            first = tl.load(seq_ptr + l0 + j * BLOCK_T)
            last = tl.load(seq_ptr + tl.maximum(tl.minimum(l0 + j * BLOCK_T + BLOCK_T, L) - 1, 0))
            for s in range(first, last + 1):
                start, stop = tl.load(cu_ptr + s), tl.load(cu_ptr + s + 1)
                if (stop > start) & (stop - 1 < l0 + CHUNK):
                    dlast = load_state(dlast_ptr + (s * H + h) * PN, p, n, P, N)
                    dx, dd_state, dB = state_grad(
                        dlast, stop - 1 - l0, s, u, u_ok, seq_u, cum_base, l0, cum_u, d_u, xu, Bu, dx, dd_state, dB,
                        PACKED, DOT, PRECISION, COMPUTE,
                    )  # fmt: skip
        tile = u_ok[:, None] & (p < P)[None, :]
        offsets = ((b * L + lu[:, None]) * H + h) * P + p[None, :]
        if HAS_D:
            if D_PER_CHANNEL:
                Dp = tl.load(D_ptr + h * P + p, mask=p < P, other=0.0).to(COMPUTE)[None, :]
            else:
                Dp = tl.load(D_ptr + h).to(COMPUTE)
            dx += Dp * tl.load(dy_ptr + offsets, mask=tile, other=0.0).to(COMPUTE)
        tl.store(dx_ptr + offsets, dx, mask=tile)
        tl.store(dd_intra_ptr + (b * H + h) * Lp + lu, dd_intra, mask=u_ok)
        tl.store(dd_state_ptr + (b * H + h) * Lp + lu, dd_state, mask=u_ok)
    dB_offsets = (((b * L + lu[:, None]) * n_splits + split) * G + g) * N + n[None, :]
    tl.store(dB_part_ptr + dB_offsets, dB, mask=u_ok[:, None] & (n < N)[None, :])


@triton.jit
def _ssd_bwd_dc_kernel(
    x_ptr, dy_ptr, B_ptr, C_ptr, CB_ptr, delta_ptr, cum_ptr, seq_ptr, cu_ptr, states_ptr, h0_ptr,
    ds_rows_ptr, dC_part_ptr,
    L, Lp, H, P, N, G, n_chunks, n_splits, heads_per_split,
    stride_x_b, stride_x_l, stride_x_h, stride_B_b, stride_B_l, stride_B_g, stride_C_b, stride_C_l, stride_C_g,
    PACKED: tl.constexpr, HAS_H0: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    COMPUTE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid (B·c, G·n_splits, T / BLOCK_T). For a block of output steps t of one chunk and the
    heads of one split of a group: through the steps u ≤ t of the chunk, the entering state E_k
    and (packed) the initial states of the sequences starting in the chunk, dC summed over the
    split's heads (a partial sum per split, (B, L, n_splits, G, N)) and the +dcum at t of every
    factor that ends there (ds_rows, (B, H, c·T))."""
    pid = tl.program_id(0).to(tl.int64)
    b, k = pid // n_chunks, pid % n_chunks
    g, split = tl.program_id(1) // n_splits, tl.program_id(1) % n_splits
    m = tl.program_id(2)
    heads = H // G
    l0 = k * CHUNK
    t = m * BLOCK_T + tl.arange(0, BLOCK_T)
    lt = l0 + t
    t_ok = lt < L
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    PN = P * N
    Ct = tl.load(
        C_ptr + b * stride_C_b + g * stride_C_g + lt[:, None] * stride_C_l + n[None, :],
        mask=t_ok[:, None] & (n < N)[None, :],
        other=0.0,
    )
    B_base = B_ptr + b * stride_B_b + g * stride_B_g
    CB_base = CB_ptr + (pid * G + g) * CHUNK * CHUNK
    seq_t = t
    if PACKED:
        seq_t = tl.load(seq_ptr + lt)
        entering = seq_t == sequence_before(seq_ptr, l0, PACKED)
    else:
        entering = t_ok
    dC = tl.zeros([BLOCK_T, BLOCK_N], dtype=COMPUTE)
    for head in range(split * heads_per_split, tl.minimum(split * heads_per_split + heads_per_split, heads)):
        h = g * heads + head
        cum_base = cum_ptr + (b * H + h) * Lp
        cum_t = tl.load(cum_base + lt)
        dyt = tl.load(
            dy_ptr + ((b * L + lt[:, None]) * H + h) * P + p[None, :], mask=t_ok[:, None] & (p < P)[None, :], other=0.0
        )
        ds = tl.zeros([BLOCK_T], dtype=COMPUTE)
        for j in range(0, m + 1):
            u = j * BLOCK_T + tl.arange(0, BLOCK_T)
            lu = l0 + u
            keep = (u[None, :] <= t[:, None]) & (lu < L)[None, :] & t_ok[:, None]
            if PACKED:
                keep = keep & (seq_t[:, None] == tl.load(seq_ptr + lu)[None, :])
            xu = tl.load(
                x_ptr + b * stride_x_b + h * stride_x_h + lu[:, None] * stride_x_l + p[None, :],
                mask=(lu < L)[:, None] & (p < P)[None, :],
                other=0.0,
            )
            Bu = tl.load(
                B_base + lu[:, None] * stride_B_l + n[None, :], mask=(lu < L)[:, None] & (n < N)[None, :], other=0.0
            )
            decay = decay_between(cum_t[:, None], tl.load(cum_base + lu)[None, :], keep)
            dW = dot(dyt, tl.trans(xu), DOT, PRECISION, COMPUTE)
            dcb = dW * decay * tl.load(delta_ptr + (b * H + h) * Lp + lu)[None, :]
            dC += dot(dcb, Bu, DOT, PRECISION, COMPUTE)
            ds += tl.sum(tl.where(keep, dcb * tl.load(CB_base + t[:, None] * CHUNK + u[None, :]), 0.0), axis=1)
        read = tl.where(entering, tl.exp(cum_t), 0.0)
        dy_E = dot(dyt, load_state(states_ptr + (pid * H + h) * PN, p, n, P, N), DOT, PRECISION, COMPUTE)
        dC += dy_E * read[:, None]
        ds += read * tl.sum(dy_E * Ct.to(COMPUTE), axis=1)
        if PACKED and HAS_H0:  # the initial states of the sequences that start in the chunk
            first = tl.load(seq_ptr + l0 + m * BLOCK_T)
            last = tl.load(seq_ptr + tl.maximum(tl.minimum(l0 + m * BLOCK_T + BLOCK_T, L) - 1, 0))
            for s in range(first, last + 1):
                start = tl.load(cu_ptr + s)
                if start >= l0:
                    w = decay_between(cum_t, anchor(cum_base, start, l0), seq_t == s)
                    h0 = load_state(h0_ptr + (s * H + h) * PN, p, n, P, N).to(COMPUTE)
                    dy_h0 = dot(dyt, h0, DOT, PRECISION, COMPUTE)
                    dC += dy_h0 * w[:, None]
                    ds += w * tl.sum(dy_h0 * Ct.to(COMPUTE), axis=1)
        tl.store(ds_rows_ptr + (b * H + h) * Lp + lt, ds, mask=t_ok)
    dC_offsets = (((b * L + lt[:, None]) * n_splits + split) * G + g) * N + n[None, :]
    tl.store(dC_part_ptr + dC_offsets, dC, mask=t_ok[:, None] & (n < N)[None, :])


@triton.jit
def _ssd_sequence_bwd_kernel(
    dy_ptr, C_ptr, cum_ptr, seq_ptr, cu_ptr, states_ptr, lam_ptr, dlast_ptr, h0_ptr, dh0_ptr, ds_last_ptr,
    L, Lp, H, P, N, G, stride_C_l, stride_C_g, n_pb,
    HAS_DLAST: tl.constexpr, HAS_H0: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    COMPUTE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid (S, H), packed (B = 1). Sequence s's last state gets, from its entering state (E_k or
    h0[s], anchored before chunk k or before its first step), the dcum at its last step q
    (ds_last, (1, H, c·T), written at q only). Its initial state's gradient dh0[s]: from the
    outputs of its steps in the chunk where it starts, the state at that chunk's end (if the
    sequence reaches it: λ) and its last state (if it ends there); dlast[s] if it is empty."""
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = h // (H // G)
    n = tl.arange(0, BLOCK_N)
    PN = P * N
    cum_base = cum_ptr + h * Lp
    start, stop = tl.load(cu_ptr + s), tl.load(cu_ptr + s + 1)
    if stop > start:
        if HAS_DLAST:
            k = (stop - 1) // CHUNK
            l0 = k * CHUNK
            cum_q = tl.load(cum_base + stop - 1)
            y = tl.sum(tl.zeros([BLOCK_N], dtype=COMPUTE), axis=0)
            for pb in range(0, n_pb):
                p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
                dlast = load_state(dlast_ptr + (s * H + h) * PN, p, n, P, N)
                if start < l0:
                    entering = load_state(states_ptr + (k * H + h) * PN, p, n, P, N)
                    y += tl.exp(cum_q) * tl.sum(tl.sum(dlast * entering, axis=1), axis=0)
                elif HAS_H0:
                    h0 = load_state(h0_ptr + (s * H + h) * PN, p, n, P, N).to(COMPUTE)
                    y += tl.exp(cum_q - anchor(cum_base, start, l0)) * tl.sum(tl.sum(dlast * h0, axis=1), axis=0)
            tl.store(ds_last_ptr + h * Lp + stop - 1, y)
        if HAS_H0:
            l0 = (start // CHUNK) * CHUNK
            sigma = anchor(cum_base, start, l0)
            reaches_end = tl.load(seq_ptr + l0 + CHUNK - 1) == s
            for pb in range(0, n_pb):
                p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
                acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=COMPUTE)
                for m in range((start - l0) // BLOCK_T, CHUNK // BLOCK_T):
                    lt = l0 + m * BLOCK_T + tl.arange(0, BLOCK_T)
                    keep = (lt >= start) & (lt < stop)
                    w = decay_between(tl.load(cum_base + lt), sigma, keep)
                    dyT = tl.load(
                        dy_ptr + (lt[None, :] * H + h) * P + p[:, None],
                        mask=keep[None, :] & (p < P)[:, None],
                        other=0.0,
                    )
                    Ct = tl.load(
                        C_ptr + g * stride_C_g + lt[:, None] * stride_C_l + n[None, :],
                        mask=keep[:, None] & (n < N)[None, :],
                        other=0.0,
                    )
                    acc += dot(dyT.to(COMPUTE) * w[None, :], Ct, DOT, PRECISION, COMPUTE)
                if reaches_end:
                    lam = load_state(lam_ptr + ((l0 // CHUNK) * H + h) * PN, p, n, P, N)
                    acc += tl.exp(tl.load(cum_base + l0 + CHUNK - 1) - sigma) * lam
                if HAS_DLAST:
                    if stop - 1 < l0 + CHUNK:
                        dlast = load_state(dlast_ptr + (s * H + h) * PN, p, n, P, N)
                        acc += tl.exp(tl.load(cum_base + stop - 1) - sigma) * dlast
                tile = (p < P)[:, None] & (n < N)[None, :]
                tl.store(dh0_ptr + ((s * H + h) * P + p[:, None]) * N + n[None, :], acc, mask=tile)
    elif HAS_H0:
        for pb in range(0, n_pb):
            p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
            tile = (p < P)[:, None] & (n < N)[None, :]
            if HAS_DLAST:
                value = load_state(dlast_ptr + (s * H + h) * PN, p, n, P, N)
            else:
                value = tl.zeros([BLOCK_P, BLOCK_N], dtype=COMPUTE)
            tl.store(dh0_ptr + ((s * H + h) * P + p[:, None]) * N + n[None, :], value, mask=tile)


@triton.jit
def _segment_sum(v1, s1, v2, s2):
    """Sums within runs of one sequence id (associative where each id's steps are contiguous)."""
    return tl.where(s1 == s2, v1 + v2, v2), s2


@triton.jit
def _ssd_dt_bwd_kernel(
    dt_ptr, A_ptr, dt_bias_ptr, delta_ptr, ds_rows_ptr, dd_intra_ptr, dd_state_ptr, ds_last_ptr, yend_ptr,
    seq_ptr, ddt_ptr, dA_part_ptr, dbias_part_ptr,
    L, H, Lp, n_chunks, stride_dt_b, stride_dt_l, dt_min, dt_max,
    PACKED: tl.constexpr, HAS_DS_LAST: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    CLAMP: tl.constexpr, COMPUTE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_H: tl.constexpr,
    DT_SCALES_INPUT: tl.constexpr = True,
):  # fmt: skip
    """Grid (B·c, ⌈H / BLOCK_H⌉). One chunk's dcum (ds_rows, −Δ·dd_intra, ds_last, and the end's
    share from the state passing at its last step) summed in reverse, plus the sums of rr = Δ·
    dd_state over the earlier steps, inside each sequence: da. Then dΔ = da·A + dd_intra +
    dd_state (da·A alone without DT_SCALES_INPUT: the decay's share), back through the clamp,
    softplus and bias: ddt (contiguous (B, L, H)), and the chunk's partial sums of dA and
    ddt_bias, (B·c, H)."""
    pid = tl.program_id(0).to(tl.int64)
    b, k = pid // n_chunks, pid % n_chunks
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t = tl.arange(0, CHUNK)
    pos = k * CHUNK + t
    valid = (pos < L)[:, None] & (h < H)[None, :]
    offsets = (b * H + h[None, :]) * Lp + pos[:, None]
    delta = tl.load(delta_ptr + offsets, mask=valid, other=0.0)
    dd_intra = tl.load(dd_intra_ptr + offsets, mask=valid, other=0.0)
    dd_state = tl.load(dd_state_ptr + offsets, mask=valid, other=0.0)
    ds = tl.load(ds_rows_ptr + offsets, mask=valid, other=0.0) - delta * dd_intra
    if HAS_DS_LAST:
        ds += tl.load(ds_last_ptr + h[None, :] * Lp + pos[:, None], mask=valid, other=0.0)
    yend = tl.load(yend_ptr + (b * H + h) * n_chunks + k, mask=h < H, other=0.0)
    ds += tl.where(t[:, None] == CHUNK - 1, yend[None, :], 0.0)
    rr = delta * dd_state
    if PACKED:
        ids = tl.broadcast_to(tl.load(seq_ptr + pos)[:, None], [CHUNK, BLOCK_H])
        da, _ = tl.associative_scan((ds, ids), 0, _segment_sum, reverse=True)
        before, _ = tl.associative_scan((rr, ids), 0, _segment_sum)
    else:
        da = tl.cumsum(ds, axis=0, reverse=True)
        before = tl.cumsum(rr, axis=0)
    da += before - rr
    A = tl.load(A_ptr + h, mask=h < H, other=0.0).to(COMPUTE)
    grad = da * A[None, :]
    if DT_SCALES_INPUT:
        grad += dd_intra + dd_state
    tl.store(dA_part_ptr + pid * H + h, tl.sum(tl.where(valid, da * delta, 0.0), axis=0), mask=h < H)

    raw = tl.load(dt_ptr + b * stride_dt_b + pos[:, None] * stride_dt_l + h[None, :], mask=valid, other=0.0).to(COMPUTE)
    bias = 0.0
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias_ptr + h, mask=h < H, other=0.0).to(COMPUTE)[None, :]
    _, unclamped = delta_of(raw, bias, dt_min, dt_max, HAS_DT_BIAS, SOFTPLUS, CLAMP)
    if CLAMP:  # as torch.clamp: the gradient passes where the value is within the limits, ends included
        grad = tl.where((unclamped >= dt_min) & (unclamped <= dt_max), grad, 0.0)
    if SOFTPLUS:  # as torch's softplus: 1 above 20, else sigmoid
        pre = raw + bias
        grad = tl.where(pre > 20.0, grad, grad * tl.sigmoid(pre))
    grad = tl.where(valid, grad, 0.0)
    tl.store(ddt_ptr + (b * L + pos[:, None]) * H + h[None, :], grad, mask=valid)
    if HAS_DT_BIAS:
        tl.store(dbias_part_ptr + pid * H + h, tl.sum(grad, axis=0), mask=h < H)
