"""scripts/scan_memory.py runs end to end on a tiny scan and reports sound numbers."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "scan_memory.py"


def test_scan_memory_script_writes_a_row_per_setting(tmp_path):
    main = runpy.run_path(str(SCRIPT))["main"]
    path = tmp_path / "m.json"
    argv = [
        "--length",
        "36",
        "--batch",
        "4",
        "--width",
        "8",
        "--checkpoint",
        "none,sqrt,4",
        "--json",
        str(path),
        "--repeats",
        "1",
    ]
    assert main(argv) == 0
    rows = {row["checkpoint"]: row for row in json.loads(path.read_text())}
    assert set(rows) == {"None", "sqrt", "4"}
    for row in rows.values():
        assert row["saved_bytes"] > 0 and row["peak_bytes"] > 0 and row["seconds"] > 0
    # without checkpointing every step's carry is kept; with sqrt (k = 6) about 6 of 36
    assert rows["None"]["saved_bytes"] >= 36 * rows["None"]["carry_bytes"]
    assert rows["sqrt"]["saved_bytes"] < rows["None"]["saved_bytes"] / 2
