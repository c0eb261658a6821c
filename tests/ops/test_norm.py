"""RMSNorm's C kernels on the CPU: values by the formula written out, gradients by finite differences."""

from __future__ import annotations

import pytest
import torch

from ssm.layers import RMSNorm
from tests.helpers import GRADCHECK_TOL


def by_formula(x, w, eps):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps) * w


@pytest.mark.parametrize("shape", [(3, 7, 5), (1, 33)])
def test_the_c_rms_norm(shape):
    """rms_norm_cpu against the formula (float64), and its gradients of x and the weight by
    gradcheck; 21 and 1 rows (the backward's rows split among the threads, and not)."""
    from ssm.native import library
    from ssm.ops import cpu

    if library() is None:
        pytest.fail("the cpu kernels did not build: the C RMSNorm is untested")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(shape[-1], generator=g, dtype=torch.float64, requires_grad=True)
    y = cpu.rms_norm_cpu(x, w, 1e-3)
    torch.testing.assert_close(y, by_formula(x, w, 1e-3), rtol=1e-13, atol=1e-13)
    assert torch.autograd.gradcheck(lambda x, w: cpu.rms_norm_cpu(x, w, 1e-3), (x, w), **GRADCHECK_TOL)


def test_the_module_takes_the_c_kernel_on_the_cpu_and_agrees_with_torch(monkeypatch):
    """RMSNorm's forward and backward in float32 match torch's F.rms_norm (its path elsewhere),
    and the C kernel is what ran."""
    from ssm.ops import norm as norm_module

    calls = []
    c_norm = norm_module.BACKENDS._backends["cpu"]
    monkeypatch.setitem(
        norm_module.BACKENDS._backends,
        "cpu",
        c_norm.__class__("cpu", lambda *a: calls.append(1) or c_norm.fn(*a), c_norm.devices),
    )
    torch.manual_seed(0)
    layer = RMSNorm(64)
    with torch.no_grad():
        layer.weight.normal_()
    x = torch.randn(4, 9, 64, requires_grad=True)
    y = layer(x)
    y.backward(torch.ones_like(y))
    assert calls == [1]
    x2 = x.detach().clone().requires_grad_()
    w2 = layer.weight.detach().clone().requires_grad_()
    y2 = torch.nn.functional.rms_norm(x2, (64,), w2, layer.eps)
    y2.backward(torch.ones_like(y2))
    torch.testing.assert_close(y, y2)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(layer.weight.grad, w2.grad)


def test_the_c_rms_norm_declines_what_it_does_not_run():
    from ssm.ops import cpu

    x, w = torch.randn(4, 6), torch.randn(6)
    assert cpu.rms_norm_cpu(x.t(), torch.randn(4), 1e-5) is None  # not contiguous
    assert cpu.rms_norm_cpu(x.half(), w.half(), 1e-5) is None
    assert cpu.rms_norm_cpu(x, w.double(), 1e-5) is None


def gated_by_formula(x, z, w, eps, group, norm_before_gate):
    silu = z / (1 + torch.exp(-z))
    v = x if norm_before_gate else x * silu
    g = v.unflatten(-1, (-1, group))
    y = (g / torch.sqrt((g * g).sum(-1, keepdim=True) / group + eps)).flatten(-2) * w
    return y * silu if norm_before_gate else y


@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("group", [12, 4])
def test_the_c_gated_rms_norm(group, norm_before_gate):
    """Mamba-2's gated, grouped norm in C against the formula (float64), z a slice of a wider
    tensor as in_proj leaves it (rows 20 apart), and its gradients of x, z and the weight by
    gradcheck; 15 rows, split among the threads in the backward."""
    from ssm.native import library
    from ssm.ops import cpu

    if library() is None:
        pytest.fail("the cpu kernels did not build: the C gated RMSNorm is untested")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 12, generator=g, dtype=torch.float64, requires_grad=True)
    wide = torch.randn(3, 5, 20, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(12, generator=g, dtype=torch.float64, requires_grad=True)

    def fn(x, wide, w):
        return cpu.rms_norm_cpu(x, w, 1e-3, wide[..., 3:15], group, norm_before_gate)

    torch.testing.assert_close(
        fn(x, wide, w), gated_by_formula(x, wide[..., 3:15], w, 1e-3, group, norm_before_gate), rtol=1e-13, atol=1e-13
    )
    assert torch.autograd.gradcheck(fn, (x, wide, w), **GRADCHECK_TOL)
