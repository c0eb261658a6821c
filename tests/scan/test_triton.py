"""Backend "triton" against the sequential reference, forward and every gradient.

Without CUDA, tests/conftest.py sets TRITON_INTERPRET=1, so every kernel runs on CPU tensors
in Triton's interpreter; these tests then run (not skip) in CI. The interpreter is slow, so
sizes are small but odd: dim not a multiple of the channel block, L = 1, 19, 300 and one
step either side of a chunk boundary. On a GPU the larger-shape test takes a model's sizes.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed (it is on Linux)")

import ssm.scan.triton
from ssm.scan import backends, linear_scan, selective_scan
from ssm.scan import linear as linear_op
from ssm.scan import selective as selective_op
from ssm.scan.triton import linear_scan as triton_linear
from ssm.scan.triton import selective_scan as triton_selective
from tests.helpers import (
    SELECTIVE_FORMS,
    assert_compiled_matches_eager,
    check_against_reference,
    check_linear,
    check_selective,
    cu_seqlens_of,
    linear_inputs,
    linear_packed_call,
    linear_solo_call,
    packed_lengths,
    run_with_grads,
    selective_call,
    selective_inputs,
    selective_packed_call,
    selective_solo_call,
    with_sequence_states,
)

ON_DEVICE = torch.cuda.is_available()
DEVICE = "cuda" if ON_DEVICE else "cpu"
CHUNK = triton_selective.CHUNK


def to_device(inputs: dict) -> dict:
    return {k: v.detach().to(DEVICE).requires_grad_() for k, v in inputs.items()}


def small(length: int, **kw) -> dict:
    """Selective-scan inputs: batch 2, dim 5 (the channel block is 8), N 4 unless given."""
    kw = {"batch": 2, "dim": 5, "N": 4, "groups": 5, **kw}
    return to_device(selective_inputs(length, **kw))


def test_backend_runs_here_and_never_by_default_on_cpu():
    """The tests below run the kernels, they do not skip: without CUDA, under the interpreter."""
    assert ON_DEVICE or os.environ.get("TRITON_INTERPRET") == "1"
    for op, table in (("selective_scan", selective_op.BACKENDS), ("linear_scan", linear_op.BACKENDS)):
        assert "triton" in backends(op, DEVICE)
        assert "triton" in backends(op, "cuda")
        assert table.resolve("auto", torch.device("cpu")).name != "triton"
        assert table.resolve("auto", torch.device("cuda")).name == "triton"


# ----------------------------------------------------------------------------- selective scan


@pytest.mark.parametrize("length", [1, 19, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 1, 300])
def test_selective_lengths(length):
    check_selective(small(length, B_form="varying", C_form="grouped"), "triton")


OPTIONS = list(itertools.product([False, True], repeat=4))  # D, z, delta_bias, initial_state


@pytest.mark.parametrize("D,z,bias,initial_state", OPTIONS)
def test_selective_options(D, z, bias, initial_state):
    """Every combination of the optional inputs (each a compile-time flag of the kernels), with
    the form of B and C taking turns."""
    form = SELECTIVE_FORMS[OPTIONS.index((D, z, bias, initial_state)) % 3]
    inputs = small(CHUNK + 3, B_form=form, D=D, z=z, bias=bias, initial_state=initial_state)
    check_selective(inputs, "triton")


@pytest.mark.parametrize(
    "B_form,C_form", [("fixed", "varying"), ("grouped", "fixed"), ("varying", "grouped"), ("fixed", "fixed")]
)
def test_selective_B_C_forms(B_form, C_form):
    check_selective(small(23, B_form=B_form, C_form=C_form), "triton")


@pytest.mark.parametrize("dim,groups", [(9, 3), (12, 4), (6, 2)])
def test_selective_groups_and_channel_blocks(dim, groups):
    """Groups of 3 channels (a block of 4 covers one group), several blocks per group, and B
    and C with different numbers of groups (the programs split on the finer of the two)."""
    x = small(21, dim=dim, groups=groups, B_form="grouped")
    x["C"] = to_device(
        selective_inputs(21, batch=2, dim=dim, N=4, groups=dim // 3 if dim % 3 == 0 else 1, B_form="grouped", seed=5)
    )["B"]
    check_selective(x, "triton")


def test_selective_delta_across_every_branch_of_softplus():
    """The kernels' own softplus: pre-softplus values above the threshold (20) and far below 0."""
    x = small(CHUNK + 9, wide_delta=True, B_form="grouped")
    pre = x["delta"] + x["delta_bias"][:, None]
    assert pre.max() > 21 and pre.min() < -8
    check_selective(x, "triton")


def test_selective_state_size_not_a_power_of_two():
    check_selective(small(19, N=3, B_form="grouped"), "triton")


