"""ssd (Mamba-2): every backend against the sequential reference, forward and every gradient,
and the one-step form against the scan."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from ssm.scan import backends, ssd, ssd_step
from tests.helpers import GRADCHECK_TOL, assert_close, check_ssd, ssd_inputs

FAST_BACKENDS = [b for b in backends("ssd", "cpu") if b not in ("ref", "triton")]  # triton: test_triton_ssd.py


@pytest.mark.parametrize("length", [1, 2, 7, 8, 9, 16, 17, 50])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_lengths_around_chunk_boundaries(backend, length):
    check_ssd(ssd_inputs(length), backend, chunk_size=8)


@pytest.mark.parametrize(
    "D,z,bias,initial_state", list(itertools.product(["none", "heads", "channels"], *[[False, True]] * 3))
)
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_options(backend, D, z, bias, initial_state):
    check_ssd(ssd_inputs(19, D=D, z=z, bias=bias, initial_state=initial_state), backend)


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_groups(backend, groups):
    check_ssd(ssd_inputs(21, groups=groups), backend)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_dt_limit(backend):
    check_ssd(ssd_inputs(21), backend, dt_limit=(0.05, 0.3))


@pytest.mark.parametrize("chunk_size", [1, 3, 64])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_chunk_sizes(backend, chunk_size):
    check_ssd(ssd_inputs(20), backend, chunk_size=chunk_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", FAST_BACKENDS + ["ref"])
def test_half_precision(backend, dtype):
    check_ssd(ssd_inputs(40, dtype=dtype), backend)


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_gradcheck(backend):
    inputs = ssd_inputs(6, batch=1, heads=2, head_dim=2, groups=1, N=2, dtype=torch.float64)
    names = list(inputs)

    def f(*tensors):
        return ssd(**dict(zip(names, tensors)), dt_softplus=True, return_last_state=True, chunk_size=4, backend=backend)

    assert torch.autograd.gradcheck(f, tuple(inputs.values()), **GRADCHECK_TOL)


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_split_sequence_continues_from_last_state(backend):
    x = ssd_inputs(30, initial_state=False)
    full = ssd(**x, dt_softplus=True, backend=backend)
    first = {k: (v[:, :11] if k in ("x", "dt", "B", "C", "z") else v) for k, v in x.items()}
    rest = {k: (v[:, 11:] if k in ("x", "dt", "B", "C", "z") else v) for k, v in x.items()}
    y1, h = ssd(**first, dt_softplus=True, return_last_state=True, backend=backend)
    y2 = ssd(**rest, dt_softplus=True, initial_state=h, backend=backend)
    assert_close(torch.cat([y1, y2], 1), full, torch.float32, "split")


def test_step_equals_scan():
    x = ssd_inputs(9, D="channels")
    out, _ = ssd(**x, dt_softplus=True, return_last_state=True, backend="ref")
    h = x["initial_state"]
    for t in range(9):
        y, h = ssd_step(
            h,
            x["x"][:, t],
            x["dt"][:, t],
            x["A"],
            x["B"][:, t],
            x["C"][:, t],
            x["D"],
            x["z"][:, t],
            dt_bias=x["dt_bias"],
            dt_softplus=True,
        )
        assert_close(y, out[:, t], torch.float32, f"step {t}")


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_length_zero(backend):
    x = ssd_inputs(0)
    out, last = ssd(**x, return_last_state=True, backend=backend)
    assert out.shape == x["x"].shape
    assert torch.equal(last, x["initial_state"].detach())


def test_errors_name_the_argument():
    x = ssd_inputs(5)
    bad = dict(x, dt=x["dt"][:, :4])
    with pytest.raises(ValueError, match=r"dt must have shape \(batch, L, H\)"):
        ssd(**bad)
    with pytest.raises(ValueError, match="not divisible by G"):
        ssd(**ssd_inputs(5, heads=3, groups=2))
    with pytest.raises(ValueError, match=r"D must have shape \(H, P\)"):
        ssd(**dict(x, D=torch.ones(4, 7)))
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        ssd(**x, chunk_size=0)
    with pytest.raises(ValueError, match="dt_limit"):
        ssd(**x, dt_limit=(1.0, 0.5))
    with pytest.raises(ValueError, match="unknown backend 'nope' for ssd"):
        ssd(**x, backend="nope")


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_outputs_are_contiguous(backend):
    """As mamba-ssm's are, so that callers can .view() them (also when L is padded to chunks)."""
    for D, z in itertools.product(["none", "heads", "channels"], [False, True]):
        out, last = ssd(**ssd_inputs(21, D=D, z=z), return_last_state=True, chunk_size=8, backend=backend)
        assert out.is_contiguous() and last.is_contiguous(), (D, z)
        out.view(-1)


