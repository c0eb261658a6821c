"""Backend "chunked" of ``trapezoidal_scan`` (Mamba-3): the chunked SSD algorithm (chunked.py)
on the shifted form of the recurrence (see _common_trapezoidal.py). Pure PyTorch, any device;
gradients by autograd.

Inside a chunk of T steps, with cumulative log decays s_t = a_0 + ... + a_t and the R ranks of
each step as R positions sharing its decay,

    y_{t,r} = Σ_{u < t, r'} (q̃_{t,r}·k̃_{u,r'}) exp(s_t − s_u) σ_u v_{u,r'}
            + Σ_{r'} (q̃_{t,r}·k̃_{t,r'}) (σ_t − c_t) v_{t,r'}            (the diagonal: λ_t·Δ_t)
            + exp(s_t) · H_prev·q̃_{t,r}                                   (the state entering)
    H_end = exp(s_{T−1})·H_prev + Σ_u exp(s_{T−1} − s_u) σ_u Σ_r v_{u,r} ⊗ k̃_{u,r}

(σ is the shifted form's s, renamed here to keep s for the log decays). Packed sequences run
one after another, each from its own initial state.

Symbols: B batch, c chunks, T (U) positions inside a chunk, R (R') ranks, H heads, P head dim,
N state size.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ._checks import sequence_bounds
from ._common import all_finite, finite_or_zero, poisoned_since
from ._common_trapezoidal import (
    Prepared,
    TrapezoidalArgs,
    gate_and_contract,
    keys_queries_values,
    run_core,
    tensor_rotary_phase,
)
from .chunked import entering_states
from .linear import linear_scan

RECOMPUTE = True  # the intra-chunk products recomputed in the backward (see _chunks)


def _chunks(k, q, v, a, sigma, c, H0, chunk_size: int, recompute: bool = RECOMPUTE):
    """One run of the core over (B, L, ...) inputs (k, q: (B, L, R, H, N); v: (B, L, R, H, P);
    a, sigma, c: (B, L, H); H0: (B, H, P, N) or None). Returns y (B, L, R, H, P) (before the
    skip, the gate and the rank contraction) and the state after the last step. ``recompute``:
    the intra-chunk products formed again in the backward (False where a caller recomputes
    the whole run)."""
    batch, length, ranks, heads, N = k.shape
    P = v.shape[-1]
    # A non-finite key, value, a, σ or c at step u makes the state non-finite from u on: 0 in the
    # products here, NaN in the outputs and the state it reaches at the end (see _common.py,
    # "non-finite inputs"); a query q_t reaches y_t alone.
    poison = None if all_finite(k, v, a, sigma, c) else _poison(k, v, a, sigma, c)
    if poison is not None:
        k, v, a, sigma, c = (finite_or_zero(t) for t in (k, v, a, sigma, c))
    T = min(chunk_size, length)
    pad = (-length) % T
    if pad:  # padded steps: no decay (a = 0), no input: the state passes through unchanged
        k, q, v = (F.pad(t, (0, 0, 0, 0, 0, 0, 0, pad)) for t in (k, q, v))
        a, sigma, c = (F.pad(t, (0, 0, 0, pad)) for t in (a, sigma, c))
    nc = (length + pad) // T
    k = k.reshape(batch, nc, T, ranks, heads, N)
    q = q.reshape(batch, nc, T, ranks, heads, N)
    v = v.reshape(batch, nc, T, ranks, heads, P)
    a, sigma, c = (t.reshape(batch, nc, T, heads).permute(0, 1, 3, 2) for t in (a, sigma, c))  # (B, c, H, T)
    s = torch.cumsum(a, dim=-1)

    # The intra-chunk products, their (B, c, H, T, U) weights and (B, c, H, T, R, U, R') scores,
    # recomputed in the backward rather than kept for it (what it reads is kept anyway). Saved for
    # the backward, batch 1, 8 heads, chunks of 64: L 16384, P 16, N 40 354 -> 220 MiB; L 4096,
    # P 64, N 128 258 -> 218 (rank 2: 490 -> 394); what is left grows with L, not with L·T.
    # Forward+backward on 2 loaded cores, alternating: 0.90x, 1.22x, 1.02x the time.
    if recompute and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, s, sigma, c)):
        y = checkpoint(_intra_chunk, q, k, v, s, sigma, c, use_reentrant=False)
    else:
        y = _intra_chunk(q, k, v, s, sigma, c)

    to_end = torch.exp(s[..., -1:] - s) * sigma  # (B, c, H, U)
    chunk_inputs = torch.einsum("bchu,bcurhp,bcurhn->bchpn", to_end, v, k)  # (B, c, H, P, N)
    chunk_decay = torch.exp(s[..., -1])[..., None, None]  # (B, c, H, 1, 1)
    state = k.new_zeros(batch, heads, P, N) if H0 is None else H0
    entering, state = entering_states(chunk_decay, chunk_inputs, state)  # entering: (B, c, H, P, N)
    y = y + torch.einsum("bctrhn,bchpn,bcht->bctrhp", q, entering, torch.exp(s))
    y = y.reshape(batch, nc * T, ranks, heads, P)[:, :length]
    if poison is not None:
        y, state = y.masked_fill(poison[0][:, :, None], float("nan")), state.masked_fill(poison[1], float("nan"))
    return y, state


def _intra_chunk(q, k, v, s, sigma, c):
    """y_{t,r} from the steps of its own chunk: weights W[t, u] = exp(s_t − s_u)·σ_u for u < t,
    σ_t − c_t on the diagonal, times the scores q̃_{t,r}·k̃_{u,r'}, times v_{u,r'}."""
    T = s.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=k.device).tril()
    log_decay = (s[..., :, None] - s[..., None, :]).masked_fill(~causal, float("-inf"))
    W = torch.exp(log_decay) * sigma[..., None, :] - torch.diag_embed(c)  # (B, c, H, T, U)
    scores = torch.einsum("bctrhn,bcuqhn->bchtruq", q, k)  # (B, c, H, T, R, U, R')
    return torch.einsum("bchtruq,bchtu,bcuqhp->bctrhp", scores, W, v)


def _poison(k, v, a, sigma, c) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the recurrence makes the result non-finite: y (B, L, H, P) at and after a non-finite
    v[t, ·, h, p], k[t, ·, h, ·] or a, σ, c [t, h], and the last state (B, H, P, N) (only column n
    for a non-finite k[·, n])."""
    head = ~torch.isfinite(a) | ~torch.isfinite(sigma) | ~torch.isfinite(c)  # (B, L, H)
    since_v = poisoned_since((~torch.isfinite(v)).any(2) | head[..., None], None)  # (B, L, H, P)
    since_k = poisoned_since((~torch.isfinite(k)).any(2), None)  # (B, L, H, N)
    return since_v | since_k.any(-1)[..., None], since_v[:, -1][..., None] | since_k[:, -1][:, :, None, :]


