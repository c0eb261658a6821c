"""The "cpu" backend beyond the cross-backend tests: its compiled chunks, the eager fallback,
what it keeps for the backward, and sequence lengths around the chunk size.

Every other test runs the backend eagerly (tests/conftest.py); the compiled path is tested
here, at one shape family, so that the compile cost is paid once per session.
"""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from ssm.scan import cpu, linear_scan, selective_scan
from ssm.scan.linear import BACKENDS as LINEAR_BACKENDS
from ssm.scan.selective import BACKENDS as SELECTIVE_BACKENDS
from tests.helpers import assert_close, check_linear, check_selective, linear_inputs, selective_call, selective_inputs

T = cpu.CHUNK


def test_auto_picks_cpu_for_cpu_tensors():
    assert SELECTIVE_BACKENDS.resolve("auto", torch.device("cpu")).name == "cpu"
    assert LINEAR_BACKENDS.resolve("auto", torch.device("cpu")).name == "cpu"


@pytest.mark.parametrize("length", [T - 1, T, T + 1, 2 * T - 1, 2 * T + 1])
@pytest.mark.parametrize("form", ["fixed", "grouped"])
def test_selective_chunk_boundaries(length, form):
    check_selective(selective_inputs(length, B_form=form, C_form="varying"), "cpu")


@pytest.mark.parametrize("length", [T - 1, T, T + 1, 2 * T + 1])
@pytest.mark.parametrize("reverse", [False, True])
def test_linear_chunk_boundaries(length, reverse):
    check_linear(linear_inputs((2, length, 3), 1), "cpu", 1, reverse)


def grads_against_ref(run, inputs, outputs, what):
    """``run(inputs, backend)`` -> (outputs, {name: grad}) for "cpu" and "ref"; compare all."""
    got, got_grads = run(inputs, "cpu")
    want, want_grads = run(inputs, "ref")
    for g, w, name in zip(got, want, outputs):
        assert_close(g, w, torch.float32, f"{what} {name}")
    for name in inputs:
        assert_close(got_grads[name], want_grads[name], torch.float32, f"{what} d{name}")


def run_selective(inputs, backend):
    out, last = selective_call(inputs, backend)
    g = torch.Generator().manual_seed(1)
    upstream = (torch.randn(out.shape, generator=g), torch.randn(last.shape, generator=g))
    grads = torch.autograd.grad((out, last), list(inputs.values()), upstream)
    return (out, last), dict(zip(inputs, grads))


def run_linear(reverse):
    def run(x, backend):
        states = linear_scan(**x, dim=1, reverse=reverse, backend=backend)
        grads = torch.autograd.grad(states, list(x.values()), torch.randn(states.shape, generator=torch.Generator().manual_seed(1)))
        return (states,), dict(zip(x, grads))

    return run


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_compiled_chunks_match_ref_and_do_not_recompile_per_length(compiled_cpu_backend):
    """One shape family (batch 2, dim 6, N 4, B time-varying, C grouped), two lengths with
    full chunks and a tail: the chunks are compiled once and agree with ref. (Not under
    poisoned(): dynamo does not trace under a dispatch mode, the chunks would run eagerly.)"""
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a compile failure would warn
        inputs = selective_inputs(2 * T + 5, B_form="varying", C_form="grouped")
        grads_against_ref(run_selective, inputs, ["out", "last_state"], "selective")
        graphs = counters["stats"]["unique_graphs"]
        assert graphs >= 2  # the forward and the backward chunk
        assert cpu._SELECTIVE_FWD._compiled is not None and not cpu._SELECTIVE_FWD.failed
        assert not cpu._SELECTIVE_BWD.failed
        inputs = selective_inputs(4 * T - 1, B_form="varying", C_form="grouped", seed=3)
        grads_against_ref(run_selective, inputs, ["out", "last_state"], "selective")
        assert counters["stats"]["unique_graphs"] == graphs, "a new length recompiled the chunks"

        for reverse in (False, True):  # the linear scan: its forward and adjoint chunks
            x = linear_inputs((2, 3 * T + 2, 5), 1)
            grads_against_ref(run_linear(reverse), x, ["states"], f"linear reverse={reverse}")
        assert cpu._LINEAR._compiled is not None and not cpu._LINEAR.failed


