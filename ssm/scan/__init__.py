"""The scan core: one public function per recurrence, each with interchangeable backends.

    selective_scan(u, delta, A, B, C, ...)   Mamba-1 / S6 selective scan
    linear_scan(gates, inputs, dim=...)     h_t = gates_t·h_{t-1} + inputs_t
    ssd(x, dt, A, B, C, ...)                 Mamba-2 / SSD: a scalar decay per head
    selective_scan_step, ssd_step            one step of each, for recurrent inference
    scan(fn, init, xs, checkpoint=...)      any step fn over pytrees (jax.lax.scan), O(√L) backward
    associative_scan(fn, elems, dim=...)    parallel prefix of any associative fn (generic.py)

Backends (``backend=`` argument; ``backends(op)`` lists them):
    "ref"    sequential float32 loop, the ground truth (reference.py)
    "pscan"  parallel scan in pure PyTorch with its own backward (pscan.py)
    "chunked" the chunked SSD algorithm, for ssd only (chunked.py)
    "triton" fused Triton kernels for CUDA; on CPU only under TRITON_INTERPRET=1 (triton/)
    "cpu"    chunked sequential sweeps compiled to C++, with a reverse-sweep backward (cpu.py)
    "auto"   the best one for the inputs' device (chosen in _dispatch.py)
"""

from . import _dispatch
from .chunked import ssd_chunked
from .generic import associative_scan, scan
from .cpu import linear_scan_cpu, selective_scan_cpu
from .linear import OP as _LINEAR
from .linear import linear_scan
from .pscan import linear_scan_pscan, selective_scan_pscan
from .reference import linear_scan_ref, selective_scan_ref, ssd_ref
from .selective import OP as _SELECTIVE
from .selective import selective_scan
from .ssd import OP as _SSD
from .ssd import ssd
from .step import selective_scan_step, ssd_step
from .triton import linear_scan_triton, selective_scan_triton
from . import triton as _triton

_dispatch.register(_SELECTIVE, "ref", selective_scan_ref)
_dispatch.register(_SELECTIVE, "pscan", selective_scan_pscan)
_dispatch.register(_LINEAR, "ref", linear_scan_ref)
_dispatch.register(_LINEAR, "pscan", linear_scan_pscan)
_dispatch.register(_SSD, "ref", ssd_ref)
_dispatch.register(_SSD, "chunked", ssd_chunked)
_dispatch.register(_SELECTIVE, "triton", selective_scan_triton, devices=_triton.devices(), available=_triton.available)
_dispatch.register(_LINEAR, "triton", linear_scan_triton, devices=_triton.devices(), available=_triton.available)
_dispatch.register(_SELECTIVE, "cpu", selective_scan_cpu, devices=("cpu",))
_dispatch.register(_LINEAR, "cpu", linear_scan_cpu, devices=("cpu",))


def backends(op: str, device=None) -> list[str]:
    """Names of the backends of ``op`` ("selective_scan", "linear_scan" or "ssd"); with
    ``device``, only those that run there. ``"auto"`` is always accepted as well."""
    if op not in (_SELECTIVE, _LINEAR, _SSD):
        raise ValueError(f"unknown op {op!r}; expected one of {[_SELECTIVE, _LINEAR, _SSD]}")
    return _dispatch.backends(op, device)


__all__ = [
    "selective_scan",
    "linear_scan",
    "ssd",
    "selective_scan_step",
    "ssd_step",
    "scan",
    "associative_scan",
    "backends",
    "selective_scan_ref",
    "linear_scan_ref",
    "ssd_ref",
]
