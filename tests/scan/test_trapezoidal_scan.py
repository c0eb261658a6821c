"""trapezoidal_scan (Mamba-3): the reference on hand-computed cases, every backend against the
reference (forward, every part of the last state, every gradient), the one-step form against
the scan, packed sequences, and bad input. The Triton backend's cases are in
test_triton_trapezoidal.py."""

from __future__ import annotations

import itertools
import math
from itertools import pairwise

import pytest
import torch

from ssm.scan import TrapezoidalState, backends, trapezoidal_scan, trapezoidal_scan_step
from ssm.scan.cpu import ssd_cpu
from ssm.scan.trapezoidal_chunked import products_heads_first
from tests.helpers import (
    CPU_PRODUCTS,
    GRADCHECK_TOL,
    assert_close,
    check_trapezoidal,
    trapezoidal_backend,
    trapezoidal_call,
    trapezoidal_inputs,
)

# (the Triton backends' cases, interpreted here, are in test_triton_trapezoidal*.py)
FAST_BACKENDS = [b for b in backends("trapezoidal_scan", "cpu") if b not in ("ref", "triton", "triton-ssd")]
FAST_BACKENDS += [CPU_PRODUCTS] * ("cpu" in FAST_BACKENDS)  # "cpu" with its other core
ROTARY = ["interleaved", "halved"]


# ----------------------------------------------------------------------------- the reference by hand


