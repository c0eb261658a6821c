"""ssd's backend "triton" (Mamba-2's SSD in Triton) against the sequential reference ``ssd_ref``,
forward and every gradient (x, dt, A, B, C, D, z, dt_bias, initial_state) under random upstream
gradients of both the output and the last state.

Without CUDA, tests/conftest.py sets TRITON_INTERPRET=1, so every kernel runs on CPU tensors in
Triton's interpreter and these tests run (not skip) in CI. Sizes are small but odd: head dim and
state size not powers of two, lengths one step either side of chunk borders, packed sequences
with empty ones and boundaries inside chunks; a few tests shrink the kernels' tiles so that a
chunk spans several tiles and a program loops over several heads, as at a GPU's sizes. On a GPU
the larger-shape test takes a Mamba-2-130m layer's sizes in every dtype.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed (it is on Linux)")

from ssm import Mamba2
from ssm.scan import backends, ssd
from ssm.scan.ssd import BACKENDS
from ssm.scan.triton import ssd as triton_ssd
from tests.helpers import (
    REFERENCE_TOLERANCES,
    assert_compiled_matches_eager,
    assert_relative,
    check_against_reference,
    check_ssd,
    cu_seqlens_of,
    packed_lengths,
    rounding_noise_floor,
    run_with_grads,
    ssd_call,
    ssd_inputs,
    ssd_packed_call,
    ssd_solo_call,
    with_sequence_states,
)

ON_DEVICE = torch.cuda.is_available()
DEVICE = "cuda" if ON_DEVICE else "cpu"
T = 16  # the chunk these tests ask for (the kernels' smallest)


def on_device(inputs: dict) -> dict:
    """``inputs`` on the test device, with A from slow to fast decay across the heads: -0.01 to
    -3 (ssd_inputs' A, -0.5 to -4, forgets a state within a chunk or two, and a state carried
    across chunks would hardly count in the comparison)."""
    heads = inputs["A"].shape[0]
    A = -torch.logspace(-2, 0.5, heads, dtype=torch.float64).to(inputs["A"].dtype)
    inputs = {**inputs, "A": A}
    return {k: v.detach().to(DEVICE).requires_grad_() for k, v in inputs.items()}


def small(length: int, **kw) -> dict:
    """ssd inputs on the test device: batch 2, 4 heads of P = 6 in 2 groups, N = 5, D per head,
    z, dt_bias and an initial state unless told otherwise."""
    kw = {"batch": 2, "heads": 4, "head_dim": 6, "groups": 2, "N": 5, **kw}
    return on_device(ssd_inputs(length, **kw))


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 16 steps and 16 channels, and one backward program per group: chunks of 32 then
    span two tiles (the loops over tiles above and below the diagonal), heads of P > 16 two
    forward programs, and a program loops over all its group's heads (partial sums over heads)."""
    monkeypatch.setattr(triton_ssd, "BLOCK_T", 16)
    monkeypatch.setattr(triton_ssd, "BLOCK_P", 16)
    monkeypatch.setattr(triton_ssd, "TARGET_PROGRAMS", 1)


def test_backend_runs_here_and_auto_takes_it_on_cuda_only():
    """The tests below run the kernels, they do not skip: without CUDA, under the interpreter."""
    assert ON_DEVICE or os.environ.get("TRITON_INTERPRET") == "1"
    assert "triton" in backends("ssd", DEVICE) and "triton" in backends("ssd", "cuda")
    assert BACKENDS.resolve("auto", torch.device("cuda")).name == "triton"
    assert BACKENDS.resolve("auto", torch.device("cpu")).name != "triton"


def test_chunk_length_is_a_power_of_two_between_16_and_256():
    assert [triton_ssd.chunk_length(c) for c in (1, 16, 17, 64, 100, 256, 1000)] == [16, 16, 32, 64, 128, 256, 256]


