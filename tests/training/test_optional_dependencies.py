"""`import ssm` (scans, layers, models) works without the training extras; `import ssm.training`
without them says what to install."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAINING_ONLY = (
    "pytorch_lightning",
    "lightning",
    "lightning_fabric",
    "lightning_utilities",
    "torchmetrics",
    "matplotlib",
    "yaml",
)

# Run in a fresh interpreter in which the training-only packages cannot be imported, as if they
# were not installed.
BLOCK = textwrap.dedent(f"""
    import importlib.abc, sys

    BLOCKED = {TRAINING_ONLY!r}

    class NotInstalled(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
""")


def run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", BLOCK + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )


def test_import_ssm_needs_no_training_extras():
    proc = run("""
        import torch
        import ssm
        from ssm import Mamba, Mamba2, MambaConfig, MambaLM
        from ssm.scan import linear_scan, selective_scan, ssd

        model = MambaLM(MambaConfig(d_model=16, n_layer=1, vocab_size=10, ssm_cfg={"d_state": 4}), backend="pscan")
        tokens = model.generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=2)
        assert tokens.shape == (1, 5)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout[-2000:] + proc.stderr[-3000:]


def test_import_ssm_training_without_the_extras_says_what_to_install():
    proc = run("""
        try:
            import ssm.training
        except ImportError as err:
            print(err)
        else:
            raise SystemExit("ssm.training imported without pytorch_lightning")
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ssm.training needs pytorch-lightning" in proc.stdout and 'pip install -e ".[train]"' in proc.stdout
