"""trapezoidal_scan's backend "triton-ssd" (rank 1 on the SSD kernels) against the sequential
reference: forward, every part of the last state, every gradient; that the SSD kernels do run
the cases they should, and that the calls they cannot take get the same answers by the chunked
core.

Without CUDA, tests/conftest.py sets TRITON_INTERPRET=1 and the kernels run on CPU tensors in
Triton's interpreter, so these run (not skip) in CI; sizes are small, lengths on either side of
the SSD kernels' smallest chunk (16).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed (it is on Linux)")

from ssm.scan import TrapezoidalState, backends
from ssm.scan import trapezoidal as trapezoidal_op
from ssm.scan.triton import trapezoidal_ssd
from tests.helpers import (
    assert_close,
    check_trapezoidal,
    rounding_noise_floor,
    trapezoidal_call,
    trapezoidal_inputs,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CHUNK = 16  # the SSD kernels' smallest chunk: chunk_size 16 here


def small(length: int, **kw) -> dict:
    """trapezoidal_scan inputs (batch 2, 4 heads of P = 3, 2 groups, N = 8, 2 rotary pairs)."""
    inputs = trapezoidal_inputs(length, **kw)
    return {k: v.to(DEVICE) if k == "cu_seqlens" else v.detach().to(DEVICE).requires_grad_() for k, v in inputs.items()}


@pytest.fixture
def ssd_calls(monkeypatch):
    """The dtypes of the values the SSD kernels' forward took, a call each, from this backend."""
    calls = []
    original = trapezoidal_ssd._ssd_fwd

    def spy(*args):
        calls.append(args[0].dtype)
        return original(*args)

    monkeypatch.setattr(trapezoidal_ssd, "_ssd_fwd", spy)
    return calls


def check(inputs, **kw):
    return check_trapezoidal(inputs, "triton-ssd", chunk_size=CHUNK, **kw)


def test_backend_runs_here_and_auto_takes_it_for_rank_1_on_cuda():
    assert "triton-ssd" in backends("trapezoidal_scan", DEVICE)
    assert trapezoidal_op.BACKENDS.resolve("auto", torch.device("cpu")).name == "cpu"


@pytest.mark.parametrize("length", [1, CHUNK - 1, CHUNK, 2 * CHUNK + 3])
def test_lengths(length, ssd_calls):
    check(small(length))
    assert len(ssd_calls) == 1  # one forward (its backward runs the SSD backward kernels)


CASES = {
    "siso": dict(),
    "nothing optional": dict(D=False, z=False, bias=False, initial_state=False),
    "one group, every pair turns": dict(groups=1, M=4),
    "no rotary pair (M = 0)": dict(M=0),
    "rank axis of 1 with MIMO weights": dict(ranks=1),
}


@pytest.mark.parametrize("rotary", ["interleaved", "halved"])
@pytest.mark.parametrize("options", CASES.values(), ids=list(CASES))
def test_options(options, rotary, ssd_calls):
    check(small(CHUNK + 5, **options), rotary=rotary)
    assert ssd_calls


@pytest.mark.parametrize("lengths", [[5, 0, CHUNK + 4, 1], [0, 2 * CHUNK + 1]])
def test_packed_sequences(lengths, ssd_calls):
    check(small(sum(lengths), packed=lengths), rotary="halved")
    assert ssd_calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtypes(dtype, ssd_calls):
    """bfloat16 gives the kernels bfloat16 operands (the rotated and scaled keys and the queries
    rounded to bfloat16: the rounding noise of 16-bit products); float16 float32 ones (a key
    scale 1/|A| can pass float16's range); float64 stays float64."""
    check(small(CHUNK + 7, dtype=dtype), floor=rounding_noise_floor if dtype == torch.bfloat16 else 0.01)
    operand = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float32}.get(dtype, dtype)
    assert ssd_calls == [operand]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_slow_decays_keep_their_gradients(dtype, ssd_calls):
    """|A| of 1e-4 .. 3e-3 (the heads that hold a key for thousands of steps): the keys' scale
    s / −a is then 300 .. 10^4, and the rate's gradient through SSD's input and through that
    scale, each that large, cancel; taken apart, each rounded (bfloat16 operands), they leave
    noise as large as dA itself. The backend's own backward takes the decay's share alone."""
    inputs = small(CHUNK + 7, dtype=dtype)
    with torch.no_grad():
        inputs["A"].mul_(1e-3)
    check(inputs, floor=rounding_noise_floor if dtype == torch.bfloat16 else 0.01)
    assert ssd_calls == [dtype]


