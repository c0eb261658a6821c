"""References of the non-scan ops: plain loops and formulas in float64, written to be read, the
ground truth that every backend of ssm.ops is tested against. Nothing here imports the code it
checks, and it imports nothing from here.

Shape symbols: B batch, L length, D channels, K the conv's width, M a row's width (d_model),
N state size, R dt_rank, V vocabulary; Mamba-2: H heads, P head dim, S = H·P, G groups.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def causal_conv1d_ref(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, state: Tensor | None = None, cu_seqlens: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """y[b, d, t] = bias[d] + Σ_k weight[d, 0, k] · v[b, d, t - (K - 1) + k] for x (B, D, L), where
    v is x within t's sequence and, before the sequence's start, its history (state (B or S, D, K),
    most recent last) or zeros. With cu_seqlens (S + 1,) (B = 1) each sequence on its own.
    Returns (y (B, D, L) float64, the new state (the last K inputs of each sequence) or None)."""
    x, weight = x.double(), weight.double()
    B, D, L = x.shape
    K = weight.shape[-1]
    cuts = [0, L] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    y = torch.zeros(B, D, L, dtype=torch.float64)
    new_state = None if state is None else torch.zeros(state.shape, dtype=torch.float64)
    for b in range(B):
        for s in range(len(cuts) - 1):
            row = b if cu_seqlens is None else s
            lo, hi = cuts[s], cuts[s + 1]
            history = [torch.zeros(D, dtype=torch.float64) for _ in range(K)]
            if state is not None:
                history = [state[row, :, k].double() for k in range(K)]
            steps = history + [x[b, :, t] for t in range(lo, hi)]  # the sequence's inputs after its history
            for t in range(lo, hi):
                i = K + (t - lo)  # index of step t in ``steps``
                acc = torch.zeros(D, dtype=torch.float64) if bias is None else bias.double().clone()
                for k in range(K):
                    acc = acc + weight[:, 0, k] * steps[i - (K - 1) + k]
                y[b, :, t] = acc
            if new_state is not None:
                new_state[row] = torch.stack(steps[-K:], -1)
    return y, new_state


def rms_norm_ref(
    x: Tensor,
    weight: Tensor,
    eps: float,
    z: Tensor | None = None,
    group_size: int | None = None,
    norm_before_gate=False,
) -> Tensor:
    """RMSNorm of x (..., M) over groups of ``group_size`` channels, times weight (M,), in
    float64; with z, norm(x·silu(z)), or norm(x)·silu(z) with ``norm_before_gate``."""
    x, weight = x.double(), weight.double()
    M = x.shape[-1]
    group = M if group_size is None else group_size

    def silu(v):
        return v / (1 + torch.exp(-v))

    v = x if z is None or norm_before_gate else x * silu(z.double())
    out = torch.empty_like(v)
    for g in range(M // group):
        part = v[..., g * group : (g + 1) * group]
        mean_square = (part * part).sum(-1, keepdim=True) / group
        out[..., g * group : (g + 1) * group] = part / torch.sqrt(mean_square + eps)
    out = out * weight
    return out * silu(z.double()) if z is not None and norm_before_gate else out


def _silu(v: float) -> float:
    return v / (1 + math.exp(-v))


def _rms(v: list, w, eps: float) -> list:
    scale = 1 / math.sqrt(sum(e * e for e in v) / len(v) + eps)
    return [e * scale * float(wi) for e, wi in zip(v, w)]


def quantized_ints_ref(q) -> Tensor:
    """The integers an ``ssm.ops.quant.QuantizedMatrix`` (read by field) stores, as float64
    (O, I), input by input: q[r, i] from int8 data, or for int4 from byte 16·(i // 32) + i % 16
    of row r, its low nibble for i % 32 < 16 and its high one else, minus 8."""
    rows, cols = q.data.shape[0], q.in_features
    out = torch.empty(rows, cols, dtype=torch.float64)
    data = q.data.tolist()
    for r in range(rows):
        for i in range(cols):
            j, t = divmod(i, 32)
            if q.scheme == "int8":
                out[r, i] = data[r][i]
            else:
                byte = data[r][16 * j + t % 16]
                out[r, i] = (byte & 15 if t < 16 else byte >> 4) - 8
    return out


def dequantize_ref(q) -> Tensor:
    """A QuantizedMatrix as float64 (O, I): w[r, i] = quantized_ints_ref(q)[r, i]·scales[r, i // 32]."""
    return quantized_ints_ref(q) * torch.repeat_interleave(q.scales.double(), 32, 1)[:, : q.in_features]


def _f32(v: float) -> float:
    """v rounded to float32 (to nearest, ties to even), as a Python float."""
    return torch.tensor(v, dtype=torch.float64).float().item()


def round_activations_ref(x) -> tuple[list[int], list[float]]:
    """The int8 activations of a quantised product (activations="int8") of a float32 vector x
    (I,), one input at a time: per block j of 32 inputs (the last may be shorter),
    d_j = max|x| / 127 and q = round-half-even(x · (1 / d_j)), each operation rounded to float32
    as float32 code computes it; q = 0 over a block of zeros, d_j NaN over a block holding a NaN
    or an infinity. Returns (q, one int per input; d, one float per block)."""
    xs = [float(v) for v in x.float().tolist()]
    q, d = [], []
    for j in range(0, len(xs), 32):
        block = xs[j : j + 32]
        amax = max(abs(v) for v in block)
        if not all(math.isfinite(v) for v in block):
            q += [0] * len(block)
            d.append(math.nan)
            continue
        dj = _f32(amax / 127)
        inv = _f32(1 / dj) if amax > 0 else 0.0
        q += [round(_f32(v * inv)) for v in block]  # Python's round: ties to even
        d.append(dj)
    return q, d


def quantized_product_ref(W, x) -> Tensor:
    """y (O,) = W·x in float64 for an ``ssm.ops.quant.QuantizedMatrix`` W (read by field, as
    dequantize_ref does) whose activations are "int8": x (I,) float32 rounded by
    round_activations_ref, then each block's integer sum times its weight scale and d_j."""
    q, d = round_activations_ref(x)
    ints = quantized_ints_ref(W)
    out = torch.zeros(W.data.shape[0], dtype=torch.float64)
    qt = torch.tensor(q, dtype=torch.float64)
    for j, dj in enumerate(d):
        isum = ints[:, 32 * j : 32 * (j + 1)] @ qt[32 * j : 32 * (j + 1)]
        out += isum * W.scales[:, j].double() * dj
    return out


def _matvec(W, v: list, bias=None) -> list:
    W = dequantize_ref(W) if hasattr(W, "scheme") else W.double()
    out = [float(torch.dot(W[r], torch.tensor(v, dtype=torch.float64))) for r in range(W.shape[0])]
    return out if bias is None else [o + float(b) for o, b in zip(out, bias)]


def _finish(hid: list, res: list, head):
    """(hidden, residual) as float64 tensors, or with ``head`` the logits of every row."""
    if head is None:
        return torch.tensor(hid, dtype=torch.float64), torch.tensor(res, dtype=torch.float64)
    logits = []
    for h_row, r_row in zip(hid, res):
        r = [h + e for h, e in zip(h_row, r_row)]
        logits.append(_matvec(head.weight, _rms(r, head.norm_weight, head.norm_eps)))
    return torch.tensor(logits, dtype=torch.float64)


def mamba_blocks_step_ref(hidden: Tensor, blocks, head=None):
    """The decoding step of a stack of Mamba-1 blocks (``ssm.ops.MambaBlockWeights``, read by
    field), one token per batch row, in float64, written out channel by channel:

        residual = hidden + residual;  x = rmsnorm(residual)
        (xi, z) = in_proj x;  conv_state ← [conv_state[1:], xi];  xc = silu(Σ_k w_k·conv_state_k + b)
        (dt, Bt, Ct) = x_proj xc;  Δ = softplus(dt_proj dt + dt_b)
        h ← exp(Δ·A)·h + Δ·xc·Bt;  y = (Ct·h + D·xc)·silu(z);  hidden = out_proj y

    Returns (hidden, residual), or with ``head`` the logits weight · rmsnorm(hidden + residual).
    The states are not changed; the new ones are returned as well: (out, conv_states, ssm_states)."""

    batch = hidden.shape[0]
    hid = [[float(e) for e in hidden[b]] for b in range(batch)]
    res = [None] * batch
    conv_states, ssm_states = [], []
    for blk in blocks:
        conv_w = blk.conv_weight.double().reshape(blk.conv_weight.shape[0], -1)  # (D, K)
        D, K = conv_w.shape
        N = blk.A.shape[1]
        R = blk.dt_proj_weight.shape[1]
        new_conv = blk.conv_state.double().clone()
        new_ssm = blk.ssm_state.double().clone()
        for b in range(batch):
            r = hid[b] if res[b] is None else [h + e for h, e in zip(hid[b], res[b])]
            res[b] = r
            x = _rms(r, blk.norm_weight, blk.norm_eps)
            xz = _matvec(blk.in_proj_weight, x, blk.in_proj_bias)
            xi, z = xz[:D], xz[D:]
            new_conv[b] = torch.cat([new_conv[b, :, 1:], torch.tensor(xi, dtype=torch.float64)[:, None]], -1)
            xc = []
            for d in range(D):
                acc = sum(float(conv_w[d, k]) * float(new_conv[b, d, k]) for k in range(K))
                xc.append(_silu(acc + (0.0 if blk.conv_bias is None else float(blk.conv_bias[d]))))
            proj = _matvec(blk.x_proj_weight, xc)
            dt, Bt, Ct = proj[:R], proj[R : R + N], proj[R + N :]
            delta = _matvec(blk.dt_proj_weight, dt, blk.dt_proj_bias)
            y = []
            for d in range(D):
                step = delta[d] if delta[d] > 20 else math.log1p(math.exp(delta[d]))
                acc = 0.0
                for n in range(N):
                    h = math.exp(step * float(blk.A[d, n])) * float(new_ssm[b, d, n]) + step * xc[d] * Bt[n]
                    new_ssm[b, d, n] = h
                    acc += Ct[n] * h
                if blk.D is not None:
                    acc += float(blk.D[d]) * xc[d]
                y.append(acc * _silu(z[d]))
            hid[b] = _matvec(blk.out_proj_weight, y, blk.out_proj_bias)
        conv_states.append(new_conv)
        ssm_states.append(new_ssm)
    return _finish(hid, res, head), conv_states, ssm_states


def mamba2_blocks_step_ref(hidden: Tensor, blocks, head=None):
    """The decoding step of a stack of Mamba-2 blocks (``ssm.ops.Mamba2BlockWeights``, read by
    field), one token per batch row, in float64, written out head by head and channel by channel
    (H heads of P channels, S = H·P, G groups of N, Q MLP-branch channels):

        residual = hidden + residual;  u = rmsnorm(residual)
        (z0, x0, z, xBC, dt) = in_proj u;  conv_state ← [conv_state[1:], xBC]
        (x, Bt, Ct) = silu(Σ_k w_k·conv_state_k + b);  head h uses group h // (H/G)
        Δ_h = clamp(softplus(dt_h + dt_bias_h), *dt_limit)
        s_{h,p,n} ← exp(Δ_h·A_h)·s + Δ_h·x_{h,p}·Bt_{g,n};  y_{h,p} = Σ_n Ct_{g,n}·s + D·x_{h,p}
        y ← rmsnorm over each group of the gate norm of y·silu(z) (or rmsnorm(y)·silu(z), or y·silu(z))
        hidden = out_proj [silu(z0)·x0, y];  with an MLP: residual = hidden + residual,
        (f, g) = fc1 rmsnorm2(residual), hidden = fc2 (f·silu(g))

    Returns (hidden, residual), or with ``head`` the logits weight · rmsnorm(hidden + residual).
    The states are not changed; the new ones are returned as well: (out, conv_states, ssm_states)."""

    batch = hidden.shape[0]
    hid = [[float(e) for e in hidden[b]] for b in range(batch)]
    res = [None] * batch
    conv_states, ssm_states = [], []
    for blk in blocks:
        _, H, P, N = blk.ssm_state.shape
        S, G = H * P, blk.ngroups
        conv_w = blk.conv_weight.double().reshape(blk.conv_weight.shape[0], -1)  # (C, K)
        C, K = conv_w.shape
        Q = (blk.in_proj_weight.shape[0] - S - C - H) // 2
        lo, hi = blk.dt_limit
        new_conv = blk.conv_state.double().clone()
        new_ssm = blk.ssm_state.double().clone()
        for b in range(batch):
            r = hid[b] if res[b] is None else [h + e for h, e in zip(hid[b], res[b])]
            res[b] = r
            proj = _matvec(blk.in_proj_weight, _rms(r, blk.norm_weight, blk.norm_eps), blk.in_proj_bias)
            z0, x0, z = proj[:Q], proj[Q : 2 * Q], proj[2 * Q : 2 * Q + S]
            xBC, dt = proj[2 * Q + S : 2 * Q + S + C], proj[2 * Q + S + C :]
            new_conv[b] = torch.cat([new_conv[b, :, 1:], torch.tensor(xBC, dtype=torch.float64)[:, None]], -1)
            xc = []
            for c in range(C):
                acc = sum(float(conv_w[c, k]) * float(new_conv[b, c, k]) for k in range(K))
                xc.append(_silu(acc + (0.0 if blk.conv_bias is None else float(blk.conv_bias[c]))))
            x, Bt, Ct = xc[:S], xc[S : S + G * N], xc[S + G * N :]
            y = []
            for h in range(H):
                g = h // (H // G)
                v = dt[h] + float(blk.dt_bias[h])
                delta = min(max(v if v > 20 else math.log1p(math.exp(v)), lo), hi)
                decay = math.exp(delta * float(blk.A[h]))
                for p in range(P):
                    xv = x[h * P + p]
                    acc = 0.0
                    for n in range(N):
                        s = decay * float(new_ssm[b, h, p, n]) + delta * xv * Bt[g * N + n]
                        new_ssm[b, h, p, n] = s
                        acc += Ct[g * N + n] * s
                    if blk.D is not None:
                        acc += float(blk.D[h] if blk.D.numel() == H else blk.D[h * P + p]) * xv
                    y.append(acc)
            gate = [_silu(e) for e in z]
            if blk.gate_norm_weight is None:
                y = [e * s for e, s in zip(y, gate)]
            else:
                size, w = blk.gate_norm_group, blk.gate_norm_weight
                before = blk.norm_before_gate
                v = y if before else [e * s for e, s in zip(y, gate)]
                normed = []
                for start in range(0, S, size):
                    normed += _rms(v[start : start + size], w[start : start + size], blk.gate_norm_eps)
                y = [e * s for e, s in zip(normed, gate)] if before else normed
            out = _matvec(blk.out_proj_weight, [_silu(a) * e for a, e in zip(z0, x0)] + y, blk.out_proj_bias)
            if blk.mlp is not None:
                r = [h + e for h, e in zip(out, res[b])]
                res[b] = r
                fg = _matvec(blk.mlp.fc1_weight, _rms(r, blk.mlp.norm_weight, blk.mlp.norm_eps))
                F = len(fg) // 2
                out = _matvec(blk.mlp.fc2_weight, [fg[i] * _silu(fg[F + i]) for i in range(F)])
            hid[b] = out
        conv_states.append(new_conv)
        ssm_states.append(new_ssm)
    return _finish(hid, res, head), conv_states, ssm_states
