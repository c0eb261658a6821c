"""Backend tables: each public op owns one, with its backends and the order in which
``backend="auto"`` tries them on each device type.

A backend is a plain function with its op's backend signature (the public signature less the
options the public function handles itself, in the same order) plus the device types it runs
on. Public functions validate their inputs, then ask their table for the backend to run; they
never pick an implementation themselves.

Rules:
- A name that is not in the table raises ``ValueError`` listing the names that are.
- A backend that cannot run on the inputs' device raises ``ValueError`` listing those that
  can. There is no silent fallback to another backend, with one exception that ``run`` holds:
  under ``"auto"``, a backend that declines the inputs it was given (returns None) is replaced
  by the op's tensor-code backend.
- ``"auto"`` walks the table's preference list for the device type (``"*"`` for device types
  not listed) and takes the first backend that runs there.
- Where a backend runs is asked when a call resolves it, never frozen earlier: the Triton
  backend's CPU support follows ``TRITON_INTERPRET`` as it is at that moment.

Adding a backend to an op: write the function, then one ``table.add(...)`` line in the op's
module (selective.py, linear.py, ssd.py), and its name in that table's ``auto`` order if
``"auto"`` should pick it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

AUTO = "auto"


def lister(tables: Iterable[BackendTable]) -> Callable[..., list[str]]:
    """The ``backends(op, device=None)`` function of a package whose ops own ``tables``."""
    by_op = {table.op: table for table in tables}

    def backends(op: str, device=None) -> list[str]:
        """Names of the backends of ``op``; with ``device``, only those that run there now.
        ``"auto"`` is always accepted as well."""
        if op not in by_op:
            raise ValueError(f"unknown op {op!r}; expected one of {list(by_op)}")
        return by_op[op].names(device)

    return backends


Devices = Callable[[], Iterable[str]]


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable
    devices: Devices | None  # the device types it runs on now; None = every device
    hint: Callable[[torch.device], str | None] | None = None  # why it cannot run on a device

    def runs_on(self, device: torch.device) -> bool:
        return self.devices is None or device.type in tuple(self.devices())


class BackendTable:
    """The backends of one op. ``auto`` maps a device type (or ``"*"``) to the names that
    ``backend="auto"`` tries, in order."""

    def __init__(self, op: str, auto: dict[str, tuple[str, ...]]):
        if "*" not in auto:
            raise ValueError(f"the auto order of {op} needs a '*' entry for other device types")
        self.op, self.auto = op, dict(auto)
        self._backends: dict[str, Backend] = {}

    def add(
        self,
        name: str,
        fn: Callable,
        *,
        devices: tuple[str, ...] | Devices | None = None,
        hint: Callable[[torch.device], str | None] | None = None,
    ) -> None:
        """Register ``fn`` as backend ``name``; ``devices``: the device types it runs on, or
        a function returning them when asked (default: every device); ``hint(device)``: what
        to do to make it run there, added to the error when it cannot."""
        if name == AUTO:
            raise ValueError(f"'{AUTO}' is reserved and cannot be a backend name")
        if devices is not None and not callable(devices):
            fixed = tuple(devices)
            devices = lambda: fixed  # noqa: E731
        self._backends[name] = Backend(name, fn, devices, hint)

    def remove(self, name: str) -> None:
        self._backends.pop(name, None)

    def names(self, device: torch.device | str | None = None) -> list[str]:
        """Names of the backends; only those that run on ``device`` when given."""
        if device is None:
            return sorted(self._backends)
        device = torch.device(device)
        return sorted(name for name, b in self._backends.items() if b.runs_on(device))

    def run(self, name: str, device: torch.device, args: tuple, *, fallback: str, needs: Callable[[], str]):
        """Resolve ``name`` and call the backend on ``args``. A backend that declines the inputs
        (returns None, as a C kernel does for a dtype or layout it does not read) is replaced by
        ``fallback`` under ``"auto"``; asked for by name, it is an error saying what it
        ``needs()`` (called only then: the message is not built on every call)."""
        out = self.resolve(name, device).fn(*args)
        if out is not None:
            return out
        if name != AUTO:
            raise ValueError(
                f"backend {name!r} of {self.op} does not take these inputs: it needs {needs()}; "
                f"use backend='auto' or '{fallback}'"
            )
        return self._backends[fallback].fn(*args)

    def resolve(self, name: str, device: torch.device) -> Backend:
        """The backend to run, given the requested ``name`` and the inputs' device."""
        if not isinstance(name, str):
            raise ValueError(f"backend must be a string, one of {[AUTO, *self.names()]}; got {name!r}")
        if name == AUTO:
            for candidate in self.auto.get(device.type, self.auto["*"]):
                backend = self._backends.get(candidate)
                if backend is not None and backend.runs_on(device):
                    return backend
            raise ValueError(f"no backend of {self.op} runs on device '{device}'; backends: {self.names()}")
        backend = self._backends.get(name)
        if backend is None:
            raise ValueError(f"unknown backend {name!r} for {self.op}; available: {[AUTO, *self.names()]}")
        if not backend.runs_on(device):
            hint = backend.hint(device) if backend.hint is not None else None
            raise ValueError(
                f"backend {name!r} of {self.op} cannot run on device '{device}'"
                + (f" ({hint})" if hint else "")
                + f"; available there: {[AUTO, *self.names(device)]}"
            )
        return backend
