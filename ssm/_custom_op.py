"""``kernel_op``: a C or Triton kernel's launcher registered as a torch custom op, with its fake
implementation and, for a forward, its autograd formula, in one decorator. The CPU kernels'
bindings (ssm/scan/cpu.py, ssm/ops/cpu.py) and the Triton launchers (ssm/scan/triton/) use it, so
that every kernel torch.compile meets is one opaque node of the graph: its outputs' shapes and
dtypes come from the fake, its backward is another such op.

Every op registered here is pure (``mutates_args=()``: each output is a fresh tensor, nothing is
written in place) and has a fake that takes the launcher's parameters, name for name, checked at
registration. ``KERNEL_OPS`` maps each op's name to it (tests/ops and tests/scan run
``torch.library.opcheck`` on each, so that a fake that disagrees with its kernel is caught).

A custom op cannot return None: a backward returns an empty tensor for an absent input's
gradient, and its autograd formula turns it back into None.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

# name ("ssm::...") -> the op, for every op registered through kernel_op in this process
KERNEL_OPS: dict[str, torch.library.CustomOpDef] = {}


def kernel_op(
    name: str,
    *,
    fake: Callable,
    device_types: str | None = None,
    backward: Callable | None = None,
    setup_context: Callable | None = None,
) -> Callable[[Callable], torch.library.CustomOpDef]:
    """Decorator: the decorated launcher (parameters and return annotated with tensor types,
    from which torch infers the op's schema) registered as pure custom op ``name``
    (``"ssm::..."``), for ``device_types`` (None: every device), with ``fake`` as its fake
    implementation (the outputs' shapes and dtypes from the inputs' metadata; never reads data)
    and, when given, ``backward(ctx, *output_grads)`` with ``setup_context(ctx, inputs, output)``
    as its autograd formula (torch's ``register_autograd``). Returns the op, which is called
    like the launcher.

    ``backward`` may call an op registered later in its module: it is looked up when it runs."""
    if (backward is None) != (setup_context is None):
        raise ValueError(f"{name}: backward and setup_context go together, got only one of them")

    def register(launcher: Callable) -> torch.library.CustomOpDef:
        expected, got = _parameters(launcher), _parameters(fake)
        if got != expected:
            raise TypeError(f"{name}: the fake's parameters {got} are not the kernel's {expected}")
        op = torch.library.custom_op(name, launcher, mutates_args=(), device_types=device_types)
        op.register_fake(fake)
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
        KERNEL_OPS[name] = op
        return op

    return register


def _parameters(fn: Callable) -> list[str]:
    return list(inspect.signature(fn).parameters)
