"""Where the fused decoding step's pieces live (issue 43): the public names that ssm.ops.decode
exported before its split still import from there, as the same objects as from their new homes
(step_weights.py: the weight types; quant_cpu.py: the C reads of a matrix), and those homes, and
a quantised layer's prefill, never import the step (no import loop, not even inside a function)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ssm.ops
from ssm.ops import decode, quant_cpu, step_weights

MOVED = {
    step_weights: [
        "MambaBlockWeights",
        "Mamba2BlockWeights",
        "Mamba3BlockWeights",
        "AttentionBlockWeights",
        "GatedMLPWeights",
        "LMHeadWeights",
    ],
    quant_cpu: ["decode_matvec", "widen_rows", "round_rows"],
}


@pytest.mark.parametrize("home, name", [(home, name) for home, names in MOVED.items() for name in names])
def test_a_moved_name_still_imports_from_ssm_ops_decode(home, name):
    assert getattr(decode, name) is getattr(home, name)
    assert name in decode.__all__
    if home is step_weights:
        assert getattr(ssm.ops, name) is getattr(home, name)


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement of the file names, at any depth of the code, with its
    leading dots (``.decode``, ``..ops.decode``, ``ssm.ops.decode``) and each name it imports
    appended (``from . import decode`` gives ``.decode``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            found.add(module)
            found.update(
                f"{module.rstrip('.')}.{alias.name}" if node.module else module + alias.name for alias in node.names
            )
    return found


@pytest.mark.parametrize("path", ["ssm/ops/step_weights.py", "ssm/ops/quant_cpu.py", "ssm/layers/quant.py"])
def test_the_new_homes_and_a_layers_prefill_do_not_import_the_step(path):
    root = Path(__file__).resolve().parents[2]
    step = [m for m in imported_modules(root / path) if m.split(".")[-1] == "decode" or ".decode." in m]
    assert not step, f"{path} imports the fused step: {step}"