def chunked_core(args: TrapezoidalArgs, p: Prepared):
    """The core (see _common_trapezoidal.py) by chunks: out in x's dtype and H_{L-1}; packed
    sequences one after another. (Also what the "cpu" backend runs where its sweeps cannot.)

    With gradients, the whole run from the scan's inputs to y + D·v is formed again in the
    backward (``checkpoint``): it keeps only what it came with (x, B and C per group, most
    often views of in_proj's output; a, s, c; Δ and θ, which the phase keeps). Kept, the keys
    and queries per head and rank, the values, the chunks' states and the inputs of every
    product were the most of a Mamba-3 layer's memory: at d_model 768, N 128, P 64, rank 4,
    under bfloat16 autocast, the layer kept 274,858 bytes a token, and now 38,760
    (``benchmark.py --op saved --gpu-path``). Forming them again costs the rotations and the
    products across chunks once more (the intra-chunk products, most of the work, were formed
    again before this too): a layer's forward+backward on this backend, one CPU thread, took
    1.08x (rank 4) and 1.13x (rank 1) the time.

    The region is a closure, and what it reads is held until the backward without a
    saved-tensor hook seeing it: it takes a, s, c and H_{-1}, and where the phase has a source
    it forms cos and sin inside from Δ and θ (one more sum along L in the forward) rather than
    hold the prepared phase, cos and sin, 3·H·M numbers a token (about 9 KB at the width
    above). Without a source (packed sequences) it holds cos and sin, which its backward needs."""

    source = p.source

    def products(a, s, c, H_init, cos, sin, rotations_source=None):
        if cos is None:  # formed here from the source, so that nothing holds them until the backward
            _, cos, sin = tensor_rotary_phase(source.delta, source.angles, source.phase0, None, source.dtype)
        k, q, v = keys_queries_values(args, cos, sin, rotations_source)  # (B, L, R, H, N), (B, L, R, H, P)
        y, H_last = chunked_products(k, q, v, a, s, c, H_init, args.cu_seqlens, args.chunk_size, recompute=False)
        if args.D is not None:
            y = y + args.D.to(args.dtype)[:, None] * v
        return y, H_last

    inputs = (args.x, args.B, args.C, args.B_bias, args.C_bias, args.mimo_x, args.D, p.a, p.s, p.c, p.H_init)
    inputs += (p.cos, p.sin) if source is None else (source.delta, source.angles, source.phase0)
    if RECOMPUTE and torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        # The region's arguments and what ``products`` reads are held until the backward: the
        # prepared tensors it needs, never p.phase, and cos and sin only where no source gives them
        cos, sin = (p.cos, p.sin) if source is None else (None, None)
        y, H_last = checkpoint(products, p.a, p.s, p.c, p.H_init, cos, sin, use_reentrant=False)
    else:
        y, H_last = products(p.a, p.s, p.c, p.H_init, p.cos, p.sin, source)  # the rotations keep the source
    out = gate_and_contract(y, None, None, args.z, args.mimo_z, args.mimo_o, args.dtype)
    return out.to(args.x.dtype), H_last


