"""The non-scan ops' C kernels as torch custom ops (ssm/ops/cpu.py: the causal conv and RMSNorm,
each registered with its fake and autograd formula by ssm._custom_op.kernel_op) pass
``torch.library.opcheck`` on the arguments the library gives them (see
tests/scan/test_custom_ops.py for the scans'), and kernel_op refuses a fake or a formula that
cannot be the op's."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

from ssm._custom_op import KERNEL_OPS, kernel_op
from ssm.ops import causal_conv1d_silu, cpu, rms_norm
from tests.helpers import assert_kernel_ops_agree_with_their_fakes, cu_seqlens_of, kernel_op_calls

OPS = ["_conv_fwd", "_conv_bwd", "_rms_norm_fwd", "_rms_norm_bwd"]


def randn(*shape, grad: bool = True, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + len(shape))
    return torch.randn(*shape, generator=g).requires_grad_(grad)


def backward(*outs: torch.Tensor) -> None:
    sum(o.square().sum() for o in outs).backward()


@pytest.mark.parametrize("case", ["transposed", "packed"])
def test_the_conv_ops_agree_with_their_fakes(case, monkeypatch):
    """SiLU(conv) of x (B, L, D) channels last, with its (B, D, L) copy; or packed sequences."""
    weight, bias = randn(5, 1, 4), randn(5)
    if case == "transposed":
        x = randn(2, 9, 5)
        run = lambda: backward(*causal_conv1d_silu(x, weight, bias, transposed=True, backend="cpu")[0])
    else:
        x, cu_seqlens = randn(1, 9, 5), cu_seqlens_of([3, 0, 6])
        run = lambda: backward(causal_conv1d_silu(x, weight, bias, cu_seqlens=cu_seqlens, backend="cpu")[0])
    calls = kernel_op_calls(monkeypatch, cpu, OPS[:2], run)
    assert set(calls) == {"ssm::cpu_causal_conv_fwd", "ssm::cpu_causal_conv_bwd"}
    assert_kernel_ops_agree_with_their_fakes(calls)


def test_the_conv_op_from_a_state_agrees_with_its_fake(monkeypatch):
    """The forward alone (a cache's next tokens: no gradient), reading a state (B, D, K)."""
    x, weight, bias, state = (randn(*shape, grad=False) for shape in ((2, 3, 5), (5, 1, 4), (5,), (2, 5, 4)))
    run = lambda: causal_conv1d_silu(x, weight, bias, state=state, backend="cpu")
    calls = kernel_op_calls(monkeypatch, cpu, OPS[:1], run)
    assert set(calls) == {"ssm::cpu_causal_conv_fwd"}
    assert calls["ssm::cpu_causal_conv_fwd"][0][4] is not None  # the state reached the kernel
    assert_kernel_ops_agree_with_their_fakes(calls)


@pytest.mark.parametrize("gate", [None, "after", "before"])
def test_the_rms_norm_ops_agree_with_their_fakes(gate, monkeypatch):
    """RMSNorm over groups of 4 of 8 channels, ungated or gated after or before the norm."""
    x, weight = randn(2, 3, 8), randn(8)
    z = None if gate is None else randn(2, 3, 8, seed=1)
    run = lambda: backward(rms_norm(x, weight, 1e-5, z, 4, gate == "before", backend="cpu"))
    calls = kernel_op_calls(monkeypatch, cpu, OPS[2:], run)
    assert set(calls) == {"ssm::cpu_rms_norm_fwd", "ssm::cpu_rms_norm_bwd"}
    assert_kernel_ops_agree_with_their_fakes(calls)


def test_every_non_scan_kernel_op_is_checked_here():
    """An op of ssm.ops registered through kernel_op without a test above fails here (the scans'
    are checked in tests/scan/test_custom_ops.py). Every module of ssm.ops is imported first, so that
    each registers its ops."""
    for info in pkgutil.iter_modules(importlib.import_module("ssm.ops").__path__):
        importlib.import_module(f"ssm.ops.{info.name}")
    checked = {getattr(cpu, name) for name in OPS}
    ours = {name: op for name, op in KERNEL_OPS.items() if op._init_fn.__module__.startswith("ssm.ops")}
    unchecked = [name for name, op in ours.items() if op not in checked]
    assert ours, "no op of ssm.ops registered through kernel_op: the check checks nothing"
    assert not unchecked


def test_kernel_op_refuses_a_fake_of_other_parameters_and_half_a_formula():
    def launcher(x: torch.Tensor, n: int) -> torch.Tensor:
        return x.clone()

    with pytest.raises(TypeError, match=r"the fake's parameters \['x'\] are not the kernel's \['x', 'n'\]"):
        kernel_op("ssm_test::refused_fake", fake=lambda x: torch.empty_like(x))(launcher)
    with pytest.raises(ValueError, match="backward and setup_context go together"):
        kernel_op("ssm_test::refused_formula", fake=lambda x, n: torch.empty_like(x), backward=lambda ctx, g: g)
    assert not any(name.startswith("ssm_test::") for name in KERNEL_OPS)