def test_selective_strided_B_C():
    """B and C as a Mamba layer makes them: (batch, L, N) projections viewed as (batch, N, L)."""
    x = small(37, B_form="varying")
    for name in ("B", "C"):
        x[name] = x[name].detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
        assert not x[name].is_contiguous()
    check_selective(x, "triton")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_selective_half_precision(dtype):
    check_selective(to_device(selective_inputs(2 * CHUNK + 5, batch=2, dim=5, N=4, groups=5, dtype=dtype)), "triton")


def test_selective_float64_tightly():
    x = to_device(selective_inputs(CHUNK + 7, batch=2, dim=5, N=4, groups=5, B_form="grouped", dtype=torch.float64))
    check_selective(x, "triton")


@pytest.mark.parametrize("form", SELECTIVE_FORMS)
def test_selective_gradcheck(form):
    x = to_device(selective_inputs(5, batch=1, dim=2, N=2, groups=2, B_form=form, dtype=torch.float64))
    names = list(x)

    def f(*tensors):
        return selective_scan(
            **dict(zip(names, tensors)), delta_softplus=True, return_last_state=True, backend="triton"
        )

    assert torch.autograd.gradcheck(f, tuple(x.values()), fast_mode=True)


@pytest.mark.parametrize("B_form", ["grouped", "fixed"])
def test_selective_gradients_are_deterministic(B_form):
    """Two backward passes on the same inputs are bitwise equal (no atomics: partial sums are
    added in a fixed order)."""
    x = small(2 * CHUNK + 3, dim=12, groups=2, B_form=B_form)
    _, first, _ = run_with_grads(selective_call, x, "triton")
    _, second, _ = run_with_grads(selective_call, x, "triton")
    for name in x:
        assert torch.equal(first[name], second[name]), name


