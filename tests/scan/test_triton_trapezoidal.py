"""trapezoidal_scan's backend "triton" against the sequential reference, forward, every part of
the last state and every gradient.

Without CUDA, tests/conftest.py sets TRITON_INTERPRET=1 and the kernels run on CPU tensors in
Triton's interpreter, so these run (not skip) in CI; sizes are small but odd: P not a multiple
of the channel block, ranks not a power of two, lengths on either side of a chunk boundary.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed (it is on Linux)")

from ssm.scan import backends, trapezoidal_scan
from ssm.scan import trapezoidal as trapezoidal_op
from ssm.scan.triton import trapezoidal_scan as triton_trapezoidal
from tests.helpers import assert_compiled_matches_eager, check_trapezoidal, trapezoidal_call, trapezoidal_inputs

ON_DEVICE = torch.cuda.is_available()
DEVICE = "cuda" if ON_DEVICE else "cpu"
CHUNK = triton_trapezoidal.CHUNK


def small(length: int, **kw) -> dict:
    """trapezoidal_scan inputs (batch 2, 4 heads of P = 3, 2 groups, N = 8, 2 rotary pairs)."""
    inputs = trapezoidal_inputs(length, **kw)
    return {k: v.to(DEVICE) if k == "cu_seqlens" else v.detach().to(DEVICE).requires_grad_() for k, v in inputs.items()}


def test_backend_runs_here_and_never_by_default_on_cpu():
    assert "triton" in backends("trapezoidal_scan", DEVICE)
    assert trapezoidal_op.BACKENDS.resolve("auto", torch.device("cpu")).name == "cpu"
    assert trapezoidal_op.BACKENDS.resolve("auto", torch.device("cuda")).name == "triton"


@pytest.mark.parametrize("length", [1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3])
def test_lengths(length):
    check_trapezoidal(small(length, ranks=2), "triton")


CASES = {
    "siso": dict(),
    "siso, nothing optional": dict(D=False, z=False, bias=False, initial_state=False),
    "siso, one group, every pair turns": dict(groups=1, M=4),
    "no rotary pair (M = 0)": dict(M=0),
    "mimo rank 3": dict(ranks=3),
    "mimo, no MIMO weights, no z": dict(ranks=2, mimo=False, z=False),
    "P = 5 over two channel blocks": dict(head_dim=5, N=64, M=3, ranks=4),
}


@pytest.mark.parametrize("rotary", ["interleaved", "halved"])
@pytest.mark.parametrize("options", CASES.values(), ids=list(CASES))
def test_options(options, rotary):
    check_trapezoidal(small(CHUNK + 5, **options), "triton", rotary=rotary)


def test_channel_blocks():
    """The case above with P = 5 does split P across programs (their partial sums are added)."""
    assert triton_trapezoidal.config(5, 64, 4).p_blocks(5) > 1


def test_per_rank_outputs():
    inputs = small(CHUNK + 2, ranks=2)
    del inputs["mimo_o"]
    (out, *_), _ = check_trapezoidal(inputs, "triton")
    assert out.shape == (2, CHUNK + 2, 2, 4, 3)


@pytest.mark.parametrize("lengths", [[5, 0, CHUNK + 4, 1], [0, 2 * CHUNK + 1]])
def test_packed_sequences(lengths):
    check_trapezoidal(small(sum(lengths), packed=lengths, ranks=2), "triton", rotary="halved")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes(dtype):
    check_trapezoidal(small(CHUNK + 7, ranks=2, dtype=dtype), "triton")


def test_length_zero():
    x = small(0, ranks=2)
    out, *last = trapezoidal_call()(x, "triton")
    assert out.shape == (2, 0, 4, 3)
    assert all(torch.equal(got, x[f"initial_{n}"].detach()) for got, n in zip(last, ("phase", "ssm", "key", "value")))


def test_inference_saves_no_chunk_states(monkeypatch):
    """Under no_grad the forward writes no chunk states (nothing will read them), and gives the
    same result."""
    sizes = []
    original = triton_trapezoidal._trapezoidal_scan_fwd

    def spy(*args):
        out = original(*args)
        sizes.append(out[2].shape[0])
        return out

    monkeypatch.setattr(triton_trapezoidal, "_trapezoidal_scan_fwd", spy)
    x = small(CHUNK + 3, ranks=2)
    with torch.no_grad():
        out, *last = trapezoidal_call()(x, "triton")
    expected, *expected_last = trapezoidal_call()(x, "triton")
    assert sizes == [0, 2 * 2]  # then batch 2 × 2 chunks with gradients
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_traces_without_graph_breaks():
    """The kernels are custom ops with fake implementations and their own backward: a function
    calling the backend compiles with fullgraph=True (aot_eager) and gives the eager gradients."""
    x = small(CHUNK + 1, ranks=2, initial_state=False)
    names = list(x)

    def f(*tensors):
        out = trapezoidal_scan(**dict(zip(names, tensors)), backend="triton")
        return (out * out).sum()

    assert_compiled_matches_eager(f, [x[k] for k in names], rtol=1e-5, atol=1e-5)
