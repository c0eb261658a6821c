"""The one place where backends are registered and where ``backend="auto"`` is resolved.

Every op family (``"selective_scan"``, ``"linear_scan"``, ...) has a table of named backends.
A backend is a plain function with the op's canonical signature plus the device types it can
run on. Public functions validate their inputs, then call :func:`resolve` with the name the
user asked for and the device of the inputs; they never pick an implementation themselves.

Rules:
- A name that is not registered for the op raises ``ValueError`` listing the registered ones.
- A registered backend that cannot run on the inputs' device raises ``ValueError`` listing the
  ones that can. There is no silent fallback to another backend.
- ``"auto"`` walks the op's preference list for the device and takes the first backend that
  is registered and available.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

AUTO = "auto"


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable
    devices: frozenset[str] | None  # device types it runs on; None = any device
    available: Callable[[], bool] = lambda: True  # e.g. "is the optional package importable"

    def runs_on(self, device: torch.device) -> bool:
        return self.available() and (self.devices is None or device.type in self.devices)


_REGISTRY: dict[str, dict[str, Backend]] = {}

# For each device type, the order in which "auto" tries backends. "*" is used for device
# types not listed. Fast paths are put in front of these lists as they are added.
_AUTO_PREFERENCE: dict[str, tuple[str, ...]] = {
    "*": ("pscan", "chunked", "ref"),
    "cpu": ("cpu", "pscan", "chunked", "ref"),
    "cuda": ("triton", "pscan", "chunked", "ref"),
}


def register(
    op: str,
    name: str,
    fn: Callable,
    *,
    devices: tuple[str, ...] | None = None,
    available: Callable[[], bool] | None = None,
) -> None:
    """Register ``fn`` as backend ``name`` of ``op``. Re-registering a name replaces it."""
    if name == AUTO:
        raise ValueError(f"'{AUTO}' is reserved and cannot be registered as a backend name")
    _REGISTRY.setdefault(op, {})[name] = Backend(
        name=name,
        fn=fn,
        devices=None if devices is None else frozenset(devices),
        available=available or (lambda: True),
    )


def unregister(op: str, name: str) -> None:
    _REGISTRY.get(op, {}).pop(name, None)


def backends(op: str, device: torch.device | str | None = None) -> list[str]:
    """Names of the backends registered for ``op``; only those that run on ``device`` if given."""
    table = _REGISTRY.get(op, {})
    if device is None:
        return sorted(table)
    device = torch.device(device)
    return sorted(name for name, b in table.items() if b.runs_on(device))


def resolve(op: str, name: str, device: torch.device) -> Backend:
    """The backend to run ``op`` with, given the requested ``name`` and the inputs' device."""
    table = _REGISTRY.get(op, {})
    if not isinstance(name, str):
        raise ValueError(f"backend must be a string, one of {[AUTO, *sorted(table)]}; got {name!r}")
    if name == AUTO:
        order = _AUTO_PREFERENCE.get(device.type, _AUTO_PREFERENCE["*"])
        for candidate in order:
            backend = table.get(candidate)
            if backend is not None and backend.runs_on(device):
                return backend
        raise ValueError(
            f"no backend of {op} runs on device '{device}'; registered: {sorted(table)}"
        )
    backend = table.get(name)
    if backend is None:
        raise ValueError(
            f"unknown backend {name!r} for {op}; available: {[AUTO, *sorted(table)]}"
        )
    if not backend.runs_on(device):
        usable = backends(op, device)
        raise ValueError(
            f"backend {name!r} of {op} cannot run on device '{device}'; "
            f"available there: {[AUTO, *usable]}"
        )
    return backend
