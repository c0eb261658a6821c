"""Test-session setup: Triton kernels run on the CPU in Triton's interpreter when there is no GPU.

TRITON_INTERPRET=1 must be set before any kernel is defined (triton.jit reads it then), so it
is set here, before the test modules import ssm. With it, the "triton" backend is registered
for CPU tensors as well, and tests/scan/test_triton.py runs it against the reference. On a
machine with CUDA the variable is left alone: the kernels are compiled and run on the GPU.

The interpreter runs an associative scan with a user combine function one element at a time
in Python (``ScanOps.generic_scan``), and re-patches triton.language on every call of a jit
function from a kernel (tl.sum included), which together make the Triton tests take many
minutes. ``_speed_up_interpreter`` replaces the scan by a log-depth scan over whole arrays
(the same combine function, associated as a tree, as on a GPU) and patches the language once
per module. tests/scan/test_triton.py checks the scan against the original.

The interpreter's tl.dot multiplies bfloat16 operands as the integers that hold their bits
(numpy has no bfloat16): ``_bfloat16_dots`` widens them to float32 first, exactly, which is what
a GPU's tensor cores compute with (products exact, sums in float32).

The "cpu" scan backend builds its C kernels with the system compiler on first use (about a
second; cached on disk for later runs) and every test runs them, as users do.

The property-based tests (test_properties.py in tests/scan and tests/layers, hypothesis) run
under one of two settings profiles, chosen by ``SSM_HYPOTHESIS_PROFILE``: "ci" (the default: a
fixed seed and a bounded number of examples, a couple of minutes in all) or "long" (random
seeds, many examples, no bound: to run by hand).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _log_depth_generic_scan(self, input):
    """ScanOps.generic_scan as a Hillis-Steele scan: log2(n) combine calls on whole arrays.

    Step j combines every element with the one 2**j before it (earlier operand on the left),
    which is the inclusive scan for any associative combine function. The association order
    is a tree, as on a GPU, instead of the interpreter's left-to-right fold, so results may
    differ from it in the last bits; tests/scan/test_triton.py compares the two."""
    import numpy as np  # the interpreter's own dependency

    axis = self.axis
    datas = [np.array(arg.handle.data, copy=True) for arg in input]
    dtypes = [arg.dtype for arg in input]
    length = datas[0].shape[axis]

    keep = [slice(None)] * datas[0].ndim
    offset = 1
    while offset < length:
        # Whole arrays (block shapes must stay powers of two): the first `offset` positions
        # combine with wrapped-around values and are then put back.
        left = [self.to_tensor(np.roll(d, offset, axis), t) for d, t in zip(datas, dtypes)]
        right = [self.to_tensor(d, t) for d, t in zip(datas, dtypes)]
        ret = self.combine_fn.fn(*left, *right)
        ret = ret if isinstance(ret, tuple) else (ret,)
        keep[axis] = slice(offset, length)
        for d, r in zip(datas, ret):
            d[tuple(keep)] = np.asarray(r.handle.data if hasattr(r, "handle") else r)[tuple(keep)]
        offset *= 2
    return [self.to_tensor(d, t) for d, t in zip(datas, dtypes)]


_LANGUAGE_PATCHED: set[int] = set()


def _device_call_patching_once(self, *args, **kwargs):
    """InterpretedFunction.__call__ (a jit function called from a kernel, tl.sum included)
    without re-patching triton.language on every call: the interpreter patches it each time
    (about a millisecond), although the patches a device call makes are never undone."""
    from triton.runtime import interpreter

    key = id(self.fn.__globals__)
    if key not in _LANGUAGE_PATCHED:
        interpreter._patch_lang(self.fn)
        _LANGUAGE_PATCHED.add(key)
    fn = self.rewrite()
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        raise interpreter.InterpreterError(repr(e)) from e


def _bfloat16_dots(create_dot):
    """InterpreterBuilder.create_dot with bfloat16 operands (held as uint16) widened to float32."""
    import numpy as np  # the interpreter's own dependency
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    def widened(handle):
        if handle.dtype != tl.bfloat16:
            return handle
        return TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    return dot


def _speed_up_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:  # no triton: the triton tests fail on import, with the reason
        return
    scan_ops = getattr(interpreter, "ScanOps", None)
    if scan_ops is None or not hasattr(scan_ops, "generic_scan"):
        return  # another triton version: keep its own (slow but correct) scan
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is not None and hasattr(builder, "create_dot"):
        builder.create_dot = _bfloat16_dots(builder.create_dot)
    scan_ops._elementwise_generic_scan = scan_ops.generic_scan
    scan_ops.generic_scan = _log_depth_generic_scan
    function = getattr(interpreter, "InterpretedFunction", None)
    if function is not None and hasattr(interpreter, "_patch_lang"):
        function.__call__ = _device_call_patching_once


_speed_up_interpreter()


def _hypothesis_profiles() -> None:
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # not installed: the property tests fail on import, with the reason
        return
    common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.register_profile("ci", derandomize=True, max_examples=100, print_blob=True, **common)
    settings.register_profile("long", max_examples=2000, print_blob=True, **common)
    settings.load_profile(os.environ.get("SSM_HYPOTHESIS_PROFILE", "ci"))


_hypothesis_profiles()
