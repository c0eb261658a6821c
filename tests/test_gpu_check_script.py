"""scripts/gpu_check.py: its dry run (the GPU plan at tiny sizes on the CPU) runs end to end and
reports every step, so that the script cannot rot between GPU windows; its log parsing and
summary read what they are given."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


def script():
    return runpy.run_path(str(SCRIPT))


def test_the_dry_run_reports_every_step(tmp_path):
    out = tmp_path / "out"
    code = script()["main"](["--out", str(out), "--dry-run", "--steps", "tests,bench,train"])
    report = json.loads((out / "report.json").read_text())
    assert report["dry_run"] is True and report["environment"]["torch"]
    tests = report["tests"]
    assert tests["counts"].get("passed", 0) >= 10 and not tests["failed"], tests
    assert tests["returncode"] == 0
    cases = {row["case"]: row for row in report["bench"]}
    assert len(cases) == 8
    for label, row in cases.items():
        assert row["returncode"] == 0, (label, row)
        results = row["report"].get("results") or row["report"].get("ms")
        assert results, label
    runs = report["train"]
    assert [r["returncode"] for r in runs] == [0, 0]
    # the same config, seed and steps on the same device: the comparison must see equal losses
    assert runs[0]["final"]["val/loss"] == runs[1]["final"]["val/loss"]
    assert runs[0]["train/loss"]["first"][1] > 0
    assert sorted(p.name for p in out.iterdir()) == [
        "bench.log",
        "pytest.log",
        "report.json",
        "summary.md",
        "train.log",
    ]
    summary = (out / "summary.md").read_text()
    assert "| selective float32 L 2048 | triton |" in summary and "passed" in summary
    assert "| selective float32 L 2048 | step loop (torch.compile) |" in summary
    assert "| ssd float32 L 2048 | triton |" in summary  # the ssd benchmark times every backend of the table
    assert code == 0


def test_pytest_outcome_reads_counts_and_failed_ids(tmp_path):
    log = tmp_path / "pytest.log"
    log.write_text(
        "$ python -m pytest ...\n..F.s\n"
        "FAILED tests/scan/test_triton.py::test_selective_lengths[19] - AssertionError: x\n"
        "ERROR tests/scan/test_triton.py::test_linear_shapes[a] - RuntimeError\n"
        "======= 1 failed, 3 passed, 1 skipped, 1 error in 2.00s =======\n"
    )
    outcome = script()["pytest_outcome"](log)
    assert outcome["counts"] == {"failed": 1, "passed": 3, "skipped": 1, "error": 1}
    assert outcome["summary"] == "1 failed, 3 passed, 1 skipped, 1 error in 2.00s"
    assert outcome["failed"] == [
        "tests/scan/test_triton.py::test_linear_shapes[a]",
        "tests/scan/test_triton.py::test_selective_lengths[19]",
    ]
    log.write_text("$ python -m pytest -q ...\n...............\n15 passed, 2 deselected in 54.60s\n")  # under -q
    assert script()["pytest_outcome"](log)["counts"] == {"passed": 15, "deselected": 2}


def test_the_summary_shows_each_form_of_result():
    report = {
        "environment": {"device": "H100"},
        "tests": {"summary": "2 passed in 1s", "failed": ["t::a"], "seconds": 1, "timed_out": False},
        "bench": [
            {
                "case": "sel",
                "report": {
                    "results": [{"name": "triton", "forward_ms": 1.5, "fwd_bwd_ms": 4.25, "fwd_bwd_peak_bytes": 2**21}]
                },
            },
            {"case": "ssd", "report": {"ms": {"chunked": 7.0}}},
            {"case": "late", "skipped": "out of the step's time"},
        ],
        "train": [{"run": "r", "returncode": 0, "seconds": 3, "train/loss": {"first": [0, 5.5], "last": [9, 1.25]}}],
        "peer_build": {"skipped": "dry run"},
    }
    text = script()["summary_markdown"](report)
    assert "| sel | triton | 1.500 | 4.250 | 2.0 |" in text
    assert "| ssd | chunked | - | 7.000 |" in text
    assert "| late | (out of the step's time) |" in text
    assert "- FAILED t::a" in text and "[9, 1.25]" in text