def test_reference_on_hand_computed_examples():
    """One head, P = N = 1: Δ = 1, A = -ln 2, B = C = x = 1 gives h_t = h_{t-1}/2 + 1; from the
    fixed point h = 2 every output is 2 + D·x = 12."""
    ones = torch.ones(1, 4, 1, 1)
    dt, A, BC = torch.ones(1, 4, 1), torch.tensor([-math.log(2.0)]), torch.ones(1, 4, 1, 1)
    out, last = ssd(
        ones,
        dt,
        A,
        BC,
        BC,
        D=torch.tensor([10.0]),
        initial_state=torch.full((1, 1, 1, 1), 2.0),
        return_last_state=True,
        backend="ref",
    )
    torch.testing.assert_close(out, torch.full((1, 4, 1, 1), 12.0))
    out, last = ssd(ones, dt, A, BC, BC, return_last_state=True, backend="ref")
    torch.testing.assert_close(out.flatten(), torch.tensor([1.0, 1.5, 1.75, 1.875]))
    torch.testing.assert_close(last.flatten(), torch.tensor([1.875]))


def test_reference_outer_product_orientation_by_hand():
    """P = N = 2, no decay (A = 0), Δ = 1: h = Σ x_t ⊗ B_t (P × N), y_t[p] = Σ_n h[p, n]·C_t[n].
    Step 1: x = (1, 2), B = (1, 3) → h = [[1, 3], [2, 6]]; C = (1, 10) → y = (31, 62).
    Step 2: x = (1, 0), B = (0, 1) → h = [[1, 4], [2, 6]]; C = (1, 1) → y = (5, 8).
    Two heads in one group share B and C; the second head's x is doubled, so is its output."""
    x = torch.tensor([[1.0, 2.0], [1.0, 0.0]])[None, :, None, :]  # (1, 2, 1, 2)
    x = torch.cat([x, 2 * x], dim=2)  # (1, L=2, H=2, P=2)
    B = torch.tensor([[1.0, 3.0], [0.0, 1.0]])[None, :, None, :]  # (1, 2, G=1, N=2)
    C = torch.tensor([[1.0, 10.0], [1.0, 1.0]])[None, :, None, :]
    out, last = ssd(x, torch.ones(1, 2, 2), torch.zeros(2), B, C, return_last_state=True, backend="ref")
    expected = torch.tensor([[31.0, 62.0], [5.0, 8.0]])
    torch.testing.assert_close(out[0, :, 0], expected)
    torch.testing.assert_close(out[0, :, 1], 2 * expected)
    torch.testing.assert_close(last[0, 0], torch.tensor([[1.0, 4.0], [2.0, 6.0]]))


@pytest.mark.parametrize("backend", ["ref"] + FAST_BACKENDS)
def test_gradients_from_the_last_state_alone(backend):
    """A loss of only the last state (the out gradient never arrives)."""
    x = ssd_inputs(19)
    grads = {}
    for b in ("ref", backend):
        _, last = ssd(**x, dt_softplus=True, return_last_state=True, chunk_size=8, backend=b)
        grads[b] = torch.autograd.grad((last * last).sum(), list(x.values()), allow_unused=True, materialize_grads=True)
    for name, got, want in zip(x, grads[backend], grads["ref"]):
        assert_close(got, want, torch.float32, f"{backend} d{name}")


