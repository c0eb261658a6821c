"""scripts/benchmark.py's dispatch and outputs: every --op has its module, --markdown writes an op's
section (and only that one) with the run's machine, commit and command, --plot draws the
measured numbers, a sweep over lengths runs once per length, and a wrong backend still fails."""

from __future__ import annotations

import importlib
import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "benchmark.py"
TINY_SCAN = ["--batch", "1", "--dim", "4", "--state", "2", "--repeats", "1", "--warmup", "0", "--device", "cpu"]
TINY_SCAN += ["--copy-mib", "1", "--backends", "ref,pscan"]


def bench(module: str):
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    return importlib.import_module(f"bench.{module}")


def main(argv: list[str]) -> int:
    return runpy.run_path(str(SCRIPT))["main"](argv)


def test_every_op_has_a_module_that_runs():
    ops = bench("__init__").OPS
    assert set(ops) == {
        "selective",
        "linear",
        "trapezoidal",
        "ssd",
        "generate",
        "decode",
        "decode-table",
        "precision",
        "packed",
        "layer",
        "train-step",
        "hybrid",
        "text",
        "cold-start",
        "memory",
        "saved",
        "gpu-peers",
        "context-parallel",
    }
    for op in ops:
        module = bench(ops[op])
        assert callable(module.run) and module.__doc__.startswith(f"--op {op}:"), op


def test_markdown_table_aligns_and_refuses_ragged_rows():
    table = bench("report").table(["name", "ms"], [["ssm", "1.50"], ["peer", "12.00"]])
    assert table.splitlines() == ["| name | ms |", "|:---|---:|", "| ssm | 1.50 |", "| peer | 12.00 |"]
    with pytest.raises(ValueError):
        bench("report").table(["name", "ms"], [["ssm"]])


def test_write_section_replaces_only_its_own_section(tmp_path):
    report = bench("report")
    path = tmp_path / "B.md"
    path.write_text(
        "# Benchmarks\n\nintro\n\n<!-- bench:a -->\nold a\n<!-- /bench:a -->\n\n"
        "<!-- bench:b -->\nb\n<!-- /bench:b -->\n"
    )
    report.write_section(path, "a", "<!-- bench:a -->\nnew a\n<!-- /bench:a -->")
    report.write_section(path, "c", "<!-- bench:c -->\nc\n<!-- /bench:c -->")
    text = path.read_text()
    assert "old a" not in text and text.count("new a") == 1
    assert text.index("intro") < text.index("new a") < text.index("\nb\n") < text.index("\nc\n")
    report.write_section(path, "a", "<!-- bench:a -->\nnewer a\n<!-- /bench:a -->")
    assert path.read_text().count("<!-- bench:a -->") == 1 and "newer a" in path.read_text()


def test_command_line_leaves_out_where_results_go():
    common = bench("common")
    argv = ["--op", "linear", "--json", "x.json", "--markdown=B.md", "--plot", "p.png", "--repeats", "3"]
    assert common.command_line(argv) == "python scripts/benchmark.py --op linear --repeats 3"


def test_selective_sweep_writes_json_markdown_and_picture(tmp_path):
    """--lengths runs the whole comparison at each length; the markdown section holds a row per
    length and implementation with the JSON's numbers, the header of the run and the picture."""
    out, md, png = tmp_path / "s.json", tmp_path / "B.md", tmp_path / "docs" / "sel.png"
    md.write_text("# Benchmarks\n")
    argv = [*TINY_SCAN, "--lengths", "9,17", "--json", str(out), "--markdown", str(md), "--plot", str(png)]
    assert main(argv) == 0

    report = json.loads(out.read_text())
    assert report["lengths"] == [9, 17] and [r["config"]["length"] for r in report["runs"]] == [9, 17]
    text = md.read_text()
    assert "<!-- bench:selective_scan-lengths-cpu -->" in text and "![" in text and "(docs/sel.png)" in text
    for run in report["runs"]:
        for row in run["results"]:
            assert (
                f"| {run['config']['length']} | {row['name']} | {row['forward_ms']:.2f} | {row['fwd_bwd_ms']:.2f} |"
                in text
            )
    assert "commit `" in text and "python scripts/benchmark.py --batch 1" in text and "--lengths 9,17" in text
    assert "--json" not in text and torch.__version__ in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_scan_picture_plots_the_measured_times_log_log():
    scans = bench("scans")

    def run(length, ms):
        rows = [{"name": n, "forward_ms": t / 2, "fwd_bwd_ms": t} for n, t in ms.items()]
        return {
            "config": {"length": length, "batch": 1, "dim": 4, "state": 2, "dtype": "float32", "device": "cpu"},
            "results": rows,
        }

    result = {
        "runs": [
            run(256, {"cpu": 1.0, "mambapy.pscan (peer)": 9.0}),
            run(1024, {"cpu": 3.0, "mambapy.pscan (peer)": 40.0}),
        ]
    }
    fig = scans.figure(result, "selective_scan")
    fwd, fwd_bwd = fig.axes
    assert fwd_bwd.get_xscale() == "log" and fwd_bwd.get_yscale() == "log"
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in fwd_bwd.get_lines()}
    assert lines == {"cpu": ([256, 1024], [1.0, 3.0]), "mambapy.pscan": ([256, 1024], [9.0, 40.0])}
    assert list(fwd.get_lines()[0].get_ydata()) == [0.5, 1.5]


