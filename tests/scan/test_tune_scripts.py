"""The Triton launch-sweep tools (scripts/dev/tune_selective.py, tune_trapezoidal.py) run between GPU windows:
here on the CPU in Triton's interpreter at a tiny shape, their first configuration only (the
default), so that a GPU window does not find them broken. The trapezoidal sweep checks each
configuration against the chunked backend: the default's error must be float32 rounding."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

pytest.importorskip("triton")

DEV = Path(__file__).resolve().parents[2] / "scripts" / "dev"


def main_of(script: str):
    """main() of scripts/dev/<script>.py."""
    return runpy.run_path(str(DEV / f"{script}.py"))["main"]


def test_tune_trapezoidal_times_and_checks_the_default_config(tmp_path, monkeypatch):
    monkeypatch.setenv("SHAPES", "1,2,4,16,20")
    monkeypatch.setenv("REPS", "1")
    monkeypatch.setenv("OUT", str(tmp_path))
    main_of("tune_trapezoidal")(["1000", "0/1000"])  # every 1000th config from the first: the default alone
    rows = json.loads((tmp_path / "sweep_trapezoidal.json").read_text())
    assert [r["dtype"] for r in rows] == ["float32", "bfloat16"]
    fp32 = rows[0]
    assert "error" not in fp32 and fp32["fwd_ms"] > 0 and fp32["fwd_bwd_ms"] > 0
    assert fp32["max_rel_err"] < 1e-4


def test_tune_selective_times_the_first_config(tmp_path, monkeypatch):
    monkeypatch.setenv("SHAPE", "1,8,4,20")
    monkeypatch.setenv("REPS", "1")
    monkeypatch.setenv("OUT", str(tmp_path))
    main_of("tune_selective")(["1000", "0/1000"])
    rows = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["dtype"] for r in rows] == ["float32", "bfloat16"]
    assert all("error" not in r and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in rows)
