"""Results as a reader sees them: markdown tables, an op's section of BENCHMARKS.md (between
``<!-- bench:KEY -->`` markers, so that a run replaces its own section and nothing else), and
matplotlib, imported only when a picture is asked for."""

from __future__ import annotations

import os
import re
from pathlib import Path


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A markdown table: the first column left-aligned (names), the others right-aligned."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join([":---"] + ["---:"] * (len(headers) - 1)) + "|"]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"a row of {len(row)} cells in a table of {len(headers)} columns: {row}")
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return "\n".join(lines)


def section(key: str, title: str, body: str, header: dict[str, str], picture: str | None = None) -> str:
    """An op's section: its title, the picture (a path relative to the markdown file) and the
    table, then where, when, at which commit and by which command it was measured."""
    parts = [f"<!-- bench:{key} -->", f"### {title}", ""]
    if picture:
        parts += [f"![{title}]({picture})", ""]
    parts += [
        body,
        "",
        f"Measured {header['date']} on {header['machine']}, commit `{header['commit']}`, by",
        "",
        "```",
        header["command"],
        "```",
        f"<!-- /bench:{key} -->",
    ]
    return "\n".join(parts)


def write_section(path: str | os.PathLike, key: str, text: str) -> None:
    """Put ``text`` (a whole section, markers included) in place of the file's section ``key``,
    or at its end if it has none; create the file if need be."""
    path = Path(path)
    old = path.read_text() if path.exists() else ""
    pattern = re.compile(rf"<!-- bench:{re.escape(key)} -->.*?<!-- /bench:{re.escape(key)} -->", re.DOTALL)
    if pattern.search(old):
        new = pattern.sub(lambda _: text, old, count=1)
    else:
        new = old.rstrip("\n") + ("\n\n" if old.strip() else "") + text + "\n"
    path.write_text(new)


def relative_picture(picture: str | None, markdown: str | None) -> str | None:
    """The picture's path as seen from the markdown file's folder (forward slashes)."""
    if picture is None or markdown is None:
        return None
    return Path(os.path.relpath(Path(picture).resolve(), Path(markdown).resolve().parent)).as_posix()


def pyplot():
    """matplotlib.pyplot with a file-only backend; a clear message when it is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (or pip install -e '.[bench]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(figure, path: str | os.PathLike) -> None:
    """Write ``figure`` as a PNG (the folders made if need be) and free it."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120, metadata={"Software": None})  # no version stamp: stable bytes
    pyplot().close(figure)
