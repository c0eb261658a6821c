"""scripts/compare_mixers.py: equal parameter counts, the table it reads from a run, and one
tiny run end to end."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "compare_mixers.py"


@pytest.fixture(scope="module")
def script():
    return runpy.run_path(str(SCRIPT))


def test_the_mixers_have_equal_parameter_counts_within_one_percent(script):
    for task in script["TASKS"]:
        counts = {mixer: script["parameter_count"](task, mixer) for mixer in script["MIXERS"]}
        assert max(counts.values()) / min(counts.values()) < 1.01, (task, counts)


def test_validation_accuracies_are_keyed_by_the_steps_done(script, tmp_path):
    # As Lightning logs them: validations inside fit at the index of the step they follow (one
    # less than the steps done), the closing validation at the steps done.
    rows = ["step,metric,value", "249,val/loss,1.5", "249,val/acc,0.25", "499,val/acc,0.5", "499,train/acc,0.9"]
    rows += ["999,val/acc,0.75", "1000,val/acc,0.75"]
    (tmp_path / "metrics.csv").write_text("\n".join(rows) + "\n")
    assert script["validation_accuracies"](tmp_path, 1000) == {250: 0.25, 500: 0.5, 1000: 0.75}


def test_bad_arguments_name_the_option(script, capsys):
    for argv, option in (
        (["--mixers", "Mamba4"], "--mixers"),
        (["--seeds", "x"], "--seeds"),
        (["--jobs", "0"], "--jobs"),
    ):
        with pytest.raises(SystemExit):
            script["parse_args"](argv)
        assert option in capsys.readouterr().err


def test_a_tiny_comparison_runs_end_to_end(script, tmp_path):
    out = tmp_path / "runs"
    argv = ["--tasks", "selective_copying", "--mixers", "Mamba1,Mamba3", "--steps", "3", "--out", str(out)]
    assert script["main"]([*argv, "--json", str(tmp_path / "r.json")]) == 0
    results = json.loads((tmp_path / "r.json").read_text())
    assert [(r["mixer"], r["steps"]) for r in results] == [("Mamba1", 3), ("Mamba3", 3)]
    for r in results:
        assert 0 <= r["val_acc"] <= 1 and r["val_acc_by_step"] == {"3": r["val_acc"]}
    # finished runs are read back, not trained again
    assert script["main"](argv) == 0
