"""ssd (Mamba-2): every backend against the sequential reference, forward and every gradient,
and the one-step form against the scan."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from ssm.scan import backends, ssd, ssd_step
from tests.helpers import assert_close, poisoned

FAST_BACKENDS = [b for b in backends("ssd", "cpu") if b != "ref"]


def make_inputs(length, *, batch=2, heads=4, head_dim=3, groups=2, N=5, D="heads", z=True, bias=True,
                initial_state=True, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, lo=-1.0, hi=1.0, dt=dtype):
        return (lo + (hi - lo) * torch.rand(*shape, generator=g, dtype=torch.float64)).to(dt)

    fp32 = torch.float64 if dtype == torch.float64 else torch.float32
    x = dict(
        x=rand(batch, length, heads, head_dim),
        dt=rand(batch, length, heads, lo=-2.0, hi=1.0),
        A=-rand(heads, lo=0.5, hi=4.0, dt=fp32),
        B=rand(batch, length, groups, N),
        C=rand(batch, length, groups, N),
    )
    if D == "heads":
        x["D"] = rand(heads, dt=fp32)
    elif D == "channels":
        x["D"] = rand(heads, head_dim, dt=fp32)
    if z:
        x["z"] = rand(batch, length, heads, head_dim)
    if bias:
        x["dt_bias"] = rand(heads, lo=-3.0, hi=-1.0, dt=fp32)
    if initial_state:
        x["initial_state"] = rand(batch, heads, head_dim, N, dt=fp32)
    for t in x.values():
        t.requires_grad_(True)
    return x


def run(inputs, backend, chunk_size=8, dt_limit=(0.0, math.inf), seed=1):
    with poisoned():
        out, last = ssd(**inputs, dt_softplus=True, dt_limit=dt_limit, return_last_state=True,
                        chunk_size=chunk_size, backend=backend)
        g = torch.Generator().manual_seed(seed)
        grad_out = torch.randn(out.shape, generator=g).to(out.dtype)
        grad_last = torch.randn(last.shape, generator=g).to(last.dtype)
        grads = torch.autograd.grad((out, last), list(inputs.values()), (grad_out, grad_last))
    return out, last, dict(zip(inputs, grads))


def check(inputs, backend, dtype=torch.float32, ref_inputs=None, **kw):
    out_ref, last_ref, grads_ref = run(ref_inputs or inputs, "ref", **kw)
    out, last, grads = run(inputs, backend, **kw)
    assert out.dtype == inputs["x"].dtype
    assert last.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close(out, out_ref, dtype, f"{backend} out")
    assert_close(last, last_ref, dtype, f"{backend} last_state")
    for name in inputs:
        assert grads[name].dtype == inputs[name].dtype, f"{backend} d{name} dtype"
        assert_close(grads[name], grads_ref[name], dtype, f"{backend} d{name}")


@pytest.mark.parametrize("length", [1, 2, 7, 8, 9, 16, 17, 50])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_lengths_around_chunk_boundaries(backend, length):
    check(make_inputs(length), backend, chunk_size=8)


@pytest.mark.parametrize("D,z,bias,initial_state", list(itertools.product(["none", "heads", "channels"], *[[False, True]] * 3)))
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_options(backend, D, z, bias, initial_state):
    check(make_inputs(19, D=D, z=z, bias=bias, initial_state=initial_state), backend)


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_groups(backend, groups):
    check(make_inputs(21, groups=groups), backend)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_dt_limit(backend):
    check(make_inputs(21), backend, dt_limit=(0.05, 0.3))


@pytest.mark.parametrize("chunk_size", [1, 3, 64])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_chunk_sizes(backend, chunk_size):
    check(make_inputs(20), backend, chunk_size=chunk_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", FAST_BACKENDS + ["ref"])
def test_half_precision(backend, dtype):
    low = make_inputs(40, dtype=dtype)
    upcast = {k: v.detach().float().requires_grad_() for k, v in low.items()}
    check(low, backend, dtype, ref_inputs=upcast)


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_gradcheck(backend):
    inputs = make_inputs(6, batch=1, heads=2, head_dim=2, groups=1, N=2, dtype=torch.float64)
    names = list(inputs)

    def f(*tensors):
        return ssd(**dict(zip(names, tensors)), dt_softplus=True, return_last_state=True, chunk_size=4, backend=backend)

    assert torch.autograd.gradcheck(f, tuple(inputs.values()))


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_split_sequence_continues_from_last_state(backend):
    x = make_inputs(30, initial_state=False)
    full = ssd(**x, dt_softplus=True, backend=backend)
    first = {k: (v[:, :11] if k in ("x", "dt", "B", "C", "z") else v) for k, v in x.items()}
    rest = {k: (v[:, 11:] if k in ("x", "dt", "B", "C", "z") else v) for k, v in x.items()}
    y1, h = ssd(**first, dt_softplus=True, return_last_state=True, backend=backend)
    y2 = ssd(**rest, dt_softplus=True, initial_state=h, backend=backend)
    assert_close(torch.cat([y1, y2], 1), full, torch.float32, "split")


def test_step_equals_scan():
    x = make_inputs(9, D="channels")
    out, _ = ssd(**x, dt_softplus=True, return_last_state=True, backend="ref")
    h = x["initial_state"]
    for t in range(9):
        y, h = ssd_step(h, x["x"][:, t], x["dt"][:, t], x["A"], x["B"][:, t], x["C"][:, t], x["D"], x["z"][:, t],
                        dt_bias=x["dt_bias"], dt_softplus=True)
        assert_close(y, out[:, t], torch.float32, f"step {t}")


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_length_zero(backend):
    x = make_inputs(0)
    out, last = ssd(**x, return_last_state=True, backend=backend)
    assert out.shape == x["x"].shape
    assert torch.equal(last, x["initial_state"].detach())


def test_errors_name_the_argument():
    x = make_inputs(5)
    bad = dict(x, dt=x["dt"][:, :4])
    with pytest.raises(ValueError, match=r"dt must have shape \(batch, L, H\)"):
        ssd(**bad)
    with pytest.raises(ValueError, match="not divisible by G"):
        ssd(**make_inputs(5, heads=3, groups=2))
    with pytest.raises(ValueError, match=r"D must have shape \(H, P\)"):
        ssd(**dict(x, D=torch.ones(4, 7)))
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        ssd(**x, chunk_size=0)
    with pytest.raises(ValueError, match="dt_limit"):
        ssd(**x, dt_limit=(1.0, 0.5))
    with pytest.raises(ValueError, match="unknown backend 'nope' for ssd"):
        ssd(**x, backend="nope")
