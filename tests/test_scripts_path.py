"""Every script imports its own checkout's ssm."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("script", ["train", "evaluate", "generate", "benchmark"])
def test_scripts_import_their_own_checkouts_ssm(tmp_path, script):
    """A script run from a checkout imports that checkout's ssm, not another installed one (an
    editable install of another worktree, a release): here a decoy ssm comes first on
    PYTHONPATH, and the script must still find the checkout's."""
    decoy = tmp_path / "decoy" / "ssm"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the decoy ssm was imported')\n")
    root = Path(__file__).resolve().parent.parent
    path = str(root / "scripts" / f"{script}.py")
    code = f"import runpy; runpy.run_path({path!r}); import ssm; print(ssm.__file__)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(decoy.parent)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.strip()).resolve().is_relative_to(root)
