"""Property-based tests of the causal convolution with SiLU (hypothesis), the op every Mamba layer
runs before its scan: drawn sizes (a width K of 0 included, which the C backward divided by),
dtypes, packings and non-finite inputs, on its two backends ("cpu", the C kernel; "torch").
Refused with a ValueError naming ``weight``, or equal (forward and gradients) to the float64
loop of ``causal_conv1d_ref``; and causal: a NaN or ±inf at step t reaches no output before t
and none in another packed sequence (tests/properties.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from ssm.ops import causal_conv1d_ref, causal_conv1d_silu
from tests.properties import Case, causal, matches_reference, refused


@st.composite
def conv_case(draw):
    backend = draw(st.sampled_from(["cpu", "torch"]))
    if draw(st.booleans()):
        lengths = draw(st.lists(st.integers(0, 8), min_size=1, max_size=4))
        bounds = tuple([0, *torch.tensor(lengths).cumsum(0).tolist()])
        batch, L = 1, bounds[-1]
    else:
        bounds, batch, L = None, draw(st.integers(0, 2)), draw(st.integers(0, 12))
    D, K = draw(st.integers(1, 6)), draw(st.sampled_from([1, 2, 3, 4, 1, 2, 3, 4, 0]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 3)))
    inputs = {
        "x": torch.randn(batch, L, D, generator=g, dtype=dtype).requires_grad_(),
        "weight": torch.randn(D, 1, K, generator=g, dtype=dtype).requires_grad_(),
    }
    if draw(st.booleans()):
        inputs["bias"] = torch.randn(D, generator=g, dtype=dtype).requires_grad_()
    cu = None if bounds is None else torch.tensor(bounds)

    def call(x, b):
        if b == "ref":
            y, _ = causal_conv1d_ref(x["x"].transpose(1, 2), x["weight"], x.get("bias"), cu_seqlens=cu)
            return (F.silu(y).transpose(1, 2),)
        return (causal_conv1d_silu(x["x"], x["weight"], x.get("bias"), cu_seqlens=cu, backend=b)[0],)

    error = "weight" if K == 0 else None
    return backend, Case(inputs, call, {"x": 1}, 1, dtype, bounds, expect_error=error, info={"L": L})


@given(st.data())
def test_causal_conv1d_silu(data):
    backend, case = data.draw(conv_case())
    if case.expect_error is not None:
        refused(case, backend)
        return
    matches_reference(case, backend)
    rows, length = case.inputs["x"].shape[:2]
    if rows and length:
        t, row = data.draw(st.integers(0, length - 1)), data.draw(st.integers(0, rows - 1))
        causal(case, backend, "x", row, t, data.draw(st.sampled_from([math.nan, math.inf, -math.inf])))
