"""Suite-wide fixtures.

The "cpu" scan backend compiles its chunk bodies with torch.compile on first use (tens of
seconds on a small machine, per shape family). Tests run it eagerly (the same chunk code,
uncompiled) unless they ask for the ``compiled_cpu_backend`` fixture, so that the compile
cost is paid once, in tests/scan/test_cpu_backend.py.
"""

from __future__ import annotations

import pytest

from ssm.scan import cpu


@pytest.fixture(autouse=True)
def _cpu_backend_eager(monkeypatch):
    monkeypatch.setattr(cpu, "COMPILE", False)


@pytest.fixture
def compiled_cpu_backend(monkeypatch):
    """The "cpu" backend with its chunk bodies compiled (as outside the tests)."""
    monkeypatch.setattr(cpu, "COMPILE", True)
