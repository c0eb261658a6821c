"""Every linear_scan backend against the sequential reference, forward and every gradient."""

from __future__ import annotations

import pytest
import torch

from ssm.scan import backends, linear_scan
from tests.helpers import assert_close, poisoned

# "triton" runs on the CPU only in Triton's (slow) interpreter; tests/scan/test_triton.py
# runs it against the reference at sizes the interpreter gets through quickly.
FAST_BACKENDS = [b for b in backends("linear_scan", "cpu") if b not in ("ref", "triton")]
LENGTHS = [1, 2, 3, 7, 63, 64, 65, 257, 1000]


def make_inputs(shape, dim, *, initial_state=True, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    gates = torch.rand(shape, generator=g, dtype=torch.float64).mul(1.05).to(dtype)  # some > 1
    inputs = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    x = dict(gates=gates, inputs=inputs)
    if initial_state:
        state_shape = list(shape)
        del state_shape[dim]
        x["initial_state"] = torch.randn(state_shape, generator=g, dtype=torch.float64).to(dtype)
    for t in x.values():
        t.requires_grad_(True)
    return x


def run(x: dict, backend: str, dim: int, reverse: bool, seed: int = 1):
    with poisoned():
        states = linear_scan(**x, dim=dim, reverse=reverse, backend=backend)
        grad = torch.randn(states.shape, generator=torch.Generator().manual_seed(seed)).to(states.device, states.dtype)
        grads = torch.autograd.grad(states, list(x.values()), grad)
    return states, dict(zip(x, grads))


def check_against_ref(x, backend, dim, reverse, dtype=torch.float32, ref_inputs=None):
    """``backend`` on ``x`` against ``ref`` on ``ref_inputs`` (default: the same inputs), with
    the tolerance of ``dtype``; states and gradients keep the inputs' dtypes."""
    states_ref, grads_ref = run(ref_inputs or x, "ref", dim, reverse)
    states, grads = run(x, backend, dim, reverse)
    assert states.dtype == x["inputs"].dtype
    assert_close(states, states_ref, dtype, f"{backend} states")
    for name in x:
        assert grads[name].dtype == x[name].dtype, f"{backend} d{name} dtype"
        assert_close(grads[name], grads_ref[name], dtype, f"{backend} d{name}")


@pytest.mark.parametrize("initial_state", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_dim_minus_one(backend, length, reverse, initial_state):
    x = make_inputs((2, 3, length), -1, initial_state=initial_state)
    check_against_ref(x, backend, -1, reverse)


@pytest.mark.parametrize("initial_state", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_dim_one(backend, length, reverse, initial_state):
    x = make_inputs((2, length, 3, 2), 1, initial_state=initial_state)
    check_against_ref(x, backend, 1, reverse)


@pytest.mark.parametrize("dim", [0, -2])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_other_dims(backend, dim):
    x = make_inputs((17, 4, 3), dim)
    check_against_ref(x, backend, dim, reverse=False)
    check_against_ref(x, backend, dim, reverse=True)


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_one_dimensional_inputs(backend):
    gates = torch.full((5,), 0.5)
    inputs = torch.ones(5)
    expected = torch.tensor([1.0, 1.5, 1.75, 1.875, 1.9375])
    torch.testing.assert_close(linear_scan(gates, inputs, backend=backend), expected)
    torch.testing.assert_close(linear_scan(gates, inputs, reverse=True, backend=backend), expected.flip(0))
    h0 = torch.tensor(2.0)  # a fixed point of h = h/2 + 1
    torch.testing.assert_close(linear_scan(gates, inputs, initial_state=h0, backend=backend), torch.full((5,), 2.0))


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_gradcheck(backend, reverse):
    x = make_inputs((2, 6, 3), 1, dtype=torch.float64)
    names = list(x)

    def f(*tensors):
        return linear_scan(**dict(zip(names, tensors)), dim=1, reverse=reverse, backend=backend)

    assert torch.autograd.gradcheck(f, tuple(x.values()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_half_precision(backend, dtype):
    low = make_inputs((3, 300), -1, dtype=dtype)
    upcast = {k: v.detach().float().requires_grad_() for k, v in low.items()}
    check_against_ref(low, backend, -1, False, dtype, ref_inputs=upcast)


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_inputs_are_not_modified(backend):
    x = make_inputs((2, 3, 50), -1)
    before = {k: v.detach().clone() for k, v in x.items()}
    run(x, backend, -1, False)
    run(x, backend, -1, True)
    for k, v in x.items():
        assert torch.equal(v.detach(), before[k]), f"{backend} modified {k}"


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_length_zero(backend):
    x = make_inputs((2, 0, 3), 1)
    states = linear_scan(**x, dim=1, backend=backend)
    assert states.shape == (2, 0, 3)


def test_mixed_dtypes_promote():
    gates = torch.rand(4, 10, dtype=torch.bfloat16)
    inputs = torch.randn(4, 10)
    for backend in ["ref"] + FAST_BACKENDS:
        assert linear_scan(gates, inputs, backend=backend).dtype == torch.float32


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_empty_non_scanned_dims(backend):
    for shape in [(0, 5, 3), (2, 5, 0)]:
        x = make_inputs(shape, 1)
        states = linear_scan(**x, dim=1, backend=backend)
        assert states.shape == shape
        states.sum().backward()
        assert x["gates"].grad.shape == shape