# ----------------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("length", [1, T - 1, T + 1, 2 * T + 3])
def test_lengths_across_chunk_borders(length):
    """Every option on (D per head, z, dt_bias with softplus, initial state, 2 groups)."""
    check_ssd(small(length), "triton", chunk_size=T)


@pytest.mark.parametrize(
    "options",
    [
        dict(D="channels", z=False, bias=False, initial_state=False, groups=1),
        dict(D="none", z=True, bias=True, initial_state=True, groups=4),
        dict(D="heads", z=False, bias=True, initial_state=False, groups=2, head_dim=8, N=8),
    ],
    ids=["D-per-channel-alone", "no-D-a-group-per-head", "P-and-N-powers-of-two"],
)
def test_options(options):
    check_ssd(small(2 * T + 3, **options), "triton", chunk_size=T)


def test_dt_limit_clamps_both_ways():
    """Δ clamped from below and above (the gradient stops where it is clamped), and a chunk_size
    that is not a power of two (rounded up to 32)."""
    x = small(2 * T + 5)
    check_ssd(x, "triton", chunk_size=20, dt_limit=(0.08, 0.3))


def test_several_tiles_per_chunk_and_heads_per_program(small_tiles):
    """Chunks of 32 in tiles of 16, P = 20 in two forward programs, and each backward program
    looping over its group's 4 heads."""
    x = small(2 * 32 + 3, heads=4, groups=1, head_dim=20, N=6, D="channels")
    check_ssd(x, "triton", chunk_size=32)


@pytest.mark.parametrize("initial_state", [False, True], ids=["zero-states", "a-state-per-sequence"])
def test_packed_sequences_equal_each_sequence_alone(initial_state):
    """packed_lengths: a boundary after step 1, empty sequences (one at the end), boundaries on
    chunk edges and inside chunks, a sequence of one step inside a chunk and one across chunks;
    outputs, per-sequence last states and every gradient against each sequence run alone by the
    reference."""
    lengths = packed_lengths(T)
    inputs = ssd_inputs(sum(lengths), batch=1, heads=4, head_dim=6, groups=2, N=5, D="channels")
    if initial_state:
        inputs = with_sequence_states(inputs, len(lengths))
    else:
        del inputs["initial_state"]
    inputs = on_device(inputs)
    cu = cu_seqlens_of(lengths, device=DEVICE)
    check_against_reference(ssd_packed_call(cu, T), inputs, "triton", reference_call=ssd_solo_call(cu, T))


def test_packed_sequences_across_tiles(small_tiles):
    """Packed, with initial states, in chunks of 32 over tiles of 16: sequences starting and
    ending in one tile, on a tile's edge and across tiles."""
    lengths = [3, 0, 14, 1, 20, 9, 33, 4, 0]
    inputs = with_sequence_states(ssd_inputs(sum(lengths), batch=1, heads=4, groups=1, head_dim=5), len(lengths))
    inputs = on_device(inputs)
    cu = cu_seqlens_of(lengths, device=DEVICE)
    check_against_reference(ssd_packed_call(cu, 32), inputs, "triton", reference_call=ssd_solo_call(cu, 32))


def test_seq_idx_as_in_mamba_ssm():
    """mamba-ssm's seq_idx (batch 2, a boundary inside a chunk of each row, the initial state
    starting each row) against the reference given the same seq_idx."""
    seq_idx = torch.tensor([[0] * 5 + [1] * 14 + [2] * 2, [0] * 17 + [3] * 4], dtype=torch.int32, device=DEVICE)
    inputs = small(21)

    def call(inputs, backend):
        return ssd(**inputs, dt_softplus=True, return_last_state=True, chunk_size=T, seq_idx=seq_idx, backend=backend)

    check_against_reference(call, inputs, "triton")


