"""Optional dependencies, imported where they are used, with a message that says what to install."""

from __future__ import annotations

import importlib
from types import ModuleType

# import name -> distribution name on the package index
_DISTRIBUTIONS = {"pytorch_lightning": "pytorch-lightning", "yaml": "pyyaml", "matplotlib": "matplotlib"}


def require(module: str, needed_by: str) -> ModuleType:
    """``import module``, or an ImportError naming the missing package and the extras that bring it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        if err.name is not None and err.name.split(".")[0] != module.split(".")[0]:
            raise  # the package is there but something it imports is not: its own message says what
        package = _DISTRIBUTIONS.get(module.split(".")[0], module)
        raise ImportError(
            f"{needed_by} needs {package}, which is not installed. Install the training extras: "
            f'pip install -e ".[train]" from the repository (or pip install "ssm-scan[train]"); '
            f"`make train` and `make test` install them into .venv themselves."
        ) from err