def test_eager_fallback_warns_once_and_stays_correct(monkeypatch):
    """When torch.compile fails (here: forced to), the chunks run eagerly after one warning."""

    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler found (simulated)")

        return run

    monkeypatch.setattr(cpu, "COMPILE", True)
    monkeypatch.setattr(cpu, "_warned", False)
    monkeypatch.setattr(torch, "compile", broken_compile)
    for name, fn in [("_SELECTIVE_FWD", cpu._selective_chunk), ("_SELECTIVE_BWD", cpu._selective_chunk_bwd),
                     ("_LINEAR", cpu._linear_chunk)]:
        monkeypatch.setattr(cpu, name, cpu._Body(fn))

    # (not under poisoned(): under a dispatch mode the chunks run eagerly without compiling)
    with pytest.warns(RuntimeWarning, match="running the chunks eagerly") as record:
        grads_against_ref(run_selective, selective_inputs(2 * T + 3), ["out", "last_state"], "selective")
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
    assert cpu._SELECTIVE_FWD.failed and cpu._SELECTIVE_BWD.failed
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no second warning
        grads_against_ref(run_selective, selective_inputs(3 * T, seed=2), ["out", "last_state"], "selective")
        grads_against_ref(run_linear(False), linear_inputs((2, 2 * T + 1, 3), 1), ["states"], "linear")
    assert cpu._LINEAR.failed


def saved_by(fn):
    """The shapes of the tensors autograd saves while running ``fn``, and its result."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return shapes, result


def test_no_grad_saves_nothing(monkeypatch):
    seen = []  # the `states` buffer each forward sweep was given
    sweep = cpu._selective_sweep

    def spy(delta, u, A, B, C, h, states=None):
        seen.append(states)
        return sweep(delta, u, A, B, C, h, states)

    monkeypatch.setattr(cpu, "_selective_sweep", spy)
    inputs = selective_inputs(3 * T + 2)

    with torch.no_grad():
        shapes, (out, last) = saved_by(lambda: selective_call(inputs, "cpu"))
    assert shapes == [] and out.grad_fn is None and last.grad_fn is None
    assert seen == [None], "the no-grad forward allocated chunk states"

    detached = {k: v.detach() for k, v in inputs.items()}  # nothing requires grad
    shapes, (out, last) = saved_by(lambda: selective_call(detached, "cpu"))
    assert shapes == [] and out.grad_fn is None

    # With gradients the chunk states are kept (so the test above can fail), and nothing
    # saved is as large as (batch, dim, L, N): memory is O(batch·dim·L) (L padded to whole chunks).
    shapes, (out, last) = saved_by(lambda: selective_call(inputs, "cpu"))
    batch, dim, length = inputs["u"].shape
    N = inputs["A"].shape[1]
    assert (-(-length // T), batch, dim, N) in shapes
    padded = -(-length // T) * T
    assert max(torch.Size(s).numel() for s in shapes) <= batch * dim * padded < batch * dim * length * N


def test_linear_no_grad_saves_nothing():
    x = linear_inputs((2, 2 * T + 3, 3), 1)
    with torch.no_grad():
        shapes, states = saved_by(lambda: linear_scan(**x, dim=1, backend="cpu"))
    assert shapes == [] and states.grad_fn is None
    shapes, states = saved_by(lambda: linear_scan(**x, dim=1, backend="cpu"))
    assert shapes and states.grad_fn is not None


def test_inside_torch_compile_traces_the_parallel_scan():
    """Under a user's torch.compile the backend traces pscan instead (no graph break)."""
    g = torch.Generator().manual_seed(0)
    u, delta = torch.randn(2, 6, 21, generator=g), torch.randn(2, 6, 21, generator=g)
    A, B, C = -torch.rand(6, 4, generator=g), torch.randn(2, 4, 21, generator=g), torch.randn(2, 4, 21, generator=g)

    def f(u, delta):
        return selective_scan(u, delta, A, B, C, delta_softplus=True, backend="cpu")

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert_close(compiled(u, delta), f(u, delta), torch.float32, "compiled out")