def test_gradients_from_one_output_alone():
    """A loss of the last state only (the output's gradient never arrives) and of the output
    only (no gradient of the last state)."""
    x = small(T + 3)
    for use in ("out", "last_state"):
        grads = {}
        for backend in ("ref", "triton"):
            out, last = ssd(**x, dt_softplus=True, return_last_state=True, chunk_size=T, backend=backend)
            loss = (out * out).sum() if use == "out" else (last * last).sum()
            grads[backend] = torch.autograd.grad(loss, list(x.values()), allow_unused=True, materialize_grads=True)
        for name, got, expected in zip(x, grads["triton"], grads["ref"]):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=lambda m: f"{use}: d{name}: {m}")


def test_float64_tightly():
    """float64 inputs run in float64 (states, sums and products): the reference's bits, almost."""
    check_ssd(small(T + 5, dtype=torch.float64), "triton", chunk_size=T)


# With 16-bit inputs the matrix products take 16-bit operands on tensor cores, as mamba-ssm's do:
# the weights exp(cum_t − cum_u)·Δ_u·C_t·B_u, the states and their gradients are rounded to the
# inputs' dtype before each product (sums stay float32). That is an error of the dtype's
# rounding next to the terms of a sum, not next to the sum: elements that cancel to a small
# value carry it. So, for these, an element is held to its own size only when it is above
# rounding_noise_floor's fraction of the tensor's RMS (a tenth, up to about 0.55 at a Mamba-2
# layer's 3.1M outputs: see there), and the RMS check is unchanged.
HALF_FLOOR = rounding_noise_floor


def test_the_16_bit_floor_passes_rounding_noise_and_catches_a_wrong_element():
    """At a Mamba-2 layer's 3.1M outputs: noise of a third of the bfloat16 RMS tolerance (as
    operand rounding makes) passes with rounding_noise_floor and failed with the old 0.1; one
    output half the RMS off still fails, as does noise at twice the tolerance."""
    tol = REFERENCE_TOLERANCES[torch.bfloat16][0]
    g = torch.Generator().manual_seed(0)
    expected = torch.randn(2 * 1024 * 24 * 64, generator=g, dtype=torch.float64)
    noisy = expected + (tol / 3) * torch.randn(expected.shape, generator=g, dtype=torch.float64)
    assert_relative(noisy, expected, tol, "noise", floor=HALF_FLOOR)
    with pytest.raises(AssertionError, match="element"):
        assert_relative(noisy, expected, tol, "noise", floor=0.1)
    wrong = noisy.clone()
    wrong[12345] += 0.5  # one element half the tensor's RMS (1) off: a wrong term, not rounding
    with pytest.raises(AssertionError, match="element 12345"):
        assert_relative(wrong, expected, tol, "one wrong", floor=HALF_FLOOR)
    with pytest.raises(AssertionError, match="relative RMS"):
        assert_relative(expected + 2 * tol * torch.randn(expected.shape, generator=g, dtype=torch.float64),
                        expected, tol, "loud noise", floor=HALF_FLOOR)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_dtype_against_ref_at_a_larger_shape(dtype):
    """On a GPU: a Mamba-2-130m layer's heads (24 of P 64, N 128, one group) over 1024 steps in
    chunks of 256, compiled kernels, against the reference. Without one (the interpreter): the
    same checks at a shape cut to its pace, so that 16-bit inputs are checked in CI too."""
    if ON_DEVICE:
        shape, length, chunk = dict(batch=2, heads=24, head_dim=64, N=128, groups=1), 1024, 256
    else:
        shape, length, chunk = dict(batch=2, heads=2, head_dim=8, N=16, groups=1), 2 * T + 5, T
    floor = 0.01 if dtype == torch.float32 else HALF_FLOOR
    check_ssd(small(length, dtype=dtype, **shape), "triton", dtype=dtype, chunk_size=chunk, floor=floor)