def two_steps(delta: float, theta: float, rotary="interleaved", N=2, backend="ref", steps=2, **kw):
    """One head, P = 1, one rotary pair: x = (1, 2), A = −ln 2 / Δ (so α = 1/2), λ = 1/2,
    B = C = e_0 at both steps (the first ``steps`` of them)."""
    e0 = torch.zeros(N, dtype=torch.float64)
    e0[0] = 1.0
    BC = e0.expand(1, steps, 1, N)  # (batch, L, G, N)
    x = torch.tensor([1.0, 2.0], dtype=torch.float64)[:steps].reshape(1, steps, 1, 1)
    dt = torch.full((1, steps, 1), delta, dtype=torch.float64)
    A = torch.full((1, steps, 1), -math.log(2.0) / delta, dtype=torch.float64)
    trap = torch.full((1, steps, 1), 0.5, dtype=torch.float64)
    angles = torch.full((1, steps, 1, 1), theta, dtype=torch.float64)
    with trapezoidal_backend(backend) as name:
        return trapezoidal_scan(
            x, dt, A, BC, BC, trap, angles, rotary=rotary, return_last_state=True, backend=name, **kw
        )


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_two_steps_by_hand(backend):
    """Δ = 1/2, θ = π: the phase is π/2 after step 0 and π after step 1; α = 1/2, β_1 = (1 − λ)Δα
    = 1/8, γ = λΔ = 1/4.
    Step 0: k̃ = q̃ = Rot(π/2)·e_0 = (0, 1); h_0 = γ·x_0·k̃_0 = (0, 1/4); y_0 = h_0·q̃_0 = 1/4.
    Step 1: k̃ = q̃ = Rot(π)·e_0 = (−1, 0); h_1 = α·h_0 + β_1·x_0·k̃_0 + γ·x_1·k̃_1
            = (0, 1/8) + (0, 1/8) + (−1/2, 0) = (−1/2, 1/4); y_1 = h_1·q̃_1 = 1/2.
    (β with the current step's input would give y_1 = 3/4; a phase not scaled by Δ, 1/4.)"""
    out, last = two_steps(0.5, math.pi, backend=backend)
    torch.testing.assert_close(out.flatten(), torch.tensor([0.25, 0.5], dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(last.phase.flatten(), torch.tensor([math.pi], dtype=torch.float64))
    torch.testing.assert_close(last.ssm.flatten(), torch.tensor([-0.5, 0.25], dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(last.key.flatten(), torch.tensor([-1.0, 0.0], dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(last.value.flatten(), torch.tensor([2.0], dtype=torch.float64))


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_rotary_pairs_by_hand(backend):
    """N = 4, one pair, phase π/2 at the last step: e_0 turns into e_1 when pairs are
    interleaved (0, 1), into e_2 when halved (0, 2); nothing turns with θ = 0."""
    expected = {"interleaved": [0.0, 1.0, 0.0, 0.0], "halved": [0.0, 0.0, 1.0, 0.0]}
    for rotary, key in expected.items():
        _, last = two_steps(0.5, math.pi / 2, rotary, N=4, backend=backend)  # phase π/4, then π/2
        torch.testing.assert_close(last.key.flatten(), torch.tensor(key, dtype=torch.float64), rtol=0, atol=1e-12)
        _, still = two_steps(0.5, 0.0, rotary, N=4, backend=backend)
        torch.testing.assert_close(still.key.flatten(), torch.tensor([1.0, 0, 0, 0], dtype=torch.float64))


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_initial_state_by_hand(backend):
    """The initial state's key and value feed step 0's β-term. One step, θ = 0, Δ = 1/2 (α = 1/2,
    β_0 = 1/8, γ = 1/4), from h = 0, value 4 and phase 0 with key e_1:
    h_0 = β_0·4·e_1 + γ·1·e_0 = (1/4, 1/2), y_0 = h_0·e_0 = 1/4. From phase π/2 with the key
    turned alike, Rot(π/2)·e_1 = (−1, 0): everything turns by π/2, h_0 = (−1/2, 1/4), and y_0 is
    still 1/4."""
    cases = {0.0: ([0.0, 1.0], [0.25, 0.5]), math.pi / 2: ([-1.0, 0.0], [-0.5, 0.25])}
    for phase, (key, h0) in cases.items():
        state = TrapezoidalState(
            torch.full((1, 1, 1), phase, dtype=torch.float64),
            torch.zeros(1, 1, 1, 2, dtype=torch.float64),
            torch.tensor(key, dtype=torch.float64).reshape(1, 1, 2),
            torch.full((1, 1, 1), 4.0, dtype=torch.float64),
        )
        out, last = two_steps(0.5, 0.0, backend=backend, steps=1, initial_state=state)
        torch.testing.assert_close(out.flatten(), torch.tensor([0.25], dtype=torch.float64), rtol=0, atol=1e-12)
        torch.testing.assert_close(last.ssm.flatten(), torch.tensor(h0, dtype=torch.float64), rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- backends against the reference


@pytest.mark.parametrize("length", [1, 2, 7, 8, 9, 16, 17, 33])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_lengths_around_chunk_boundaries(backend, length):
    check_trapezoidal(trapezoidal_inputs(length), backend, chunk_size=8)


OPTIONS = {
    "siso": dict(),
    "siso, nothing optional": dict(D=False, z=False, bias=False, initial_state=False),
    "siso, no z": dict(z=False),
    "mimo": dict(ranks=2),
    "mimo, rank 3, no MIMO weights": dict(ranks=3, mimo=False),
    "mimo, no z": dict(ranks=2, z=False),
    "one group, M = 4 (every pair)": dict(groups=1, M=4),
    "groups = heads": dict(groups=4, M=1),
    "no rotary pair (M = 0)": dict(M=0),
    "mimo, no rotary pair": dict(ranks=2, M=0),
}


@pytest.mark.parametrize("rotary", ROTARY)
@pytest.mark.parametrize("options", OPTIONS.values(), ids=list(OPTIONS))
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_options(backend, options, rotary):
    check_trapezoidal(trapezoidal_inputs(19, **options), backend, rotary=rotary)


def test_mimo_per_rank_outputs():
    """Without mimo_o the output keeps its rank axis, (batch, L, R, H, P)."""
    inputs = trapezoidal_inputs(13, ranks=3)
    del inputs["mimo_o"]
    (out, *_), _ = check_trapezoidal(inputs, "chunked")
    assert out.shape == (2, 13, 3, 4, 3)


@pytest.mark.parametrize("chunk_size", [1, 3, 64])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_chunk_sizes(backend, chunk_size):
    check_trapezoidal(trapezoidal_inputs(20, ranks=2), backend, chunk_size=chunk_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", FAST_BACKENDS + ["ref"])
def test_half_precision(backend, dtype):
    """Half-precision inputs, a float32 state: the outputs in the input dtype, the state float32."""
    check_trapezoidal(trapezoidal_inputs(40, ranks=2, dtype=dtype), backend)


@pytest.mark.parametrize("packed", [None, [5, 0, 18]])
@pytest.mark.parametrize("scale", [1e-4, 1e-6])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_slow_decays_keep_their_gradients(backend, scale, packed):
    """|A| of 1e-7 .. 3e-4 (heads that hold a state for 10^4 steps and more). The "cpu" backend's
    sweeps run with Δ = −a and the keys scaled by s/−a: the rate's gradient through the sweeps'
    input and through that scale, each of size 1/|A|, cancel, and taken apart after rounding
    they left dA 2e-3 off in float32 at 1e-4. The decay's share alone is the gradient."""
    inputs = trapezoidal_inputs(23, packed=packed)
    with torch.no_grad():
        inputs["A"].mul_(scale)
    check_trapezoidal(inputs, backend, chunk_size=16)


@pytest.mark.parametrize("lengths", [[5, 0, 12, 1], [0, 17], [9, 8, 0]])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_packed_sequences(backend, lengths):
    for ranks in (None, 2):
        check_trapezoidal(trapezoidal_inputs(sum(lengths), packed=lengths, ranks=ranks), backend, rotary="halved")


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_packed_equals_one_call_per_sequence(backend):
    """Packing changes nothing: each sequence's output and last state as when scanned alone,
    from its own initial state (an empty sequence returns its initial state)."""
    lengths = [6, 0, 11]
    x = {k: v.detach() for k, v in trapezoidal_inputs(17, packed=lengths, ranks=2, dtype=torch.float64).items()}
    call = trapezoidal_call("interleaved", 4)
    out, *last = call(x, backend)
    starts = [0, 6, 6, 17]
    for s in range(3):
        part = {
            k: (v[:, starts[s] : starts[s + 1]] if v.ndim >= 3 and v.shape[1] == 17 else v)
            for k, v in x.items()
            if k != "cu_seqlens"
        }
        part.update({k: v[s : s + 1] for k, v in x.items() if k.startswith("initial_")})
        alone, *alone_last = call(part, backend)
        torch.testing.assert_close(out[:, starts[s] : starts[s + 1]], alone, rtol=1e-12, atol=1e-12)
        for a, b in zip(last, alone_last):
            torch.testing.assert_close(a[s : s + 1], b, rtol=1e-12, atol=1e-12)
    assert torch.equal(last[1][1], x["initial_ssm"][1])  # the empty sequence


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
@pytest.mark.parametrize("ranks", [None, 2])
def test_gradcheck(backend, ranks):
    """Finite differences in float64, to 1e-6 of each gradient (gradcheck's default 1e-3 lets a
    gradient 1e-4 off pass); rank 1 is the "cpu" backend's C path, rank 2 its chunked core."""
    inputs = trapezoidal_inputs(5, batch=1, heads=2, head_dim=2, groups=1, N=4, M=1, ranks=ranks, dtype=torch.float64)
    names = list(inputs)

    def f(*tensors):
        return trapezoidal_call("halved", 2)(dict(zip(names, tensors)), backend)

    assert torch.autograd.gradcheck(f, tuple(inputs.values()), **GRADCHECK_TOL)


@pytest.mark.parametrize("ranks", [None, 2])
@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_split_sequence_continues_from_last_state(backend, ranks):
    x = {k: v.detach() for k, v in trapezoidal_inputs(30, ranks=ranks, dtype=torch.float64).items()}
    call = trapezoidal_call("interleaved", 8)
    full, *full_last = call(x, backend)
    first = {k: (v[:, :11] if v.ndim >= 3 and v.shape[1] == 30 else v) for k, v in x.items()}
    rest = {
        k: (v[:, 11:] if v.ndim >= 3 and v.shape[1] == 30 else v) for k, v in x.items() if not k.startswith("initial_")
    }
    y1, *state = call(first, backend)
    y2, *last = call({**rest, **{f"initial_{n}": s for n, s in zip(TrapezoidalState._fields, state)}}, backend)
    torch.testing.assert_close(torch.cat([y1, y2], 1), full, rtol=1e-10, atol=1e-10)
    for a, b in zip(last, full_last):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_length_zero(backend):
    x = trapezoidal_inputs(0, ranks=2)
    out, *last = trapezoidal_call()(x, backend)
    assert out.shape == (2, 0, 4, 3)
    for got, name in zip(last, TrapezoidalState._fields):
        assert torch.equal(got, x[f"initial_{name}"].detach())
    out, *last = trapezoidal_call()(trapezoidal_inputs(0, initial_state=False), backend)
    assert out.shape == (2, 0, 4, 3) and all(not t.any() for t in last)


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_gradients_from_the_last_state_alone(backend):
    """A loss of only the last state (the out gradient never arrives)."""
    x = trapezoidal_inputs(19, ranks=2)
    grads = {}
    for b in ("ref", backend):
        _, *last = trapezoidal_call()(x, b)
        loss = sum((t * t).sum() for t in last)
        grads[b] = torch.autograd.grad(loss, list(x.values()), allow_unused=True, materialize_grads=True)
    for name, got, want in zip(x, grads[backend], grads["ref"]):
        assert_close(got, want, torch.float32, f"{backend} d{name}")


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_phase_is_not_wrapped(backend):
    """The last phase is φ_{-1} + Σ Δ·θ as summed, not taken modulo 2π (the layer wraps its
    cache; the op reports what the equation says)."""
    x = {k: v.detach() for k, v in trapezoidal_inputs(40, dtype=torch.float64).items()}
    x["angles"] = x["angles"].abs() + 2.0  # every phase grows past 2π
    _, phase, *_ = trapezoidal_call()(x, backend)
    expected = x["initial_phase"] + (x["dt"][..., None] * x["angles"]).sum(1)
    torch.testing.assert_close(phase, expected, rtol=1e-12, atol=1e-12)
    assert phase.max() > 2 * math.pi


# ----------------------------------------------------------------------------- the one-step form


@pytest.mark.parametrize("rotary", ROTARY)
@pytest.mark.parametrize("options", OPTIONS.values(), ids=list(OPTIONS))
def test_step_equals_the_scan(options, rotary):
    """Token by token from the same initial state, in float64, to 1e-12 (the step is the direct
    form of the recurrence; the reference runs it on complex numbers)."""
    x = {k: v.detach() for k, v in trapezoidal_inputs(9, dtype=torch.float64, **options).items()}
    out, *last = trapezoidal_call(rotary)(x, "ref")
    if "initial_phase" in x:
        state = TrapezoidalState(*(x[f"initial_{n}"] for n in TrapezoidalState._fields))
    else:
        state = TrapezoidalState(*(torch.zeros_like(t) for t in last))
    per_step = ("x", "dt", "A", "B", "C", "trap", "angles")
    fixed = {k: v for k, v in x.items() if k not in per_step and k != "z" and not k.startswith("initial_")}
    for t in range(9):
        z = x["z"][:, t] if "z" in x else None
        y, state = trapezoidal_scan_step(state, *(x[k][:, t] for k in per_step), z=z, rotary=rotary, **fixed)
        torch.testing.assert_close(y, out[:, t], rtol=1e-12, atol=1e-12, msg=lambda m: f"step {t}: {m}")
    for got, want in zip(state, last):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- bad input


def test_errors_name_the_argument():
    x = {k: v.detach() for k, v in trapezoidal_inputs(5, ranks=2).items() if not k.startswith("initial_")}
    with pytest.raises(ValueError, match=r"dt must have shape \(batch, L, H\)"):
        trapezoidal_scan(**dict(x, dt=x["dt"][:, :4]))
    with pytest.raises(ValueError, match=r"trap must have shape \(batch, L, H\)"):
        trapezoidal_scan(**dict(x, trap=x["trap"][..., :3]))
    with pytest.raises(ValueError, match=r"C must have shape \(batch, L, R, G, N\) like B"):
        trapezoidal_scan(**dict(x, C=x["C"][..., :7]))
    with pytest.raises(ValueError, match="not divisible by G"):
        trapezoidal_scan(
            **dict(x, B=x["B"].repeat(1, 1, 1, 3, 1)[:, :, :, :3], C=x["C"].repeat(1, 1, 1, 3, 1)[:, :, :, :3])
        )
    with pytest.raises(ValueError, match=r"angles has M = 5 rotary pairs, but the state has only N = 8"):
        trapezoidal_scan(**dict(x, angles=torch.zeros(2, 5, 4, 5)))
    with pytest.raises(ValueError, match="rotary must be one of"):
        trapezoidal_scan(**x, rotary="pairs")
    with pytest.raises(ValueError, match=r"mimo_o must have shape \(H, R, P\)"):
        trapezoidal_scan(**dict(x, mimo_o=torch.ones(4, 3, 3)))
    siso = {k: v.detach() for k, v in trapezoidal_inputs(5).items() if not k.startswith("initial_")}
    with pytest.raises(ValueError, match="mimo_x needs B and C with a rank axis"):
        trapezoidal_scan(**siso, mimo_x=torch.ones(4, 1, 3))
    with pytest.raises(ValueError, match=r"B_bias must have shape \(H, N\)"):
        trapezoidal_scan(**dict(siso, B_bias=torch.ones(4, 7)))
    with pytest.raises(ValueError, match="mimo_z scales z, but z is None"):
        trapezoidal_scan(**dict(x, z=None))
    with pytest.raises(ValueError, match="initial_state must be a TrapezoidalState"):
        trapezoidal_scan(**x, initial_state=torch.zeros(2, 4, 3, 8))
    bad_state = TrapezoidalState(
        torch.zeros(2, 4, 2), torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 8), torch.zeros(2, 4, 3)
    )
    with pytest.raises(ValueError, match=r"initial_state.key must be 4-D"):
        trapezoidal_scan(**x, initial_state=bad_state)
    with pytest.raises(ValueError, match=r"initial_state.ssm must have shape \(batch, H, P, N\)"):
        trapezoidal_scan(**siso, initial_state=bad_state._replace(ssm=torch.zeros(2, 4, 3, 7)))
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        trapezoidal_scan(**x, chunk_size=0)
    with pytest.raises(ValueError, match="unknown backend 'nope' for trapezoidal_scan"):
        trapezoidal_scan(**x, backend="nope")
    with pytest.raises(ValueError, match="N must be even"):
        odd = {k: v.detach() for k, v in trapezoidal_inputs(5, N=7).items() if not k.startswith("initial_")}
        trapezoidal_scan(**odd, rotary="halved")
    with pytest.raises(ValueError, match="with cu_seqlens the sequences are packed along L in a batch of 1"):
        trapezoidal_scan(**x, cu_seqlens=torch.tensor([0, 2, 5]))
    packed = {k: v.detach() for k, v in trapezoidal_inputs(5, packed=[2, 2, 1]).items() if not k.startswith("initial_")}
    with pytest.raises(ValueError, match=r"initial_state.phase must have shape \(S, H, M\)"):
        trapezoidal_scan(**packed, initial_state=bad_state)


def test_auto_on_cuda_takes_the_chunk_parallel_forms():
    """Rank 1: the SSD kernels at any batch. MIMO: one Triton program per row and head; fewer
    than the multiprocessors, the chunked form (3x faster at batch 1 × 8 heads on an H100); as
    many or more, Triton."""
    from ssm.scan.trapezoidal import auto_on_cuda

    assert auto_on_cuda(1, 8, 1, 132) == "triton-ssd"
    assert auto_on_cuda(8, 96, 1, 132) == "triton-ssd"
    assert auto_on_cuda(1, 8, 2, 132) == "chunked"
    assert auto_on_cuda(1, 131, 4, 132) == "chunked"
    assert auto_on_cuda(1, 132, 2, 132) == "triton"
    assert auto_on_cuda(8, 96, 2, 132) == "triton"


# ----------------------------------------------------------------------------- backend "cpu"


def test_cpu_backend_runs_siso_on_the_sweeps_or_the_products(monkeypatch):
    """On CPU tensors "auto" is "cpu", whose rank-1 core is the C sweeps up to N·P = SWEEPS_UP_TO
    (not the chunked fallback) and the chunked form's products above; MIMO goes to the products
    too (a step's ranks as positions), or with a non-finite input to the chunked form's general
    products."""
    import ssm.scan.trapezoidal_cpu as cpu_backend

    calls = []
    monkeypatch.setattr(cpu_backend, "ssd_cpu", lambda *a, **k: calls.append("sweeps") or ssd_cpu(*a, **k))
    general = cpu_backend.chunked_products
    monkeypatch.setattr(cpu_backend, "chunked_products", lambda *a: calls.append("chunked") or general(*a))
    products = products_heads_first
    monkeypatch.setattr(cpu_backend, "products_heads_first", lambda *a: calls.append("products") or products(*a))
    check_trapezoidal(trapezoidal_inputs(19), "auto")
    check_trapezoidal(trapezoidal_inputs(19, ranks=2), "cpu")
    assert cpu_backend.SWEEPS_UP_TO < 33 * 32
    check_trapezoidal(trapezoidal_inputs(19, N=34, head_dim=32, M=2), "auto")
    assert calls == ["sweeps", "products", "products"]
    x = {k: v.detach() for k, v in trapezoidal_inputs(19, ranks=2).items()}
    x["x"][0, 7, 1, 2] = float("nan")
    out = trapezoidal_call()(x, "cpu")[0]
    assert calls[-1] == "chunked"
    assert torch.isnan(out[0, 7:, 1, 2]).all() and torch.isfinite(out[0, :7]).all() and torch.isfinite(out[1]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_backend_half_precision_siso(dtype):
    check_trapezoidal(trapezoidal_inputs(40, dtype=dtype), "cpu")


def test_cpu_backend_gradcheck_siso():
    inputs = trapezoidal_inputs(5, batch=1, heads=2, head_dim=2, groups=1, N=4, M=1, dtype=torch.float64)
    names = list(inputs)

    def f(*tensors):
        return trapezoidal_call("interleaved", 2)(dict(zip(names, tensors)), "cpu")

    assert torch.autograd.gradcheck(f, tuple(inputs.values()), **GRADCHECK_TOL)


@pytest.mark.parametrize("a", [0.0, -1e-320, -math.inf, "s = 0"])
def test_cpu_backend_where_the_sweeps_cannot_divide(a, monkeypatch):
    """The sweeps take keys scaled by s/(−a) and divide c by that scale: a step with no decay
    (a = 0), a rate below 1e-30 (1e-320: the division overflows), an infinite one, or s = 0
    (λ_t = 0 and λ_{t+1} = 1) goes to the chunked form's products. The answer is the
    reference's, except at a = −∞: there the chunked forms' rule for non-finite inputs (NaN from
    that step on, _common.py) holds, where the reference's exp(−∞) = 0 stays finite; "cpu" must
    give what "chunked" gives."""
    import ssm.scan.trapezoidal_cpu as cpu_backend

    calls = []
    monkeypatch.setattr(cpu_backend, "ssd_cpu", lambda *a, **k: calls.append("sweeps") or ssd_cpu(*a, **k))
    inputs = {k: v.detach() for k, v in trapezoidal_inputs(9, dtype=torch.float64).items()}
    if a == "s = 0":
        inputs["trap"] = inputs["trap"].clone()
        inputs["trap"][0, 4, 1], inputs["trap"][0, 5, 1] = 0.0, 1.0
    else:
        inputs["A"] = inputs["A"].clone()
        inputs["A"][0, 4, 1] = a / float(inputs["dt"][0, 4, 1])
    call = trapezoidal_call("interleaved", 4)
    finite = a == "s = 0" or math.isfinite(a)
    got, want = call(inputs, "cpu"), call(inputs, "ref" if finite else "chunked")
    assert not calls
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, equal_nan=not finite)


@pytest.mark.parametrize("backend,ranks", [("chunked", 2), (CPU_PRODUCTS, None)])
def test_chunked_keeps_no_intra_chunk_square_for_the_backward(backend, ranks):
    """The chunked form (and the cpu backend's products, rank 1) recompute their (·, T, T)
    weights and scores in the backward: no tensor saved for it has two axes of the chunk length
    (T = 16 here, which no other size of these inputs equals); the gradients are checked against
    the reference above."""
    inputs = {k: v.detach().requires_grad_() for k, v in trapezoidal_inputs(64, ranks=ranks).items()}
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trapezoidal_call("interleaved", 16)(inputs, backend)
    assert shapes, "nothing saved: the test would not see a square"
    squares = [s for s in shapes if 16 in s and s.count(16) >= 2]
    assert not squares, f"intra-chunk tensors kept for the backward: {squares}"


@pytest.mark.parametrize("ranks", [None, 2])
def test_chunked_keeps_less_than_one_key_tensor_a_step(ranks):
    """The chunked backend forms its whole run again in the backward: what it keeps beyond the
    scan's own inputs grows by less a step than one tensor of rotated keys per head (H·N floats;
    the output before the gate, R·H·P, and a few per-head scalars are what it keeps). Keeping
    the keys, queries and values per head and rank and the products' inputs, as it did, was
    4,965 bytes a step at rank 1 and 9,301 at rank 2 here, against the bound of 1,024."""
    from ssm.memory import saved_storages

    heads, N = 4, 64

    def kept_per_step(length):
        inputs = {k: v.detach().requires_grad_() for k, v in trapezoidal_inputs(length, ranks=ranks, N=N, M=8).items()}
        given = {t.untyped_storage().data_ptr() for t in inputs.values()}
        storages, _ = saved_storages(lambda: trapezoidal_call("interleaved", 16)(inputs, "chunked"))
        return sum(n for ptr, n in storages.items() if ptr not in given)

    grown = (kept_per_step(64) - kept_per_step(32)) / (2 * 32)  # batch 2
    assert 0 < grown < heads * N * 4, f"{grown:.0f} bytes a step kept for the backward"


@pytest.mark.parametrize("ranks", [None, 2])
def test_chunked_holds_no_phase_tensor_until_the_backward(ranks):
    """What the chunked backend's forward leaves allocated beyond its outputs, counted from the
    allocator rather than from saved-tensor hooks: a checkpoint's closure holds what it reads
    without the hooks seeing it. It grows by less a step than one (B, L, H, M) float tensor of
    the phase. Holding the prepared phase, cos and sin until the backward, as the first version
    of the whole-run checkpoint did, was 1,668 bytes a step here against a bound of 512."""
    from ssm.memory import extra_held_bytes

    heads, M = 4, 32

    def held_per_run(length):
        inputs = {k: v.detach().requires_grad_() for k, v in trapezoidal_inputs(length, ranks=ranks, N=64, M=M).items()}
        held, outs = extra_held_bytes(lambda: trapezoidal_call("interleaved", 16)(inputs, "chunked"), "cpu")
        return held - sum(o.numel() * o.element_size() for o in outs)

    grown = (held_per_run(64) - held_per_run(32)) / (2 * 32)  # batch 2
    assert 0 < grown < heads * M * 4, f"{grown:.0f} bytes a step held until the backward"


@pytest.mark.parametrize("gate,skip,steps_adjacent", [(True, True, True), (True, False, False), (False, True, False)])
def test_the_c_output_pass_against_its_formula(gate, skip, steps_adjacent):
    """ssm.scan.trapezoidal_cpu.trapezoidal_output, the C pass that turns the sweep's y into the rank-1
    scan's output: values against (y + (D − c·Σ_n q·k)·v)·silu(z) written out here, and every
    gradient (y, v, z, q, k, c, D) against finite differences (gradcheck, float64); v and z
    strided views, as the layer's in_proj leaves them, y contiguous or laid out as the sweep
    leaves it (steps adjacent), and rows enough to split among threads."""
    from ssm.native import library
    from ssm.scan.trapezoidal_cpu import trapezoidal_output

    if library() is None:
        pytest.fail("the cpu kernels did not build: the C output pass is untested")
    g = torch.Generator().manual_seed(7)
    B, L, H, P, N = 2, 37, 3, 5, 4
    f64 = dict(dtype=torch.float64, generator=g)
    y, q, k = torch.randn(B, L, H, P, **f64), torch.randn(B, L, H, N, **f64), torch.randn(B, L, H, N, **f64)
    if steps_adjacent:  # (B, H·P, L) seen as (B, L, H, P)
        y = torch.randn(B, H * P, L, **f64).transpose(1, 2).unflatten(-1, (H, P))
    c = torch.randn(B, L, H, **f64)
    wide = torch.randn(B, L, 3 * H * P, **f64)  # v and z as views of one projection's output
    v = wide[..., : H * P].unflatten(-1, (H, P))
    z = wide[..., H * P : 2 * H * P].unflatten(-1, (H, P)) if gate else None
    D = torch.randn(H, **f64) if skip else None
    inputs = [t.detach().requires_grad_() if t is not None else None for t in (y, v, z, q, k, c, D)]
    out = trapezoidal_output(*inputs)
    assert out is not None and out.shape == (B, L, H, P)
    coef = (D[:, None] if skip else 0) - c[..., None] * (q * k).sum(-1, keepdim=True)
    want = y + coef * v
    if gate:
        want = want * z * torch.sigmoid(z)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    live = [t for t in inputs if t is not None]

    def fn(*args):
        it = iter(args)
        return trapezoidal_output(*[next(it) if t is not None else None for t in inputs])

    assert torch.autograd.gradcheck(fn, live, **GRADCHECK_TOL)


@pytest.mark.parametrize("packed", [None, [5, 0, 9, 6]], ids=["batch", "packed"])
def test_the_c_rotary_phase_against_a_loop(packed):
    """The "cpu" backend's rotary phase (trapezoidal.c, one pass each way) against a loop in
    Python floats: φ summed per sequence from its initial phase, its cos and sin; gradcheck in
    float64; a non-finite Δ reaches its own sequence's later steps and no other."""
    from ssm.scan.trapezoidal_cpu import rotary_phase

    g = torch.Generator().manual_seed(3)
    B, L, H, M = (2 if packed is None else 1), 20, 3, 2
    cu = None if packed is None else torch.tensor([0, *itertools.accumulate(packed)])
    bounds = [(b, 0, L) for b in range(B)] if cu is None else [(0, a, e) for a, e in pairwise(cu.tolist())]
    d = torch.rand(B, L, H, generator=g, dtype=torch.float64) * 3
    th = torch.randn(B, L, H, M, generator=g, dtype=torch.float64) * 3
    p0 = torch.randn(len(bounds), H, M, generator=g, dtype=torch.float64) * 100
    phase, cos, sin = rotary_phase(d, th, p0, cu, torch.float64)
    for q, (b, lo, hi) in enumerate(bounds):
        for h, m in itertools.product(range(H), range(M)):
            acc = p0[q, h, m].item()
            for t in range(lo, hi):
                acc += d[b, t, h].item() * th[b, t, h, m].item()
                assert phase[b, t, h, m].item() == pytest.approx(acc, rel=1e-13)
                assert cos[b, t, h, m].item() == pytest.approx(math.cos(acc), abs=1e-12)
                assert sin[b, t, h, m].item() == pytest.approx(math.sin(acc), abs=1e-12)
    leaves = [t.requires_grad_() for t in (d, th, p0)]
    assert torch.autograd.gradcheck(lambda *t: rotary_phase(*t, cu, torch.float64), leaves, **GRADCHECK_TOL)
    with torch.no_grad():
        d[0, 7, 1] = float("inf")
    _, cos, _ = rotary_phase(d, th, p0, cu, torch.float64)
    (b, lo, hi), *_ = (s for s in bounds if s[1] <= 7 < s[2])
    assert torch.isnan(cos[0, 7:hi, 1]).all()
    assert (
        torch.isfinite(cos[0, :7]).all()
        and torch.isfinite(cos[0, hi:]).all()
        and torch.isfinite(cos[:, :, [0, 2]]).all()
    )


def test_the_c_rotary_phase_in_float32_against_float64():
    """Float32's cos and sin (trapezoidal.c's polynomials, not libm) within a rounding of the
    float64 values, over phases that sweep every quadrant many times (the reduction mod π/2 and
    its signs), from 0 to about 1e4; a non-finite phase stays NaN."""
    from ssm.scan.trapezoidal_cpu import rotary_phase

    g = torch.Generator().manual_seed(4)
    L, H, M = 3000, 2, 8
    d = torch.rand(1, L, H, generator=g, dtype=torch.float64) + 0.5
    th = torch.rand(1, L, H, M, generator=g, dtype=torch.float64) * torch.logspace(-3, 0.5, M, dtype=torch.float64)
    d32, th32 = d.float(), th.float()
    phase, cos, sin = rotary_phase(d32, th32, None, None, torch.float32)
    exact = torch.cumsum(d32.double()[..., None] * th32.double(), dim=1)  # what the C pass sums, in float64
    assert cos.dtype == sin.dtype == torch.float32
    assert exact.max() > 1e3 and (exact % (2 * math.pi)).min() < 0.05  # many quadrants, some near 0
    torch.testing.assert_close(phase.double(), exact, rtol=1e-7, atol=0)
    assert (cos.double() - exact.cos()).abs().max() <= 1e-7
    assert (sin.double() - exact.sin()).abs().max() <= 1e-7
    d32[0, 5, 1] = float("nan")
    _, cos, sin = rotary_phase(d32, th32, None, None, torch.float32)
    assert torch.isnan(cos[0, 5:, 1]).all() and torch.isnan(sin[0, 5:, 1]).all()
    assert torch.isfinite(cos[0, :, 0]).all()


@pytest.mark.parametrize("ranks", [None, 2])
@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_last_state_is_contiguous(backend, ranks):
    """Every part of the last state is contiguous after several chunks: a cache keeps it, and the
    fused decoding step takes only contiguous states (a strided view made it decline)."""
    x = {k: v.detach() for k, v in trapezoidal_inputs(21, ranks=ranks).items()}
    _, *last = trapezoidal_call(chunk_size=4)(x, backend)
    assert all(t.is_contiguous() for t in last), [tuple(t.stride()) for t in last]


def kept_storages(run) -> tuple[set[int], object]:
    """The storages (data pointers) of every tensor autograd keeps for the backward of run(), and its result."""
    from ssm.memory import saved_storages

    storages, out = saved_storages(run)
    return set(storages), out


def test_the_shared_pieces_keep_their_inputs_not_copies():
    """The fast forms' rotary phase, rotation per head and output gate keep for the backward
    only tensors that exist anyway: their inputs as they came (z a view of a wider tensor, as
    in_proj leaves it; B per group, not per head), and not the cos and sin of the phase (formed
    again from Δ and θ, and for the rotation where it is given their source); the gate, with
    a bfloat16 z and rank 1, y in bfloat16.
    Through autograd they kept θ and φ in float64, w per head, z upcast, silu(z) and y + D·v.
    Their gradients are checked through every backend's against the reference above."""
    from ssm.scan._common_trapezoidal import PhaseSource, gate_and_contract, rotated_per_head, tensor_rotary_phase

    g = torch.Generator().manual_seed(0)
    batch, L, heads, M, P, N = 2, 5, 4, 3, 6, 8

    def leaf(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    def ptr(t):
        return t.untyped_storage().data_ptr()

    delta, angles = leaf(batch, L, heads), leaf(batch, L, heads, M)
    kept, (_, cos, sin) = kept_storages(lambda: tensor_rotary_phase(delta, angles, None, None, torch.float32))
    assert kept and kept <= {ptr(t) for t in (delta, angles)}  # cos and sin formed again

    B, bias = leaf(batch, L, 1, 1, N), leaf(heads, 1, N)  # one group, rank 1
    c, s = cos.detach()[:, :, None], sin.detach()[:, :, None]
    kept, _ = kept_storages(lambda: rotated_per_head(B, heads, bias, c, s, "interleaved", torch.float32))
    assert kept and kept <= {ptr(t) for t in (B, bias, c, s)}
    # with the phase's source, cos and sin are formed again from it, and the gradients are the
    # ones from kept cos and sin
    source = PhaseSource(delta, angles, None, torch.float32)
    kept, w = kept_storages(lambda: rotated_per_head(B, heads, bias, c, s, "interleaved", torch.float32, source))
    assert kept and kept <= {ptr(t) for t in (B, bias, delta, angles)}
    grad = torch.randn(w.shape, generator=g)
    got = torch.autograd.grad(w, (B, bias), grad)
    want = torch.autograd.grad(rotated_per_head(B, heads, bias, c, s, "interleaved", torch.float32), (B, bias), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    # the gate with a float32 z keeps y itself; with a bfloat16 z (under autocast), y in
    # bfloat16: one new storage of half y's bytes, in place of y
    from ssm.memory import saved_storages

    y, v, D = leaf(batch, L, 1, heads, P), leaf(batch, L, 1, heads, P), leaf(heads)
    for z_dtype in (torch.float32, torch.bfloat16):
        wide = leaf(batch, L, heads * P + 5, dtype=z_dtype)
        z = wide[..., 2 : 2 + heads * P].unflatten(-1, (heads, P))
        kept, _ = saved_storages(lambda: gate_and_contract(y, v, D, z, None, None, torch.float32))
        new = {p: n for p, n in kept.items() if p not in {ptr(t) for t in (y, v, D, wide)}}
        if z_dtype == torch.float32:
            assert not new and ptr(y) in kept
        else:
            assert list(new.values()) == [y.numel() * 2] and ptr(y) not in kept

    # MIMO's gate and rank contraction (rank 3) keep their inputs alone, y as it came; through
    # autograd they kept four more tensors of y's size
    R = 3
    y, v = leaf(batch, L, R, heads, P), leaf(batch, L, R, heads, P)
    mimo_z, mimo_o = leaf(heads, R, P), leaf(heads, R, P)
    wide = leaf(batch, L, heads * P + 5, dtype=torch.bfloat16)
    z = wide[..., 2 : 2 + heads * P].unflatten(-1, (heads, P))
    kept, _ = kept_storages(lambda: gate_and_contract(y, v, D, z, mimo_z, mimo_o, torch.float32))
    assert kept and kept <= {ptr(t) for t in (y, v, D, wide, mimo_z, mimo_o)}
