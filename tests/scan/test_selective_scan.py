"""Every selective_scan backend against the sequential reference, forward and every gradient."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from ssm.scan import backends, selective_scan
from tests.helpers import GRADCHECK_TOL, check_selective, run_with_grads, selective_call, selective_inputs
from tests.helpers import SELECTIVE_FORMS as FORMS

# "triton" runs on the CPU only in Triton's (slow) interpreter; tests/scan/test_triton.py
# runs it against the reference at sizes the interpreter gets through quickly.
FAST_BACKENDS = [b for b in backends("selective_scan", "cpu") if b not in ("ref", "triton")]
LENGTHS = [1, 2, 3, 7, 63, 64, 65, 257, 1000]


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_lengths(backend, length):
    check_selective(selective_inputs(length, B_form="varying", C_form="grouped"), backend)


@pytest.mark.parametrize("D,z,bias,initial_state", list(itertools.product([False, True], repeat=4)))
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_options(backend, form, D, z, bias, initial_state):
    inputs = selective_inputs(19, B_form=form, D=D, z=z, bias=bias, initial_state=initial_state)
    check_selective(inputs, backend)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_delta_across_every_branch_of_softplus(backend):
    """The pre-softplus Δ spans values above softplus's threshold (20), where it is the
    identity, and far below 0, where it is nearly exp."""
    inputs = selective_inputs(45, wide_delta=True, B_form="grouped", C_form="varying")
    pre = inputs["delta"] + inputs["delta_bias"][:, None]
    assert pre.max() > 21 and pre.min() < -8
    check_selective(inputs, backend)


@pytest.mark.parametrize("B_form,C_form", [("fixed", "varying"), ("grouped", "fixed"), ("varying", "grouped")])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_mixed_B_C_forms(backend, B_form, C_form):
    check_selective(selective_inputs(33, B_form=B_form, C_form=C_form), backend)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", FAST_BACKENDS + ["ref"])
def test_half_precision(backend, dtype):
    """Half inputs: state in float32, output in the input dtype, close to the float64
    reference run on the same (rounded) values."""
    check_selective(selective_inputs(200, dtype=dtype), backend)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_gradcheck(backend, form):
    inputs = selective_inputs(5, batch=1, dim=2, N=2, groups=2, B_form=form, dtype=torch.float64)
    names = list(inputs)

    def f(*tensors):
        return selective_scan(**dict(zip(names, tensors)), delta_softplus=True, return_last_state=True, backend=backend)

    assert torch.autograd.gradcheck(f, tuple(inputs.values()), **GRADCHECK_TOL)


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_float64_matches_ref_tightly(backend):
    check_selective(selective_inputs(65, B_form="grouped", dtype=torch.float64), backend)


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_inputs_are_not_modified(backend):
    inputs = selective_inputs(37)
    before = {k: v.detach().clone() for k, v in inputs.items()}
    run_with_grads(selective_call, inputs, backend)
    for k, v in inputs.items():
        assert torch.equal(v.detach(), before[k]), f"{backend} modified {k}"


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_length_zero(backend):
    inputs = selective_inputs(0)
    out, last = selective_scan(**inputs, delta_softplus=True, return_last_state=True, backend=backend)
    assert out.shape == (2, 6, 0) and out.dtype == torch.float32
    torch.testing.assert_close(last, inputs["initial_state"])
    last.sum().backward()  # the state passes straight through
    torch.testing.assert_close(inputs["initial_state"].grad, torch.ones_like(last))
    no_state = selective_inputs(0, initial_state=False)
    out, last = selective_scan(**no_state, return_last_state=True, backend=backend)
    assert torch.equal(last, torch.zeros(2, 6, 4))


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_return_last_state_false_returns_only_out(backend):
    inputs = selective_inputs(9)
    out = selective_scan(**inputs, backend=backend)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 6, 9)


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_split_sequence_via_states(backend):
    """Running two halves, the second from the first's last state, equals one full run."""
    x = selective_inputs(40, B_form="varying", initial_state=False)
    out, last = selective_call(x, backend)
    first = {k: v[..., :25] if v.ndim >= 3 else v for k, v in x.items()}
    second = {k: v[..., 25:] if v.ndim >= 3 else v for k, v in x.items()}
    out1, state1 = selective_call(first, backend)
    out2, state2 = selective_call({**second, "initial_state": state1}, backend)
    torch.testing.assert_close(torch.cat([out1, out2], -1), out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state2, last, rtol=1e-5, atol=1e-5)


def test_reference_on_a_hand_computed_example():
    """One channel, one state: Δ = 1, A = -ln 2, B = C = u = 1 gives h_t = h_{t-1}/2 + 1."""
    ones = torch.ones(1, 1, 4)
    out, last = selective_scan(
        ones,
        ones,
        torch.tensor([[-math.log(2.0)]]),
        torch.ones(1, 1),
        torch.ones(1, 1),
        D=torch.tensor([10.0]),
        return_last_state=True,
        initial_state=torch.full((1, 1, 1), 2.0),
        backend="ref",
    )
    # h: 2 -> 2, 2, 2, 2 (a fixed point); then from 0: 1, 1.5, 1.75, 1.875
    torch.testing.assert_close(out, torch.full((1, 1, 4), 12.0))
    out, last = selective_scan(
        ones,
        ones,
        torch.tensor([[-math.log(2.0)]]),
        torch.ones(1, 1),
        torch.ones(1, 1),
        return_last_state=True,
        backend="ref",
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
    x = selective_inputs(23, B_form="grouped", C_form="varying", dtype=torch.float64)
    out, last = selective_call(x, "ref")
    y, h = closed_form(x)
    torch.testing.assert_close(out, y, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(last, h, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_empty_batch(backend):
    out, last = selective_call(selective_inputs(9, batch=0), backend)
    assert out.shape == (0, 6, 9) and last.shape == (0, 6, 4)


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_outputs_are_contiguous(backend):
    """As mamba-ssm's are, so that callers can .view() them."""
    for form, D, z in itertools.product(FORMS, [False, True], [False, True]):
        out, last = selective_call(selective_inputs(21, B_form=form, D=D, z=z), backend)
        assert out.is_contiguous() and last.is_contiguous(), (form, D, z)
        out.view(-1)


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_gradients_from_the_last_state_alone(backend):
    """A loss of only the last state: the out gradient never arrives (None upstream)."""
    x = selective_inputs(37, B_form="grouped", C_form="varying")
    grads = {}
    for b in ("ref", backend):
        _, last = selective_call(x, b)
        grads[b] = torch.autograd.grad((last * last).sum(), list(x.values()), allow_unused=True, materialize_grads=True)
    for name, got, want in zip(x, grads[backend], grads["ref"]):
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4, msg=lambda m: f"{backend} d{name}: {m}")


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_long_sequence(backend):
    """L = 8192 (many chunks of every chunked sweep, deep parallel-scan trees), against the
    float64 reference."""
    check_selective(selective_inputs(8192, batch=1, dim=3, N=2, groups=1, B_form="varying", C_form="fixed"), backend)
