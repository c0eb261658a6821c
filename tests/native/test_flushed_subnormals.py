"""ssm.native.flushed_subnormals: inside it every thread of torch's CPU team flushes subnormals to
zero (a parallel torch op over subnormal inputs gives zeros in every thread's share), and after
it, even after an exception, each thread has its own mode back (the same op keeps them)."""

from __future__ import annotations

import pytest
import torch

from ssm.native import flushed_subnormals, library


def test_every_thread_flushes_inside_and_gets_its_mode_back():
    if library() is None:
        pytest.fail("the C library did not build: flushed_subnormals is untested")
    x = torch.full((1 << 21,), 1e-39)  # subnormal in float32; large enough for every thread
    assert torch.get_num_threads() >= 1
    assert (x * 1.5 != 0).all()
    with flushed_subnormals():
        with flushed_subnormals():  # nested: the outer mode stays until the outer block ends
            pass
        assert (x * 1.5 == 0).all(), "a thread kept its subnormals inside the block"
    assert (x * 1.5 != 0).all(), "a thread did not get its mode back"
    with pytest.raises(RuntimeError, match="inside"):
        with flushed_subnormals():
            raise RuntimeError("inside")
    assert (x * 1.5 != 0).all(), "an exception left the threads flushing"
