"""ssm.layers.linear: the bfloat16 product widened to float32 on the CPU gives the float64
product of the same bfloat16 values, rounded once; gradients too; nn.Linear's keys and API."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ssm.layers.linear import WIDEN_MIN_ROWS, Linear, linear


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference in units of the bfloat16 spacing at |want| (2^-7 relative)."""
    got, want = got.detach().double(), want.detach()
    spacing = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
    return float(((got - want) / spacing).abs().max())


@pytest.mark.parametrize("rows", [1, WIDEN_MIN_ROWS - 1, WIDEN_MIN_ROWS, 3 * WIDEN_MIN_ROWS + 5])
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_product_is_the_float64_product_rounded(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 96, generator=g).bfloat16()  # two leading dims: rows counted over both
    w = (torch.randn(40, 96, generator=g) / 10).bfloat16()
    b = torch.randn(40, generator=g).bfloat16() if bias else None
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    got = linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (2, rows, 40)
    # one rounding of an f32 sum: within one bf16 spacing (a bf16 accumulation would not be)
    assert bf16_ulps(got, want) <= 1.0


def test_widened_gradients_are_the_float64_gradients():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(WIDEN_MIN_ROWS, 48, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(24, 48, generator=g) / 7).bfloat16().requires_grad_()
    b = torch.randn(24, generator=g).bfloat16().requires_grad_()
    dy = torch.randn(WIDEN_MIN_ROWS, 24, generator=g).bfloat16()
    linear(x, w, b).backward(dy)
    dyd = dy.double()
    assert bf16_ulps(x.grad, dyd @ w.double()) <= 1.0
    assert bf16_ulps(w.grad, dyd.T @ x.double()) <= 1.0
    assert bf16_ulps(b.grad, dyd.sum(0)) <= 1.0
    assert x.grad.dtype == w.grad.dtype == b.grad.dtype == torch.bfloat16


def test_other_dtypes_are_torchs_own_product():
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float16, torch.float64):
        x = torch.randn(WIDEN_MIN_ROWS * 2, 32, generator=g).to(dtype)
        w = torch.randn(16, 32, generator=g).to(dtype)
        assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))
    # mismatched dtypes fail as nn.Linear does, whatever the number of rows
    for rows in (1, WIDEN_MIN_ROWS * 2):
        with pytest.raises(RuntimeError):
            linear(torch.randn(rows, 32), torch.randn(16, 32).bfloat16())


def test_linear_is_an_nn_linear_with_its_keys():
    layer = Linear(8, 4, bias=True)
    assert isinstance(layer, nn.Linear) and set(layer.state_dict()) == {"weight", "bias"}
    plain = nn.Linear(8, 4, bias=True)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(3, 8)
    assert torch.equal(layer(x), plain(x))
