"""--op linear: ``ssm.scan.linear_scan`` (h_t = gates_t·h_{t-1} + inputs_t) on every backend of
the device against mambapy's parallel scan, with the same measurements and checks as --op
selective. Inputs: gates in [0.5, 1) and inputs, (batch, dim, L, N), scanned along L (dim=2):
the shape of the selective scan's discretised recurrence."""

from __future__ import annotations

from functools import partial

import torch

from ssm.scan import linear_scan

from . import scans

OP = "linear_scan"
add_arguments = scans.add_arguments


def check(args, parser) -> None:
    scans.check(args, parser, OP)


def inputs(batch: int, dim: int, N: int, length: int) -> tuple[torch.Tensor, ...]:
    """gates, inputs for ``linear_scan(..., dim=2)``, float32 on the CPU."""
    gates = 0.5 + 0.5 * torch.rand(batch, dim, length, N)
    return gates, torch.randn(batch, dim, length, N)


def functions(names: list[str]) -> dict:
    return {b: partial(linear_scan, dim=2, backend=b) for b in names}


def run(args) -> tuple[int, dict]:
    return scans.run(args, OP, inputs, functions)


def markdown(result: dict, args) -> tuple[str, str, str]:
    return scans.markdown(result, args, OP)


def plot(result: dict, path: str) -> None:
    scans.plot(result, path, OP)
