"""Property-based tests of the four scans (hypothesis): drawn shapes (sizes of 0 included),
dtypes, strides (non-contiguous inputs), packings (cu_seqlens with empty sequences), optional
inputs and non-finite values, on every backend that runs on the CPU (Triton in its interpreter,
at small sizes). Each case is refused with a ValueError naming the argument the strategy made
invalid, or gives the reference's result (forward and gradients, tests/properties.py), and a NaN
or ±inf planted at a step changes nothing before it nor in another sequence.

Settings: the "ci" profile (fixed seed, bounded) or "long" (SSM_HYPOTHESIS_PROFILE=long), see
tests/conftest.py. A failure prints the drawn case; ``@reproduce_failure`` replays it.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ssm.scan import backends, linear_scan, selective_scan, ssd
from tests.helpers import (
    linear_inputs,
    selective_inputs,
    ssd_inputs,
    state_dtype,
    trapezoidal_call,
    trapezoidal_inputs,
)
from tests.properties import Case, causal, matches_reference, refused, strided

CPU = torch.device("cpu")
DTYPES = st.sampled_from([torch.float32, torch.float64, torch.bfloat16])
NONFINITE = st.sampled_from([math.nan, math.inf, -math.inf])


def fast(op: str) -> list[str]:
    return [b for b in backends(op, CPU) if b not in ("ref", "auto", "triton")]


def triton(op: str) -> list[str]:
    return [b for b in backends(op, CPU) if b == "triton"]


FEWER = settings(max_examples=max(settings().max_examples // 4, 5))  # Triton's interpreter: slow
# the interpreter computes in numpy, which warns at each NaN it makes: the planted ones make them
QUIET = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def divisors(n: int) -> list[int]:
    return [g for g in range(1, n + 1) if n % g == 0] or [1]


def size(hi: int, lo: int = 1):
    """A size in lo..hi, or 0 about one time in ten (hypothesis favours the ends of a range, so
    the 0 is one entry, last, of a list of the others repeated)."""
    return st.sampled_from(list(range(lo, hi + 1)) * max(1, 9 // (hi - lo + 1)) + [0])


def rarely(draw) -> bool:
    """True about one time in ten: a case made invalid on purpose."""
    return draw(st.sampled_from([False] * 9 + [True]))


@st.composite
def packing(draw, small: bool):
    """(batch, L, bounds or None): a batch of rows, or sequences (some empty) packed in one."""
    top = 6 if small else 12
    if draw(st.booleans()):
        lengths = draw(st.lists(size(top), min_size=1, max_size=4))
        bounds = tuple([0, *torch.tensor(lengths).cumsum(0).tolist()])
        return 1, bounds[-1], bounds
    return draw(size(2)), draw(size(top + 4)), None


def finish(case: Case, draw, backend: str) -> None:
    """The three checks of tests/properties.py on a drawn case."""
    if draw(st.booleans()):
        case.inputs = {k: strided(v) if isinstance(v, torch.Tensor) else v for k, v in case.inputs.items()}
        event("strided")
    event(f"{backend}, {str(case.dtype)[6:]}, {'packed' if case.bounds else 'rows'}")
    if case.expect_error is not None:
        event(f"refused, naming {case.expect_error}")
        refused(case, backend)
        return
    event("an empty output" if case.call(case.inputs, backend)[0].numel() == 0 else "an output")
    matches_reference(case, backend)
    rows, length = next(iter(case.inputs.values())).shape[0], case.info["L"]
    if rows and length and case.time:
        name = draw(st.sampled_from(sorted(case.time)))
        event(f"causal, {'packed' if case.bounds else 'rows'}")
        causal(case, backend, name, draw(st.integers(0, rows - 1)), draw(st.integers(0, length - 1)), draw(NONFINITE))


# ----------------------------------------------------------------------------- selective_scan


def selective_case(draw, backend: str) -> Case:
    small = backend == "triton"
    batch, L, bounds = draw(packing(small))
    dim, N = draw(size(5)), draw(size(4))
    form = draw(st.sampled_from(["fixed", "varying", "grouped"]))
    groups = dim + 1 if rarely(draw) else draw(st.sampled_from(divisors(dim)))
    dtype = draw(DTYPES)
    flags = {k: draw(st.booleans()) for k in ("D", "z", "bias", "initial_state")}
    inputs = selective_inputs(L, batch=batch, dim=dim, N=N, groups=groups, B_form=form, dtype=dtype, seed=0, **flags)
    if bounds is not None and flags["initial_state"]:
        inputs["initial_state"] = torch.randn(len(bounds) - 1, dim, N, dtype=state_dtype(dtype)).requires_grad_()
    cu = None if bounds is None else torch.tensor(bounds)
    error = "A" if N == 0 else "B" if form == "grouped" and dim % groups else None

    def call(x, b):
        return selective_scan(**x, delta_softplus=flags["bias"], return_last_state=True, cu_seqlens=cu, backend=b)

    time = {"u": 2, "delta": 2} | ({"z": 2} if flags["z"] else {})
    time |= {} if form == "fixed" else {"B": 2 if form == "varying" else 3, "C": 2 if form == "varying" else 3}
    return Case(inputs, call, time, 2, dtype, bounds, expect_error=error, info={"L": L})


@given(st.data(), st.sampled_from(fast("selective_scan")))
def test_selective_scan(data, backend):
    finish(selective_case(data.draw, backend), data.draw, backend)


@QUIET
@FEWER
@given(st.data(), st.sampled_from(triton("selective_scan")))
def test_selective_scan_triton(data, backend):
    finish(selective_case(data.draw, backend), data.draw, backend)


# ----------------------------------------------------------------------------- linear_scan


def linear_case(draw, backend: str) -> Case:
    small = backend == "triton"
    batch, L, bounds = draw(packing(small))
    F = draw(size(4))
    dtype, reverse, initial = draw(DTYPES), draw(st.booleans()), draw(st.booleans())
    inputs = linear_inputs((batch, L, F), 1, initial_state=initial and bounds is None, dtype=dtype)
    if bounds is not None and initial:
        inputs["initial_state"] = torch.randn(len(bounds) - 1, F, dtype=dtype).requires_grad_()
    cu = None if bounds is None else torch.tensor(bounds)

    def call(x, b):
        return (linear_scan(**x, dim=1, reverse=reverse, cu_seqlens=cu, backend=b),)

    return Case(inputs, call, {"gates": 1, "inputs": 1}, 1, dtype, bounds, reverse=reverse, info={"L": L})


@given(st.data(), st.sampled_from(fast("linear_scan")))
def test_linear_scan(data, backend):
    finish(linear_case(data.draw, backend), data.draw, backend)


@QUIET
@FEWER
@given(st.data(), st.sampled_from(triton("linear_scan")))
def test_linear_scan_triton(data, backend):
    finish(linear_case(data.draw, backend), data.draw, backend)


# ----------------------------------------------------------------------------- ssd


def ssd_case(draw, backend: str) -> Case:
    batch, L, bounds = draw(packing(False))
    heads, P, N = draw(size(4)), draw(size(3)), draw(size(4))
    groups = heads + 1 if rarely(draw) else draw(st.sampled_from(divisors(heads)))
    dtype, D = draw(DTYPES), draw(st.sampled_from(["none", "heads", "channels"]))
    z, bias, initial = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
    inputs = ssd_inputs(
        L,
        batch=batch,
        heads=heads,
        head_dim=P,
        groups=groups,
        N=N,
        D=D,
        z=z,
        bias=bias,
        initial_state=initial,
        dtype=dtype,
    )
    if bounds is not None and initial:
        inputs["initial_state"] = torch.randn(len(bounds) - 1, heads, P, N, dtype=state_dtype(dtype)).requires_grad_()
    cu = None if bounds is None else torch.tensor(bounds)
    chunk = draw(st.integers(1, 8))
    limit = draw(st.sampled_from([(0.0, math.inf), (0.05, 0.5)]))
    error = "B" if N == 0 or heads % groups else None

    def call(x, b):
        return ssd(
            **x, dt_softplus=True, dt_limit=limit, chunk_size=chunk, return_last_state=True, cu_seqlens=cu, backend=b
        )

    time = {"x": 1, "dt": 1, "B": 1, "C": 1} | ({"z": 1} if z else {})
    return Case(inputs, call, time, 1, dtype, bounds, expect_error=error, info={"L": L})


@given(st.data(), st.sampled_from(fast("ssd")))
def test_ssd(data, backend):
    finish(ssd_case(data.draw, backend), data.draw, backend)


# ----------------------------------------------------------------------------- trapezoidal_scan


def trapezoidal_case(draw, backend: str) -> Case:
    small = backend == "triton"
    batch, L, bounds = draw(packing(small))
    heads, P, N = draw(size(3)), draw(size(3)), 2 * draw(size(3))
    M = draw(st.integers(0, N // 2))
    groups = draw(st.sampled_from(divisors(heads)))
    ranks = draw(st.sampled_from([None, 1, 2]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    flags = {k: draw(st.booleans()) for k in ("D", "z", "bias", "mimo", "initial_state")}
    inputs = trapezoidal_inputs(
        L, batch=batch, heads=heads, head_dim=P, groups=groups, N=N, M=M, ranks=ranks, dtype=dtype,
        packed=None if bounds is None else [b - a for a, b in zip(bounds, bounds[1:])], **flags,
    )  # fmt: skip
    cu = inputs.pop("cu_seqlens", None)
    rotary = "halved" if ranks is not None else "interleaved"
    run = trapezoidal_call(rotary, draw(st.integers(1, 8)))

    def call(x, b):
        return run(x if cu is None else {**x, "cu_seqlens": cu}, b)

    time = {k: 1 for k in ("x", "dt", "A", "B", "C", "trap", "angles")} | ({"z": 1} if flags["z"] else {})
    return Case(inputs, call, time, 1, dtype, bounds, expect_error="B" if N == 0 else None, info={"L": L})


@given(st.data(), st.sampled_from(fast("trapezoidal_scan")))
def test_trapezoidal_scan(data, backend):
    finish(trapezoidal_case(data.draw, backend), data.draw, backend)


@QUIET
@FEWER
@given(st.data(), st.sampled_from(triton("trapezoidal_scan")))
def test_trapezoidal_scan_triton(data, backend):
    finish(trapezoidal_case(data.draw, backend), data.draw, backend)
