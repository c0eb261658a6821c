"""Which files of a model directory are its weights, so that a directory holds one model.

A weight set is one of: model.safetensors; pytorch_model.bin; model.safetensors.index.json with
its shards; pytorch_model.bin.index.json with its shards (transformers names shards
model-00001-of-00002.safetensors and pytorch_model-00001-of-00002.bin). ``save_pretrained``
writes one set and then removes every file of the others (``remove_other_weights``: only those
names and shard patterns, never another file), and ``weight_set`` refuses a directory holding two
sets, naming both: it cannot tell which one is the model (a directory saved as safetensors and
then again as .bin held both, and the stale one was read first).

Files written here and by training checkpoints are written to ``.NAME.<pid>.tmp`` beside their
final name and renamed over it (``temporary_path``), so that a killed writer leaves the old file
whole; ``remove_orphans`` removes what a killed writer left.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

BIN, SAFETENSORS = "pytorch_model.bin", "model.safetensors"
INDEX_SUFFIX = ".index.json"  # model.safetensors.index.json, pytorch_model.bin.index.json
# The sets in the order a hub snapshot (which publishes several copies of one model) is read.
WEIGHT_FILES = (SAFETENSORS, SAFETENSORS + INDEX_SUFFIX, BIN, BIN + INDEX_SUFFIX)
SHARD = re.compile(r"(model-\d+-of-\d+\.safetensors|pytorch_model-\d+-of-\d+\.bin)")
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.(?P<pid>\d+)\.tmp")


def weight_sets(directory: Path) -> list[str]:
    """The weight files of ``directory`` (WEIGHT_FILES' names that are there), in read order."""
    return [name for name in WEIGHT_FILES if (directory / name).is_file()]


def weight_set(directory: Path, strict: bool = True) -> str | None:
    """The one weight file (or index) of ``directory``; None when there is none. ``strict``:
    two sets are refused with a ValueError naming both; else (a hub snapshot, whose repo may
    publish one model in several formats) the first in WEIGHT_FILES' order is taken."""
    found = weight_sets(directory)
    if strict and len(found) > 1:
        raise ValueError(
            f"{directory} holds {len(found)} weight sets, {' and '.join(found)}, and which one is the model is "
            "unknown (one may be stale: an older save used to leave the other format in place); remove all but "
            "the model's (if they are copies of one model, any one may stay)"
        )
    return found[0] if found else None


def remove_other_weights(directory: Path, keep: str) -> list[str]:
    """Remove from ``directory`` every weight file of ours but ``keep``: the other single files
    and index files (WEIGHT_FILES) and every shard (SHARD's names). Returns the names removed.
    No other file is touched, whatever its name; a shard an index lists under another name is
    left (without its index nothing reads it)."""
    removed = []
    for path in sorted(directory.iterdir()):
        name = path.name
        if name != keep and (name in WEIGHT_FILES or SHARD.fullmatch(name)) and path.is_file():
            path.unlink()
            removed.append(name)
    return removed


def temporary_path(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place: ``.NAME.<pid>.tmp`` beside it."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OverflowError:
        return False
    return True


def remove_orphans(directory: Path, names=None) -> list[str]:
    """Remove the temporary files (``temporary_path``) in ``directory`` whose writer is no longer
    running: a writer killed while writing leaves one (a checkpoint's can be hundreds of MB).
    ``names``: only those of these final names (default: any). A file whose pid is a live
    process is left, as another process may be writing it this moment (two runs of one
    directory, or DDP ranks); the pid is this machine's, so a directory written from several
    machines at once may keep an orphan (never lose a live file). Returns the names removed."""
    removed = []
    if not directory.is_dir():
        return removed
    for path in sorted(directory.iterdir()):
        match = _TEMPORARY.fullmatch(path.name)
        if match is None or (names is not None and match["name"] not in names):
            continue
        if not _alive(int(match["pid"])) and path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed
