"""Backend "triton": fused GPU kernels, one entry module per op.

    selective_scan.py        launchers, custom ops with autograd, selective_scan_triton
    _selective_kernels.py    its forward and backward kernels, with the @triton.jit helpers they share
    linear_scan.py           kernel, launchers, custom ops with autograd, linear_scan_triton
    trapezoidal_scan.py      launchers, custom ops with autograd, trapezoidal_scan_triton (Mamba-3)
    trapezoidal_ssd.py       trapezoidal_scan_ssd: Mamba-3 (rank 1) on the SSD kernels, chunk-parallel
    _trapezoidal_kernels.py  its forward and backward kernels
    _trapezoidal_jit.py      the @triton.jit helpers those two kernels share
    ssd.py                   launchers, custom ops with autograd, ssd_triton (Mamba-2's SSD, chunked)
    _ssd_kernels.py          its forward kernels, and the @triton.jit helpers its backward shares
    _ssd_bwd_kernels.py      its backward kernels
    _jit.py                  what the ops share: @triton.jit helpers, launcher checks, custom-op plumbing
    _interpreter.py          interpreting(): whether TRITON_INTERPRET is on (no triton import)

triton is optional: importing ``ssm`` does not import it. An op module (and with it triton) is
imported on the first call of its backend, inside the function of that name here (the op
modules import nothing from this one, so that is no import loop); without triton the backend is
not offered for any device. The backend runs on CUDA (and ROCm) tensors, and on CPU tensors in
Triton's interpreter when ``TRITON_INTERPRET=1`` (slow, for tests). Both are read when a call
asks where the backend runs, not frozen at import; but Triton defines a process's kernels for
one mode when they are first launched, so set TRITON_INTERPRET before then.
"""

from __future__ import annotations

import importlib.util

import torch

from ._interpreter import interpreting

# Looked up once, here (finding the package does not import it): torch.compile in torch 2.11
# refuses to trace importlib's find_spec, and backend resolution runs inside compiled code.
_INSTALLED = importlib.util.find_spec("triton") is not None


def available() -> bool:
    """Whether the triton package is installed."""
    return _INSTALLED


def devices() -> tuple[str, ...]:
    """The device types the backend runs on now: CUDA (also ROCm in torch), and the CPU under
    the interpreter; none without triton."""
    if not available():
        return ()
    return ("cuda", "cpu") if interpreting() else ("cuda",)


def hint(device: torch.device) -> str | None:
    """What it takes for the backend to run on ``device``, when it cannot."""
    if not available():
        return "the triton package is not installed: pip install triton (Linux)"
    if device.type == "cpu" and not interpreting():
        return "CPU tensors run only in Triton's interpreter: set TRITON_INTERPRET=1 before the first launch"
    return None


def selective_scan_triton(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """Backend "triton" of ``selective_scan`` (see selective_scan.py)."""
    from .selective_scan import selective_scan_triton

    return selective_scan_triton(*args)


def linear_scan_triton(*args) -> torch.Tensor:
    """Backend "triton" of ``linear_scan`` (see linear_scan.py)."""
    from .linear_scan import linear_scan_triton

    return linear_scan_triton(*args)


def trapezoidal_scan_triton(*args):
    """Backend "triton" of ``trapezoidal_scan`` (see trapezoidal_scan.py)."""
    from .trapezoidal_scan import trapezoidal_scan_triton

    return trapezoidal_scan_triton(*args)


def trapezoidal_scan_ssd(*args):
    """Backend "triton-ssd" of ``trapezoidal_scan`` (see trapezoidal_ssd.py): rank 1 on the SSD
    kernels."""
    from .trapezoidal_ssd import trapezoidal_scan_ssd

    return trapezoidal_scan_ssd(*args)


def ssd_triton(*args):
    """Backend "triton" of ``ssd`` (see ssd.py); None when it declines the inputs."""
    from .ssd import ssd_triton

    return ssd_triton(*args)


__all__ = [
    "selective_scan_triton",
    "linear_scan_triton",
    "trapezoidal_scan_triton",
    "trapezoidal_scan_ssd",
    "ssd_triton",
    "available",
    "devices",
    "hint",
    "interpreting",
]
