"""--op trapezoidal: ``ssm.scan.trapezoidal_scan`` (Mamba-3's SISO scan: the trapezoidal rule on a
rotating state) on every backend of the device (on CUDA the Triton one among them), with the
measurements and checks of --op selective: forward and forward+backward time, extra peak memory,
and every output and gradient checked against ``ref``'s (exit status 1 beyond tolerance). There is
no peer. Inputs (time second, as in ``ssm.scan``; random with ``--seed``): x, z (batch, L, H, P)
with H = dim / --headdim heads of P = --headdim channels; Δ in [0.001, 0.1], A in [-1.5, -0.5]
and λ in [0, 1] (batch, L, H); one group of B, C (batch, L, 1, N); rotary rates θ (batch, L, H,
N/2) in [0, 0.1]; D (H,), float32."""

from __future__ import annotations

from functools import partial

import torch

from ssm.scan import trapezoidal_scan

from . import scans

OP = "trapezoidal_scan"
add_arguments = scans.add_arguments


def check(args, parser) -> None:
    scans.check(args, parser, OP)
    if args.dim % args.headdim or args.state % 2:
        parser.error("--headdim must divide --dim, and --state be even (its pairs rotate)")


def inputs(batch: int, dim: int, N: int, length: int, headdim: int) -> tuple[torch.Tensor, ...]:
    """x, dt, A, B, C, trap, angles, D, z for ``trapezoidal_scan``, float32 on the CPU."""
    H, shape = dim // headdim, (batch, length, dim // headdim)
    x, z = torch.randn(*shape, headdim), torch.randn(*shape, headdim)
    dt = torch.empty(shape).uniform_(1e-3, 1e-1)
    A = -torch.empty(shape).uniform_(0.5, 1.5)
    trap = torch.rand(shape)
    B, C = torch.randn(batch, length, 1, N), torch.randn(batch, length, 1, N)
    angles = 0.1 * torch.rand(*shape, N // 2)
    return x, dt, A, B, C, trap, angles, torch.randn(H), z


def functions(names: list[str]) -> dict:
    return {b: partial(trapezoidal_scan, backend=b) for b in names}


def run(args) -> tuple[int, dict]:
    return scans.run(args, OP, partial(inputs, headdim=args.headdim), functions)


def markdown(result: dict, args) -> tuple[str, str, str]:
    return scans.markdown(result, args, OP)


def plot(result: dict, path: str) -> None:
    scans.plot(result, path, OP)
