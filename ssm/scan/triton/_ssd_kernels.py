"""The forward Triton kernels of ``ssd`` (Mamba-2's SSD, chunked), and the @triton.jit helpers
that the backward kernels (_ssd_bwd_kernels.py) share with them. Launchers, custom ops and the
backend entry point are in ssd.py, which says what each kernel's grid is.

The chunked algorithm (see ../chunked.py for the derivation): the sequence is cut into chunks
of T steps. With a_t = Δ_t·A and cum_t = a_0 + ... + a_t inside a chunk (cum_{-1} = 0),

    y_t  = Σ_{u ≤ t} (C_t·B_u) exp(cum_t − cum_u) Δ_u x_u  +  exp(cum_t) C_t·E      (E: the state
    S    = Σ_u exp(cum_{T−1} − cum_u) Δ_u x_u ⊗ B_u          (what the chunk adds)    entering the chunk)
    E'   = exp(cum_{T−1})·E + S                             (the state entering the next one)

Forward, one kernel each, in this order:
    _ssd_cumsum_kernel         Δ = clamp(softplus(dt + dt_bias)) and cum, (B, H, c·T) float32
    _ssd_cb_kernel             C·Bᵀ of each chunk and group, (B, c, G, T, T) float32, shared by the heads
    _ssd_chunk_state_kernel    S of each chunk, (B, c, H, P, N) float32
    _ssd_state_passing_kernel  E of each chunk (a loop over the chunks, written over S) and the last state
    _ssd_chunk_scan_kernel     y, then + D·x and ·silu(z): the output
    _ssd_last_state_kernel     packed only: each sequence's state after its last step

Packed sequences (cu_seqlens, batch 1) keep the same chunk grid: ``seq`` (c·T,) int32 gives
each step's sequence (the padding after L takes the last one). Weights between two steps are
kept only inside one sequence; a chunk's S holds only the steps of the sequence at its end; the
entering state E is read only by the steps that continue the sequence before the chunk, and
decays through the chunk only if that sequence reaches its end. A sequence s that starts at
step o inside a chunk brings its initial state h0[s] in as another entering state, anchored at
cum_{o−1}: its steps read exp(cum_t − cum_{o−1}) C_t·h0[s]. Each sequence's last state (at its
last step q, in chunk k) is its own steps in chunk k, decayed to q, plus the state it entered
chunk k with (E, or h0[s] if it starts in k), decayed to q.

Matrix products run on tensor cores in the inputs' 16-bit dtype (operands rounded to it, sums in
float32), and in float32 ("ieee", no TF32) or float64 otherwise: ``DOT`` and ``PRECISION``.
Everything else is float32 (float64 for float64 inputs): ``COMPUTE``.

Shape symbols: B batch, L length, H heads, P head dim, N state size, G groups, T chunk length
(CHUNK), c chunks, S packed sequences.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._jit import softplus


@triton.jit
def dot(a, b, DOT: tl.constexpr, PRECISION: tl.constexpr, COMPUTE: tl.constexpr):
    """a @ b with operands rounded to DOT and sums in COMPUTE."""
    return tl.dot(a.to(DOT), b.to(DOT), input_precision=PRECISION, out_dtype=COMPUTE)


@triton.jit
def decay_between(cum_hi, cum_lo, keep):
    """exp(cum_hi − cum_lo) where ``keep``, else 0 (never exp of a masked-out difference, which
    may overflow)."""
    diff = cum_hi - cum_lo
    return tl.where(keep, tl.exp(tl.where(keep, diff, 0.0)), 0.0)


@triton.jit
def delta_of(raw, bias, dt_min, dt_max, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr):
    """Δ = clamp(softplus(dt + dt_bias), dt_min, dt_max), each part only when asked; also the
    value before the clamp (the backward's mask)."""
    if HAS_DT_BIAS:
        raw = raw + bias
    if SOFTPLUS:
        raw = softplus(raw)
    if CLAMP:
        delta = tl.minimum(tl.maximum(raw, dt_min), dt_max)
    else:
        delta = raw
    return delta, raw


@triton.jit
def sequence_before(seq_ptr, l0, PACKED: tl.constexpr):
    """The sequence of the step before position l0 (a chunk's start): -1 at l0 = 0."""
    if PACKED:
        prev = tl.load(seq_ptr + tl.maximum(l0 - 1, 0))
        prev = tl.where(l0 > 0, prev, -1)
    else:
        prev = 0
    return prev


@triton.jit
def anchor(cum_base, start, l0):
    """cum just before step ``start`` of the chunk starting at l0: cum_{o−1}, 0 when o = 0."""
    value = tl.load(cum_base + tl.maximum(start - 1, l0))
    return tl.where(start > l0, value, 0.0)


@triton.jit
def load_state_T(ptr, p, n, P, N):
    """A (P, N) float32 state at ``ptr`` as its transpose, a (BLOCK_N, BLOCK_P) tile."""
    return tl.load(ptr + p[None, :] * N + n[:, None], mask=(n < N)[:, None] & (p < P)[None, :], other=0.0)


@triton.jit
def load_state(ptr, p, n, P, N):
    """A (P, N) float32 state at ``ptr``, a (BLOCK_P, BLOCK_N) tile."""
    return tl.load(ptr + p[:, None] * N + n[None, :], mask=(p < P)[:, None] & (n < N)[None, :], other=0.0)


@triton.jit
def own_state(
    x_base, stride_x_l, B_base, stride_B_l, delta_base, cum_base, seq_ptr,
    l0, L, P, N, q, target, p, n,
    PACKED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr, COMPUTE: tl.constexpr,
):  # fmt: skip
    """Σ_{u ≤ q, seq_u = target} exp(cum_q − cum_u) Δ_u x_u ⊗ B_u over the chunk starting at l0
    (q counted from l0): the state its steps leave at step q. A (BLOCK_P, BLOCK_N) tile."""
    cum_q = tl.load(cum_base + l0 + q)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=COMPUTE)
    for j in range(0, q // BLOCK_T + 1):
        u = j * BLOCK_T + tl.arange(0, BLOCK_T)
        lu = l0 + u
        keep = (u <= q) & (lu < L)
        if PACKED:
            keep = keep & (tl.load(seq_ptr + lu) == target)
        w = decay_between(cum_q, tl.load(cum_base + lu), keep) * tl.load(delta_base + lu)
        xT = tl.load(
            x_base + lu[None, :] * stride_x_l + p[:, None], mask=keep[None, :] & (p < P)[:, None], other=0.0
        )  # (BLOCK_P, BLOCK_T)
        Bu = tl.load(B_base + lu[:, None] * stride_B_l + n[None, :], mask=keep[:, None] & (n < N)[None, :], other=0.0)
        acc += dot(xT.to(COMPUTE) * w[None, :], Bu, DOT, PRECISION, COMPUTE)
    return acc


@triton.jit
def _ssd_cumsum_kernel(
    dt_ptr, A_ptr, dt_bias_ptr, delta_ptr, cum_ptr,
    L, H, Lp, n_chunks, stride_dt_b, stride_dt_l, dt_min, dt_max,
    HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr, COMPUTE: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Grid (B·c, ⌈H / BLOCK_H⌉). Δ and cum of one chunk, for BLOCK_H heads; Δ = 0 after L."""
    pid = tl.program_id(0).to(tl.int64)
    b, k = pid // n_chunks, pid % n_chunks
    t = tl.arange(0, CHUNK)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pos = k * CHUNK + t
    valid = (pos < L)[:, None] & (h < H)[None, :]
    raw = tl.load(dt_ptr + b * stride_dt_b + pos[:, None] * stride_dt_l + h[None, :], mask=valid, other=0.0)
    bias = 0.0
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias_ptr + h, mask=h < H, other=0.0).to(COMPUTE)[None, :]
    delta, _ = delta_of(raw.to(COMPUTE), bias, dt_min, dt_max, HAS_DT_BIAS, SOFTPLUS, CLAMP)
    delta = tl.where(valid, delta, 0.0)
    A = tl.load(A_ptr + h, mask=h < H, other=0.0).to(COMPUTE)
    cum = tl.cumsum(delta * A[None, :], axis=0)
    offsets = (b * H + h[None, :]) * Lp + pos[:, None]
    tl.store(delta_ptr + offsets, delta, mask=(h < H)[None, :])
    tl.store(cum_ptr + offsets, cum, mask=(h < H)[None, :])


@triton.jit
def _ssd_cb_kernel(
    B_ptr, C_ptr, CB_ptr,
    L, N, G, n_chunks, stride_B_b, stride_B_l, stride_B_g, stride_C_b, stride_C_l, stride_C_g,
    DOT: tl.constexpr, PRECISION: tl.constexpr, COMPUTE: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid (B·c, G, (T / BLOCK_T)²). One (BLOCK_T, BLOCK_T) tile C_t·B_u of a chunk's C·Bᵀ, for
    the tiles on or below the diagonal (u ≤ t somewhere in them); the others are never read."""
    pid = tl.program_id(0).to(tl.int64)
    b, k = pid // n_chunks, pid % n_chunks
    g = tl.program_id(1)
    n_t: tl.constexpr = CHUNK // BLOCK_T
    m, j = tl.program_id(2) // n_t, tl.program_id(2) % n_t
    if j <= m:
        t = m * BLOCK_T + tl.arange(0, BLOCK_T)
        u = j * BLOCK_T + tl.arange(0, BLOCK_T)
        n = tl.arange(0, BLOCK_N)
        lt, lu = k * CHUNK + t, k * CHUNK + u
        Ct = tl.load(
            C_ptr + b * stride_C_b + g * stride_C_g + lt[:, None] * stride_C_l + n[None, :],
            mask=(lt < L)[:, None] & (n < N)[None, :],
            other=0.0,
        )
        BuT = tl.load(
            B_ptr + b * stride_B_b + g * stride_B_g + lu[None, :] * stride_B_l + n[:, None],
            mask=(lu < L)[None, :] & (n < N)[:, None],
            other=0.0,
        )
        cb = dot(Ct, BuT, DOT, PRECISION, COMPUTE)
        tl.store(CB_ptr + ((pid * G + g) * CHUNK + t[:, None]) * CHUNK + u[None, :], cb)


@triton.jit
def _ssd_chunk_state_kernel(
    x_ptr, B_ptr, delta_ptr, cum_ptr, seq_ptr, cu_ptr, h0_ptr, states_ptr,
    L, Lp, H, P, N, G, n_chunks, stride_x_b, stride_x_l, stride_x_h, stride_B_b, stride_B_l, stride_B_g,
    PACKED: tl.constexpr, HAS_H0: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    COMPUTE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid (B·c, H, ⌈P / BLOCK_P⌉). What chunk k adds to the state at its end, S_k (P, N): the
    steps of the sequence at its end (packed), and that sequence's initial state if it starts
    inside the chunk."""
    pid = tl.program_id(0).to(tl.int64)
    b, k = pid // n_chunks, pid % n_chunks
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    g = h // (H // G)
    l0 = k * CHUNK
    cum_base = cum_ptr + (b * H + h) * Lp
    target = 0
    if PACKED:
        target = tl.load(seq_ptr + l0 + CHUNK - 1)
    acc = own_state(
        x_ptr + b * stride_x_b + h * stride_x_h, stride_x_l, B_ptr + b * stride_B_b + g * stride_B_g, stride_B_l,
        delta_ptr + (b * H + h) * Lp, cum_base, seq_ptr, l0, L, P, N, CHUNK - 1, target, p, n,
        PACKED, BLOCK_T, BLOCK_P, BLOCK_N, DOT, PRECISION, COMPUTE,
    )  # fmt: skip
    if PACKED and HAS_H0:
        start = tl.load(cu_ptr + target)
        if start >= l0:
            factor = tl.exp(tl.load(cum_base + l0 + CHUNK - 1) - anchor(cum_base, start, l0))
            acc += factor * load_state(h0_ptr + (target * H + h) * P * N, p, n, P, N).to(COMPUTE)
    offsets = ((pid * H + h) * P + p[:, None]) * N + n[None, :]
    tl.store(states_ptr + offsets, acc, mask=(p < P)[:, None] & (n < N)[None, :])


@triton.jit
def _ssd_state_passing_kernel(
    states_ptr, cum_ptr, seq_ptr, h0_ptr, last_ptr,
    H, Lp, PN, n_chunks,
    PACKED: tl.constexpr, HAS_H0: tl.constexpr, STORE_LAST: tl.constexpr, COMPUTE: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid (B·H, ⌈P·N / BLOCK⌉). Across the chunks in order: E_k = the state so far (written
    over S_k), then state = decay_k·state + S_k. Unpacked, the state starts at h0 and its end is
    the last state; packed, it starts at 0 (initial states come in with their sequences) and
    decays through a chunk only if no sequence starts in it."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = e < PN
    if HAS_H0 and not PACKED:
        state = tl.load(h0_ptr + bh * PN + e, mask=mask, other=0.0).to(COMPUTE)
    else:
        state = tl.zeros([BLOCK], dtype=COMPUTE)
    for k in range(0, n_chunks):
        ptrs = states_ptr + ((b * n_chunks + k) * H + h) * PN + e
        added = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, state, mask=mask)
        decay = tl.exp(tl.load(cum_ptr + bh * Lp + k * CHUNK + CHUNK - 1))
        if PACKED:
            through = tl.load(seq_ptr + k * CHUNK + CHUNK - 1) == sequence_before(seq_ptr, k * CHUNK, PACKED)
            decay = tl.where(through, decay, 0.0)
        state = decay * state + added
    if STORE_LAST:
        tl.store(last_ptr + bh * PN + e, state, mask=mask)


@triton.jit
def _ssd_chunk_scan_kernel(
    x_ptr, z_ptr, C_ptr, CB_ptr, delta_ptr, cum_ptr, seq_ptr, cu_ptr, states_ptr, h0_ptr, D_ptr,
    out_ptr, y_pre_ptr,
    L, Lp, H, P, N, G, n_chunks, n_pb,
    stride_x_b, stride_x_l, stride_x_h, stride_z_b, stride_z_l, stride_z_h, stride_C_b, stride_C_l, stride_C_g,
    PACKED: tl.constexpr, HAS_H0: tl.constexpr, HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
    HAS_Z: tl.constexpr, SAVE_Y: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, COMPUTE: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid (B·c, H, (T / BLOCK_T)·⌈P / BLOCK_P⌉). The output at BLOCK_T steps of one chunk and
    BLOCK_P channels of one head: the entering state read out, the initial states of the
    sequences starting in the chunk (packed), the steps before in the chunk (C·Bᵀ tiles on and
    below the diagonal), then D·x and the gate. out (and y_pre, the output before the gate,
    which the backward of the gate reads) are contiguous (B, L, H, P)."""
    pid = tl.program_id(0).to(tl.int64)
    b, k = pid // n_chunks, pid % n_chunks
    h = tl.program_id(1)
    m, pb = tl.program_id(2) // n_pb, tl.program_id(2) % n_pb
    g = h // (H // G)
    l0 = k * CHUNK
    t = m * BLOCK_T + tl.arange(0, BLOCK_T)
    lt = l0 + t
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    row_ok = lt < L
    cum_base = cum_ptr + (b * H + h) * Lp
    delta_base = delta_ptr + (b * H + h) * Lp
    x_base = x_ptr + b * stride_x_b + h * stride_x_h
    cum_t = tl.load(cum_base + lt)
    Ct = tl.load(
        C_ptr + b * stride_C_b + g * stride_C_g + lt[:, None] * stride_C_l + n[None, :],
        mask=row_ok[:, None] & (n < N)[None, :],
        other=0.0,
    )

    # The state entering the chunk, read by the steps that continue its sequence.
    read = tl.exp(cum_t)
    if PACKED:
        seq_t = tl.load(seq_ptr + lt)
        read = tl.where(seq_t == sequence_before(seq_ptr, l0, PACKED), read, 0.0)
    ET = load_state_T(states_ptr + (pid * H + h) * P * N, p, n, P, N)
    acc = dot(Ct, ET, DOT, PRECISION, COMPUTE) * read[:, None]
    if PACKED and HAS_H0:  # the initial states of the sequences that start in the chunk
        first = tl.load(seq_ptr + l0 + m * BLOCK_T)
        last = tl.load(seq_ptr + tl.minimum(l0 + m * BLOCK_T + BLOCK_T, L) - 1)
        for s in range(first, last + 1):
            start = tl.load(cu_ptr + s)
            if start >= l0:
                w = decay_between(cum_t, anchor(cum_base, start, l0), seq_t == s)
                h0T = load_state_T(h0_ptr + (s * H + h) * P * N, p, n, P, N)
                acc += dot(Ct, h0T, DOT, PRECISION, COMPUTE) * w[:, None]

    # The steps before, inside the chunk.
    CB_base = CB_ptr + (pid * G + g) * CHUNK * CHUNK
    for j in range(0, m + 1):
        u = j * BLOCK_T + tl.arange(0, BLOCK_T)
        lu = l0 + u
        keep = (u[None, :] <= t[:, None]) & (lu < L)[None, :]
        if PACKED:
            keep = keep & (seq_t[:, None] == tl.load(seq_ptr + lu)[None, :])
        cb = tl.load(CB_base + t[:, None] * CHUNK + u[None, :])
        decay = decay_between(cum_t[:, None], tl.load(cum_base + lu)[None, :], keep)
        W = tl.where(keep, cb * decay * tl.load(delta_base + lu)[None, :], 0.0)
        xu = tl.load(
            x_base + lu[:, None] * stride_x_l + p[None, :], mask=(lu < L)[:, None] & (p < P)[None, :], other=0.0
        )
        acc += dot(W, xu, DOT, PRECISION, COMPUTE)

    tile = row_ok[:, None] & (p < P)[None, :]
    y = acc
    if HAS_D:
        xt = tl.load(x_base + lt[:, None] * stride_x_l + p[None, :], mask=tile, other=0.0).to(COMPUTE)
        if D_PER_CHANNEL:
            Dp = tl.load(D_ptr + h * P + p, mask=p < P, other=0.0).to(COMPUTE)
        else:
            Dp = tl.load(D_ptr + h).to(COMPUTE)
        y += Dp * xt
    out_offsets = ((b * L + lt[:, None]) * H + h) * P + p[None, :]
    if HAS_Z:
        if SAVE_Y:
            tl.store(y_pre_ptr + out_offsets, y, mask=tile)
        zt = tl.load(
            z_ptr + b * stride_z_b + h * stride_z_h + lt[:, None] * stride_z_l + p[None, :], mask=tile, other=0.0
        ).to(COMPUTE)
        y = y * zt * tl.sigmoid(zt)
    tl.store(out_ptr + out_offsets, y, mask=tile)


@triton.jit
def _ssd_last_state_kernel(
    x_ptr, B_ptr, delta_ptr, cum_ptr, seq_ptr, cu_ptr, states_ptr, h0_ptr, last_ptr,
    L, Lp, H, P, N, G, stride_x_l, stride_x_h, stride_B_l, stride_B_g,
    HAS_H0: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, COMPUTE: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid (S, H, ⌈P / BLOCK_P⌉), packed (B = 1). Sequence s's state after its last step q (in
    chunk k): its own steps in chunk k decayed to q, plus E_k (if it began before chunk k) or its
    initial state (if it starts in k) decayed to q. An empty sequence's is its initial state."""
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    g = h // (H // G)
    start, stop = tl.load(cu_ptr + s), tl.load(cu_ptr + s + 1)
    if stop > start:
        k = (stop - 1) // CHUNK
        l0 = k * CHUNK
        q = stop - 1 - l0
        cum_base = cum_ptr + h * Lp
        acc = own_state(
            x_ptr + h * stride_x_h, stride_x_l, B_ptr + g * stride_B_g, stride_B_l,
            delta_ptr + h * Lp, cum_base, seq_ptr, l0, L, P, N, q, s, p, n,
            True, BLOCK_T, BLOCK_P, BLOCK_N, DOT, PRECISION, COMPUTE,
        )  # fmt: skip
        cum_q = tl.load(cum_base + l0 + q)
        if start < l0:
            acc += tl.exp(cum_q) * load_state(states_ptr + (k * H + h) * P * N, p, n, P, N)
        elif HAS_H0:
            factor = tl.exp(cum_q - anchor(cum_base, start, l0))
            acc += factor * load_state(h0_ptr + (s * H + h) * P * N, p, n, P, N).to(COMPUTE)
    elif HAS_H0:
        acc = load_state(h0_ptr + (s * H + h) * P * N, p, n, P, N).to(COMPUTE)
    else:
        acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=COMPUTE)
    tl.store(last_ptr + ((s * H + h) * P + p[:, None]) * N + n[None, :], acc, mask=(p < P)[:, None] & (n < N)[None, :])