def test_a_wrong_backend_fails_the_run_and_shows_in_the_markdown(tmp_path, monkeypatch):
    """A backend whose output is off by a little: exit status 1, the mismatch in the JSON and
    in the section."""
    selective = bench("selective")
    right = selective.functions

    def functions(names):
        fns = right(names)
        fns["pscan"] = lambda *inputs, f=fns["pscan"]: f(*inputs) * 1.01
        return fns

    monkeypatch.setattr(selective, "functions", functions)
    out, md = tmp_path / "s.json", tmp_path / "B.md"
    assert main([*TINY_SCAN, "--length", "9", "--no-peer", "--json", str(out), "--markdown", str(md)]) == 1
    assert any(m.startswith("pscan vs ref") for m in json.loads(out.read_text())["mismatches"])
    assert "MISMATCH: pscan vs ref" in md.read_text()


def test_train_step_per_mixer_rows_markdown_and_picture(tmp_path):
    out, md = tmp_path / "t.json", tmp_path / "B.md"
    argv = ["--op", "train-step", "--d-model", "16", "--layers", "1", "--batch", "1", "--length", "8"]
    argv += ["--headdim", "8", "--repeats", "1", "--warmup", "0", "--no-peer", "--mixers", "Mamba1,Mamba2,Mamba3"]
    assert main([*argv, "--json", str(out), "--markdown", str(md)]) == 0
    rows = json.loads(out.read_text())["rows"]
    names = ["ssm MambaLM (eager)", "ssm MambaLM Mamba2 (eager)", "ssm MambaLM Mamba3 (eager)"]
    assert list(rows) == names
    text = md.read_text()
    assert all(f"| {name} |" in text for name in names)
    fig = bench("train_step").figure(json.loads(out.read_text()))
    bars = fig.axes[0].patches
    widths = sorted(bar.get_width() for bar in bars)
    assert widths == sorted(r["step_s"][0] for r in rows.values())


def test_generate_picture_is_tokens_per_second_against_position():
    generate = bench("generate")
    result = {"config": {"d_model": 16, "layers": 1, "device": "cpu"}, "step_ms": {"10": 2.0, "2000": 2.5}}
    (line,) = generate.figure(result).axes[0].get_lines()
    assert list(line.get_xdata()) == [10, 2000] and list(line.get_ydata()) == [500.0, 400.0]


def test_plot_on_an_op_without_a_picture_is_refused(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--op", "ssd", "--plot", "x.png", "--device", "cpu"])
    assert exit.value.code == 2 and "draws no picture" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
@pytest.mark.parametrize("op", ["selective", "ssd", "decode", "train-step", "cold-start"])
def test_device_cuda_without_cuda_is_a_clear_error(op, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--op", op, "--device", "cuda"])
    assert exit.value.code == 2 and "--device cuda, but CUDA is not available" in capsys.readouterr().err


def test_commit_is_dirty_only_for_changes_other_than_the_runs_outputs(tmp_path, monkeypatch):
    """A run writing BENCHMARKS.md must not call the next run's commit dirty because of it."""
    import subprocess

    common = bench("common")

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "B.md").write_text("a\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    monkeypatch.setattr(common, "ROOT", tmp_path)
    (tmp_path / "B.md").write_text("b\n")
    assert not common.commit((str(tmp_path / "B.md"), None)).endswith("-dirty")
    assert common.commit(()).endswith("-dirty")
    (tmp_path / "code.py").write_text("x = 2\n")
    assert common.commit((str(tmp_path / "B.md"), None)).endswith("-dirty")


def test_trapezoidal_op_checks_every_backend_against_ref(tmp_path):
    """--op trapezoidal, added as one module over the scan harness: a row per backend, each
    output and gradient within tolerance of ref's, and no peer (mambapy has no such scan)."""
    from ssm.scan import backends

    out = tmp_path / "t.json"
    argv = ["--op", "trapezoidal", "--batch", "1", "--dim", "8", "--headdim", "4", "--state", "4", "--length", "9"]
    argv += ["--repeats", "1", "--warmup", "0", "--device", "cpu", "--copy-mib", "1", "--json", str(out)]
    assert main(argv) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == set(backends("trapezoidal_scan", "cpu")) and "ref" in rows
    for name, row in rows.items():
        assert row["fwd_bwd_ms"] > 0 and not row["is_peer"]
        if name != "ref":
            assert row["max_grad_rel_diff"]["ref"] < 1e-4


def test_decode_table_captions_say_which_batches_the_rows_hold():
    """A run of batches 4 and 16 only is titled and captioned for those batches, never "Batch 1"
    (BENCHMARKS.md once had a "Batch 1" caption over rows of batches 4 and 16); with batch 1 too,
    both captions."""
    markdown = bench("decode_table").markdown
    cell = {"mixer": "mamba1", "precision": "float32", "llama.cpp": 10.0, "ssm": 20.0, "weight_read_limit": 50.0}
    config = {"prompt_length": 16, "new_tokens": 128, "repeats": 3, "d_model": 768, "layers": 24, "peer": "llama.cpp"}
    key, title, body = markdown({"config": {**config, "peer_batches": [4, 16]}, "cells": [cell]}, None)
    assert key == "decode-table-b4-b16" and "batches of 4 and 16" in title and "batch 1" not in title
    assert "Batch 1," not in body and "Batches of 4 and 16 prompts decoded together" in body
    key, title, body = markdown({"config": {**config, "peer_batches": [1, 4]}, "cells": [cell]}, None)
    assert key == "decode-table-b4" and "batch 1 and batches of 4" in title
    assert "Batch 1, 16-token prompt" in body and "Batches of 4 prompts" in body
    key, title, body = markdown({"config": {**config, "peer_batches": [1]}, "cells": [cell]}, None)
    assert key == "decode-table" and title == "decoding per precision against llama.cpp, d_model 768, 24 layers, cpu"
