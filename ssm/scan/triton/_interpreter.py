"""Whether Triton's interpreter is on: read by the package (where the backend runs) and by _jit
(the mode this process's kernels were defined in). A module of its own, importing no triton, so
that the package and the op modules below it do not import one another."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton's interpreter is on (TRITON_INTERPRET=1): kernels then run on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
