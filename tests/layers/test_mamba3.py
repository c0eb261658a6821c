"""The Mamba-3 mixer: a hand-computed two-step case, a plain float64 re-implementation written
here from mamba-ssm's equations (the rotation applied pair by pair in absolute coordinates, a
loop over time, no library code) for every option that changes the math, prefill + steps
equal to one forward, packed sequences, mamba-ssm's parameter names, shapes and
initialisation, and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from ssm import Mamba3
from ssm.scan import backends

D_MODEL = 16


def silu(x):
    return x / (1 + torch.exp(-x))


def rms(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def naive_mamba3(m: Mamba3, u: torch.Tensor) -> torch.Tensor:
    """mamba-ssm's Mamba-3, from its equations: in_proj → (z, x, B, C, Δ, A, λ, θ); B, C (their
    features ordered (rank, group, state)) RMS-normalised, plus a per-head, per-rank bias;
    A = −max(log(1 + exp(a)), A_floor) (mamba-ssm 2.3.2's modules/mamba3.py: −softplus(dd_A) clamped
    at −A_floor; with A_activation "heavy_tail", 1 + a for a ≥ 0 and 1/(1 − a) below in its
    place), Δ = softplus(· + dt_bias),
    λ = sigmoid(·), θ = π·tanh(·); the phase φ += Δ·θ turns pairs (2i, 2i+1) (SISO) or
    (i, i + N/2) (MIMO) of k and q; h = α·h + β·Σ_r v_prev ⊗ k̃_prev + γ·Σ_r v ⊗ k̃ with
    α = exp(ΔA), β = (1 − λ)Δα, γ = λΔ, v = x ⊙ mimo_x; y_r = h·q̃_r + D·v_r; then y_r·silu(z ⊙
    mimo_z) or, with is_outproj_norm, a per-head RMSNorm · weight · silu(z ⊙ mimo_z); Σ_r
    mimo_o ⊙ y_r; out_proj."""
    H, P, N, G, R, M = m.nheads, m.headdim, m.d_state, m.ngroups, m.mimo_rank, m.num_rope_angles
    batch, length, _ = u.shape
    proj = u @ m.in_proj.weight.T
    sizes = [m.d_inner, m.d_inner, N * G * R, N * G * R, H, H, H, M]
    z, x, B, C, dt, a, trap, angle = torch.split(proj, sizes, dim=-1)
    z, x = z.reshape(batch, length, H, P), x.reshape(batch, length, H, P)
    B = rms(B.reshape(batch, length, R, G, N), m.B_norm.weight, 1e-5)
    C = rms(C.reshape(batch, length, R, G, N), m.C_norm.weight, 1e-5)
    A = -torch.where(a >= 0, 1 + a, 1 / (1 - a)) if m.A_activation == "heavy_tail" else -torch.log1p(torch.exp(a))
    A = torch.minimum(A, torch.full_like(A, -m.A_floor))
    delta = torch.log1p(torch.exp(dt + m.dt_bias))
    lam = 1 / (1 + torch.exp(-trap))
    theta = math.pi * torch.tanh(angle)  # (batch, L, M), the same for every head
    ones = torch.ones(H, R, P, dtype=u.dtype)
    mimo_x, mimo_z, mimo_o = (getattr(m, name, ones) for name in ("mimo_x", "mimo_z", "mimo_o"))
    pairs = [(i, i + N // 2) if m.is_mimo else (2 * i, 2 * i + 1) for i in range(M)]

    h = torch.zeros(batch, H, P, N, dtype=u.dtype)
    phase = torch.zeros(batch, H, M, dtype=u.dtype)
    k_prev = torch.zeros(batch, R, H, N, dtype=u.dtype)
    v_prev = torch.zeros(batch, R, H, P, dtype=u.dtype)
    outs = []
    for t in range(length):
        phase = phase + delta[:, t, :, None] * theta[:, t, None, :]
        k = torch.stack([B[:, t, :, hh * G // H] + m.B_bias[hh] for hh in range(H)], dim=2)  # (batch, R, H, N)
        q = torch.stack([C[:, t, :, hh * G // H] + m.C_bias[hh] for hh in range(H)], dim=2)
        k_rot, q_rot = k.clone(), q.clone()
        for i, (n0, n1) in enumerate(pairs):
            cos, sin = torch.cos(phase[:, None, :, i]), torch.sin(phase[:, None, :, i])  # (batch, 1, H)
            for w, w_rot in ((k, k_rot), (q, q_rot)):
                w_rot[..., n0] = w[..., n0] * cos - w[..., n1] * sin
                w_rot[..., n1] = w[..., n0] * sin + w[..., n1] * cos
        v = x[:, t, None] * mimo_x.transpose(0, 1)  # (batch, R, H, P)
        alpha = torch.exp(delta[:, t] * A[:, t])[..., None, None]  # (batch, H, 1, 1)
        beta = ((1 - lam[:, t]) * delta[:, t])[..., None, None] * alpha
        gamma = (lam[:, t] * delta[:, t])[..., None, None]
        h = (
            alpha * h
            + beta * torch.einsum("brhp,brhn->bhpn", v_prev, k_prev)
            + gamma * torch.einsum("brhp,brhn->bhpn", v, k_rot)
        )
        y = torch.einsum("bhpn,brhn->brhp", h, q_rot) + m.D[:, None] * v
        gate = silu(z[:, t, None] * mimo_z.transpose(0, 1))
        if m.is_outproj_norm:
            y = rms(y, m.norm.weight.reshape(H, P), 1e-5) * gate
        else:
            y = y * gate
        outs.append((y * mimo_o.transpose(0, 1)).sum(1).reshape(batch, H * P))
        k_prev, v_prev = k_rot, v
    return torch.stack(outs, 1) @ m.out_proj.weight.T


OPTIONS = {
    "siso": dict(),
    "siso, ngroups 2": dict(ngroups=2),
    "siso, outproj norm": dict(is_outproj_norm=True),
    "siso, rope_fraction 1, A_floor": dict(rope_fraction=1.0, A_floor=0.5),
    "siso, A_activation heavy_tail": dict(A_activation="heavy_tail"),
    "siso, no rotary state (rope_fraction 0)": dict(rope_fraction=0.0),
    "mimo rank 2": dict(is_mimo=True, mimo_rank=2),
    "mimo rank 2, no rotary state": dict(is_mimo=True, mimo_rank=2, rope_fraction=0.0),
    "mimo rank 3, ngroups 2, outproj norm": dict(is_mimo=True, mimo_rank=3, ngroups=2, is_outproj_norm=True),
    "mimo, rope_fraction 1, ngroups 4": dict(is_mimo=True, mimo_rank=2, rope_fraction=1.0, ngroups=4),
}


def build(options, d_state=8, headdim=4, chunk_size=4):
    torch.manual_seed(0)
    m = Mamba3(D_MODEL, d_state=d_state, headdim=headdim, chunk_size=chunk_size, **options).double()
    with torch.no_grad():  # every parameter away from its initial value, so that none can hide
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return m


@pytest.mark.parametrize("options", OPTIONS.values(), ids=list(OPTIONS))
def test_forward_against_plain_reimplementation(options):
    m = build(options)
    u = torch.randn(2, 9, D_MODEL, dtype=torch.float64)
    expected = naive_mamba3(m, u)
    assert expected.abs().max() > 1e-2
    for backend in ("ref", "auto"):
        m.backend = backend
        torch.testing.assert_close(m(u), expected, rtol=1e-9, atol=1e-9, msg=lambda s: f"{backend}: {s}")


@pytest.mark.parametrize("options", OPTIONS.values(), ids=list(OPTIONS))
def test_prefill_then_steps_equal_forward(options):
    """Every option, ngroups > 1 and MIMO included, to 1e-10 in float64 (mamba-ssm's own step
    fails with ngroups > 1, and its forward with a cache offset)."""
    m = build(options)
    u = torch.randn(3, 13, D_MODEL, dtype=torch.float64)
    full = m(u)
    for prefill in (0, 1, 6):
        cache = m.allocate_inference_cache(3, dtype=torch.float64)
        outs = [m(u[:, :prefill], cache=cache)]
        for t in range(prefill, 13):
            y = m.step(u[:, t] if t % 2 else u[:, t : t + 1], cache)  # (batch, d) and (batch, 1, d) inputs
            outs.append(y[:, None] if y.ndim == 2 else y)
        torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("options", [OPTIONS["siso, ngroups 2"], OPTIONS["mimo rank 2"]], ids=["siso", "mimo"])
def test_two_prefills_equal_one_and_the_phase_stays_wrapped(options):
    m = build(options)
    with torch.no_grad():
        m.dt_bias.add_(3.0)  # large steps: the phase passes 2π within a few tokens
    u = torch.randn(2, 40, D_MODEL, dtype=torch.float64)
    cache = m.allocate_inference_cache(2, dtype=torch.float64)
    y = torch.cat([m(u[:, :17], cache=cache), m(u[:, 17:], cache=cache)], 1)
    torch.testing.assert_close(y, m(u), rtol=1e-10, atol=1e-10)
    phase = cache.state.phase
    assert phase.min() >= 0 and phase.max() < 2 * math.pi


@pytest.mark.parametrize("options", [OPTIONS["siso, outproj norm"], OPTIONS["mimo rank 2"]], ids=["siso", "mimo"])
def test_packed_sequences_equal_separate_ones(options):
    m = build(options)
    lengths = [5, 0, 9]
    u = torch.randn(1, 14, D_MODEL, dtype=torch.float64)
    cu_seqlens = torch.tensor([0, 5, 5, 14])
    cache = m.allocate_inference_cache(3, dtype=torch.float64)
    packed = m(u, cache=cache, cu_seqlens=cu_seqlens)
    start = 0
    for s, n in enumerate(lengths):
        alone_cache = m.allocate_inference_cache(1, dtype=torch.float64)
        alone = m(u[:, start : start + n], cache=alone_cache)
        torch.testing.assert_close(packed[:, start : start + n], alone, rtol=1e-10, atol=1e-10)
        for got, want in zip(cache.state, alone_cache.state):
            torch.testing.assert_close(got[s : s + 1], want, rtol=1e-10, atol=1e-10)
        start += n


def test_two_steps_by_hand():
    """One head, P = 1, N = 2 (one rotary pair), in_proj set so that at both steps Δ = 1/2,
    A = −2·ln 2 (α = 1/2), λ = 1/2 (β_1 = 1/8, γ = 1/4), θ = π/2 (the phase turns by Δθ = π/4),
    B = C = e_0 after their norm, biases 0, D = 1, z = 3; x = 1, then 2.
    Step 0: φ = π/4, k̃ = q̃ = (s, s) with s = √2/2; h_0 = γ·x_0·k̃ = (s/4, s/4);
            y_0 = (h_0·q̃ + D·x_0)·silu(3) = (1/4 + 1)·silu(3).
    Step 1: φ = π/2, k̃ = q̃ = (0, 1); h_1 = α·h_0 + β_1·x_0·k̃_0 + γ·x_1·k̃_1 = (s/4, s/4 + 1/2);
            y_1 = (s/4 + 1/2 + 2)·silu(3).
    out_proj = (1, −1). (β on the current step's input would give y_1 = (s/8 + 3/4 + 2)·silu(3);
    a phase not scaled by Δ, (1/2 + 2)·silu(3).) The forward and two steps give these, and the
    cache after either holds φ = π/2, h_1, k̃_1 = (0, 1) and x_1 = 2."""
    m = Mamba3(2, d_state=2, expand=0.5, headdim=1, rope_fraction=1.0, chunk_size=4).double()
    assert (m.nheads, m.headdim, m.num_rope_angles) == (1, 1, 1)
    eps = 1e-5
    with torch.no_grad():
        at_both = dict(
            z=3.0,
            B0=1.0,
            B1=0.0,
            C0=1.0,
            C1=0.0,
            dt=math.log(math.exp(0.5) - 1),
            A=math.log(3.0),  # softplus(ln 3) = ln 4
            trap=0.0,
            angle=math.atanh(0.5),
        )
        rows = ["z", "x", "B0", "B1", "C0", "C1", "dt", "A", "trap", "angle"]
        values = {**{k: (v, v) for k, v in at_both.items()}, "x": (1.0, 2.0)}
        m.in_proj.weight.copy_(torch.tensor([values[r] for r in rows], dtype=torch.float64))  # u_t = e_t
        m.dt_bias.zero_()
        m.B_bias.zero_()
        m.C_bias.zero_()
        m.B_norm.weight.fill_(math.sqrt(0.5 + eps))  # (1, 0) / rms((1, 0)) · weight = (1, 0)
        m.C_norm.weight.fill_(math.sqrt(0.5 + eps))
        m.D.fill_(1.0)
        m.out_proj.weight.copy_(torch.tensor([[1.0], [-1.0]], dtype=torch.float64))
    u = torch.eye(2, dtype=torch.float64)[None]  # (1, L = 2, d_model = 2)
    s, gate = math.sqrt(0.5), 3 / (1 + math.exp(-3))
    y = torch.tensor([(0.25 + 1) * gate, (s / 4 + 0.5 + 2) * gate], dtype=torch.float64)
    expected = torch.stack([y, -y], -1)[None]
    torch.testing.assert_close(m(u), expected, rtol=0, atol=1e-12)
    cache = m.allocate_inference_cache(1, dtype=torch.float64)
    stepped = torch.stack([m.step(u[:, t], cache) for t in range(2)], 1)
    torch.testing.assert_close(stepped, expected, rtol=0, atol=1e-12)
    prefilled = m.allocate_inference_cache(1, dtype=torch.float64)
    m(u, cache=prefilled)
    for state in (cache.state, prefilled.state):  # after two steps, and after a prefill
        phase, ssm, key, value = state
        torch.testing.assert_close(phase.flatten(), torch.tensor([math.pi / 2], dtype=torch.float64))
        torch.testing.assert_close(
            ssm.flatten(), torch.tensor([s / 4, s / 4 + 0.5], dtype=torch.float64), rtol=0, atol=1e-12
        )
        torch.testing.assert_close(key.flatten(), torch.tensor([0.0, 1.0], dtype=torch.float64), rtol=0, atol=1e-12)
        torch.testing.assert_close(value.flatten(), torch.tensor([2.0], dtype=torch.float64))


@pytest.mark.parametrize(
    "options", [OPTIONS["siso, ngroups 2"], OPTIONS["mimo rank 3, ngroups 2, outproj norm"]], ids=["siso", "mimo"]
)
def test_every_backend_same_outputs_and_gradients(options):
    x = torch.randn(2, 19, D_MODEL)
    results = {}
    for backend in backends("trapezoidal_scan", "cpu"):
        torch.manual_seed(0)
        m = Mamba3(D_MODEL, d_state=8, headdim=4, chunk_size=4, backend=backend, **options)
        y = m(x)
        grads = torch.autograd.grad((y * torch.linspace(-1, 1, D_MODEL)).sum(), list(m.parameters()))
        results[backend] = (y, dict(zip([n for n, _ in m.named_parameters()], grads)))
    assert {"ref", "chunked"} <= set(results)
    y_ref, g_ref = results.pop("ref")
    for backend, (y, g) in results.items():
        torch.testing.assert_close(y, y_ref, rtol=2e-4, atol=2e-4, msg=lambda s: f"{backend} output: {s}")
        for name in g_ref:
            scale = max(g_ref[name].abs().max().item(), 1.0)
            torch.testing.assert_close(
                g[name], g_ref[name], rtol=2e-4, atol=2e-4 * scale, msg=lambda s: f"{backend} d{name}: {s}"
            )


def test_parameters_match_mamba_ssm():
    """Names and shapes of mamba-ssm's Mamba3 at d_model 768 with its defaults (N 128, P 64,
    rope_fraction 0.5: 32 angles), SISO, and MIMO rank 4 with the output norm."""
    siso = {k: tuple(v.shape) for k, v in Mamba3(768, device="meta").state_dict().items()}
    assert siso == {
        "in_proj.weight": (3432, 768),
        "dt_bias": (24,),
        "B_bias": (24, 1, 128),
        "C_bias": (24, 1, 128),
        "B_norm.weight": (128,),
        "C_norm.weight": (128,),
        "D": (24,),
        "out_proj.weight": (768, 1536),
    }
    mimo = {
        k: tuple(v.shape)
        for k, v in Mamba3(768, is_mimo=True, is_outproj_norm=True, device="meta").state_dict().items()
    }
    assert mimo == {
        "in_proj.weight": (4200, 768),
        "dt_bias": (24,),
        "B_bias": (24, 4, 128),
        "C_bias": (24, 4, 128),
        "B_norm.weight": (128,),
        "C_norm.weight": (128,),
        "mimo_x": (24, 4, 64),
        "mimo_z": (24, 4, 64),
        "mimo_o": (24, 4, 64),
        "D": (24,),
        "norm.weight": (1536,),
        "out_proj.weight": (768, 1536),
    }
    # an odd rotated size drops to the even size below it: N 10, fraction 0.5 → 5 → 4 entries, 2 angles
    odd = Mamba3(32, d_state=10, headdim=16, ngroups=2, device="meta")
    assert odd.in_proj.weight.shape[0] == 2 * 64 + 2 * 10 * 2 + 3 * 4 + 2
    # mamba-ssm's attributes: its kernels' fused norm only for MIMO with the output norm
    assert (odd.num_bc_heads, odd.split_tensor_size, odd.num_rope_angles, odd.rotary_dim_divisor) == (2, 4, 2, 4)
    assert not odd.fuse_pregate_headwise_norm and odd.mimo_rank == 1
    assert Mamba3(768, is_mimo=True, is_outproj_norm=True, device="meta").fuse_pregate_headwise_norm


def test_initialisation():
    torch.manual_seed(0)
    m = Mamba3(64, d_state=16, headdim=16, dt_min=0.01, dt_max=0.05, is_mimo=True, mimo_rank=4)
    dt = torch.nn.functional.softplus(m.dt_bias)
    assert dt.min() >= 0.01 - 1e-6 and dt.max() <= 0.05 + 1e-6
    assert torch.equal(m.B_bias, torch.ones(8, 4, 16)) and torch.equal(m.C_bias, torch.ones(8, 4, 16))
    assert torch.equal(m.mimo_x, torch.full((8, 4, 16), 0.25)) and torch.equal(m.mimo_o, torch.full((8, 4, 16), 0.25))
    assert torch.equal(m.mimo_z, torch.ones(8, 4, 16)) and torch.equal(m.D, torch.ones(8))
    assert torch.equal(m.B_norm.weight, torch.ones(16))
    for p in (m.dt_bias, m.D):
        assert getattr(p, "_no_weight_decay", False)
    assert not getattr(m.B_bias, "_no_weight_decay", False)


def test_bad_inputs():
    m = build(OPTIONS["mimo rank 2"])
    with pytest.raises(ValueError, match=r"hidden_states must have shape \(batch, L, d_model\) with d_model = 16"):
        m(torch.randn(2, 5, 15, dtype=torch.float64))
    cache = m.allocate_inference_cache(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="cache was allocated for batch size 2, but the input has batch size 3"):
        m(torch.randn(3, 5, D_MODEL, dtype=torch.float64), cache=cache)
    with pytest.raises(ValueError, match="cache was allocated for batch size 2"):
        m.step(torch.randn(3, D_MODEL, dtype=torch.float64), cache)
    with pytest.raises(ValueError, match=r"\(batch, d_model\) or \(batch, 1, d_model\)"):
        m.step(torch.randn(2, 2, D_MODEL, dtype=torch.float64), cache)
    with pytest.raises(ValueError, match="unknown backend"):
        Mamba3(D_MODEL, d_state=8, headdim=4, backend="fast")(torch.randn(1, 3, D_MODEL))
    with pytest.raises(ValueError, match="rope_fraction must be 0.5 or 1.0"):
        Mamba3(D_MODEL, headdim=4, rope_fraction=0.25)
    with pytest.raises(ValueError, match="A_activation must be one of softplus, heavy_tail, got 'exp'"):
        Mamba3(D_MODEL, headdim=4, A_activation="exp")
    with pytest.raises(ValueError, match="headdim = 5 must divide d_inner"):
        Mamba3(D_MODEL, headdim=5)
    with pytest.raises(ValueError, match="ngroups = 3 must divide the number of heads 8"):
        Mamba3(D_MODEL, headdim=4, ngroups=3)
    with pytest.raises(ValueError, match="mimo_rank must be a positive int, got 2.0"):
        Mamba3(D_MODEL, headdim=4, is_mimo=True, mimo_rank=2.0)
    with pytest.raises(ValueError, match="leaves no state pair to rotate"):
        Mamba3(D_MODEL, d_state=2, headdim=4)
