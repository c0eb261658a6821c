"""Every selective_scan backend against the sequential reference, forward and every gradient."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from ssm.scan import backends, selective_scan
from tests.helpers import assert_close, poisoned

# "triton" runs on the CPU only in Triton's (slow) interpreter; tests/scan/test_triton.py
# runs it against the reference at sizes the interpreter gets through quickly.
FAST_BACKENDS = [b for b in backends("selective_scan", "cpu") if b not in ("ref", "triton")]
LENGTHS = [1, 2, 3, 7, 63, 64, 65, 257, 1000]
FORMS = ["fixed", "varying", "grouped"]  # B/C as (dim, N), (batch, N, L), (batch, G, N, L)


def make_inputs(
    length: int,
    *,
    batch: int = 2,
    dim: int = 6,
    N: int = 4,
    groups: int = 3,
    B_form: str = "varying",
    C_form: str | None = None,
    D: bool = True,
    z: bool = True,
    bias: bool = True,
    initial_state: bool = True,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> dict:
    """Inputs for selective_scan in the ranges a Mamba layer sees, as leaf tensors."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, lo=-1.0, hi=1.0, dt=dtype):
        return (lo + (hi - lo) * torch.rand(*shape, generator=g, dtype=torch.float64)).to(dt)

    def bc(form):
        return {
            "fixed": lambda: rand(dim, N),
            "varying": lambda: rand(batch, N, length),
            "grouped": lambda: rand(batch, groups, N, length),
        }[form]()

    fp32 = torch.float64 if dtype == torch.float64 else torch.float32  # A, D, delta_bias, state
    x = dict(
        u=rand(batch, dim, length),
        # with softplus and the bias below, Δ lies around 0.05..1
        delta=rand(batch, dim, length, lo=-1.0, hi=0.5) if bias else rand(batch, dim, length, lo=0.01, hi=0.8),
        A=-rand(dim, N, lo=0.1, hi=3.0, dt=fp32),
        B=bc(B_form),
        C=bc(C_form or B_form),
    )
    if D:
        x["D"] = rand(dim, dt=fp32)
    if z:
        x["z"] = rand(batch, dim, length)
    if bias:
        x["delta_bias"] = rand(dim, lo=-2.0, hi=-1.0, dt=fp32)
    if initial_state:
        x["initial_state"] = rand(batch, dim, N, dt=fp32)
    for t in x.values():
        t.requires_grad_(True)
    return x


def forward(inputs: dict, backend: str):
    """(out, last_state) of selective_scan on ``inputs``, with softplus when there is a bias."""
    return selective_scan(
        **inputs, delta_softplus="delta_bias" in inputs, return_last_state=True, backend=backend
    )


def run(inputs: dict, backend: str, seed: int = 1):
    """Forward and backward under random upstream gradients on ``out`` and ``last_state``;
    every allocation poisoned with NaN. Returns (out, last_state, {name: grad})."""
    with poisoned():
        out, last = forward(inputs, backend)
        g = torch.Generator().manual_seed(seed)
        grad_out = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
        grad_last = torch.randn(last.shape, generator=g).to(last.device, last.dtype)
        grads = torch.autograd.grad((out, last), list(inputs.values()), (grad_out, grad_last))
    return out, last, dict(zip(inputs, grads))


def check_against_ref(
    inputs: dict, backend: str, dtype: torch.dtype = torch.float32, ref_inputs: dict | None = None
):
    """``backend`` on ``inputs`` against ``ref`` on ``ref_inputs`` (default: the same inputs),
    with the tolerance of ``dtype``; outputs and gradients keep their documented dtypes."""
    out_ref, last_ref, grads_ref = run(ref_inputs or inputs, "ref")
    out, last, grads = run(inputs, backend)
    assert out.dtype == inputs["u"].dtype
    assert last.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close(out, out_ref, dtype, f"{backend} out")
    assert_close(last, last_ref, dtype, f"{backend} last_state")
    for name in inputs:
        assert grads[name].dtype == inputs[name].dtype, f"{backend} d{name} dtype"
        assert_close(grads[name], grads_ref[name], dtype, f"{backend} d{name}")


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_lengths(backend, length):
    check_against_ref(make_inputs(length, B_form="varying", C_form="grouped"), backend)


@pytest.mark.parametrize(
    "D,z,bias,initial_state", list(itertools.product([False, True], repeat=4))
)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_options(backend, form, D, z, bias, initial_state):
    inputs = make_inputs(19, B_form=form, D=D, z=z, bias=bias, initial_state=initial_state)
    check_against_ref(inputs, backend)


@pytest.mark.parametrize("B_form,C_form", [("fixed", "varying"), ("grouped", "fixed"), ("varying", "grouped")])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_mixed_B_C_forms(backend, B_form, C_form):
    check_against_ref(make_inputs(33, B_form=B_form, C_form=C_form), backend)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", FAST_BACKENDS + ["ref"])