def chunked_products(k, q, v, a, sigma, c, H_init, cu_seqlens, chunk_size: int, recompute: bool = RECOMPUTE):
    """The core's y (B, L, R, H, P) (before the skip term, the gate and the rank contraction)
    and H_{L-1}, by chunks, from the rotated keys and queries k, q (B, L, R, H, N), the values
    v (B, L, R, H, P), a, σ, c (B, L, H) and H_{-1} (B or S, H, P, N) or None; packed
    sequences one after another (``recompute``: see ``_chunks``)."""
    if cu_seqlens is None:
        return _chunks(k, q, v, a, sigma, c, H_init, chunk_size, recompute)

    def run(start, end, H0):
        k_i, q_i, v_i, a_i, sigma_i, c_i = (t[:, start:end] for t in (k, q, v, a, sigma, c))
        return _chunks(k_i, q_i, v_i, a_i, sigma_i, c_i, H0, chunk_size, recompute)

    ys, H_last = each_sequence(cu_seqlens, H_init, lambda: v.new_zeros(1, k.shape[3], v.shape[-1], k.shape[-1]), run)
    return torch.cat(ys, dim=1), H_last


def each_sequence(cu_seqlens, H_init, empty_state, run):
    """Packed sequences one after another: the outputs ``run(start, end, H0)`` of each non-empty
    sequence (a list, for the caller to join along its length axis) and the last states of all
    (S, H, P, N), an empty sequence's its initial state (H_init[i], or ``empty_state()``)."""
    ys, lasts = [], []
    for i, (start, end) in enumerate(pairwise(sequence_bounds(cu_seqlens))):
        H0 = None if H_init is None else H_init[i : i + 1]
        if end == start:
            lasts.append(H0 if H0 is not None else empty_state())
            continue
        y_i, last_i = run(start, end, H0)
        ys.append(y_i)
        lasts.append(last_i)
    return ys, torch.cat(lasts)


