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
from ._common_trapezoidal import Prepared, TrapezoidalArgs, gate_and_contract, keys_queries_values, run_core
from .chunked import entering_states

RECOMPUTE = True  # the intra-chunk products recomputed in the backward (see _chunks)


def _chunks(k, q, v, a, sigma, c, H0, chunk_size: int):
    """One run of the core over (B, L, ...) inputs (k, q: (B, L, R, H, N); v: (B, L, R, H, P);
    a, sigma, c: (B, L, H); H0: (B, H, P, N) or None). Returns y (B, L, R, H, P) (before the
    skip, the gate and the rank contraction) and the state after the last step."""
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
    if RECOMPUTE and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, s, sigma, c)):
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
    sequences one after another. (Also what the "cpu" backend runs where its sweeps cannot.)"""
    x, cu_seqlens, dtype = args.x, args.cu_seqlens, args.dtype
    heads = x.shape[2]
    k, q, v = keys_queries_values(args, p.cos, p.sin)  # (B, L, R, H, N), (B, L, R, H, P)
    a, sigma, c = p.a, p.s, p.c
    if cu_seqlens is None:
        y, H_last = _chunks(k, q, v, a, sigma, c, p.H_init, args.chunk_size)
    else:
        ys, lasts = [], []
        for i, (start, end) in enumerate(pairwise(sequence_bounds(cu_seqlens))):
            H0 = None if p.H_init is None else p.H_init[i : i + 1]
            if end == start:
                lasts.append(H0 if H0 is not None else v.new_zeros(1, heads, v.shape[-1], k.shape[-1]))
                continue
            part = slice(start, end)
            y_i, last_i = _chunks(
                k[:, part], q[:, part], v[:, part], a[:, part], sigma[:, part], c[:, part], H0, args.chunk_size
            )
            ys.append(y_i)
            lasts.append(last_i)
        y, H_last = torch.cat(ys, dim=1), torch.cat(lasts)
    out = gate_and_contract(y, v, args.D, args.z, args.mimo_z, args.mimo_o, dtype)
    return out.to(x.dtype), H_last


def trapezoidal_scan_chunked(args: TrapezoidalArgs):
    """Backend "chunked" of :func:`ssm.scan.trapezoidal_scan`: (out, last state)."""
    return run_core(chunked_core, args)