def test_packed_in_bfloat16():
    """Packed, with initial states, in bfloat16 (the sequence masks on 16-bit products)."""
    lengths = packed_lengths(T)
    inputs = with_sequence_states(ssd_inputs(sum(lengths), batch=1, groups=1, dtype=torch.bfloat16), len(lengths))
    inputs = on_device(inputs)
    cu = cu_seqlens_of(lengths, device=DEVICE)
    check_against_reference(
        ssd_packed_call(cu, T), inputs, "triton", reference_call=ssd_solo_call(cu, T), floor=HALF_FLOOR
    )


# ----------------------------------------------------------------------------- properties


def test_gradients_are_deterministic():
    """Two backward passes give the same bits (partial sums added in a fixed order, no atomics),
    with the backward's head splits in play."""
    x = small(2 * T + 3, heads=4, groups=1)
    _, first, _ = run_with_grads(ssd_call(T), x, "triton")
    _, second, _ = run_with_grads(ssd_call(T), x, "triton")
    for name in x:
        assert torch.equal(first[name], second[name]), name


def test_compiles_without_graph_breaks():
    """torch.compile(fullgraph=True) traces ssd(backend="triton"): the custom ops are opaque
    nodes with fake implementations; "aot_eager" traces the backward too."""
    x = small(T + 5)
    names = list(x)

    def f(*tensors):
        out, last = ssd(
            **dict(zip(names, tensors)), dt_softplus=True, return_last_state=True, chunk_size=T, backend="triton"
        )
        return (out * out).sum() + last.sum()

    assert_compiled_matches_eager(f, list(x.values()))


def test_inference_keeps_no_output_before_the_gate():
    """With no backward to come the forward does not write the pre-gate output; the results
    are the same bits."""
    x = small(T + 3)
    args = [x[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")]
    options = (True, 0.0, math.inf, x["initial_state"], T)
    out, last, y_pre = triton_ssd.ssd_fwd(*args, *options, None, True)
    assert y_pre.shape == x["x"].shape
    out2, last2, none = triton_ssd.ssd_fwd(*args, *options, None, False)
    assert none.numel() == 0 and torch.equal(out, out2) and torch.equal(last, last2)


def test_declines_a_head_too_large_and_auto_takes_chunked(monkeypatch):
    """P above 256: asked for by name, an error naming what it needs; under "auto" (made to
    prefer triton on the CPU here) the chunked form answers instead."""
    x = small(3, head_dim=257, heads=2, groups=1, initial_state=False)
    with pytest.raises(ValueError, match="head dim P of at most 256"):
        ssd(**x, backend="triton")
    monkeypatch.setitem(BACKENDS.auto, "cpu", ("triton", "chunked"))
    monkeypatch.setitem(BACKENDS.auto, "cuda", ("triton", "chunked"))
    torch.testing.assert_close(ssd(**x), ssd(**x, backend="chunked"))


def test_empty_inputs():
    x = small(5, batch=0)
    out, last = ssd(**x, return_last_state=True, backend="triton")
    assert out.shape == (0, 5, 4, 6) and last.shape == (0, 4, 6, 5)
    out, last = ssd(**small(0), return_last_state=True, backend="triton")
    assert out.shape == (2, 0, 4, 6) and last.shape == (2, 4, 6, 5)


def test_the_mamba2_layer_takes_it_unchanged():
    """Mamba2 (backend "triton", a layer's defaults otherwise) gives the chunked backend's
    output and parameter gradients."""
    torch.manual_seed(0)
    results = {}
    for backend in ("chunked", "triton"):
        torch.manual_seed(0)
        layer = Mamba2(32, d_state=8, headdim=8, ngroups=1, chunk_size=16, backend=backend).to(DEVICE)
        hidden = torch.randn(2, 21, 32, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
        y = layer(hidden)
        results[backend] = (y, torch.autograd.grad(y.square().sum(), list(layer.parameters())))
    (y_c, g_c), (y_t, g_t) = results["chunked"], results["triton"]
    torch.testing.assert_close(y_t, y_c, rtol=1e-4, atol=1e-4)
    for a, b in zip(g_t, g_c):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
