"""The scan core: one public function per recurrence, each with interchangeable backends.

    selective_scan(u, delta, A, B, C, ...)   Mamba-1 / S6 selective scan
    linear_scan(gates, inputs, dim=...)     h_t = gates_t·h_{t-1} + inputs_t

Backends (``backend=`` argument; ``backends(op)`` lists them):
    "ref"    sequential float32 loop, the ground truth (reference.py)
    "pscan"  parallel scan in pure PyTorch with its own backward (pscan.py)
    "cpu"    chunked sequential sweeps compiled to C++, with a reverse-sweep backward (cpu.py)
    "auto"   the best one for the inputs' device (chosen in _dispatch.py)
"""

from . import _dispatch
from .cpu import linear_scan_cpu, selective_scan_cpu
from .linear import OP as _LINEAR
from .linear import linear_scan
from .pscan import linear_scan_pscan, selective_scan_pscan
from .reference import linear_scan_ref, selective_scan_ref
from .selective import OP as _SELECTIVE
from .selective import selective_scan

_dispatch.register(_SELECTIVE, "ref", selective_scan_ref)
_dispatch.register(_SELECTIVE, "pscan", selective_scan_pscan)
_dispatch.register(_LINEAR, "ref", linear_scan_ref)
_dispatch.register(_LINEAR, "pscan", linear_scan_pscan)
_dispatch.register(_SELECTIVE, "cpu", selective_scan_cpu, devices=("cpu",))
_dispatch.register(_LINEAR, "cpu", linear_scan_cpu, devices=("cpu",))


def backends(op: str, device=None) -> list[str]:
    """Names of the backends of ``op`` ("selective_scan" or "linear_scan"); with ``device``,
    only those that run there. ``"auto"`` is always accepted as well."""
    if op not in (_SELECTIVE, _LINEAR):
        raise ValueError(f"unknown op {op!r}; expected one of {[_SELECTIVE, _LINEAR]}")
    return _dispatch.backends(op, device)


__all__ = [
    "selective_scan",
    "linear_scan",
    "backends",
    "selective_scan_ref",
    "linear_scan_ref",
]