def trapezoidal_scan_chunked(args: TrapezoidalArgs):
    """Backend "chunked" of :func:`ssm.scan.trapezoidal_scan`: (out, last state)."""
    return run_core(chunked_core, args)


# ----------------------------------------------------------------------------- rank 1, heads first


def products_heads_first(k, q, v, a, sigma, c, H_init, chunk_size: int, ranks: int = 1):
    """The core by chunks in the layout of its matrix products: the rotated keys and queries
    k, q (B, H, L·R, N) and values v (B, H, L·R, P), each head's steps adjacent, a step's R ranks
    at positions t·R .. t·R + R − 1 (R = ``ranks``, 1 without MIMO); a, σ, c (B, L, H) per step;
    H_{-1} (B, H, P, N) or None. Returns y (B, H, L·R, P) (before the skip term, the gate and the
    rank contraction; the diagonal weighs v by σ_t − c_t) and H_{L-1} (B, H, P, N).

    What :func:`chunked_products` computes, without its rank axes, permutes and einsum copies:
    every product is one batched matrix product over (B, H, chunks), a step's R ranks R positions
    that share its decay (a block of R × R on the diagonal), and the intra-chunk weights and
    scores ((T·R)² per chunk of T steps) are formed again in the backward (``_IntraChunk``)
    rather than kept. All entries must be finite (the caller checks)."""
    batch, heads, positions, N = k.shape
    P, length = v.shape[-1], positions // ranks
    T = min(chunk_size, length)
    pad = (-length) % T
    a, sigma, c = (t.transpose(1, 2) for t in (a, sigma, c))  # (B, H, L)
    if pad:  # padded steps: no decay (a = 0), no input: the state passes through unchanged
        k, q, v = (F.pad(t, (0, 0, 0, pad * ranks)) for t in (k, q, v))
        a, sigma, c = (F.pad(t, (0, pad)) for t in (a, sigma, c))
    nc, TR = (length + pad) // T, T * ranks
    if ranks > 1:  # per position: the step's decay at its first rank only, its σ and c at each
        a = F.pad(a[..., None], (0, ranks - 1)).flatten(-2)
        sigma, c = (t.repeat_interleave(ranks, dim=-1) for t in (sigma, c))
    s = torch.cumsum(a.reshape(batch, heads, nc, TR), dim=-1)  # (B, H, c, T·R) log decays within each chunk
    chunks = batch * heads * nc
    y, inputs = _IntraChunk.apply(
        q.reshape(chunks, TR, N), k.reshape(chunks, TR, N), v.reshape(chunks, TR, P),
        s.reshape(chunks, TR), sigma.reshape(chunks, TR), c.reshape(chunks, TR), ranks,
    )  # fmt: skip
    inputs = inputs.view(batch, heads, nc, P, N)
    decay = torch.exp(s[..., -1])[..., None, None].expand_as(inputs)  # (B, H, c, P, N)
    state = k.new_zeros(batch, heads, P, N) if H_init is None else H_init
    states = linear_scan(decay, inputs, dim=2, initial_state=state)  # the state after each chunk
    entering = torch.cat([state.unsqueeze(2), states[:, :, :-1]], dim=2).view(chunks, P, N)
    # the state entering each chunk, read by its queries: exp(s_t)·H·q_t
    y = torch.baddbmm(y, q.reshape(chunks, TR, N) * torch.exp(s).reshape(chunks, TR, 1), entering.transpose(1, 2))
    y = y.view(batch, heads, nc * TR, P)[:, :, :positions]
    return y, states[:, :, -1].contiguous()  # (a cache keeps it: the fused decoding step reads it whole)


