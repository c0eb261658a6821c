"""The chunked SSD algorithm (Mamba-2): quadratic attention-like form inside each chunk, a linear
recurrence of chunk states across chunks. Pure PyTorch, any device; gradients by autograd.

Why it is fast: all the work but the (short) recurrence over chunks is batched matrix products,
and the (B, L, H, P, N) state tensor is never formed, only one state per chunk.

Splitting the sequence into chunks of T steps, with a_t = Δ_t·A and the within-chunk cumulative
sums s_t = a_0 + ... + a_t, the recurrence of ``ssd_ref`` unrolls to

    y_t = Σ_{u ≤ t in chunk} (C_t·B_u) exp(s_t − s_u) Δ_u x_u        (intra-chunk, "diagonal")
        + exp(s_t) · C_t·S_prev                                      (the state entering the chunk)
    S_end = exp(s_{T−1})·S_prev + Σ_u exp(s_{T−1} − s_u) Δ_u x_u ⊗ B_u

Symbols: B batch, L length, H heads = G groups × Hg heads per group, P head dim, N state size,
c chunks, T positions inside a chunk (T' the source step of the T × T' within-chunk weights).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import compute_dtype
from ._common import ssd_delta, ssd_skip_and_gate


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``reference.ssd_ref``."""
    dtype = compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_state)
    batch, length, heads, head_dim = x.shape
    groups, N = B.shape[2], B.shape[3]
    Hg = heads // groups
    out_dtype = x.dtype
    x_in = x.to(dtype)
    dt = ssd_delta(dt.to(dtype), dt_bias, dt_softplus, dt_limit)  # (B, L, H)

    # Pad L to whole chunks. Padded steps have Δ = 0: no decay and no input, so they change
    # neither the outputs of real steps nor the last state.
    T = min(chunk_size, length)
    pad = (-length) % T
    x, B, C = x_in, B.to(dtype), C.to(dtype)
    if pad:
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        dt = F.pad(dt, (0, 0, 0, pad))
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))
    c = (length + pad) // T
    x = x.reshape(batch, c, T, groups, Hg, head_dim)  # (B, c, T, G, Hg, P)
    dt = dt.reshape(batch, c, T, groups, Hg)  # (B, c, T, G, Hg)
    B = B.reshape(batch, c, T, groups, N)  # (B, c, T, G, N)
    C = C.reshape(batch, c, T, groups, N)

    a = (dt * A.to(dtype).reshape(groups, Hg)).permute(0, 1, 3, 4, 2)  # (B, c, G, Hg, T)
    s = torch.cumsum(a, dim=-1)  # (B, c, G, Hg, T)

    # Intra-chunk: weights W[t, u] = (C_t·B_u) exp(s_t − s_u) Δ_u for u ≤ t.
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    log_decay = (s[..., :, None] - s[..., None, :]).masked_fill(~causal, float("-inf"))
    scores = torch.einsum("bctgn,bcsgn->bcgts", C, B)  # (B, c, G, T, T')
    dt_s = dt.permute(0, 1, 3, 4, 2)[..., None, :]  # (B, c, G, Hg, 1, T')
    W = scores[:, :, :, None] * torch.exp(log_decay) * dt_s  # (B, c, G, Hg, T, T')
    y = torch.einsum("bcgrts,bcsgrp->bctgrp", W, x)  # (B, c, T, G, Hg, P)

    # What each chunk adds to the state at its end, and the decay of the whole chunk.
    to_end = torch.exp(s[..., -1:] - s) * dt.permute(0, 1, 3, 4, 2)  # (B, c, G, Hg, T)
    chunk_inputs = torch.einsum("bcgrs,bcsgrp,bcsgn->bcgrpn", to_end, x, B)  # (B, c, G, Hg, P, N)
    chunk_decay = torch.exp(s[..., -1])[..., None, None]  # (B, c, G, Hg, 1, 1)

    # Across chunks: S_k = decay_k·S_{k−1} + inputs_k, keeping the state entering each chunk.
    if initial_state is None:
        state = x.new_zeros(batch, groups, Hg, head_dim, N)
    else:
        state = initial_state.to(dtype).reshape(batch, groups, Hg, head_dim, N)
    entering = []
    for k in range(c):
        entering.append(state)
        state = chunk_decay[:, k] * state + chunk_inputs[:, k]
    entering = torch.stack(entering, dim=1)  # (B, c, G, Hg, P, N)

    # Inter-chunk: the entering state, decayed to step t and read out with C_t.
    y = y + torch.einsum("bctgn,bcgrpn,bcgrt->bctgrp", C, entering, torch.exp(s))

    y = y.reshape(batch, c * T, heads, head_dim)[:, :length]  # (B, L, H, P)
    out = ssd_skip_and_gate(y, x_in, D, z)
    return out.to(out_dtype), state.reshape(batch, heads, head_dim, N)