@pytest.mark.parametrize(("head_dim", "N", "expected"), [(4, 8, "cpu"), (64, 64, "cpu"), (64, 65, "chunked")])
def test_auto_on_the_cpu_takes_the_sweeps_for_small_head_states(monkeypatch, head_dim, N, expected):
    from ssm.scan.ssd import BACKENDS

    called = []
    for name in ("cpu", "chunked"):
        backend = BACKENDS._backends[name]
        monkeypatch.setitem(
            BACKENDS._backends,
            name,
            dataclasses.replace(backend, fn=lambda *a, _n=name, _f=backend.fn: called.append(_n) or _f(*a)),
        )
    x = torch.randn(1, 5, 2, head_dim)
    B = torch.randn(1, 5, 1, N)
    ssd(x, torch.rand(1, 5, 2), -torch.rand(2), B, B.clone())
    assert called == [expected]


@pytest.mark.parametrize(
    ("backend", "chunk_size", "expected"), [("auto", 256, 64), ("auto", 16, 16), ("chunked", 256, 256)]
)
def test_auto_on_the_cpu_runs_the_chunked_form_in_blocks_of_at_most_64(monkeypatch, backend, chunk_size, expected):
    """chunk_size is a GPU tile (mamba2-130m's config says 256); on a CPU blocks of 64 made its
    prefill 2.2x faster, so "auto" takes at most that, and the answer does not change. An
    explicit backend keeps the caller's chunk_size."""
    from ssm.scan.ssd import BACKENDS

    chunked = BACKENDS._backends["chunked"]
    seen = []
    monkeypatch.setitem(
        BACKENDS._backends,
        "chunked",
        dataclasses.replace(chunked, fn=lambda *a: seen.append(a[-2]) or chunked.fn(*a)),
    )
    x = ssd_inputs(300, heads=2, head_dim=64, groups=1, N=65)  # P·N over the sweeps' limit: "chunked"
    got = ssd(**x, dt_softplus=True, chunk_size=chunk_size, backend=backend)
    assert seen == [expected]
    assert_close(got, ssd(**x, dt_softplus=True, backend="ref"), torch.float32, "out")


def test_entering_states_matches_a_loop_and_keeps_the_backward_linear():
    """The inter-chunk recurrence of the chunked backends (ssm.scan.chunked.entering_states)
    against a float64 loop written here, values and gradients (decay, inputs, initial state);
    and its backward holds no per-chunk index (whose gradients are each the size of the whole
    input: O(chunks²) work, what made Mamba-3's backward at L 16384 25x that at 2048)."""
    from ssm.scan.chunked import entering_states

    g = torch.Generator().manual_seed(0)
    decay = torch.rand(2, 7, 3, 1, 1, generator=g, dtype=torch.float64).requires_grad_()
    inputs = torch.randn(2, 7, 3, 4, 5, generator=g, dtype=torch.float64).requires_grad_()
    state0 = torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64).requires_grad_()
    entering, last = entering_states(decay, inputs, state0)

    want, s = [], state0
    for k in range(7):
        want.append(s)
        s = decay[:, k] * s + inputs[:, k]
    want = torch.stack(want, 1)
    torch.testing.assert_close(entering, want)
    torch.testing.assert_close(last, s)
    w1, w2 = torch.randn_like(entering), torch.randn_like(last)
    got = torch.autograd.grad((entering * w1).sum() + (last * w2).sum(), (decay, inputs, state0))
    ref = torch.autograd.grad((want * w1).sum() + (s * w2).sum(), (decay, inputs, state0))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)

    seen, todo, selects = set(), [entering.grad_fn, last.grad_fn], 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        selects += type(node).__name__ == "SelectBackward0"
        todo += [n for n, _ in node.next_functions]
    assert selects <= 1, f"{selects} indexes in the backward: one per chunk (7), not the last state's alone"
