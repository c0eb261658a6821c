"""Shared test utilities: NaN-poisoned allocations and dtype-aware comparisons."""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_UNINITIALISED = {
    torch.ops.aten.empty,
    torch.ops.aten.empty_like,
    torch.ops.aten.empty_strided,
    torch.ops.aten.new_empty,
    torch.ops.aten.new_empty_strided,
}


class _PoisonEmpty(TorchDispatchMode):
    """Fills every uninitialised allocation with NaN, so that an element a kernel forgets to
    write shows up as NaN in its output instead of as whatever the memory held."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in _UNINITIALISED and out.is_floating_point():
            out.fill_(float("nan"))
        return out


@contextlib.contextmanager
def poisoned():
    with _PoisonEmpty():
        yield


# Tolerances for comparing a backend with the float32 reference, by the inputs' dtype.
TOLERANCES = {
    torch.float64: dict(rtol=1e-9, atol=1e-10),
    torch.float32: dict(rtol=2e-4, atol=2e-4),
    torch.float16: dict(rtol=5e-3, atol=5e-3),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Compare in float64, with the tolerance of ``dtype`` scaled by the size of ``expected``."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not torch.isnan(actual).any(), f"{what}: NaN in the result (an element left unwritten?)"
    tol = TOLERANCES[dtype]
    scale = max(expected.abs().max().item(), 1.0) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual.double(), expected.double(), rtol=tol["rtol"], atol=tol["atol"] * scale, msg=lambda m: f"{what}: {m}"
    )
