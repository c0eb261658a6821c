"""Training checkpoints on disk: written atomically, read without running code.

A checkpoint someone else wrote is untrusted: it is read with ``torch.load(weights_only=True)``,
which builds tensors and plain containers only and refuses any other pickled object (and so any
code the file would run). Lightning's checkpoints need nothing more.

A checkpoint is written to a temporary file in its own directory, flushed to disk and renamed
over the old one, so a run killed while writing leaves the previous checkpoint whole. (Lightning's
own writer renames a file from the system's temporary directory, which is a copy, not an atomic
rename, when that directory lies on another file system, and does not flush it to disk.) A damaged
file, such as one cut short by a full disk or a copy that stopped, is detected on reading and
named in the error. A writer killed mid-write (SIGKILL, power) leaves its ``.last.ckpt.<pid>.tmp``;
the next start of the run removes those whose process is gone (``remove_orphan_checkpoints``).
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from pytorch_lightning.plugins import TorchCheckpointIO

from ..models.weight_files import remove_orphans, temporary_path


class CheckpointError(ValueError):
    """A checkpoint that is damaged, holds more than tensors and plain containers, or is not a
    training checkpoint."""


def load_checkpoint(path: str | Path, map_location: Any = "cpu", mmap: bool = False) -> dict:
    """The training checkpoint at ``path``, read with ``weights_only=True``. Raises
    CheckpointError naming the file when it is damaged or holds anything but tensors and plain
    containers; nothing in the file is executed."""
    path = Path(path)
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        named = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        raise CheckpointError(
            f"{path} holds pickled objects other than tensors and plain containers"
            f"{f' (it names {named.group(1)})' if named else ''}; it was not loaded, since unpickling them could run "
            "code. Resume only from checkpoints written by a training run."
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        first_line = (str(err).splitlines() or [type(err).__name__])[0]
        raise CheckpointError(
            f"{path} is damaged (truncated or half-written?) and cannot be read: {first_line}"
        ) from err
    if not isinstance(checkpoint, dict) or not {"global_step", "state_dict"} <= checkpoint.keys():
        raise CheckpointError(
            f"{path} is not a training checkpoint (a mapping with global_step and state_dict expected)"
        )
    return checkpoint


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint I/O with atomic writes and ``weights_only=True`` reads."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options, got {storage_options!r}")
        save_atomically(checkpoint, Path(path))

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        # weights_only is always True here, whatever the caller asks for
        return load_checkpoint(path, map_location=map_location or "cpu")


def save_atomically(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)`` such that ``path`` holds either its old content or the whole
    new one, never a part: a temporary file beside it, flushed to disk, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_path(path)
    try:
        with open(temporary, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def remove_orphan_checkpoints(directory: Path) -> list[str]:
    """Remove the temporary checkpoint files in ``directory`` that a killed writer left (see
    ssm.models.weight_files.remove_orphans: only those whose process is gone, since another
    process may be writing one now). Returns their names."""
    return remove_orphans(Path(directory))
