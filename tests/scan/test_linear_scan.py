"""Every linear_scan backend against the sequential reference, forward and every gradient."""

from __future__ import annotations

import pytest
import torch

from ssm.scan import backends, linear_scan
from tests.helpers import GRADCHECK_TOL, check_linear, linear_call, linear_inputs, run_with_grads

# "triton" runs on the CPU only in Triton's (slow) interpreter; tests/scan/test_triton.py
# runs it against the reference at sizes the interpreter gets through quickly.
FAST_BACKENDS = [b for b in backends("linear_scan", "cpu") if b not in ("ref", "triton")]
LENGTHS = [1, 2, 3, 7, 63, 64, 65, 257, 1000]


@pytest.mark.parametrize("initial_state", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_dim_minus_one(backend, length, reverse, initial_state):
    x = linear_inputs((2, 3, length), -1, initial_state=initial_state)
    check_linear(x, backend, -1, reverse)


@pytest.mark.parametrize("initial_state", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_dim_one(backend, length, reverse, initial_state):
    x = linear_inputs((2, length, 3, 2), 1, initial_state=initial_state)
    check_linear(x, backend, 1, reverse)


@pytest.mark.parametrize("dim", [0, -2])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_other_dims(backend, dim):
    x = linear_inputs((17, 4, 3), dim)
    check_linear(x, backend, dim, False)
    check_linear(x, backend, dim, True)


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
    x = linear_inputs((2, 6, 3), 1, dtype=torch.float64)
    names = list(x)

    def f(*tensors):
        return linear_scan(**dict(zip(names, tensors)), dim=1, reverse=reverse, backend=backend)

    assert torch.autograd.gradcheck(f, tuple(x.values()), **GRADCHECK_TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_half_precision(backend, dtype):
    check_linear(linear_inputs((3, 300), -1, dtype=dtype), backend, -1, False)


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_inputs_are_not_modified(backend):
    x = linear_inputs((2, 3, 50), -1)
    before = {k: v.detach().clone() for k, v in x.items()}
    run_with_grads(linear_call(-1, False), x, backend)
    run_with_grads(linear_call(-1, True), x, backend)
    for k, v in x.items():
        assert torch.equal(v.detach(), before[k]), f"{backend} modified {k}"


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_length_zero(backend):
    x = linear_inputs((2, 0, 3), 1)
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
        x = linear_inputs(shape, 1)
        states = linear_scan(**x, dim=1, backend=backend)
        assert states.shape == shape
        states.sum().backward()
        assert x["gates"].grad.shape == shape


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_outputs_are_contiguous(backend):
    for dim in (0, 1, 2):
        states = linear_scan(**linear_inputs((4, 5, 6), dim), dim=dim, backend=backend)
        assert states.is_contiguous(), dim
        states.view(-1)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_long_sequence(backend, reverse):
    """L = 8192 with gates below 1 (bounded states), against the float64 reference."""
    x = linear_inputs((2, 8192, 3), 1)
    x["gates"] = (0.9 * x["gates"].detach()).requires_grad_()
    check_linear(x, backend, 1, reverse)