def test_selective_only_chunk_states_are_saved():
    """Activation memory: the forward saves one state per chunk, never the (B, D, L, N) states."""
    selective_scan_fwd = triton_selective.selective_scan_fwd
    x = small(300)
    B, C = x["B"].unsqueeze(1), x["C"].unsqueeze(1)  # (batch, 1, N, L), as selective_scan passes them
    out, last, chunk_states = selective_scan_fwd(
        x["u"], x["delta"], x["A"], B, C, x["D"], x["z"], x["delta_bias"], True, x["initial_state"]
    )
    assert chunk_states.shape == (2, 5, -(-300 // CHUNK), 4)
    torch.testing.assert_close(chunk_states[:, :, 0], x["initial_state"].detach())
    # the state before chunk 1 is the last state of a run over chunk 0 alone
    first = {k: v[..., :CHUNK] if v.ndim >= 3 and k != "initial_state" else v for k, v in x.items()}
    _, state = selective_call(first, "ref")
    torch.testing.assert_close(chunk_states[:, :, 1], state.detach(), rtol=1e-5, atol=1e-5)
    # with no backward to come (inference) nothing is saved, and the results are the same
    args = (x["u"], x["delta"], x["A"], B, C, x["D"], x["z"], x["delta_bias"], True, x["initial_state"], False)
    out2, last2, none = selective_scan_fwd(*args)
    assert none.shape == (2, 5, 0, 4)
    assert torch.equal(out2, out) and torch.equal(last2, last)
    with torch.no_grad():
        assert torch.equal(selective_call(x, "triton")[0], out)


def test_selective_split_sequence_and_empty_inputs():
    x = small(40, initial_state=False)
    out, last = selective_call(x, "triton")
    first = {k: v[..., :25] if v.ndim >= 3 else v for k, v in x.items()}
    second = {k: v[..., 25:] if v.ndim >= 3 else v for k, v in x.items()}
    out1, state1 = selective_call(first, "triton")
    out2, state2 = selective_call({**second, "initial_state": state1}, "triton")
    torch.testing.assert_close(torch.cat([out1, out2], -1), out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state2, last, rtol=1e-5, atol=1e-5)
    out, last = selective_call(small(9, batch=0), "triton")
    assert out.shape == (0, 5, 9) and last.shape == (0, 5, 4)
    out, last = selective_call(small(0), "triton")
    assert out.shape == (2, 5, 0)


# ----------------------------------------------------------------------------- linear scan


def linear_small(shape, dim, **kw):
    return to_device(linear_inputs(shape, dim, **kw))


@pytest.mark.parametrize("initial_state", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("shape,dim", [((2, 3, 1), -1), ((2, 3, 19), -1), ((2, 300, 3), 1), ((300, 2, 3), 0)])
def test_linear_shapes(shape, dim, reverse, initial_state):
    x = linear_small(shape, dim, initial_state=initial_state)
    check_linear(x, "triton", dim, reverse)


@pytest.mark.parametrize("reverse", [False, True])
def test_linear_block_boundaries(reverse):
    """Lengths one either side of the time block (the carry between blocks)."""
    block_t = triton_linear.config(1 << 20, 3).block_t
    for length in (block_t - 1, block_t + 1):
        x = linear_small((length, 3), 0)
        check_linear(x, "triton", 0, reverse)


def test_linear_long_reverse():
    """65536 steps, reverse, from an initial state: against the reference, which runs the
    same recurrence one step at a time (gates below 1 keep the states bounded)."""
    x = linear_small((65536, 2), 0)
    x["gates"] = (0.5 * x["gates"].detach()).requires_grad_()
    check_linear(x, "triton", 0, reverse=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_half_precision(dtype):
    check_linear(linear_small((3, 100), -1, dtype=dtype), "triton", -1, False)


@pytest.mark.parametrize("reverse", [False, True])
def test_linear_gradcheck(reverse):
    x = linear_small((2, 6, 3), 1, dtype=torch.float64)
    names = list(x)

    def f(*tensors):
        return linear_scan(**dict(zip(names, tensors)), dim=1, reverse=reverse, backend="triton")

    assert torch.autograd.gradcheck(f, tuple(x.values()), fast_mode=True)


def test_linear_deterministic_and_mixed_dtypes():
    x = linear_small((2, 70, 3), 1)
    call = lambda inputs, backend: (linear_scan(**inputs, dim=1, reverse=True, backend=backend),)  # noqa: E731
    _, first, _ = run_with_grads(call, x, "triton")
    _, second, _ = run_with_grads(call, x, "triton")
    for name in x:
        assert torch.equal(first[name], second[name]), name
    gates = torch.rand(4, 10, dtype=torch.bfloat16, device=DEVICE)
    assert linear_scan(gates, torch.randn(4, 10, device=DEVICE), backend="triton").dtype == torch.float32
    for shape in [(0, 5, 3), (2, 5, 0)]:
        assert (
            linear_scan(*linear_small(shape, 1, initial_state=False).values(), dim=1, backend="triton").shape == shape
        )


# ----------------------------------------------------------------------------- packed sequences


@pytest.mark.parametrize("initial_state", [False, True])
@pytest.mark.parametrize("B_form,C_form", [("varying", "grouped"), ("fixed", "fixed"), ("grouped", "varying")])
def test_selective_packed_equals_each_sequence_alone(B_form, C_form, initial_state):
    """Boundaries after step 1, inside a chunk and exactly on chunk edges of the kernel's own
    chunk, sequences of length 1 and 0: outputs, per-sequence last states and every gradient
    against each sequence run alone by the float64 reference."""
    lengths = packed_lengths(CHUNK)
    inputs = selective_inputs(sum(lengths), batch=1, dim=5, N=4, groups=5, B_form=B_form, C_form=C_form)
    if initial_state:
        inputs = with_sequence_states(inputs, len(lengths))
    else:
        del inputs["initial_state"]
    cu = cu_seqlens_of(lengths, device=DEVICE)
    check_against_reference(
        selective_packed_call(cu), to_device(inputs), "triton", reference_call=selective_solo_call(cu)
    )


@pytest.mark.parametrize("initial_state", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
def test_linear_packed_equals_each_sequence_alone(reverse, initial_state):
    """F = 64 lanes make the time block 32 steps, so that the layout puts boundaries on its
    edges and inside it (the block grows with L for narrower inputs)."""
    F = 64
    block_t = triton_linear.config(1 << 20, F).block_t
    lengths = packed_lengths(block_t)
    inputs = linear_inputs((1, sum(lengths), F), 1, initial_state=True)
    if initial_state:
        inputs = with_sequence_states(inputs, len(lengths))
    else:
        del inputs["initial_state"]
    cu = cu_seqlens_of(lengths, device=DEVICE)
    check_against_reference(
        linear_packed_call(cu, 1, reverse), to_device(inputs), "triton", reference_call=linear_solo_call(cu, 1, reverse)
    )


# ----------------------------------------------------------------------------- torch.compile


def test_compile_without_graph_breaks():
    """fullgraph=True fails on any graph break; "aot_eager" traces forward and backward (the
    custom ops are opaque nodes with fake implementations) and runs them eagerly."""
    x = small(37, B_form="grouped", C_form="varying")
    names = list(x)

    def f(*tensors):
        out, last = selective_scan(
            **dict(zip(names, tensors)), delta_softplus=True, return_last_state=True, backend="triton"
        )
        return (out * out).sum() + last.sum()

    assert_compiled_matches_eager(f, list(x.values()))

    a = linear_small((3, 21, 5), 1)

    def g(gates, inputs, h0):
        return linear_scan(gates, inputs, dim=1, initial_state=h0, reverse=True, backend="triton").pow(2).sum()

    assert_compiled_matches_eager(g, list(a.values()))


def test_compile_with_dynamic_lengths():
    """With dynamic shapes the fake implementation sees a symbolic L (the number of saved
    chunk states is computed from it): one compiled graph serves two lengths."""

    def f(*tensors):
        out, last = selective_scan(*tensors[:8], True, True, initial_state=tensors[8], backend="triton")
        return (out * out).sum() + last.sum()

    torch.compiler.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)
    for length in (CHUNK + 5, 2 * CHUNK + 9):
        x = list(small(length, B_form="varying").values())
        with torch._dynamo.config.patch(error_on_recompile=length != CHUNK + 5):
            got = [compiled(*x)]
        got += torch.autograd.grad(got[0], x)
        expected = [f(*x)]
        expected += torch.autograd.grad(expected[0], x)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------- test machinery


@pytest.mark.skipif(ON_DEVICE, reason="checks the interpreter, which runs only without CUDA")
def test_log_depth_interpreter_scan_matches_the_original(monkeypatch):
    """tests/conftest.py replaces the interpreter's element-by-element scan by a tree-ordered
    one: they agree to rounding."""
    from triton.runtime import interpreter

    x = linear_small((2, 40, 3), 1)
    args = (x["gates"].detach(), x["inputs"].detach(), x["initial_state"].detach(), True)
    fast = triton_linear._linear_scan_fwd(*args)
    monkeypatch.setattr(interpreter.ScanOps, "generic_scan", interpreter.ScanOps._elementwise_generic_scan)
    slow = triton_linear._linear_scan_fwd(*args)
    torch.testing.assert_close(fast, slow, rtol=1e-6, atol=1e-6)
    assert not torch.equal(fast, torch.zeros_like(fast))


@pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None, reason="triton without its CUDA backend"
)
def test_kernels_compile_for_a_gpu():
    """The interpreter runs kernel bodies as Python and accepts code the compiler rejects: every
    kernel variant is also compiled for sm_90 (through triton's own ptxas; no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = pathlib.Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "scripts/dev/compile_kernels.py", "bf16"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = [line for line in done.stdout.splitlines() if "REG:" in line or ": ?" in line]
    assert len(compiled) == 35, done.stdout  # selective 6, trapezoidal 4, linear 4, ssd 21


# ----------------------------------------------------------------------------- every dtype at a larger shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_dtype_against_ref_at_a_larger_shape(dtype):
    """On a GPU: a Mamba-130m-like shape, compiled kernels, against the reference. Without one
    (the interpreter, about 7 s a dtype here): the same checks at a shape cut to its pace, the
    selective scan over two chunks and a part, the linear scan over 200 steps, so that the
    16-bit inputs are checked in CI too rather than skipped (the GPU shape took over 10 minutes
    a dtype in the interpreter)."""
    if ON_DEVICE:
        length, dim, linear_shape = 1100, 96, (4, 5000, 24)
    else:
        length, dim, linear_shape = 2 * CHUNK + 5, 8, (2, 200, 8)
    check_selective(to_device(selective_inputs(length, batch=2, dim=dim, N=16, groups=1, dtype=dtype)), "triton")
    check_linear(linear_small(linear_shape, 1, dtype=dtype), "triton", 1, True)


def test_without_triton_the_backend_is_refused_saying_what_to_install(monkeypatch):
    """Importing ssm never imports triton (checked in a fresh process); without triton the
    backend runs nowhere, and asking for it says what to install."""
    done = subprocess.run(
        [sys.executable, "-c", "import sys, ssm, ssm.scan; print('triton' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.strip() == "False", done.stderr[-2000:]
    monkeypatch.setattr(ssm.scan.triton, "_INSTALLED", False)  # as if it were not installed
    assert not ssm.scan.triton.available() and ssm.scan.triton.devices() == ()
    with pytest.raises(ValueError, match="pip install triton"):
        selective_call(small(5), "triton")


@pytest.mark.parametrize("use", ["out", "last_state"])
def test_selective_gradient_of_one_output_only(use):
    """A loss of only one output: the other's gradient never arrives (None upstream)."""
    x = small(CHUNK + 2, B_form="grouped")
    grads = {}
    for backend in ("ref", "triton"):
        out, last = selective_call(x, backend)
        loss = (out * out).sum() if use == "out" else (last * last).sum()
        grads[backend] = torch.autograd.grad(loss, list(x.values()), allow_unused=True, materialize_grads=True)
    for name, got, expected in zip(x, grads["triton"], grads["ref"]):
        torch.testing.assert_close(got, expected, rtol=2e-4, atol=2e-4, msg=lambda m: f"d{name}: {m}")