def test_half_precision(backend, dtype):
    """Half inputs: state in float32, output in the input dtype, close to the float32
    reference run on the same (rounded) values."""
    low = make_inputs(200, dtype=dtype)
    upcast = {k: v.detach().float().requires_grad_() for k, v in low.items()}
    check_against_ref(low, backend, dtype, ref_inputs=upcast)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_gradcheck(backend, form):
    inputs = make_inputs(5, batch=1, dim=2, N=2, groups=2, B_form=form, dtype=torch.float64)
    names = list(inputs)

    def f(*tensors):
        return selective_scan(
            **dict(zip(names, tensors)), delta_softplus=True, return_last_state=True, backend=backend
        )

    assert torch.autograd.gradcheck(f, tuple(inputs.values()))


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_float64_matches_ref_tightly(backend):
    check_against_ref(make_inputs(65, B_form="grouped", dtype=torch.float64), backend, torch.float64)


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_inputs_are_not_modified(backend):
    inputs = make_inputs(37)
    before = {k: v.detach().clone() for k, v in inputs.items()}
    run(inputs, backend)
    for k, v in inputs.items():
        assert torch.equal(v.detach(), before[k]), f"{backend} modified {k}"


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_length_zero(backend):
    inputs = make_inputs(0)
    out, last = selective_scan(**inputs, delta_softplus=True, return_last_state=True, backend=backend)
    assert out.shape == (2, 6, 0) and out.dtype == torch.float32
    torch.testing.assert_close(last, inputs["initial_state"])
    last.sum().backward()  # the state passes straight through
    torch.testing.assert_close(inputs["initial_state"].grad, torch.ones_like(last))
    no_state = make_inputs(0, initial_state=False)
    out, last = selective_scan(**no_state, return_last_state=True, backend=backend)
    assert torch.equal(last, torch.zeros(2, 6, 4))


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_return_last_state_false_returns_only_out(backend):
    inputs = make_inputs(9)
    out = selective_scan(**inputs, backend=backend)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 6, 9)


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_split_sequence_via_states(backend):
    """Running two halves, the second from the first's last state, equals one full run."""
    x = make_inputs(40, B_form="varying", initial_state=False)
    out, last = forward(x, backend)
    first = {k: v[..., :25] if v.ndim >= 3 else v for k, v in x.items()}
    second = {k: v[..., 25:] if v.ndim >= 3 else v for k, v in x.items()}
    out1, state1 = forward(first, backend)
    out2, state2 = forward({**second, "initial_state": state1}, backend)
    torch.testing.assert_close(torch.cat([out1, out2], -1), out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state2, last, rtol=1e-5, atol=1e-5)


def test_reference_on_a_hand_computed_example():
    """One channel, one state: Δ = 1, A = -ln 2, B = C = u = 1 gives h_t = h_{t-1}/2 + 1."""
    ones = torch.ones(1, 1, 4)
    out, last = selective_scan(
        ones, ones, torch.tensor([[-math.log(2.0)]]), torch.ones(1, 1), torch.ones(1, 1),
        D=torch.tensor([10.0]), return_last_state=True, initial_state=torch.full((1, 1, 1), 2.0),
        backend="ref",
    )
    # h: 2 -> 2, 2, 2, 2 (a fixed point); then from 0: 1, 1.5, 1.75, 1.875
    torch.testing.assert_close(out, torch.full((1, 1, 4), 12.0))
    out, last = selective_scan(
        ones, ones, torch.tensor([[-math.log(2.0)]]), torch.ones(1, 1), torch.ones(1, 1),
        return_last_state=True, backend="ref",
    )
    torch.testing.assert_close(out, torch.tensor([[[1.0, 1.5, 1.75, 1.875]]]))
    torch.testing.assert_close(last, torch.tensor([[[1.875]]]))


def closed_form(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan without any loop over time, in float64, for checking the reference:
    h_t = Σ_{s≤t} exp(Σ_{s<r≤t} Δ_r A) Δ_s B_s u_s + exp(Σ_{r≤t} Δ_r A) h_{-1}."""
    x = {k: v.detach().double() for k, v in x.items()}
    u, A = x["u"], x["A"]
    batch, dim, L = u.shape
    delta = F.softplus(x["delta"] + x["delta_bias"][:, None])
    B, C = (M[:, None] if M.ndim == 3 else M for M in (x["B"], x["C"]))  # (b, g, n, l)
    B = B.repeat_interleave(dim // B.shape[1], 1)  # (b, d, n, l)
    C = C.repeat_interleave(dim // C.shape[1], 1)
    cum = torch.cumsum(delta[..., None] * A[:, None, :], dim=2)  # (b, d, l, n): Σ_{r≤t} Δ_r A
    # decay[b, d, t, s, n] = exp(cum_t - cum_s) for s ≤ t
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    diff = cum[:, :, :, None, :] - cum[:, :, None, :, :]
    decay = torch.where(causal[None, None, :, :, None], diff, torch.full_like(diff, -math.inf)).exp()
    drive = (delta * u)[:, :, None, :, None] * B.transpose(-1, -2)[:, :, None, :, :]  # (b, d, 1, s, n)
    h = (decay * drive).sum(3) + cum.exp() * x["initial_state"][:, :, None, :]  # (b, d, t, n)
    y = torch.einsum("bdtn,bdnt->bdt", h, C) + x["D"][:, None] * u
    return y * F.silu(x["z"]), h[:, :, -1]


def test_reference_against_closed_form():
    x = make_inputs(23, B_form="grouped", C_form="varying", dtype=torch.float64)
    out, last = forward(x, "ref")
    y, h = closed_form(x)
    torch.testing.assert_close(out, y, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(last, h, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_empty_batch(backend):
    out, last = forward(make_inputs(9, batch=0), backend)
    assert out.shape == (0, 6, 9) and last.shape == (0, 6, 4)
