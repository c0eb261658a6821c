"""torch.compile traces the public scan functions with fullgraph=True (no graph breaks).

The "aot_eager" compiler backend traces forward and backward exactly as inductor would but
runs the captured graphs eagerly, so the test needs no C++ compiler and stays fast.
"""

from __future__ import annotations

import pytest
import torch

from ssm.scan import TrapezoidalState, linear_scan, selective_scan, trapezoidal_scan
from tests.helpers import assert_compiled_matches_eager, trapezoidal_inputs


@pytest.mark.parametrize("backend", ["pscan", "cpu"])
def test_selective_scan_compiles_without_graph_breaks(backend):
    g = torch.Generator().manual_seed(0)
    b, d, L, N = 2, 6, 37, 4
    inputs = [
        torch.randn(b, d, L, generator=g),  # u
        torch.randn(b, d, L, generator=g),  # delta
        -torch.rand(d, N, generator=g),  # A
        torch.randn(b, 3, N, L, generator=g),  # B, grouped
        torch.randn(b, N, L, generator=g),  # C
        torch.randn(d, generator=g),  # D
        torch.randn(b, d, L, generator=g),  # z
        torch.randn(d, generator=g),  # delta_bias
        torch.randn(b, d, N, generator=g),  # initial_state
    ]
    inputs = [x.requires_grad_() for x in inputs]

    def f(u, delta, A, B, C, D, z, delta_bias, h0):
        out, last = selective_scan(u, delta, A, B, C, D, z, delta_bias, True, True, initial_state=h0, backend=backend)
        return (out * out).sum() + last.sum()

    assert_compiled_matches_eager(f, inputs, **({"rtol": 1e-4, "atol": 1e-4} if backend == "cpu" else {}))


@pytest.mark.parametrize("backend", ["pscan", "cpu"])
def test_linear_scan_compiles_without_graph_breaks(backend):
    g = torch.Generator().manual_seed(0)
    inputs = [
        torch.rand(3, 21, 5, generator=g).requires_grad_(),
        torch.randn(3, 21, 5, generator=g).requires_grad_(),
        torch.randn(3, 5, generator=g).requires_grad_(),
    ]

    def f(a, x, h0):
        return linear_scan(a, x, dim=1, initial_state=h0, reverse=True, backend=backend).pow(2).sum()

    assert_compiled_matches_eager(f, inputs)


@pytest.mark.parametrize("backend", ["chunked", "cpu"])
def test_trapezoidal_scan_compiles_without_graph_breaks(backend):
    """Mamba-3's scan, SISO with every option: "cpu" reads its decays to choose the
    sweeps, which a trace cannot, so under torch.compile it runs the chunked core."""
    inputs = {k: v.detach().requires_grad_() for k, v in trapezoidal_inputs(19).items()}
    names = list(inputs)

    def f(*tensors):
        kw = dict(zip(names, tensors))
        state = TrapezoidalState(*(kw.pop(f"initial_{n}") for n in TrapezoidalState._fields))
        out, last = trapezoidal_scan(**kw, initial_state=state, return_last_state=True, backend=backend)
        return out.pow(2).sum() + last.ssm.pow(2).sum()

    assert_compiled_matches_eager(
        f, list(inputs.values()), **({"rtol": 1e-4, "atol": 1e-4} if backend == "cpu" else {})
    )
