"""The chunked SSD algorithm (Mamba-2): quadratic attention-like form inside each chunk, a linear
recurrence of chunk states across chunks. Pure PyTorch, any device; gradients by autograd. The
recurrence across chunks (``entering_states``, one linear_scan) also serves trapezoidal_chunked.py.

Why it is fast: all the work but the (short) recurrence over chunks is batched matrix products,
and the (B, L, H, P, N) state tensor is never formed, only one state per chunk.

Splitting the sequence into chunks of T steps, with a_t = Δ_t·A and the within-chunk cumulative
sums s_t = a_0 + ... + a_t, the recurrence of ``ssd_ref`` unrolls to

    y_t = Σ_{u ≤ t in chunk} (C_t·B_u) exp(s_t − s_u) Δ_u x_u        (intra-chunk, "diagonal")
        + exp(s_t) · C_t·S_prev                                      (the state entering the chunk)
    S_end = exp(s_{T−1})·S_prev + Σ_u exp(s_{T−1} − s_u) Δ_u x_u ⊗ B_u

Packed sequences (``cu_seqlens``, batch 1) keep the same chunk grid, whatever the lengths: a
sequence boundary may fall anywhere inside a chunk. With each step's sequence known, the
within-chunk weight of source step u on step t is kept only when both belong to one sequence;
a chunk adds to the state at its end only the steps of the sequence that reaches that end; the
state entering a chunk is read out only by the steps that continue its sequence, and passes
through the chunk only if no sequence starts inside it. The state after each sequence's last
step, in whichever chunk it ends, is the state entering that chunk (if the sequence began
before it) plus its own steps in that chunk, decayed to its last step. Per-sequence initial
states enter by linearity: sequence s adds exp(Σ_{r≤t} a_r)·C_t·h0[s] to its outputs (the
sum from its first step) and exp(Σ a)·h0[s] to its last state, one small product per sequence.

Symbols: B batch, L length, H heads = G groups × Hg heads per group, P head dim, N state size,
c chunks, T positions inside a chunk (T' the source step of the T × T' within-chunk weights),
S packed sequences (S' the non-empty ones).
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F
from einops import rearrange

from ._checks import compute_dtype, sequence_bounds
from ._common import all_finite, finite_or_zero, poisoned_since, ssd_delta, ssd_skip_and_gate
from .linear import linear_scan


def ssd_chunked(
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
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``reference.ssd_ref``, packed sequences included."""
    dtype = compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_state)
    batch, length, heads, head_dim = x.shape
    groups, N = B.shape[2], B.shape[3]
    Hg = heads // groups
    out_dtype = x.dtype
    x_in = x.to(dtype)
    dt = ssd_delta(dt.to(dtype), dt_bias, dt_softplus, dt_limit)  # (B, L, H)
    x, B, C_in = x_in, B.to(dtype), C.to(dtype)
    # A non-finite x, Δ or B at step u makes the state non-finite from u on in its sequence; here
    # it is 0 in every product, and the outputs and last states it reaches are NaN at the end
    # (_common.py, "non-finite inputs"). C_t reaches y_t alone: it needs no mask.
    poison = None
    if not all_finite(x, dt, B):
        poison = _poison(x, dt, B, cu_seqlens, heads // groups)
        x, dt, B = finite_or_zero(x), finite_or_zero(dt), finite_or_zero(B)
    dt_in = dt

    # Pad L to whole chunks. Padded steps have Δ = 0: no decay and no input, so they change
    # neither the outputs of real steps nor the last state.
    T = min(chunk_size, length)
    pad = (-length) % T
    C = C_in
    if pad:
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        dt = F.pad(dt, (0, 0, 0, pad))
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))
    c = (length + pad) // T
    # Heads split into their groups (Hg heads share a group's B and C), time into chunks.
    x = rearrange(x, "b (c t) (g h) p -> b c t g h p", t=T, g=groups)
    dt = rearrange(dt, "b (c t) (g h) -> b c t g h", t=T, g=groups)
    B, C = (rearrange(v, "b (c t) g n -> b c t g n", t=T) for v in (B, C))

    a = rearrange(dt * A.to(dtype).reshape(groups, Hg), "b c t g h -> b c g h t")
    s = torch.cumsum(a, dim=-1)  # (B, c, G, Hg, T)

    # Which steps may see which (all of them, without packing).
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()  # (T, T')
    if cu_seqlens is not None:
        seq = _sequence_of_each_step(cu_seqlens, length, pad).view(c, T)  # (c, T)
        causal = causal & (seq[:, :, None] == seq[:, None, :])  # (c, T, T'): one sequence
        before = torch.cat([seq.new_full((1,), -1), seq[:-1, -1]])  # (c,) the step before each chunk's
        continues = (seq == before[:, None]).to(dtype)  # (c, T): continues the sequence entering
        reaches_end = (seq == seq[:, -1:]).to(dtype)  # (c, T): in the sequence at the chunk's end

    # Intra-chunk: weights W[t, u] = (C_t·B_u) exp(s_t − s_u) Δ_u for u ≤ t.
    visible = causal if causal.ndim == 2 else causal[:, None, None]  # (T, T') or (c, 1, 1, T, T')
    log_decay = (s[..., :, None] - s[..., None, :]).masked_fill(~visible, float("-inf"))
    scores = torch.einsum("bctgn,bcsgn->bcgts", C, B)  # (B, c, G, T, T')
    dt_s = rearrange(dt, "b c s g h -> b c g h 1 s")
    W = scores[:, :, :, None] * torch.exp(log_decay) * dt_s  # (B, c, G, Hg, T, T')
    y = torch.einsum("bcgrts,bcsgrp->bctgrp", W, x)  # (B, c, T, G, Hg, P)

    # What each chunk adds to the state at its end, and the decay of the whole chunk.
    to_end = torch.exp(s[..., -1:] - s) * rearrange(dt, "b c t g h -> b c g h t")
    chunk_decay = torch.exp(s[..., -1])  # (B, c, G, Hg)
    read_entering = torch.exp(s)  # (B, c, G, Hg, T)
    if cu_seqlens is not None:
        to_end = to_end * reaches_end[:, None, None, :]
        chunk_decay = chunk_decay * continues[:, -1, None, None]
        read_entering = read_entering * continues[:, None, None, :]
    chunk_inputs = torch.einsum("bcgrs,bcsgrp,bcsgn->bcgrpn", to_end, x, B)  # (B, c, G, Hg, P, N)
    chunk_decay = chunk_decay[..., None, None]  # (B, c, G, Hg, 1, 1)

    # Across chunks: S_k = decay_k·S_{k−1} + inputs_k, keeping the state entering each chunk.
    if initial_state is None or cu_seqlens is not None:  # packed: initial states come last
        state = x.new_zeros(batch, groups, Hg, head_dim, N)
    else:
        state = initial_state.to(dtype).reshape(batch, groups, Hg, head_dim, N)
    entering, state = entering_states(chunk_decay, chunk_inputs, state)  # entering: (B, c, G, Hg, P, N)

    # Inter-chunk: the entering state, decayed to step t and read out with C_t.
    y = y + torch.einsum("bctgn,bcgrpn,bcgrt->bctgrp", C, entering, read_entering)

    y = rearrange(y, "b c t g h p -> b (c t) (g h) p")[:, :length]
    if cu_seqlens is None:
        last = state.reshape(batch, heads, head_dim, N)
    else:
        last = _packed_last_states(cu_seqlens, T, s, dt, x, B, entering, continues, seq)  # (S, H, P, N)
        if initial_state is not None:
            y, last = _add_initial_states(y, last, initial_state.to(dtype), cu_seqlens, dt_in * A.to(dtype), C_in)
    if poison is not None:
        y, last = y.masked_fill(poison[0], float("nan")), last.masked_fill(poison[1], float("nan"))
    out = ssd_skip_and_gate(y, x_in, D, z)
    return out.to(out_dtype), last