def _intra_weights(s, sigma, c, ranks: int):
    """W (X, T, U) of a chunk of positions (R = ``ranks`` a step): exp(s_t − s_u)·σ_u where u's
    step is before t's, σ_t − c_t where they are the same step (the diagonal, or a block of R × R),
    0 after; E = exp(s_t − s_u) where u's step is before t's (0 elsewhere); and the mask of the
    same-step block (None for R = 1: the diagonal). s, σ, c (X, T)."""
    T = s.shape[-1]
    step = torch.arange(T, device=s.device) // ranks
    before = step[:, None] > step[None, :]
    E = torch.exp((s[:, :, None] - s[:, None, :]).masked_fill(~before, float("-inf")))
    W = E * sigma[:, None, :]
    if ranks == 1:
        W.diagonal(dim1=1, dim2=2).copy_(sigma - c)
        return W, E, None
    same = step[:, None] == step[None, :]
    return torch.where(same, (sigma - c)[:, :, None], W), E, same


class _IntraChunk(torch.autograd.Function):
    """Per chunk x (X = B·H·chunks of them): y = (q·kᵀ ⊙ W)·v, the chunk's own steps' part of
    its outputs, and I = Σ_u exp(s_{T−1} − s_u)·σ_u·v_u ⊗ k_u, what the chunk adds to the state.
    q, k (X, T, N), v (X, T, P), s, σ, c (X, T) over positions, ``ranks`` of them a step. Keeps
    its inputs only: W and q·kᵀ, T × T per chunk, are formed again in the backward."""

    @staticmethod
    def forward(ctx, q, k, v, s, sigma, c, ranks: int):
        W, _, _ = _intra_weights(s, sigma, c, ranks)
        scores = torch.bmm(q, k.transpose(1, 2)).mul_(W)  # (X, T, U)
        y = torch.bmm(scores, v)
        to_end = torch.exp(s[:, -1:] - s) * sigma  # (X, U)
        inputs = torch.bmm((v * to_end[..., None]).transpose(1, 2), k)  # (X, P, N)
        ctx.save_for_backward(q, k, v, s, sigma, c)
        ctx.ranks = ranks
        return y, inputs

    @staticmethod
    def backward(ctx, dy, d_inputs):
        q, k, v, s, sigma, c = ctx.saved_tensors
        W, E, same = _intra_weights(s, sigma, c, ctx.ranks)
        qk = torch.bmm(q, k.transpose(1, 2))  # (X, T, U)
        d_scores = torch.bmm(dy, v.transpose(1, 2))  # d (q·kᵀ ⊙ W)
        dv = torch.bmm((qk * W).transpose(1, 2), dy)
        dW = d_scores * qk
        d_qk = d_scores.mul_(W)
        dq = torch.bmm(d_qk, k)
        dk = torch.bmm(d_qk.transpose(1, 2), q)
        # the chunk's input to the state, I = Σ_u w_u·v_u ⊗ k_u with w_u = exp(s_{T−1} − s_u)·σ_u
        to_end_decay = torch.exp(s[:, -1:] - s)
        to_end = to_end_decay * sigma
        k_dI = torch.bmm(k, d_inputs.transpose(1, 2))  # (X, U, P): Σ_n k_u[n]·dI[p, n]
        dv.addcmul_(k_dI, to_end[..., None])
        dk.addcmul_(torch.bmm(v, d_inputs), to_end[..., None])
        d_to_end = (k_dI * v).sum(-1)  # (X, U)
        # W before t's step is exp(s_t − s_u)·σ_u; in t's own step σ_t − c_t (row t's)
        block = dW.diagonal(dim1=1, dim2=2) if same is None else (dW * same).sum(2)
        d_sigma = (dW * E).sum(1) + block + d_to_end * to_end_decay
        dc = -block
        flow = dW.mul_(E).mul_(sigma[:, None, :])  # dW ⊙ W before the step, 0 in and after it
        ds = flow.sum(2) - flow.sum(1)
        through_end = d_to_end * to_end
        ds -= through_end
        ds[:, -1] += through_end.sum(1)
        return dq, dk, dv, ds, d_sigma, dc, None
