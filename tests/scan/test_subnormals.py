"""The chunked backends' CPU forwards (ssd's and trapezoidal_scan's "chunked") run with subnormals
flushed to zero (ssm.scan.cpu.subnormals_flushed over ssm.native.flushed_subnormals): the exps of
strong decays fall into the subnormal range, where each product takes a microcode assist.

Seen in the numbers, not in the code: a decay of exp(-92) ≈ 1.1e-40 (subnormal in float32)
carries the first step's input to the second step's output, which the reference (never flushed)
gives as that subnormal and the flushed forward gives as exactly 0. After the call the threads
have their own mode back.
"""

from __future__ import annotations

import pytest
import torch

from ssm.native import library
from ssm.scan import ssd, trapezoidal_scan

TINY = 1.1089455657127305e-40  # exp(-92) in float32: subnormal


def two_steps():
    """One head of one channel over two steps: x = (1, 0), Δ = 1, a decay exp(-92) at step 1."""
    x = torch.tensor([1.0, 0.0]).view(1, 2, 1, 1)
    dt = torch.ones(1, 2, 1)
    return x, dt


def ssd_call(backend):
    x, dt = two_steps()
    return ssd(x, dt, torch.tensor([-92.0]), torch.ones(1, 2, 1, 1), torch.ones(1, 2, 1, 1), backend=backend)


def trapezoidal_call(backend):
    x, dt = two_steps()
    A, trap, angles = torch.full((1, 2, 1), -92.0), torch.full((1, 2, 1), 0.5), torch.zeros(1, 2, 1, 1)
    return trapezoidal_scan(x, dt, A, torch.ones(1, 2, 1, 2), torch.ones(1, 2, 1, 2), trap, angles, backend=backend)


def threads_flush() -> bool:
    """Whether torch's CPU threads flush subnormals now."""
    return bool((torch.full((1 << 21,), 1e-39) * 1.5 == 0).any())


@pytest.mark.parametrize("call", [ssd_call, trapezoidal_call], ids=["ssd", "trapezoidal_scan"])
def test_the_chunked_forward_runs_flushed(call):
    if library() is None:
        pytest.fail("the C library did not build: flushed_subnormals is untested")
    assert not threads_flush()
    reference = call("ref")[0, 1, 0, 0].item()
    assert 0 < abs(reference) < 1e-38, f"the reference should give a subnormal, got {reference}"
    chunked = call("chunked")[0, 1, 0, 0].item()
    assert chunked == 0.0, f"the chunked forward left a subnormal ({chunked}): it ran without flushing"
    assert not threads_flush(), "the chunked forward left torch's threads flushing"
