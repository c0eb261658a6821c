"""The mixers' numerics against plain float64 re-implementations written here from mamba-ssm's
equations (a loop over time, the convolution as a sum over taps, no library code), and their
one-token step against their forward, for every constructor option that changes the math."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ssm import Mamba, Mamba2

D_MODEL = 16


def silu(x):
    return x / (1 + torch.exp(-x))


def softplus(x):
    return torch.log1p(torch.exp(x))


def causal_conv(x, weight, bias):
    """x (B, L, C), weight (C, 1, K): y_t = Σ_k weight[:, 0, k]·x_{t-K+1+k} (+ bias)."""
    K = weight.shape[-1]
    y = torch.zeros_like(x)
    for t in range(x.shape[1]):
        for k in range(K):
            s = t - K + 1 + k
            if s >= 0:
                y[:, t] += weight[:, 0, k] * x[:, s]
    return y if bias is None else y + bias


def linear(x, layer):
    y = x @ layer.weight.T
    return y if layer.bias is None else y + layer.bias


def naive_mamba(m: Mamba, u: torch.Tensor) -> torch.Tensor:
    """Mamba-1: in_proj → (x, z); x → conv → silu → x_proj (Δ, B, C); Δ → dt_proj, softplus
    with its bias; h_t = exp(Δ_t A)·h + Δ_t B_t x_t; y_t = C_t·h_t + D x_t; y·silu(z) → out_proj."""
    xz = linear(u, m.in_proj)
    x, z = xz[..., : m.d_inner], xz[..., m.d_inner :]
    x = silu(causal_conv(x, m.conv1d.weight, m.conv1d.bias))
    dbc = x @ m.x_proj.weight.T
    dt, B, C = dbc[..., : m.dt_rank], dbc[..., m.dt_rank : m.dt_rank + m.d_state], dbc[..., m.dt_rank + m.d_state :]
    delta = softplus(dt @ m.dt_proj.weight.T + m.dt_proj.bias)  # (batch, L, D)
    A = -torch.exp(m.A_log)  # (D, N)
    h = torch.zeros(u.shape[0], m.d_inner, m.d_state, dtype=u.dtype)
    ys = []
    for t in range(u.shape[1]):
        h = torch.exp(delta[:, t, :, None] * A) * h + (delta[:, t] * x[:, t])[..., None] * B[:, t, None, :]
        ys.append((h * C[:, t, None, :]).sum(-1) + m.D * x[:, t])
    y = torch.stack(ys, 1) * silu(z)
    return linear(y, m.out_proj)


def naive_mamba2(m: Mamba2, u: torch.Tensor) -> torch.Tensor:
    """Mamba-2: in_proj → (z0, x0, z, xBC, dt); xBC → conv → silu → (x, B, C); Δ = softplus(dt +
    dt_bias), clamped to dt_limit; per head h_t = exp(Δ_t A)·h + Δ_t x_t ⊗ B_t; y = h·C + D x;
    gated (grouped) RMSNorm with z, or y·silu(z) without it; the MLP branch silu(z0)·x0 first."""
    m_ = m.d_mlp
    G, N, H, P = m.ngroups, m.d_state, m.nheads, m.headdim
    sizes = [m_, m_, m.d_ssm, m.d_ssm + 2 * G * N, H]
    z0, x0, z, xBC, dt = torch.split(linear(u, m.in_proj), sizes, dim=-1)
    xBC = silu(causal_conv(xBC, m.conv1d.weight, m.conv1d.bias))
    x, B, C = torch.split(xBC, [m.d_ssm, G * N, G * N], dim=-1)
    batch, length = u.shape[:2]
    x = x.reshape(batch, length, H, P)
    B = B.reshape(batch, length, G, N)
    C = C.reshape(batch, length, G, N)
    delta = softplus(dt + m.dt_bias)
    if tuple(m.dt_limit) != (0.0, math.inf):
        delta = delta.clamp(*m.dt_limit)
    A = -torch.exp(m.A_log)
    D = m.D.reshape(H, P) if m.D_has_hdim else m.D[:, None]
    h = torch.zeros(batch, H, P, N, dtype=u.dtype)
    ys = []
    for t in range(length):
        Bt = B[:, t].repeat_interleave(H // G, dim=1)  # (batch, H, N): head h reads group h // (H / G)
        Ct = C[:, t].repeat_interleave(H // G, dim=1)
        h = (
            torch.exp(delta[:, t, :, None, None] * A[:, None, None]) * h
            + (delta[:, t, :, None] * x[:, t])[..., None] * Bt[:, :, None, :]
        )
        ys.append((h * Ct[:, :, None, :]).sum(-1) + D * x[:, t])
    y = torch.stack(ys, 1).reshape(batch, length, m.d_ssm)
    if m.rmsnorm:
        gate = silu(z)
        if not m.norm.norm_before_gate:
            y = y * gate
        groups = y.reshape(batch, length, G, -1)
        y = (groups / torch.sqrt(groups.pow(2).mean(-1, keepdim=True) + m.norm.eps)).reshape(batch, length, -1)
        y = y * m.norm.weight
        if m.norm.norm_before_gate:
            y = y * gate
    else:
        y = y * silu(z)
    if m_ > 0:
        y = torch.cat([silu(z0) * x0, y], dim=-1)
    return linear(y, m.out_proj)


MAMBA_OPTIONS = {
    "default": dict(d_state=5),
    "bias, no conv bias": dict(d_state=5, bias=True, conv_bias=False),
    "dt_rank 3, d_conv 2, expand 3": dict(d_state=3, dt_rank=3, d_conv=2, expand=3),
}
MAMBA2_OPTIONS = {
    "default": dict(d_state=6, headdim=8),
    "ngroups 2": dict(d_state=6, headdim=4, ngroups=2),
    "dt_limit": dict(d_state=6, headdim=8, dt_limit=(0.02, 0.05)),
    "rmsnorm off": dict(d_state=6, headdim=8, rmsnorm=False),
    "D_has_hdim": dict(d_state=6, headdim=8, D_has_hdim=True),
    "norm before gate": dict(d_state=6, headdim=4, ngroups=2, norm_before_gate=True),
    "MLP branch (d_ssm < d_inner)": dict(d_state=6, headdim=4, d_ssm=16),
    "bias, no conv bias, d_conv 3": dict(d_state=6, headdim=8, bias=True, conv_bias=False, d_conv=3),
}


def build(cls, options):
    torch.manual_seed(0)
    m = cls(D_MODEL, chunk_size=4, **options) if cls is Mamba2 else cls(D_MODEL, **options)
    m = m.double()
    with torch.no_grad():  # every parameter away from its initial value, so that none can hide
        for name, p in m.named_parameters():
            if name in ("A_log", "dt_bias", "dt_proj.bias"):
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 1.0))
    return m


def cases():
    for name, options in MAMBA_OPTIONS.items():
        yield pytest.param(Mamba, options, id=f"Mamba-{name}")
    for name, options in MAMBA2_OPTIONS.items():
        yield pytest.param(Mamba2, options, id=f"Mamba2-{name}")


@pytest.mark.parametrize("cls,options", list(cases()))
def test_forward_against_plain_reimplementation(cls, options):
    m = build(cls, options)
    u = torch.randn(2, 9, D_MODEL, dtype=torch.float64)
    expected = naive_mamba(m, u) if cls is Mamba else naive_mamba2(m, u)
    for backend in ("ref", "auto"):
        m.backend = backend
        torch.testing.assert_close(m(u), expected, rtol=1e-9, atol=1e-9, msg=lambda s: f"{backend}: {s}")


@pytest.mark.parametrize("cls,options", list(cases()))
def test_prefill_then_steps_equal_forward(cls, options):
    """Every option that changes the math, dt_limit included: our step clamps Δ exactly as the
    forward does (mamba-ssm's and transformers' steps do not), so decoding equals the forward."""
    m = build(cls, options)
    u = torch.randn(2, 9, D_MODEL, dtype=torch.float64)
    full = m(u)
    cache = m.allocate_inference_cache(2, dtype=torch.float64)
    outs = [m(u[:, :3], cache=cache)] + [m.step(u[:, t], cache)[:, None] for t in range(3, 9)]
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)


def test_dt_limit_changes_the_output():
    """The dt_limit case above can fail: the limit really binds at these values."""
    m = build(Mamba2, MAMBA2_OPTIONS["dt_limit"])
    u = torch.randn(2, 9, D_MODEL, dtype=torch.float64)
    limited = m(u)
    m.dt_limit = (0.0, math.inf)
    assert (limited - m(u)).abs().max() > 1e-3


def test_reimplementation_is_not_trivially_equal():
    """Sanity of the plain re-implementation itself: it sees the gate (dropping silu(z) changes
    it), so the comparisons above compare something."""
    m = build(Mamba, MAMBA_OPTIONS["default"])
    u = torch.randn(1, 5, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        m.D.zero_()
    baseline = naive_mamba(m, u)
    assert baseline.abs().max() > 1e-3
    assert (F.silu(torch.ones(1)) - silu(torch.ones(1))).abs().item() < 1e-7
