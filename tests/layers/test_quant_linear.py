"""QuantLinear's tensor path (a prompt's prefill through a quantised layer): the C widening of
its rows (``ops.quant_cpu.widen_rows``) against ``dequantize_ref``, the float64 reading of the
stored integers and scales that shares no code with it; the layer's output and gradient against
float64 products of those weights, over several chunks of rows and for float32 and bfloat16
inputs, with float32 activations and rounded to int8 (round_activations, against its reference
one input at a time)."""

from __future__ import annotations

import pytest
import torch

import ssm.layers.quant as quant
from ssm.layers.quant import QuantLinear
from ssm.native import library
from ssm.ops import dequantize_ref, quantize_matrix, quantized_product_ref, round_activations_ref
from ssm.ops.quant import round_activations
from ssm.ops.quant_cpu import round_rows, widen_rows


def needs_library():
    if library() is None:
        pytest.fail("the C library did not build: the C widening is untested")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("n", [1, 17, 32, 33, 47, 64, 100])
def test_widen_rows_reads_the_stored_weights_exactly(scheme, n):
    """float32 products of a small integer and a float32 scale are exact in float64, so the
    float64 reading rounded once to float32 is what one float32 multiplication gives: equal."""
    needs_library()
    g = torch.Generator().manual_seed(n)
    w = torch.randn(11, n, generator=g) * torch.rand(11, 1, generator=g) * 4
    q = quantize_matrix(w, scheme)
    want = dequantize_ref(q).float()
    for lo, hi in [(0, 11), (3, 4), (5, 11), (7, 7)]:
        got = widen_rows(q, lo, hi)
        assert got.shape == (hi - lo, n)
        assert torch.equal(got, want[lo:hi]), (scheme, n, lo, hi)
    buf = torch.full((200 * n,), float("nan"))  # a larger buffer: only its first rows are written
    assert torch.equal(widen_rows(q, 2, 9, buf), want[2:9])


def test_widen_rows_refuses_a_wrong_buffer_range_or_matrix():
    needs_library()
    q = quantize_matrix(torch.randn(4, 40), "int8")
    for bad in (torch.empty(4 * 40 - 1), torch.empty(4 * 40, dtype=torch.float64), torch.empty(40, 8).t()):
        with pytest.raises(ValueError, match="out must be"):
            widen_rows(q, 0, 4, bad)
    for lo, hi in ((-1, 2), (3, 2), (0, 5)):
        with pytest.raises(ValueError, match=r"lo, hi must satisfy 0 <= lo <= hi <= 4 \(rows\)"):
            widen_rows(q, lo, hi)
    with pytest.raises(ValueError, match="weight must be a QuantizedMatrix, got Tensor"):
        widen_rows(torch.randn(4, 40), 0, 4)


@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_forward_and_input_gradient_against_float64_over_several_chunks(scheme, dtype, activations, monkeypatch):
    """Chunks of 7 rows (35 outputs: five chunks, the widened rows reused between them unless
    autograd keeps them). Output: float32 rounding of the float64 product for float32 inputs, one
    bfloat16 rounding for bfloat16 ones, float64 rounding for float64 ones (not a float32
    product); with int8 activations the float64 product of the rounded activations
    (quantized_product_ref; a float64 input is never rounded). x's gradient: float32 rounding of
    the float product (the rounding passes the gradient straight through)."""
    needs_library()
    monkeypatch.setattr(quant, "_ROWS", 7)
    torch.manual_seed(3)
    lin = torch.nn.Linear(45, 35)
    layer = QuantLinear.from_linear(lin, scheme, activations)
    wide = dequantize_ref(layer.matrix()).float().double()  # the float32 weights (see the test above)
    x = torch.randn(6, 45).to(dtype)
    want = x.double() @ wide.T + lin.bias.double()
    if activations == "int8" and dtype != torch.float64:
        want = torch.stack([quantized_product_ref(layer.matrix(), row.float()) for row in x]) + lin.bias.double()
    scale = (x.double().abs() @ wide.abs().T + lin.bias.double().abs()).max()
    with torch.no_grad():
        got = layer(x)
    assert got.dtype == dtype
    tol = {torch.bfloat16: 2.0**-8, torch.float32: 1e-6, torch.float64: 1e-13}[dtype]
    assert ((got.double() - want).abs() <= tol * (want.abs() + scale)).all()

    xg = x.float().requires_grad_()
    g = torch.randn(6, 35)
    layer(xg).backward(g)
    torch.testing.assert_close(xg.grad.double(), g.double() @ wide, rtol=1e-5, atol=1e-5)


def test_round_activations_equals_the_reference_one_input_at_a_time():
    """The tensor path's rounding (ssm.ops.quant.round_activations, and in C ops.quant_cpu.round_rows)
    against round_activations_ref: exactly, for blocks of zeros, partial last blocks, ties
    (x = (k + 1/2)·d) and non-finite values (NaN over their block only)."""
    g = torch.Generator().manual_seed(4)
    for n in (1, 31, 32, 33, 70, 100):
        x = torch.randn(3, n, generator=g) * torch.rand(3, n, generator=g) ** 3
        if n >= 64:
            x[0, 32:64] = 0
            x[1, :32] = torch.arange(32) + 0.5  # d = 31.5 / 127: (k + 1/2)·d are ties in exact arithmetic
            x[2, 40] = float("nan")
            x[2, 5] = float("inf")
        got = round_activations(x)
        assert got.dtype == torch.float32 and got.shape == x.shape
        in_c = round_rows(x)  # the C rounding the tensor path takes on the CPU
        assert in_c is not None and torch.equal(in_c.isnan(), got.isnan())
        assert torch.equal(in_c.nan_to_num(7.0), got.nan_to_num(7.0))
        for row in range(3):
            q, d = round_activations_ref(x[row])
            want = torch.tensor([qi * d[i // 32] for i, qi in enumerate(q)], dtype=torch.float64).float()
            assert torch.equal(got[row].isnan(), want.isnan()), (n, row)
            ok = ~want.isnan()
            assert torch.equal(got[row][ok], want[ok]), (n, row)
    for shape in ((1, 70, 40), (3, 33, 17)):  # transposed (B, D, L) inputs: strided rows, read in tiles
        xt = torch.randn(*shape, generator=g).transpose(1, 2)
        assert torch.equal(round_rows(xt), round_activations(xt))
    xg = torch.randn(40, requires_grad=True)
    round_activations(xg).sum().backward()
    assert torch.equal(xg.grad, torch.ones(40))  # straight through


def test_bad_activations_name_the_argument():
    with pytest.raises(ValueError, match=r"activations must be one of \['float32', 'int8'\], got 'int4'"):
        QuantLinear(40, 8, "int8", activations="int4")
