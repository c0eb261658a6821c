"""Test-session setup: Triton kernels run on the CPU in Triton's interpreter when there is no GPU.

TRITON_INTERPRET=1 must be set before any kernel is defined (triton.jit reads it then), so it
is set here, before the test modules import ssm. With it, the "triton" backend is registered
for CPU tensors as well, and every cross-backend test in tests/scan runs it against the
reference. On a machine with CUDA the variable is left alone and the kernels are compiled.

The interpreter runs an associative scan or reduction with a user combine function one
element at a time in Python (``ScanOps.generic_scan``, ``ReduceOps.generic_reduce``), which
makes the scan tests take many minutes. ``_vectorise_interpreter_scans`` replaces them by the
same sequential recurrence along the scanned axis, applied to all other indices at once: the
combine function is elementwise, so each output element is computed by the same operations
in the same order. tests/scan/test_triton.py checks the replacement against the original.
"""

from __future__ import annotations

import os

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _vectorised_generic_scan(self, input):
    """ScanOps.generic_scan with one combine call per position along the axis."""
    axis = self.axis
    datas = [arg.handle.data for arg in input]
    outs = [np.empty_like(d) for d in datas]
    length = datas[0].shape[axis]

    def at(a, k):
        return a[(slice(None),) * axis + (k,)]

    for j in range(len(outs)):
        at(outs[j], 0)[...] = at(datas[j], 0) if length else 0
    for k in range(1, length):
        acc = tuple(self.to_tensor(at(o, k - 1), arg.dtype) for o, arg in zip(outs, input))
        cur = tuple(self.to_tensor(at(d, k), arg.dtype) for d, arg in zip(datas, input))
        ret = self.combine_fn.fn(*acc, *cur)
        ret = ret if isinstance(ret, tuple) else (ret,)
        for j, r in enumerate(ret):
            at(outs[j], k)[...] = r.handle.data if hasattr(r, "handle") else r
    return [self.to_tensor(o, arg.dtype) for o, arg in zip(outs, input)]


def _vectorise_interpreter_scans() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:  # no triton: the triton tests fail on import, with the reason
        return
    scan_ops = getattr(interpreter, "ScanOps", None)
    if scan_ops is None or not hasattr(scan_ops, "generic_scan"):
        return  # another triton version: keep its own (slow but correct) scan
    scan_ops._elementwise_generic_scan = scan_ops.generic_scan
    scan_ops.generic_scan = _vectorised_generic_scan


_vectorise_interpreter_scans()
