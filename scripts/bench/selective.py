"""--op selective: ``ssm.scan.selective_scan`` on every backend of the device against the
installed peers (mambapy's parallel scan; on CUDA also mamba-ssm's ``selective_scan_fn``), at a
mamba-130m layer's shape by default: forward and forward+backward time, extra peak memory,
achieved bandwidth, and a check of every output and gradient against ``ref`` and the peers.

Inputs (channels first, as in ``ssm.scan``; random with ``--seed``): u, z, delta (batch, dim,
L); A (dim, N) = -(1..N), the S4D-real init; B, C (batch, N, L); D, delta_bias (dim,). A, D
and delta_bias are float32, the rest ``--dtype``. As in a Mamba layer, D and the silu(z) gate
are on and Δ = softplus(delta + delta_bias) lies around 0.001-0.1: delta_bias is the inverse
softplus of a log-uniform step in [0.001, 0.1], delta is small noise. The peer runs on the same
values in its (batch, L, dim, ...) layout and computes what mambapy's MambaBlock does,
softplus(delta + bias), D·u and the silu(z) gate included, so that the same work is compared.
``--lengths 256,1024,4096`` runs the whole comparison at each length (the picture of time
against length). ``--compiled-step`` adds the row users write first: a Python loop over L
calling ``torch.compile(selective_scan_step)`` (the one-step reference formula, compiled once
for all steps), with autograd through the loop."""

from __future__ import annotations

import math
from functools import partial

import torch

from ssm.scan import selective_scan, selective_scan_step

from . import scans

OP = "selective_scan"

add_arguments = scans.add_arguments


def check(args, parser) -> None:
    scans.check(args, parser, OP)


def inputs(batch: int, dim: int, N: int, length: int) -> tuple[torch.Tensor, ...]:
    """u, delta, A, B, C, D, z, delta_bias for ``selective_scan``, float32 on the CPU."""
    dt = torch.empty(dim).uniform_(math.log(1e-3), math.log(1e-1)).exp()
    delta_bias = dt + torch.log(-torch.expm1(-dt))  # softplus(delta_bias) = dt
    delta = 0.1 * torch.randn(batch, dim, length)
    A = -torch.arange(1, N + 1, dtype=torch.float32).repeat(dim, 1)
    u, z = torch.randn(batch, dim, length), torch.randn(batch, dim, length)
    B, C = torch.randn(batch, N, length), torch.randn(batch, N, length)
    D = torch.randn(dim)
    return u, delta, A, B, C, D, z, delta_bias


def functions(names: list[str]) -> dict:
    return {b: partial(selective_scan, delta_softplus=True, backend=b) for b in names}


def compiled_step_loop():
    """selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True) as a loop over
    L of the compiled one-step function, the state carried in float32."""
    step = torch.compile(selective_scan_step, dynamic=False)

    def loop(u, delta, A, B, C, D, z, delta_bias):
        state = torch.zeros(u.shape[0], u.shape[1], A.shape[1], device=u.device)  # (B, D, N)
        outs = []
        for t in range(u.shape[-1]):
            y, state = step(state, u[..., t], delta[..., t], A, B[..., t], C[..., t], D, z[..., t], delta_bias, True)
            outs.append(y)
        return torch.stack(outs, -1)  # (B, D, L)

    return loop


def run(args) -> tuple[int, dict]:
    def with_step_loop(names: list[str]) -> dict:
        found = functions(names)
        if args.compiled_step:
            found["step loop (torch.compile)"] = compiled_step_loop()
        return found

    return scans.run(args, OP, inputs, with_step_loop)


def markdown(result: dict, args) -> tuple[str, str, str]:
    return scans.markdown(result, args, OP)


def plot(result: dict, path: str) -> None:
    scans.plot(result, path, OP)
