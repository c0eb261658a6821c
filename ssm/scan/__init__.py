"""The scan core: one public function per recurrence, each with interchangeable backends.

    selective_scan(u, delta, A, B, C, ...)   Mamba-1 / S6 selective scan           (selective.py)
    linear_scan(gates, inputs, dim=...)      h_t = gates_t·h_{t-1} + inputs_t       (linear.py)
    ssd(x, dt, A, B, C, ...)                 Mamba-2 / SSD: a scalar decay per head (ssd.py)
    trapezoidal_scan(x, dt, A, B, C, ...)    Mamba-3: trapezoidal rule, rotary state, MIMO (trapezoidal.py)
    selective_scan_step, ssd_step            one step of each, for recurrent inference (step.py)
    scan(fn, init, xs, checkpoint=...)       any step fn over pytrees (jax.lax.scan), O(√L) backward
    associative_scan(fn, elems, dim=...)     parallel prefix of any associative fn (generic.py)

Every op also runs packed variable-length sequences (``cu_seqlens``, batch 1; ``ssd`` also
mamba-ssm's ``seq_idx``), with one initial and one last state per sequence.
``packed_sequences(cu_seqlens, L)`` validates the boundaries once; the ``PackedSequences`` it
returns passes every later check without another host sync (what models and layers hand down).

Each op's module owns its backend table (``BACKENDS``: the backends and the order ``"auto"``
tries them on each device type); ``backends(op, device)`` lists them:
    "ref"      sequential loop, the ground truth (reference.py)
    "pscan"    parallel scan in pure PyTorch with its own backward (pscan.py)
    "cpu"      chunked sequential sweeps in C (ssm/native), with a reverse-sweep backward (cpu.py)
    "triton"   fused Triton kernels for CUDA; on the CPU only under TRITON_INTERPRET=1 (triton/)
    "chunked"  the chunked SSD algorithm, for ssd (chunked.py) and trapezoidal_scan (trapezoidal_chunked.py)
    "auto"     the best one for the inputs' device
"""

import warnings

from .._backends import lister
from . import linear as _linear
from . import selective as _selective
from . import ssd as _ssd
from . import trapezoidal as _trapezoidal
from ._checks import PackedSequences, packed_sequences
from ._common_trapezoidal import TrapezoidalState
from .generic import associative_scan, scan
from .linear import linear_scan
from .reference import linear_scan_ref, selective_scan_ref, ssd_ref, trapezoidal_scan_ref
from .selective import selective_scan
from .ssd import ssd
from .step import selective_scan_step, ssd_step, trapezoidal_scan_step
from .trapezoidal import trapezoidal_scan

_MOVED = {"mamba_blocks_step_cpu": "ssm.ops.mamba_blocks_step"}


def __getattr__(name: str):
    """Names that moved out of the scan core: a warning, then the new one."""
    if name in _MOVED:
        # imported here: the scan core needs ssm.ops for this deprecated name alone (ops imports no scan)
        from ..ops import mamba_blocks_step

        warnings.warn(f"ssm.scan.{name} moved to {_MOVED[name]}", DeprecationWarning, stacklevel=2)
        return mamba_blocks_step
    raise AttributeError(f"module 'ssm.scan' has no attribute {name!r}")


# backends(op, device=None): the names of the backends of "selective_scan", "linear_scan", "ssd"
# or "trapezoidal_scan"; with a device, only those that run there now ("auto" is always accepted).
# (the op modules under private names: ``from .ssd import ssd`` below rebinds ``ssd`` to the function)
backends = lister((_selective.BACKENDS, _linear.BACKENDS, _ssd.BACKENDS, _trapezoidal.BACKENDS))


__all__ = [
    "selective_scan",
    "linear_scan",
    "ssd",
    "trapezoidal_scan",
    "TrapezoidalState",
    "selective_scan_step",
    "ssd_step",
    "trapezoidal_scan_step",
    "scan",
    "associative_scan",
    "backends",
    "PackedSequences",
    "packed_sequences",
    "selective_scan_ref",
    "linear_scan_ref",
    "ssd_ref",
    "trapezoidal_scan_ref",
]