def test_a_step_without_decay_goes_to_the_chunked_core(ssd_calls):
    """A = 0 at one step (−a = 0: the keys' scale s / −a has no value): the chunked core, the same
    answer."""
    inputs = small(CHUNK + 3)
    with torch.no_grad():
        inputs["A"][0, 4, 1] = 0.0
    check(inputs)
    assert ssd_calls == []


def test_mimo_goes_to_the_chunked_core(ssd_calls):
    check(small(CHUNK + 3, ranks=2))
    assert ssd_calls == []


def test_length_zero():
    x = small(0)
    out, *last = trapezoidal_call(chunk_size=CHUNK)(x, "triton-ssd")
    assert out.shape == (2, 0, 4, 3)
    assert all(torch.equal(got, x[f"initial_{n}"].detach()) for got, n in zip(last, ("phase", "ssm", "key", "value")))


def test_gradients_from_the_last_state_alone(ssd_calls):
    """A loss of only the last state: the output's gradient never arrives (zeros for the kernels)."""
    x = small(CHUNK + 3)
    grads = {}
    for b in ("ref", "triton-ssd"):
        _, *last = trapezoidal_call(chunk_size=CHUNK)(x, b)
        loss = sum((t * t).sum() for t in last)
        grads[b] = torch.autograd.grad(loss, list(x.values()), allow_unused=True, materialize_grads=True)
    assert ssd_calls
    for name, got, want in zip(x, grads["triton-ssd"], grads["ref"]):
        assert_close(got, want, torch.float32, f"triton-ssd d{name}")


def test_split_sequence_continues_from_last_state():
    x = {k: v.detach() for k, v in small(2 * CHUNK + 5, dtype=torch.float64).items()}
    call, L = trapezoidal_call(chunk_size=CHUNK), 2 * CHUNK + 5
    full, *full_last = call(x, "triton-ssd")
    first = {k: (v[:, : CHUNK + 2] if v.ndim >= 3 and v.shape[1] == L else v) for k, v in x.items()}
    rest = {k: (v[:, CHUNK + 2 :] if v.ndim >= 3 and v.shape[1] == L else v) for k, v in x.items()}
    rest = {k: v for k, v in rest.items() if not k.startswith("initial_")}
    y1, *state = call(first, "triton-ssd")
    y2, *last = call({**rest, **{f"initial_{n}": s for n, s in zip(TrapezoidalState._fields, state)}}, "triton-ssd")
    torch.testing.assert_close(torch.cat([y1, y2], 1), full, rtol=1e-10, atol=1e-10)
    for a, b in zip(last, full_last):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_keeps_no_rotated_keys_nor_cos_sin_for_the_backward(ssd_calls):
    """What the backward keeps, beyond the scan's own inputs, grows by less per token than the
    phase's cos and sin would (2·H·M in the compute dtype, here a quarter of one tensor of
    rotated keys, H·N): the keys and queries are rotated again in the backward, the values
    formed again from x, and cos and sin formed again from Δ and θ (inputs). Keeping k̃, q̃ and
    v, as autograd through the parts did, is over eight times that bound; keeping cos and sin,
    as the core did before, is over it too (404 against 256 bytes a step)."""
    from ssm.memory import saved_storages

    heads, N, M, batch = 4, 64, 8, 2

    def kept_per_step(length):
        inputs = small(length, N=N, M=M)
        given = {t.untyped_storage().data_ptr() for t in inputs.values()}
        storages, _ = saved_storages(lambda: trapezoidal_call(chunk_size=CHUNK)(inputs, "triton-ssd"))
        return sum(n for ptr, n in storages.items() if ptr not in given)

    grown = (kept_per_step(4 * CHUNK) - kept_per_step(2 * CHUNK)) / (batch * 2 * CHUNK)
    assert ssd_calls
    assert 0 < grown < 2 * heads * M * 4, f"{grown:.0f} bytes a step kept for the backward"