def _poison(x, dt, B, cu_seqlens, Hg: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the recurrence makes the result non-finite: y (B, L, H, P) at and after a non-finite
    x[t, h, p], Δ[t, h] or B[t, g(h), ·] in its sequence, and the last states (B or S, H, P, N)
    (only column n for a non-finite B[·, n]). x (B, L, H, P), dt (B, L, H), B (B, L, G, N)."""
    since_xdt = poisoned_since(~torch.isfinite(x) | ~torch.isfinite(dt)[..., None], cu_seqlens)  # (B, L, H, P)
    since_B = poisoned_since(~torch.isfinite(B), cu_seqlens)  # (B, L, G, N)
    y = since_xdt | since_B.any(-1).repeat_interleave(Hg, dim=2)[..., None]
    if cu_seqlens is None:
        last_xdt, last_B = since_xdt[:, -1], since_B[:, -1]  # (B, H, P), (B, G, N)
    else:
        nonempty = (cu_seqlens[1:] > cu_seqlens[:-1])[:, None, None]
        at = (cu_seqlens[1:] - 1).clamp(min=0)
        last_xdt, last_B = since_xdt[0, at] & nonempty, since_B[0, at] & nonempty  # (S, H, P), (S, G, N)
    last = last_xdt[..., None] | last_B.repeat_interleave(Hg, dim=1)[:, :, None, :]
    return y, last


def _sequence_of_each_step(cu_seqlens: torch.Tensor, length: int, pad: int) -> torch.Tensor:
    """(L + pad,) the sequence each step belongs to; padded steps (Δ = 0: they change nothing)
    count as the last step's sequence."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths, output_size=length)
    return torch.cat([seq, seq[-1:].expand(pad)])


def _packed_last_states(cu_seqlens, T, s, dt, x, B, entering, continues, seq):
    """Each sequence's state after its last step q (in chunk k = q // T, at o = q % T), from a
    zero initial state: the state entering chunk k decayed to o (if the sequence began before
    chunk k), plus its own steps u ≤ o in chunk k, each decayed from u to o.
    Returns (S, H, P, N); zero for empty sequences."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    nonempty = (lengths > 0).nonzero()[:, 0]  # (S',)
    q = cu_seqlens[1:][nonempty] - 1
    k, o = q // T, q % T  # (S',)
    s_k = s[0][k]  # (S', G, Hg, T)
    s_o = s_k.gather(-1, o[:, None, None, None].expand(*s_k.shape[:-1], 1))  # (S', G, Hg, 1)
    steps = torch.arange(T, device=q.device)
    own = (steps <= o[:, None]) & (seq[k] == nonempty[:, None])  # (S', T)
    weight = torch.exp((s_o - s_k).masked_fill(~own[:, None, None, :], float("-inf")))
    weight = weight * dt[0][k].permute(0, 2, 3, 1)  # (S', G, Hg, T)
    own_steps = torch.einsum("sgru,sugrp,sugn->sgrpn", weight, x[0][k], B[0][k])  # (S', G, Hg, P, N)
    carried = (continues[k, o][:, None, None] * torch.exp(s_o[..., 0]))[..., None, None] * entering[0][k]
    last_nonempty = (own_steps + carried).flatten(1, 2)  # (S', H, P, N)
    last = last_nonempty.new_zeros(lengths.numel(), *last_nonempty.shape[1:])
    return last.index_copy(0, nonempty, last_nonempty)


def _add_initial_states(y, last, h0, cu_seqlens, a, C):
    """Sequence s's initial state h0[s] (S, H, P, N), carried by linearity: its outputs gain
    exp(Σ_{first ≤ r ≤ t} a_r)·C_t·h0[s] and its last state exp(Σ a)·h0[s] (an empty sequence's
    last state is h0[s] itself). y (1, L, H, P); a = Δ·A (1, L, H); C (1, L, G, N)."""
    groups = C.shape[2]
    S, heads, head_dim, N = h0.shape
    y_parts, lasts = [], []
    for seq, (start, end) in enumerate(pairwise(sequence_bounds(cu_seqlens))):
        h0_s = h0[seq]
        if end == start:
            lasts.append(h0_s)
            continue
        decay = torch.exp(torch.cumsum(a[0, start:end], dim=0))  # (len, H)
        read = torch.einsum("tgn,grpn->tgrp", C[0, start:end], h0_s.view(groups, heads // groups, head_dim, N))
        y_parts.append(decay[..., None] * read.flatten(1, 2))  # (len, H, P)
        lasts.append(decay[-1, :, None, None] * h0_s)
    return y + torch.cat(y_parts)[None], last + torch.stack(lasts)


def entering_states(
    decay: torch.Tensor, inputs: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Across the chunks of the chunked algorithms (this one and trapezoidal_chunked.py's),
    S_k = decay_k·S_{k−1} + inputs_k from S_{−1} = ``state``: (the state entering each chunk,
    stacked along dim 1, and the state after the last). decay (B, c, ...) broadcasts against
    inputs (B, c, ...); state: inputs without dim 1.

    One call of the library's linear scan (its ``auto`` backend: the C sweeps on the CPU, Triton
    on CUDA). It was a loop over the chunks, two ops each and more in the backward: on an H100
    at L 2^18 in chunks of 32 (8192 chunks) ``ssd`` spent 939 ms of its forward+backward
    launching them, 12.9 ms now; on the CPU the loop took 44 / 62-97 ms forward / backward at
    2048 chunks of 5120 columns, the scan 28 / 47."""
    states = linear_scan(decay.expand_as(inputs), inputs, dim=1, initial_state=state)
    return torch.cat([state.unsqueeze(1), states[:, :-1]], dim=1), states[:, -1].contiguous()
