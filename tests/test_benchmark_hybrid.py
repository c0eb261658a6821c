"""scripts/benchmark.py --op hybrid runs end to end on a tiny shape: both models' training step
and decoding at each position, and its markdown section."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "benchmark.py"


def test_hybrid_mode_times_both_models(tmp_path, capsys):
    main = runpy.run_path(str(SCRIPT))["main"]
    tiny = ["--d-model", "16", "--layers", "3", "--attn-every", "2", "--attn-heads", "2", "--batch", "2"]
    tiny += ["--length", "16", "--repeats", "1", "--warmup", "0", "--new-tokens", "3", "--decode-positions", "4,9"]
    out, md = tmp_path / "hybrid.json", tmp_path / "BENCH.md"
    assert main(["--op", "hybrid", *tiny, "--json", str(out), "--markdown", str(md)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert list(rows) == ["all Mamba-1", "hybrid, attention at [1]"]
    for row in rows.values():
        assert row["step_s"][0] > 0 and set(row["decode_tok_s"]) == {"4", "9"}
        assert all(v > 0 for v in row["decode_tok_s"].values())
    assert "decoding tok/s at 9" in md.read_text() and "hybrid, attention at [1]" in capsys.readouterr().out
