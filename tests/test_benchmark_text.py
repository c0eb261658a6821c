"""scripts/benchmark.py --op text runs end to end on a tiny shape: a sharded transformers
directory with a trained tokenizer, scripts/generate.py in its own process against
transformers' generate, the same tokens, and its markdown section."""

from __future__ import annotations

import importlib.util
import json
import runpy
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "benchmark.py"


def test_text_mode_runs_generate_py_against_transformers(tmp_path, capsys):
    main = runpy.run_path(str(SCRIPT))["main"]
    tiny = ["--d-model", "16", "--layers", "2", "--new-tokens", "6", "--tokenizer-vocab", "300"]
    out, md = tmp_path / "text.json", tmp_path / "BENCH.md"
    assert main(["--op", "text", *tiny, "--json", str(out), "--markdown", str(md)]) == 0
    result = json.loads(out.read_text())
    # with transformers installed its greedy tokens must equal generate.py's; without it, no peer
    peer = importlib.util.find_spec("transformers") is not None
    assert result["same_tokens"] is (True if peer else None)
    assert result["generate_py_tokens_per_s"] > 0
    assert (result["transformers_tokens_per_s"] > 0) if peer else result["transformers_tokens_per_s"] is None
    assert 0 < result["generate_py_first_token_s"] < result["generate_py_process_s"]
    assert "scripts/generate.py (fresh process)" in md.read_text()
    assert "generate.py:" in capsys.readouterr().out


def test_text_mode_without_the_peer(tmp_path):
    main = runpy.run_path(str(SCRIPT))["main"]
    tiny = ["--d-model", "16", "--layers", "2", "--new-tokens", "4", "--tokenizer-vocab", "300", "--no-peer"]
    out = tmp_path / "text.json"
    assert main(["--op", "text", *tiny, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["same_tokens"] is None and result["transformers_tokens_per_s"] is None
    assert result["generate_py_tokens_per_s"] > 0
