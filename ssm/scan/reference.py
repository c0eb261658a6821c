"""Sequential reference implementations: the ground truth every other backend is tested against.

They are written to be read, not to be fast: one Python loop over time, state in float32
(float64 when the inputs are float64), gradients by autograd through the loop. They share no
helper with the fast paths (those use _common.py), so that a bug in a shared piece of
arithmetic cannot hide from the comparison.

Shape symbols: B batch, L length, D channels, N state size, G groups, H heads, P head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import compute_dtype


def selective_scan_ref(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan as a loop over time.

    u, delta, z: (B, D, L); A: (D, N); B, C: (D, N) fixed or (B, G, N, L) time-varying;
    D, delta_bias: (D,); initial_state: (B, D, N).
    Returns out (B, D, L) in u's dtype and the last state (B, D, N) in the compute dtype.

        Δ_t = softplus(delta_t + delta_bias)            (as asked)
        h_t = exp(Δ_t·A) ⊙ h_{t-1} + Δ_t·u_t·B_t        h_{-1} = initial_state or 0
        y_t = C_t · h_t + D·u_t,  out_t = y_t · silu(z_t)

    With ``cu_seqlens`` (S + 1,) (batch 1), each of the S sequences is run alone, one after
    the other, from initial_state[s] ((S, D, N)) or 0; the last state is (S, D, N).
    """
    if cu_seqlens is not None:
        outs, lasts = [], []
        bounds = cu_seqlens.tolist()
        for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):

            def part(M):  # the time steps of sequence s of a time-varying input
                return M if M is None or M.ndim == 2 else M[..., start:end]

            out, last = selective_scan_ref(
                part(u),
                part(delta),
                A,
                part(B),
                part(C),
                D,
                part(z),
                delta_bias,
                delta_softplus,
                None if initial_state is None else initial_state[s : s + 1],
            )
            outs.append(out)
            lasts.append(last)
        return torch.cat(outs, dim=-1), torch.cat(lasts, dim=0)
    dtype = compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    batch, dim, length = u.shape
    out_dtype = u.dtype
    u, delta, A = u.to(dtype), delta.to(dtype), A.to(dtype)
    if delta_bias is not None:
        delta = delta + delta_bias.to(dtype)[:, None]
    if delta_softplus:
        delta = F.softplus(delta)  # (B, D, L)
    # Each channel gets its own copy of B and C: (D, N) when fixed, (B, D, N, L) when time-
    # varying, channel d reading group d // (D / G).
    B, C = B.to(dtype), C.to(dtype)
    if B.ndim == 4:
        B = B.repeat_interleave(dim // B.shape[1], dim=1)
    if C.ndim == 4:
        C = C.repeat_interleave(dim // C.shape[1], dim=1)

    if initial_state is None:
        h = u.new_zeros(batch, dim, A.shape[1])  # (B, D, N)
    else:
        h = initial_state.to(dtype)
    # One slice per time step. (unbind rather than indexing inside the loop: the backward of
    # an index allocates a full-size gradient per step, which makes the loop quadratic.)
    steps = zip(
        delta.unbind(-1),  # (B, D) each
        u.unbind(-1),
        [B] * length if B.ndim == 2 else B.unbind(-1),  # (D, N) or (B, D, N) each
        [C] * length if C.ndim == 2 else C.unbind(-1),
    )
    ys = []
    for delta_t, u_t, B_t, C_t in steps:
        decay = torch.exp(delta_t[..., None] * A)  # (B, D, N)
        h = decay * h + (delta_t * u_t)[..., None] * B_t
        ys.append((h * C_t).sum(-1))  # (B, D)
    y = torch.stack(ys, dim=-1) if ys else u.new_zeros(batch, dim, 0)  # (B, D, L)
    if D is not None:
        y = y + D.to(dtype)[:, None] * u
    if z is not None:
        y = y * F.silu(z.to(dtype))
    return y.to(out_dtype), h


def linear_scan_ref(
    gates: torch.Tensor,
    inputs: torch.Tensor,
    dim: int,
    initial_state: torch.Tensor | None = None,
    reverse: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """h_t = gates_t·h_{t-1} + inputs_t along ``dim`` (h_t = gates_t·h_{t+1} + inputs_t when
    ``reverse``), starting from ``initial_state`` (the input shape without ``dim``) or 0.
    Returns all states, shaped like ``inputs``, in the inputs' promoted dtype.

    With ``cu_seqlens`` (S + 1,) (every dimension before ``dim`` of size 1), each of the S
    sequences along ``dim`` is scanned alone, from initial_state[s] ((S, *dims after dim)) or 0.
    """
    if cu_seqlens is not None:
        parts = []
        bounds = cu_seqlens.tolist()
        for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            if end == start:
                continue
            h0 = (
                None
                if initial_state is None
                else initial_state[s].reshape(inputs.shape[:dim] + inputs.shape[dim + 1 :])
            )
            parts.append(
                linear_scan_ref(
                    gates.narrow(dim, start, end - start), inputs.narrow(dim, start, end - start), dim, h0, reverse
                )
            )
        return torch.cat(parts, dim=dim)
    dtype = compute_dtype(gates, inputs, initial_state)
    out_dtype = torch.promote_types(gates.dtype, inputs.dtype)
    a, x = gates.to(dtype), inputs.to(dtype)
    length = x.shape[dim]
    a_steps, x_steps = a.unbind(dim), x.unbind(dim)  # one slice per step (why: selective_scan_ref)
    h = torch.zeros_like(x_steps[0]) if initial_state is None else initial_state.to(dtype)
    order = range(length - 1, -1, -1) if reverse else range(length)
    states = [None] * length
    for t in order:
        h = a_steps[t] * h + x_steps[t]
        states[t] = h
    return torch.stack(states, dim=dim).to(out_dtype)


def ssd_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_state: torch.Tensor | None = None,
    chunk_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba-2 (SSD) recurrence as a loop over time; ``chunk_size`` is ignored.

    x, z: (B, L, H, P); dt: (B, L, H); A, dt_bias: (H,); B, C: (B, L, G, N) with head h using
    group h // (H / G); D: (H,) or (H, P); initial_state: (B, H, P, N).

        Δ_t = clamp(softplus(dt_t + dt_bias), dt_limit)       (as asked)
        h_t = exp(Δ_t·A)·h_{t-1} + Δ_t·x_t ⊗ B_t             (a scalar decay per head)
        y_t = h_t·C_t + D·x_t,  out_t = y_t · silu(z_t)
    Returns out (B, L, H, P) in x's dtype and the last state (B, H, P, N) in the compute dtype.

    With ``cu_seqlens`` (S + 1,) (batch 1), each of the S sequences is run alone, one after
    the other, from initial_state[s] ((S, H, P, N)) or 0; the last state is (S, H, P, N).
    """
    if cu_seqlens is not None:
        outs, lasts = [], []
        bounds = cu_seqlens.tolist()
        for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):

            def part(M):  # the time steps of sequence s
                return None if M is None else M[:, start:end]

            out, last = ssd_ref(
                part(x),
                part(dt),
                A,
                part(B),
                part(C),
                D,
                part(z),
                dt_bias,
                dt_softplus,
                dt_limit,
                None if initial_state is None else initial_state[s : s + 1],
            )
            outs.append(out)
            lasts.append(last)
        return torch.cat(outs, dim=1), torch.cat(lasts, dim=0)
    dtype = compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_state)
    batch, length, heads, head_dim = x.shape
    groups, N = B.shape[2], B.shape[3]
    out_dtype = x.dtype
    x, A, dt = x.to(dtype), A.to(dtype), dt.to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, float("inf")):  # the default limits mean "no clamp"
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])  # (B, L, H)
    B = B.to(dtype).repeat_interleave(heads // groups, dim=2)  # (B, L, H, N)
    C = C.to(dtype).repeat_interleave(heads // groups, dim=2)

    if initial_state is None:
        h = x.new_zeros(batch, heads, head_dim, N)  # (B, H, P, N)
    else:
        h = initial_state.to(dtype)
    ys = []
    for x_t, dt_t, B_t, C_t in zip(x.unbind(1), dt.unbind(1), B.unbind(1), C.unbind(1)):
        decay = torch.exp(dt_t * A)[..., None, None]  # (B, H, 1, 1)
        h = decay * h + (dt_t[..., None] * x_t)[..., None] * B_t[:, :, None, :]
        ys.append((h * C_t[:, :, None, :]).sum(-1))  # (B, H, P)
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(batch, 0, heads, head_dim)  # (B, L, H, P)
    if D is not None:
        D = D.to(dtype)
        y = y + (D[:, None] if D.ndim == 1 else D) * x  # D: (H,) or (H, P)
    if z is not None:
        y = y * F.silu(z.to(dtype))
    return y.to(out_dtype), h


def trapezoidal_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    trap: torch.Tensor,
    angles: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    B_bias: torch.Tensor | None = None,
    C_bias: torch.Tensor | None = None,
    mimo_x: torch.Tensor | None = None,
    mimo_z: torch.Tensor | None = None,
    mimo_o: torch.Tensor | None = None,
    rotary: str = "interleaved",
    initial_state: tuple | None = None,
    chunk_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
):
    """The Mamba-3 recurrence as a loop over time, with the state held as the paper writes it:
    complex numbers on the rotary pairs, so that the rotation is part of the decay; ``chunk_size``
    is ignored.

    x, z: (B, L, H, P); dt, A, trap: (B, L, H); B, C: (B, L, R, G, N) (R = 1: also (B, L, G, N));
    angles: (B, L, H, M); D: (H,); B_bias, C_bias: (H, R, N) ((H, N) with 4-D B); mimo_x,
    mimo_z, mimo_o: (H, R, P); initial_state: (phase (B, H, M), h (B, H, P, N), key (B, R, H, N)
    ((B, H, N) with 4-D B), value (B, H, P)); with cu_seqlens (S + 1,) every B above is S.

    State pairs (n0, n1) are complex numbers n0 + i·n1: (2m, 2m+1) for "interleaved", (m, m + N/2)
    for "halved", m < M; the other N - 2M entries are real. Per head h (group g = h // (H/G)),
    rank r, time t, with k = B + B_bias, q = C + C_bias, v_r = x ⊙ mimo_x[:, r]:

        λ̂_t = exp(Δ_t·(A_t − i·θ_t)) on the pairs, exp(Δ_t·A_t) on the real entries
        ĥ_t = λ̂_t·ĥ_{t-1} + (1 − λ_t)·Δ_t·λ̂_t·Σ_r v_{t-1,r} ⊗ k_{t-1,r} + λ_t·Δ_t·Σ_r v_{t,r} ⊗ k_{t,r}
        y_{t,r} = Re(conj(ĥ_t)·q_{t,r}) + D·v_{t,r},  gated by silu(z_t ⊙ mimo_z[:, r]),
        out_t = Σ_r mimo_o[:, r] ⊙ y_{t,r}  (without mimo_o: one output per rank, (B, L, R, H, P))

    (the exponential-trapezoidal rule of Mamba-3 with a complex A; λ = trap). ĥ lives in the
    frame of the current step; the state the scan hands over is the real state in absolute
    coordinates: h_t = e^{iφ_t}·ĥ_t on the pairs, φ_t = φ_{-1} + Σ_{s ≤ t} Δ_s·θ_s the phase,
    and the key is likewise e^{iφ_t}·k_t (the rotated key of the last step), the value x_t.

    Returns out in x's dtype and the last state (phase, h, key, value) in the compute dtype.
    """
    dtype = compute_dtype(x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, mimo_x, mimo_z, mimo_o)
    if initial_state is not None:
        dtype = compute_dtype(torch.empty(0, dtype=dtype), *initial_state)
    cdtype = torch.complex128 if dtype == torch.float64 else torch.complex64
    rank_axis = B.ndim == 5
    if not rank_axis:
        B, C = B.unsqueeze(2), C.unsqueeze(2)
        B_bias = None if B_bias is None else B_bias.unsqueeze(1)
        C_bias = None if C_bias is None else C_bias.unsqueeze(1)
    batch, length, heads, head_dim = x.shape
    ranks, groups, N = B.shape[2], B.shape[3], B.shape[4]
    M = angles.shape[-1]
    if rotary == "interleaved":
        n0 = torch.arange(0, 2 * M, 2)
        n1 = n0 + 1  # (not arange(1, 2·M, 2): with M = 0 no pair turns, and that range is an error)
    else:
        n0, n1 = torch.arange(M), torch.arange(M) + N // 2
    paired = torch.zeros(N, dtype=torch.bool)
    paired[n0], paired[n1] = True, True
    nr = (~paired).nonzero()[:, 0]  # the real entries
    n0, n1, nr = (i.to(x.device) for i in (n0, n1, nr))

    def per_head(M_):  # (B, L, R, G, N) -> (B, L, R, H, N): head h reads group h // (H / G)
        return M_.to(dtype).repeat_interleave(heads // groups, dim=3)

    k_all, q_all = per_head(B), per_head(C)
    if B_bias is not None:
        k_all = k_all + B_bias.to(dtype).transpose(0, 1)  # (R, H, N)
    if C_bias is not None:
        q_all = q_all + C_bias.to(dtype).transpose(0, 1)
    x_all = x.to(dtype)
    vx = (
        torch.ones(ranks, heads, head_dim, dtype=dtype, device=x.device)
        if mimo_x is None
        else mimo_x.to(dtype).transpose(0, 1)
    )
    vz = None if mimo_z is None else mimo_z.to(dtype).transpose(0, 1)

    def as_complex(w):  # (..., N) -> the pairs as complex numbers (..., M) and the real part
        return torch.complex(w[..., n0], w[..., n1]), w[..., nr]

    def as_real(wc, wr):  # the inverse
        out = wr.new_zeros(*wr.shape[:-1], N)
        out[..., n0], out[..., n1], out[..., nr] = wc.real, wc.imag, wr
        return out

    bounds = (
        [(b, 0, length) for b in range(batch)]
        if cu_seqlens is None
        else [(0, int(s), int(e)) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    )
    outs = [None] * len(bounds)
    last = []
    for i, (b, start, end) in enumerate(bounds):
        if initial_state is None:
            phase = x.new_zeros(heads, M, dtype=dtype)
            h = x.new_zeros(heads, head_dim, N, dtype=dtype)
            key = x.new_zeros(ranks, heads, N, dtype=dtype)
            value = x.new_zeros(heads, head_dim, dtype=dtype)
        else:
            phase, h, key, value = (s[i].to(dtype) for s in initial_state)
            if not rank_axis:
                key = key.unsqueeze(0)
        turn = torch.exp(torch.complex(torch.zeros_like(phase), -phase))  # e^{-iφ}: into the frame
        hc, hr = as_complex(h)
        hc = hc * turn[:, None, :]  # (H, P, M)
        kc, kr = as_complex(key)
        kc = kc * turn  # (R, H, M): the previous key, unrotated
        prev_v = value[None] * vx  # (R, H, P)
        prev_kc, prev_kr = kc, kr
        ys = []
        for t in range(start, end):
            delta, a, lam = dt[b, t].to(dtype), A[b, t].to(dtype), trap[b, t].to(dtype)  # (H,)
            theta = angles[b, t].to(dtype)  # (H, M)
            phase = phase + delta[:, None] * theta
            decay_c = torch.exp(delta[:, None] * torch.complex(a[:, None].expand(-1, M), -theta))  # (H, M)
            decay_r = torch.exp(delta * a)  # (H,)
            k_c, k_r = as_complex(k_all[b, t])  # (R, H, M), (R, H, N - 2M)
            q_c, q_r = as_complex(q_all[b, t])
            v = x_all[b, t][None] * vx  # (R, H, P)
            prev_in_c = torch.einsum("rhp,rhm->hpm", prev_v.to(cdtype), prev_kc)
            prev_in_r = torch.einsum("rhp,rhn->hpn", prev_v, prev_kr)
            new_in_c = torch.einsum("rhp,rhm->hpm", v.to(cdtype), k_c)
            new_in_r = torch.einsum("rhp,rhn->hpn", v, k_r)
            beta = ((1 - lam) * delta)[:, None, None]
            gamma = (lam * delta)[:, None, None]
            hc = decay_c[:, None, :] * (hc + beta * prev_in_c) + gamma * new_in_c
            hr = decay_r[:, None, None] * (hr + beta * prev_in_r) + gamma * new_in_r
            y = torch.einsum("hpm,rhm->rhp", hc.conj(), q_c).real + torch.einsum("hpn,rhn->rhp", hr, q_r)
            if D is not None:
                y = y + D.to(dtype)[None, :, None] * v
            if z is not None:
                gate = z[b, t].to(dtype)[None] * (1.0 if vz is None else vz)
                y = y * gate * torch.sigmoid(gate)
            if mimo_o is not None:
                y = (y * mimo_o.to(dtype).transpose(0, 1)).sum(0)  # (H, P)
            elif not rank_axis:
                y = y[0]
            ys.append(y)
            prev_v, prev_kc, prev_kr = v, k_c, k_r
        if not ys:  # a sequence without steps hands over its initial state as it is
            last.append((phase, h, key if rank_axis else key[0], value))
            continue
        outs[i] = torch.stack(ys)
        turn_back = torch.exp(torch.complex(torch.zeros_like(phase), phase))  # e^{iφ}: back out
        h_last = as_real(hc * turn_back[:, None, :], hr)
        key_last = as_real(prev_kc * turn_back, prev_kr)
        last.append((phase, h_last, key_last if rank_axis else key_last[0], x_all[b, end - 1]))

    out_shape = (heads, head_dim) if (mimo_o is not None or not rank_axis) else (ranks, heads, head_dim)
    if cu_seqlens is None:
        out = torch.stack([o if o is not None else x_all.new_zeros(0, *out_shape) for o in outs])
    else:
        out = torch.cat([o for o in outs if o is not None] or [x_all.new_zeros(0, *out_shape)])[None]
    last_state = tuple(torch.stack(parts) for parts in zip(*last))
    return out.to(x.dtype), last_state
